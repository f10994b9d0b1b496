"""SpecForge's own online EAGLE-3 loop, driven from its source: the same-run peer of benchmarks/online.py
(`--peer-src PATH`).

Which SpecForge: the in-process online loop lives in its trees up to the July 2026 cutover ("server-only
algorithm runtime", 7d1fbf08): there `scripts/train_eagle3.py --target-model-backend hf` runs the target
in the trainer's process. Its later trees, and the `specforge==0.2.0` wheel on PyPI (built from them), run
online training only against a patched SGLang server publishing features through Mooncake
(docs/basic_usage/training.md there), which a one-GPU benchmark does not stand up. So PATH is the v0.2.0
tag of sgl-project/SpecForge (73e6f808):

    git -C SPECFORGE_CHECKOUT archive 73e6f808 specforge version.txt | tar -x -C peers/v0.2.0-git

One training step, as its script's loop runs it on one GPU (nothing of it is copied into eyas):

  target   specforge.modeling.target.eagle3_target_model.HFEagle3TargetModel around the same random
           target module eyas runs; set_aux_hidden_states_layers(eyas' aux layers); per batch
           generate_eagle3_data(input_ids, attention_mask, loss_mask): forward hooks on the three
           layers and the full forward with full-vocabulary logits (its teacher)
  draft    specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3 of the target's width, bf16,
           the target's embedding frozen, eyas' draft vocabulary (d2t, t2d)
  model    specforge.core.eagle3.OnlineEagle3Model(draft, length=TTT, attention_backend) under FSDP
           (SHARD_GRAD_OP, bf16 mixed precision, one-process NCCL group), as its script wraps it
  step     loss = sum_j 0.8^j * ploss_j; backward; specforge.optimizer.BF16Optimizer.step()

Stand-in: those trees import sglang at module level (for the sglang backend, which this loop never
calls); where sglang is not installed, `import sglang...` inside specforge gets empty stand-in modules.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
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


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def imported(path: Path):
    """The peer's API from `path` (a SpecForge tree), forgotten again on leaving."""
    if not (path / "specforge" / "__init__.py").is_file():
        raise PeerUnusable(f"{path} holds no specforge package")
    stand_in = _AbsentSglang() if importlib.util.find_spec("sglang") is None else None
    _forget("specforge")
    sys.path.insert(0, str(path))
    if stand_in is not None:
        sys.meta_path.insert(0, stand_in)
    try:
        try:
            found = {name: getattr(importlib.import_module(mod), attr) for name, (mod, attr) in API.items()}
        except (ImportError, AttributeError) as e:
            ours = str(getattr(e, "name", "") or "").startswith("specforge") or isinstance(e, AttributeError)
            hint = " (its in-process online loop is in trees up to the v0.2.0 tag: see benchmarks/" \
                   "specforge_online_peer.py)" if ours else ""
            raise PeerUnusable(f"{type(e).__name__}: {e}{hint}") from None
        yield types.SimpleNamespace(**found)
    finally:
        sys.path.remove(str(path))
        if stand_in is not None:
            sys.meta_path.remove(stand_in)
            _forget("sglang")
        _forget("specforge")


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
    # That tree was written for transformers 4, where plain rotary meant `rope_scaling` None; transformers 5
    # fills it with {"rope_type": "default"}, which the tree refuses. Plain rotary at the target's theta:
    cfg.rope_scaling, cfg.rope_theta = None, theta
    return cfg


def build_step(api: Any, target: torch.nn.Module, aux_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor,
               ttt: int, attention: str) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """One step of the peer's online loop on a [1, T] batch (token ids, loss mask); returns its loss."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    dev = target.device
    teacher = api.HFEagle3TargetModel(target)
    teacher.set_aux_hidden_states_layers(list(aux_ids))
    with torch.device(dev):
        draft = api.LlamaForCausalLMEagle3(draft_config(target.config, int(d2t.numel())),
                                           attention_backend=attention).to(torch.bfloat16)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    draft.freeze_embedding()
    model = FullyShardedDataParallel(
        api.OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=attention), use_orig_params=True,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, process_group=torch.distributed.group.WORLD)
    optimizer = api.BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, warmup_ratio=0.015, total_steps=10**6)

    def step(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> float:
        ids, mask = input_ids.to(dev)[None], loss_mask.to(dev)[None].long()
        data = teacher.generate_eagle3_data(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        plosses, _, _ = model(input_ids=data.input_ids, attention_mask=data.attention_mask,
                              loss_mask=data.loss_mask, target=data.target, hidden_states=data.hidden_states)
        loss = sum(0.8**j * p for j, p in enumerate(plosses))
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step
