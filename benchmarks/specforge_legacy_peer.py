"""SpecForge's trees up to the v0.2.0 tag, driven from their source: the in-process online EAGLE-3 loop (the
same-run peer of benchmarks/online.py) and the offline training step (a peer version of benchmarks/train.py).

Which SpecForge: the in-process online loop lives in its trees up to the July 2026 cutover ("server-only
algorithm runtime", 7d1fbf08): there `scripts/train_eagle3.py --target-model-backend hf` runs the target
in the trainer's process. Its later trees, and the `specforge==0.2.0` wheel on PyPI (built from them), run
online training only against a patched SGLang server publishing features through Mooncake
(docs/basic_usage/training.md there), which a one-GPU benchmark does not stand up; their offline step is
driven by benchmarks/specforge_peer.py. PATH here is the v0.2.0 tag of sgl-project/SpecForge (73e6f808):

    git -C SPECFORGE_CHECKOUT archive 73e6f808 specforge version.txt | tar -x -C peers/v0.2.0-git

One training step, as that tag's scripts/train_eagle3.py runs it on one GPU (nothing of it is copied into
eyas):

  target   online: specforge.modeling.target.eagle3_target_model.HFEagle3TargetModel around the same
           random target module eyas runs; set_aux_hidden_states_layers(eyas' aux layers); per batch
           generate_eagle3_data(input_ids, attention_mask, loss_mask): forward hooks on the three
           layers and the full forward with full-vocabulary logits (its teacher).
           offline: specforge.modeling.target.target_head.TargetHead (eyas' random lm_head) over the
           stored final state, then its preprocess(); batches in its OfflineEagle3Dataset form
  draft    specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3 of the target's width, bf16,
           the embedding frozen, eyas' draft vocabulary (d2t, t2d)
  model    specforge.core.eagle3.OnlineEagle3Model(draft, length=TTT, attention_backend) under FSDP
           (SHARD_GRAD_OP, bf16 mixed precision, one-process NCCL group), as its script wraps it
  step     loss = sum_j 0.8^j * ploss_j; backward; specforge.optimizer.BF16Optimizer.step()

Stand-in: those trees import sglang at module level (for the sglang backend, which neither step calls);
where sglang is not installed, `import sglang...` inside specforge gets empty stand-in modules.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

API = {
    "HFEagle3TargetModel": ("specforge.modeling.target.eagle3_target_model", "HFEagle3TargetModel"),
    "OnlineEagle3Model": ("specforge.core.eagle3", "OnlineEagle3Model"),
    "LlamaForCausalLMEagle3": ("specforge.modeling.draft.llama3_eagle", "LlamaForCausalLMEagle3"),
    "BF16Optimizer": ("specforge.optimizer", "BF16Optimizer"),
    "TargetHead": ("specforge.modeling.target.target_head", "TargetHead"),
    "padding": ("specforge.utils", "padding"),
}


class PeerUnusable(Exception):
    """Why the peer cannot be driven, in one line."""


class _Absent:
    """What a name of an absent sglang stands for: subclassable, callable (giving a falsy stand-in)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> _Absent:
        return _Absent()

    def __getattr__(self, name: str) -> Any:
        return _Absent()


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent


class _AbsentSglang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-in modules for `sglang` and its submodules, found only while the peer is imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "sglang" or name.startswith("sglang."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def forget(prefix: str) -> None:
    """Drop `prefix` and its submodules from sys.modules: the next import reads them from the next tree."""
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def imported(path: Path):
    """The peer's API from `path` (a SpecForge tree), forgotten again on leaving."""
    if not (path / "specforge" / "__init__.py").is_file():
        raise PeerUnusable(f"{path} holds no specforge package")
    stand_in = _AbsentSglang() if importlib.util.find_spec("sglang") is None else None
    forget("specforge")
    sys.path.insert(0, str(path))
    if stand_in is not None:
        sys.meta_path.insert(0, stand_in)
    try:
        try:
            found = {name: getattr(importlib.import_module(mod), attr) for name, (mod, attr) in API.items()}
        except (ImportError, AttributeError) as e:
            ours = str(getattr(e, "name", "") or "").startswith("specforge") or isinstance(e, AttributeError)
            hint = " (its in-process online loop is in trees up to the v0.2.0 tag: see benchmarks/" \
                   "specforge_legacy_peer.py)" if ours else ""
            raise PeerUnusable(f"{type(e).__name__}: {e}{hint}") from None
        yield types.SimpleNamespace(**found)
    finally:
        sys.path.remove(str(path))
        if stand_in is not None:
            sys.meta_path.remove(stand_in)
            forget("sglang")
        forget("specforge")


def draft_config(target_config: Any, draft_vocab: int) -> Any:
    """Its draft's LlamaConfig: the target's width and heads, one layer, eyas' draft vocabulary size."""
    from transformers import LlamaConfig

    c = target_config
    theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 1e4)))
    cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      head_dim=c.hidden_size // c.num_attention_heads, vocab_size=c.vocab_size,
                      draft_vocab_size=draft_vocab, target_hidden_size=c.hidden_size, num_hidden_layers=1,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                      hidden_act="silu", pad_token_id=0, tie_word_embeddings=False)
    return plain_rotary(cfg, theta)


