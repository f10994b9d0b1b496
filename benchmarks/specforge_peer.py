"""SpecForge's own EAGLE-3 TTT training step, driven from its source: the same-run baseline of
benchmarks/train.py (`--peer-src [LABEL=]PATH`, repeatable).

PATH holds the `specforge` package: a checkout of sgl-project/SpecForge, or its wheel unzipped
(`pip download --no-deps specforge==0.2.0`, then `python3 -m zipfile -e WHEEL PATH`). A tree of the older
layout (up to the v0.2.0 tag, 73e6f808: no `specforge/algorithms/`) is driven as its own script trains
offline, by benchmarks/specforge_legacy_peer.py. No SpecForge code lives in eyas: one version at a time is
imported from PATH and driven through its own API, as its trainer assembles an offline EAGLE-3 run on
one GPU:

  draft    specforge.modeling.auto.AutoDraftModel.from_config(LlamaConfig, attention_backend,
           torch_dtype), i.e. its LlamaForCausalLMEagle3; embedding frozen; eyas' draft vocabulary
  model    specforge.algorithms.eagle3.model.OnlineEagle3Model(draft, length=TTT, attention_backend)
  teacher  specforge.modeling.target.target_head.TargetHead holding eyas' random lm_head; batches in
           its offline form (target_repr "hidden_state": the target's final hidden state)
  step     specforge.training.controller.TrainerCore(Eagle3TrainStrategy, FSDPTrainingBackend with
           specforge.optimizer.BF16Optimizer).train_step: the TTT forward and loss, backward, clipping,
           AdamW on fp32 master weights, and its step metrics
  batch    specforge.algorithms.eagle3.data.normalize_offline_sample of eyas' random batch, pinned
  wrap     CUDA: FSDP (its default SHARD_GRAD_OP) over a one-process NCCL group, as its trainer runs
           on one GPU; `--peer-wrap none`: the bare module (its backend's prepare_model(wrap=False))

benchmarks/duel_peer.py trains a whole draft with the same pieces (SpecForge.build_trainer) for
benchmarks/quality_duel.py.

Variants are BACKEND[+compact]: flex (its flex_attention), sdpa, and +compact for its compact teacher
(specforge/core/compact_teacher.py; a version without one says so).

Stubs: none on CUDA; nothing on this path imports sglang, and its process-group helpers are never
called. On CPU (the smoke test) there is no triton: specforge/core/loss.py's own `import triton` gets
a stand-in (torch itself still sees none), the peer's reference loss `specforge.core.loss._compute_loss`
replaces its Triton kernel, its torch.compile'd helpers run eagerly, and the module runs unwrapped
(FSDP needs an accelerator).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.util
import inspect
import logging
import math
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))
import specforge_legacy_peer  # noqa: E402

# what the step needs, by the name this module uses -> (peer module, attribute)
API = {
    "AutoDraftModel": ("specforge.modeling.auto", "AutoDraftModel"),
    "OnlineEagle3Model": ("specforge.algorithms.eagle3.model", "OnlineEagle3Model"),
    "normalize_offline_sample": ("specforge.algorithms.eagle3.data", "normalize_offline_sample"),
    "Eagle3TrainStrategy": ("specforge.training.strategies.base", "Eagle3TrainStrategy"),
    "TrainerCore": ("specforge.training.controller", "TrainerCore"),
    "FSDPTrainingBackend": ("specforge.training.backend", "FSDPTrainingBackend"),
    "ParallelConfig": ("specforge.training.backend", "ParallelConfig"),
    "BF16Optimizer": ("specforge.optimizer", "BF16Optimizer"),
    "TargetHead": ("specforge.modeling.target.target_head", "TargetHead"),
    "TrainBatch": ("specforge.runtime.contracts", "TrainBatch"),
}
BACKENDS = {"flex": "flex_attention", "sdpa": "sdpa"}


PeerUnusable = specforge_legacy_peer.PeerUnusable  # why a peer version cannot be driven, in one line


class PeerInputs(NamedTuple):
    """What eyas trains on, handed to the peer unchanged: raw stored batches and the target's head."""

    batches: list[dict]  # eyas' random_batch rows: input_ids, loss_mask, aux_hidden, final_hidden
    lm_head: torch.Tensor  # [vocab, hidden]
    d2t: torch.Tensor
    t2d: torch.Tensor


