"""A whole optimizer step as one CUDA graph: forward of all TTT steps, the fused loss, backward,
clipping and AdamW, replayed with a single launch.

Why: a small draft does little work per kernel, so an eager step is bound by launching its kernels
and the Python that issues them. Replaying the captured step removes that overhead; a large draft
gains only the gaps between kernels (figures in docs/benchmarks.md, "Train").

How, within what a graph allows (fixed addresses, fixed shapes, no host syncs):
- every batch is copied into static device buffers (the trainer pads each packed row to its token
  budget on a GPU, so shapes never change); a batch of another shape runs eagerly;
- attention always takes the document path, and flex attention's block mask is rebuilt outside
  the graph from the static document ids each step and copied into the captured mask's tensors;
- AdamW is `capturable` with its learning rate in a device tensor that the scheduler fills;
- the first `warmup` steps run eagerly on a side stream (they are real steps: torch.compile
  builds its kernels, the optimizer its state), the next one is captured and then replayed; while
  the draft compiles in the background (eyas.train.compiling), the steps stay eager, and the
  `warmup` steps count from when its compiled code takes over.
If capturing fails (an op that cannot be captured in some torch version), training goes on
eagerly with one warning.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from eyas.model.attention import document_block_mask
from eyas.utils.devices import run_on_stream

# the batch tensors a step reads (input_embeds only when the embedding table is on the host)
STATIC_KEYS = ("input_ids", "loss_mask", "position_ids", "document_ids", "aux_hidden", "final_hidden",
               "input_embeds")

Update = Callable[[list[dict[str, Any]], Any], torch.Tensor]  # (micro-batches, block mask) -> stats [S, 3]


class GraphedStep:
    """`step(batch) -> stats [S, 3]`: `update([batch])` (Trainer.update of one micro-batch), replayed
    as a CUDA graph. `prepare` completes a batch as `update` reads it (Trainer.with_embeds); `opt` and
    `model` are the optimizer and the module whose gradients a failed capture leaves behind; `flex`:
    attention is flex attention (its block mask is rebuilt outside the graph); `host_embeds`: batches
    bring their rows of an embedding table kept on the host."""

    def __init__(self, update: Update, prepare: Callable[[dict[str, Any]], dict[str, Any]],
                 opt: torch.optim.Optimizer, model: nn.Module, device: torch.device, flex: bool,
                 host_embeds: bool, warmup: int = 2, ready: Callable[[], bool] = lambda: True) -> None:
        self.update, self.prepare = update, prepare
        self.opt, self.model, self.device = opt, model, device
        self.flex, self.host_embeds = flex, host_embeds
        self.warmup = warmup
        self.ready = ready  # whether the compiled code has taken over (eyas.train.compiling): only then capture
        self.failed = False
        self.capture_s = 0.0  # seconds the last capture took (the first-step line reports it)
        self.static: dict[str, Any] | None = None  # the batch buffers every replay reads
        self.docs: torch.Tensor | None = None  # [1, N] view of the static document ids
        self.block_mask: Any = None  # flex: the captured mask, refreshed in place
        self._side: torch.cuda.Stream | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the captured graph (the optimizer's state tensors were replaced)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stats: torch.Tensor | None = None
        self.eager_left = self.warmup

    def __call__(self, batch: dict[str, Any]) -> torch.Tensor:
        if self.failed:
            return self.update([batch], None)
        batch = self.prepare(batch)
        if not self._load(batch):
            return self.update([batch], None)  # another shape: this step runs eagerly
        if self.graph is None:
            ready = self.ready()  # read once: the background thread may finish meanwhile
            if not ready:
                self.eager_left = max(self.eager_left, 1)  # steps of compiled code run before the capture
            if self.eager_left > 0:
                self.eager_left -= ready
                return self._on_side_stream(lambda: self.update([self.static], self.block_mask))
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001 -- any capture error: train on eagerly
                warnings.warn(f"CUDA graph capture of the training step failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); training without graphs", stacklevel=2)
                self.failed = True
                self.graph = None
                self.opt.zero_grad(set_to_none=True)
                self.model.zero_grad(set_to_none=True)
                torch.cuda.synchronize(self.device)
                return self.update([self.static], self.block_mask)
        self.graph.replay()
        return self.stats.clone()

    def _load(self, batch: dict[str, Any]) -> bool:
        """Copy the batch into the static buffers (allocated on first use); False if it does not fit."""
        keys = [k for k in STATIC_KEYS if k in batch and (k != "input_embeds" or self.host_embeds)]
        if self.static is None:
            self.static = {k: torch.empty_like(batch[k], device=self.device) for k in keys}
            self.static["multi_doc"] = True  # always the document path: one compiled kernel for every batch
            self.docs = self.static["document_ids"][None]  # [1, N], the view the block mask reads
        s = self.static
        if any(k not in s or s[k].shape != batch[k].shape or s[k].dtype != batch[k].dtype for k in keys):
            return False
        for k in keys:
            s[k].copy_(batch[k], non_blocking=True)
        if self.flex:
            fresh = document_block_mask(self.docs)
            if self.block_mask is None:
                self.block_mask = fresh
            elif not _copy_block_mask(self.block_mask, fresh):
                raise RuntimeError("flex attention block masks of one shape differ in layout; "
                                   "train with --cuda-graph off")
        return True

    def _on_side_stream(self, fn: Any) -> Any:
        """Eager steps before the capture run on the stream the capture will use."""
        self._side = self._side or torch.cuda.Stream(self.device)
        out = run_on_stream(self._side, fn)
        out.record_stream(torch.cuda.current_stream(self.device))  # made on the side stream, read on this one
        return out

    def _capture(self) -> None:
        t = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)  # gradients are allocated inside the graph, at fixed addresses
        graph = torch.cuda.CUDAGraph()
        # thread_local: DataLoader pin-memory threads may use CUDA while this thread captures
        with torch.cuda.graph(graph, stream=self._side, capture_error_mode="thread_local"):
            self.stats = self.update([self.static], self.block_mask)
        self.graph = graph
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph has its own pool
        self.capture_s = time.perf_counter() - t


def _copy_block_mask(dst: Any, src: Any) -> bool:
    """Copy every tensor of BlockMask `src` into `dst` in place; False if their layouts differ."""
    pairs = [(a, vars(src).get(k)) for k, a in vars(dst).items() if isinstance(a, torch.Tensor)]
    if any(not isinstance(b, torch.Tensor) or b.shape != a.shape for a, b in pairs):
        return False
    for a, b in pairs:
        a.copy_(b)
    return True