def plain_rotary(cfg: Any, theta: float) -> Any:
    """That tree was written for transformers 4, where plain rotary meant `rope_scaling` None; transformers 5
    fills it with {"rope_type": "default"}, which the tree refuses. Plain rotary at `theta`, as it reads it."""
    cfg.rope_scaling, cfg.rope_theta = None, theta
    return cfg


def draft_model(api: Any, config: Any, embedding: torch.Tensor | None, d2t: torch.Tensor, t2d: torch.Tensor,
                ttt: int, attention: str, wrap: bool) -> tuple[Any, Any]:
    """(its OnlineEagle3Model, FSDP-wrapped as its script does where `wrap`; its BF16Optimizer)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    with torch.device(d2t.device):
        draft = api.LlamaForCausalLMEagle3(config, attention_backend=attention).to(torch.bfloat16)
    with torch.no_grad():
        if embedding is not None:
            draft.embed_tokens.weight.copy_(embedding)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    draft.freeze_embedding()
    model = api.OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=attention)
    if wrap:
        model = FullyShardedDataParallel(
            model, use_orig_params=True,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, process_group=torch.distributed.group.WORLD)
    return model, api.BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, warmup_ratio=0.015, total_steps=10**6)


def update(model: Any, optimizer: Any, **inputs: torch.Tensor) -> torch.Tensor:
    """Its TTT forward, loss = sum_j 0.8^j ploss_j, backward and optimizer step (scripts/train_eagle3.py)."""
    plosses, _, _ = model(**inputs)
    loss = sum(0.8**j * p for j, p in enumerate(plosses))
    loss.backward()
    optimizer.step()
    return loss.detach()


def build_step(api: Any, target: torch.nn.Module, aux_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor,
               ttt: int, attention: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One step of the peer's online loop on a [1, T] batch (token ids, loss mask); returns its loss."""
    dev = target.device
    teacher = api.HFEagle3TargetModel(target)
    teacher.set_aux_hidden_states_layers(list(aux_ids))
    model, optimizer = draft_model(api, draft_config(target.config, int(d2t.numel())),
                                   target.get_input_embeddings().weight, d2t, t2d, ttt, attention, wrap=True)

    def step(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        ids, mask = input_ids.to(dev)[None], loss_mask.to(dev)[None].long()
        data = teacher.generate_eagle3_data(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        return update(model, optimizer, input_ids=data.input_ids, attention_mask=data.attention_mask,
                      loss_mask=data.loss_mask, target=data.target, hidden_states=data.hidden_states)

    return step


def build_offline_step(api: Any, config: Any, batches: list[dict], lm_head: torch.Tensor, d2t: torch.Tensor,
                       t2d: torch.Tensor, ttt: int, attention: str, wrap: bool) -> Callable[[], torch.Tensor]:
    """Its offline step over eyas' stored rows (input_ids, loss_mask, aux_hidden, final_hidden), in turn:
    its TargetHead over the stored final state, its preprocess(), then the same update as online."""
    dev = d2t.device
    model, optimizer = draft_model(api, config, None, d2t, t2d, ttt, attention, wrap)
    head = target_head(api, config, lm_head, torch.bfloat16).to(dev)
    rows = [_offline_row(api, r) for r in batches]  # what its DataLoader workers hand over, pinned
    turn = iter(range(10**9))

    def step() -> torch.Tensor:
        r = {k: v.to(dev, non_blocking=True) for k, v in rows[next(turn) % len(rows)].items()}
        input_ids, target, loss_mask = head.preprocess(r["input_ids"], head(r["target"]), r["loss_mask"])
        return update(model, optimizer, input_ids=input_ids, attention_mask=r["attention_mask"],
                      loss_mask=loss_mask, target=target, hidden_states=r["hidden_state"])

    return step


def target_head(api: Any, config: Any, lm_head: torch.Tensor, dtype: torch.dtype) -> Any:
    """Its TargetHead (both layouts) reads the target's config from a folder; the weight is eyas' lm_head."""
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        head = api.TargetHead(tmp)
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval().to(dtype=dtype)




def _offline_row(api: Any, raw: dict) -> dict[str, torch.Tensor]:
    """Its OfflineEagle3Dataset.process_data of one stored sample (the last position out of the loss)."""
    loss_mask = raw["loss_mask"].long()[None].clone()
    loss_mask[0, -1] = 0
    row = {"input_ids": api.padding(raw["input_ids"][None], left=False), "loss_mask": loss_mask,
           "attention_mask": torch.ones_like(loss_mask), "hidden_state": raw["aux_hidden"][None].to(torch.bfloat16),
           "target": api.padding(raw["final_hidden"][None].to(torch.bfloat16), left=False)}
    return {k: v.pin_memory() if torch.cuda.is_available() else v for k, v in row.items()}