def parse_variant(variant: str) -> tuple[str, bool]:
    backend, _, extra = variant.partition("+")
    if backend not in BACKENDS or extra not in ("", "compact"):
        raise ValueError(f"peer variant {variant!r}: expected BACKEND[+compact], BACKEND one of {sorted(BACKENDS)}")
    return BACKENDS[backend], extra == "compact"


@contextlib.contextmanager
def one_process_group():
    """FSDP wants a process group: one process on the current card, what a one-GPU launch gives it."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class SpecForge:
    """One SpecForge source tree. `with peer.imported(dev):` imports what its step needs from PATH and
    forgets it again on leaving (every version is the package `specforge`)."""

    def __init__(self, spec: str) -> None:
        label, _, path = spec.rpartition("=")
        self.path = Path(path).expanduser().resolve()
        self.label = label or self.path.name
        self.api: types.SimpleNamespace | None = None
        self.has_compact = False

    def version(self) -> str:
        """The version the tree says it is: version.txt (a checkout) or the wheel's METADATA."""
        if (self.path / "version.txt").is_file():
            return (self.path / "version.txt").read_text().strip()
        for meta in self.path.glob("specforge-*.dist-info/METADATA"):
            for line in meta.read_text().splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        return "version unknown"

    @contextlib.contextmanager
    def imported(self, dev: torch.device):
        if not (self.path / "specforge" / "__init__.py").is_file():
            raise PeerUnusable(f"{self.path} holds no specforge package")
        if self.legacy:
            with specforge_legacy_peer.imported(self.path) as api:
                self.api, self.has_compact = api, False
                try:
                    yield self
                finally:
                    self.api = None
                    torch._dynamo.reset()
            return
        specforge_legacy_peer.forget("specforge")
        sys.path.insert(0, str(self.path))
        try:
            self.api = _import_api(cpu=dev.type != "cuda")
            strategy_args = inspect.signature(self.api.Eagle3TrainStrategy.__init__).parameters
            self.has_compact = (importlib.util.find_spec("specforge.core.compact_teacher") is not None
                                and "compact_teacher" in strategy_args)
            yield self
        finally:
            sys.path.remove(str(self.path))
            specforge_legacy_peer.forget("specforge")
            self.api = None
            torch._dynamo.reset()  # its compiled helpers belong to modules just forgotten

    @property
    def legacy(self) -> bool:
        """A tree up to the v0.2.0 tag (no algorithms/ package): driven by benchmarks/specforge_legacy_peer.py."""
        return not (self.path / "specforge" / "algorithms").is_dir() and \
            (self.path / "specforge" / "core" / "eagle3.py").is_file()

    def build_step(self, shape: Any, variant: str, inputs: PeerInputs, dev: torch.device, ttt: int,
                   wrap: str) -> tuple[Callable[[], Any], Callable[[Any], bool]]:
        """The peer's optimizer step over `inputs`, and how to tell its result trained (a finite loss)."""
        api, (attention, compact) = self.api, parse_variant(variant)
        if compact and not self.has_compact:
            raise PeerUnusable("this version has no compact teacher")
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        config = draft_config(shape)
        if self.legacy:
            if dev.type != "cuda":
                raise PeerUnusable("a tree up to the v0.2.0 tag trains through its Triton loss: it needs a GPU")
            config = specforge_legacy_peer.plain_rotary(config, shape.rope_theta)
            step = specforge_legacy_peer.build_offline_step(
                api, config, inputs.batches, inputs.lm_head.to(dev), inputs.d2t.to(dev), inputs.t2d.to(dev), ttt,
                attention, wrap=wrap == "fsdp")
            return step, lambda loss: math.isfinite(float(loss))
        _, core = self.build_trainer(config, inputs, dev, ttt, attention, compact, wrap == "fsdp")
        batches = [self._batch(b, dtype, pin=dev.type == "cuda") for b in inputs.batches]
        turn = iter(range(10**9))

        def step():
            with eager_on_cpu(dev):
                return core.train_step(batches[next(turn) % len(batches)])

        return step, lambda result: math.isfinite(result.loss)

    def build_trainer(self, config: Any, inputs: PeerInputs, dev: torch.device, ttt: int, attention: str,
                      compact: bool, fsdp: bool, total_steps: int = 10**6, embedding: torch.Tensor | None = None
                      ) -> tuple[Any, Any]:
        """(its draft, its TrainerCore) as its trainer assembles them, with its defaults (AdamW at 1e-4,
        warm-up 1.5% of `total_steps`, then cosine; clipping at 0.5); `embedding`: the target's, frozen."""
        api, dtype = self.api, torch.bfloat16 if dev.type == "cuda" else torch.float32
        with torch.device(dev):
            draft = api.AutoDraftModel.from_config(config, attention_backend=attention, torch_dtype=dtype)
            head = specforge_legacy_peer.target_head(api, config, inputs.lm_head, dtype)
        with torch.no_grad():
            draft.t2d.copy_(inputs.t2d)
            draft.d2t.copy_(inputs.d2t)
            if embedding is not None:
                draft.embed_tokens.weight.copy_(embedding)
        draft.freeze_embedding()
        model = api.OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=attention).to(dev, dtype)
        backend = api.FSDPTrainingBackend(api.ParallelConfig.from_distributed(),
                                          optimizer_factory=lambda m: api.BF16Optimizer(m, lr=1e-4,
                                                                                        total_steps=total_steps))
        wrapped = backend.prepare_model(model, wrap=fsdp, optimizer_target=model.draft_model)
        strategy = api.Eagle3TrainStrategy(wrapped, target_head=head, **({"compact_teacher": True} if compact else {}))
        return draft, api.TrainerCore(strategy, backend)

    def batch(self, raw: dict, dtype: torch.dtype, pin: bool, max_len: int | None = None) -> Any:
        """One stored row (eyas' input_ids, loss_mask, aux_hidden, final_hidden) in its offline batch form."""
        return self._batch({**raw, "num_tokens": max_len or raw["num_tokens"]}, dtype, pin)

    def _batch(self, raw: dict, dtype: torch.dtype, pin: bool) -> Any:
        stored = {"input_ids": raw["input_ids"], "loss_mask": raw["loss_mask"].long(),
                  "aux_hidden_state": raw["aux_hidden"][None].to(dtype),
                  "hidden_state": raw["final_hidden"][None].to(dtype)}
        tensors = self.api.normalize_offline_sample(stored, max_len=raw["num_tokens"])
        if pin:
            tensors = {k: v.pin_memory() for k, v in tensors.items()}
        return self.api.TrainBatch(sample_ids=["0"], strategy="eagle3", tensors=tensors,
                                   metadata={"target_repr": "hidden_state"})


def eager_on_cpu(dev: torch.device) -> contextlib.AbstractContextManager:
    """Its torch.compile'd helpers run eagerly on CPU: the smoke test checks the driving, not the speed."""
    return torch._dynamo.config.patch(disable=True) if dev.type != "cuda" else contextlib.nullcontext()


def draft_config(shape: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=shape.hidden,
                       intermediate_size=shape.inter, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
                       draft_vocab_size=shape.draft_vocab, num_hidden_layers=1, rope_theta=shape.rope_theta,
                       max_position_embeddings=16384, rms_norm_eps=1e-5, hidden_act="silu",
                       tie_word_embeddings=False)


def _import_api(cpu: bool) -> types.SimpleNamespace:
    logging.getLogger("specforge").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "flash_attn is not found"
            if cpu and importlib.util.find_spec("triton") is None:
                _import_loss_without_triton()
            found = {name: getattr(importlib.import_module(module), attr) for name, (module, attr) in API.items()}
    except (ImportError, AttributeError) as e:
        raise PeerUnusable(f"{type(e).__name__}: {e}") from None
    return types.SimpleNamespace(**found)


def _import_loss_without_triton() -> None:
    """specforge/core/loss.py imports triton at module level for its CUDA kernel; on CPU its own import
    gets a stand-in and its reference loss takes the kernel's place in the EAGLE-3 model."""
    stand_in = types.ModuleType("triton")
    stand_in.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    stand_in.language = types.SimpleNamespace(constexpr=int)
    real_import = builtins.__import__

    def peer_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name.split(".")[0] == "triton" and (globals or {}).get("__name__", "").startswith("specforge"):
            return stand_in
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = peer_import
    try:
        loss = importlib.import_module("specforge.core.loss")
        model = importlib.import_module("specforge.algorithms.eagle3.model")
    finally:
        builtins.__import__ = real_import
    model.LogSoftmaxLoss = types.SimpleNamespace(apply=loss._compute_loss)
