"""The trainer: the draft family's objective (eyas.train.objectives: TTT for EAGLE-3, blocks for
DFlash, depths for P-EAGLE) on packed batches, mixed precision, accumulation, clipping, AdamW with
warmup + cosine.
Where parameters live and in what precision (one process, DDP, FSDP2; fp32 or bf16 with fp32
master weights) is the strategy's business (eyas.train.strategy); checkpoints, logs and
the loop around the trainer live in eyas.train.checkpointer, .metrics and .loop.

Normalization: a batch's loss is sum over valid rows and steps of w_j CE / (valid step-0 rows
of the whole global batch; DFlash: valid slot-1 rows). That count is only known after the forward
passes (it depends on the target's argmax), so the backward runs on the unnormalized sum and the
gradients are scaled once per optimizer step, by a device tensor: no host sync in the loop except
at log intervals.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from eyas.engines.head import TargetHead
from eyas.model.attention import resolve_ttt_backend
from eyas.model.draft import DraftModel, check_state_dict
from eyas.model.vocab import draft_to_target_ids, target_to_draft_ids
from eyas.train import distributed as D
from eyas.train.config import TrainConfig, lr_lambda
from eyas.train.graphed import GraphedStep
from eyas.train.loss import opening_mask, target_distribution
from eyas.train.objectives import make_objective
from eyas.train.strategy import make_strategy
from eyas.train.ttt import summarize

OPENING_TOKENS = 64  # held-out accuracy is also measured on each first reply's first 64 tokens


class Trainer:
    """One optimizer step at a time over lists of packed micro-batches (eyas.train.data)."""

    def __init__(self, cfg: TrainConfig, draft: DraftModel, head: TargetHead, info: D.DistInfo,
                 total_steps: int) -> None:
        self.cfg, self.info, self.total_steps = cfg, info, total_steps
        dev = self.device = info.device
        self.dtype = cfg.resolved_dtype(dev)
        self.bf16 = self.dtype == torch.bfloat16
        # compile by default on one GPU / DDP; under FSDP2 only when asked (less tested there)
        self.compiled = (dev.type == "cuda" and not cfg.fsdp) if cfg.compile is None else cfg.compile
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.strategy = make_strategy(cfg, info, self.dtype)
        draft = self.strategy.cast(draft)  # before the move: half the bytes to copy
        # The frozen embedding table (1 GB for a 128k vocabulary) never needs the device: batches
        # bring their rows (eyas.train.data looks them up in the DataLoader workers).
        self.offload = dev.type == "cuda" if cfg.offload_embedding is None else cfg.offload_embedding
        self.embed_table: torch.Tensor | None = None
        if self.offload:
            self.embed_table = draft.embed_tokens.weight.detach().cpu().contiguous()  # [V, H]
            draft.embed_tokens = None
        draft = draft.to(dev)
        self.draft = draft
        model = self.objective = make_objective(draft, cfg, self.compiled, self.embed_table)  # by the draft's family
        self.weights = model.weights
        self.model = self.strategy.wrap(model)
        graphed = self._graphs_wanted()
        self.opt = self._optimizer(graphed)
        warmup = cfg.warmup_steps or max(1, round(cfg.warmup_ratio * total_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(total_steps, warmup, cfg.min_lr_ratio))

        # the target's head on the device, in the compute dtype; its embedding stays on the host
        self.head = TargetHead(torch.empty(0), head.norm_weight.to(dev, torch.float32),
                               head.lm_head.to(dev, self.dtype), head.norm_eps, head.norm_offset, head.embed_scale)
        self.vocab_ids = None if draft.config.draft_vocab_size == draft.config.vocab_size else \
            draft_to_target_ids(draft.d2t).to(dev)
        self.t2d_index = target_to_draft_ids(draft.t2d.cpu()).to(dev)
        self.step = 0
        self.window = torch.zeros(len(self.weights), 3, dtype=torch.float32, device=dev)  # stats since the last log
        self.window_empty = torch.zeros((), dtype=torch.float32, device=dev)  # steps since the last log, no valid row
        self.last_norm = torch.zeros((), device=dev)
        self.graphed: GraphedStep | None = None
        self.background = getattr(model, "background", None)  # the draft compiling while the first steps run
        if graphed:
            self.graphed = GraphedStep(self.update, self.with_embeds, self.opt, self.draft, dev,
                                       flex=resolve_ttt_backend(cfg.attention) == "flex",
                                       host_embeds=self.embed_table is not None, ready=self.compile_ready)

    @property
    def mode(self) -> str:
        """"fp32" | "master" (bf16 weights, fp32 master copies) | "fsdp", for logs."""
        return self.strategy.name

    def compile_ready(self) -> bool:
        """Whether the compiled draft has taken over (always, unless it compiles in the background)."""
        return self.background is None or self.background.ready

    def _fused_optimizer(self) -> bool:
        return self.device.type == "cuda" and self.strategy.fused_optimizer

    def _graphs_wanted(self) -> bool:
        """Whether each optimizer step runs as one replayed CUDA graph (eyas.train.graphed)."""
        cfg = self.cfg
        # a CUDA graph needs the optimizer to read its step count and learning rate from the device
        can_graph = self._fused_optimizer() and not self.info.distributed and cfg.grad_accum == 1 \
            and self.objective.graphable
        if cfg.cuda_graph and not can_graph:
            warnings.warn("--cuda-graph on needs one CUDA device, one process, no FSDP, --grad-accum 1 and an "
                          "EAGLE-3 draft without --draft-window; training without CUDA graphs", stacklevel=3)
        return bool((cfg.cuda_graph if cfg.cuda_graph is not None else self.compiled) and can_graph)

    def _optimizer(self, graphed: bool) -> torch.optim.AdamW:
        cfg, fused = self.cfg, self._fused_optimizer()
        opt = torch.optim.AdamW(self.strategy.opt_params,
                                lr=torch.tensor(cfg.lr, device=self.device) if graphed else cfg.lr,
                                betas=tuple(cfg.betas), eps=1e-8, weight_decay=cfg.weight_decay,
                                fused=fused or None, foreach=None if fused else True, capturable=graphed)
        if graphed:
            opt._warned_capturable_if_run_uncaptured = True  # the first steps run uncaptured on purpose
            for g in opt.param_groups:
                g["initial_lr"] = cfg.lr  # a float: the scheduler then never reads the device tensor back
        return opt

    # ------------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        nb = self.device.type == "cuda"
        return {k: (v.to(self.device, non_blocking=nb) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def with_embeds(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with the frozen embeddings of its tokens, when the table lives on the host and
        the data pipeline did not look them up already (online mode, benchmarks)."""
        if self.embed_table is None or "input_embeds" in batch:
            return batch
        emb = self.embed_table.index_select(0, batch["input_ids"].cpu())  # [N, H]
        return {**batch, "input_embeds": emb.pin_memory() if self.device.type == "cuda" else emb}

    def forward_batch(self, batch: dict[str, Any], block_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, stats [S, 3]) of one packed micro-batch; builds the graph for backward.
        `block_mask`: flex attention's mask of the batch's documents, prebuilt (eyas.train.graphed)."""
        b = self._to_device(self.with_embeds(batch))
        b.update({k: b[k].to(self.dtype) for k in ("aux_hidden", "final_hidden", "input_embeds") if k in b})
        if self.embed_table is None:
            b.pop("input_embeds", None)
        with torch.no_grad():
            tgt = target_distribution(self.head, b["final_hidden"], self.vocab_ids, self.t2d_index,
                                      pad_rows=self.objective.pad_rows, dtype=self.dtype,
                                      label_temperature=self.cfg.label_temperature,
                                      with_mass=self.cfg.loss_spec().needs_mass)
        with self.autocast():  # the family's objective (eyas.train.objectives)
            return self.model(b, tgt.probs, tgt.ids, block_mask, target_mass=tgt.mass)

    def train_step(self, micro: list[dict[str, Any]]) -> torch.Tensor:
        """One optimizer step; returns this step's stats [S, 3] summed over ranks (device tensor)."""
        self.model.train()
        if self.graphed is not None and len(micro) == 1:
            stats = self.graphed(micro[0])
        else:
            stats = self.update(micro)
        if self.background is not None:
            self.background.start()  # after a first step: every compiled part has seen its inputs
        self.sched.step()
        self.step += 1
        self.window += stats
        self.window_empty += stats[0, 2] == 0  # device ops only: read back with the window at the log step
        return stats

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict[str, Any]], opening_tokens: int = OPENING_TOKENS) -> dict[str, Any]:
        """The draft's loss, per-step accuracy and tau_sim on `batches` (held-out data), without training
        on them, and under "opening" the accuracy and tau_sim of predicting the first `opening_tokens`
        tokens of each conversation's first reply (eyas.train.loss.opening_mask; 0: not measured). Every
        rank runs the same batches (DDP and FSDP forwards are collective): no reduction."""
        stats, opening = torch.zeros_like(self.window), torch.zeros_like(self.window)
        for batch in batches:
            stats += self.forward_batch(batch)[1]
            if opening_tokens:
                mask = opening_mask(batch["loss_mask"], batch["document_ids"], opening_tokens)
                opening += self.forward_batch({**batch, "loss_mask": mask})[1]
        m = summarize(stats, self.weights)
        if opening_tokens:
            o = summarize(opening, self.weights)
            m["opening"] = {"tokens": opening_tokens, "acc": o["acc"], "tau_sim": o["tau_sim"],
                            "valid_tokens": o["valid_tokens"]}
        return m

    def update(self, micro: list[dict[str, Any]], block_mask: Any = None) -> torch.Tensor:
        """Forward and backward of each micro-batch, gradient scaling, clipping and the optimizer
        update: device work only, no host sync, so one micro-batch's update can be graph-captured."""
        stats = torch.zeros_like(self.window)
        for m, batch in enumerate(micro):
            with self.strategy.grad_sync(last=m == len(micro) - 1):
                loss, st = self.forward_batch(batch, block_mask)
                loss.backward()
            stats += st
            self.strategy.collect_grads()
        D.all_reduce_sum_(stats)
        # DDP/FSDP averaged the gradients over ranks; make them sum / (global valid step-0 rows)
        scale = self.info.world / stats[0, 2].clamp(min=1.0)
        self.last_norm = self.strategy.scale_and_clip_(scale, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.strategy.after_step()
        return stats

    # -- checkpoints ---------------------------------------------------------------------------
    def draft_state(self) -> dict[str, torch.Tensor]:
        """The full draft state dict on the host (fp32 master weights where they exist). Collective
        under FSDP: every rank must call it; only rank 0 gets a non-empty dict."""
        state = self.strategy.draft_state()
        if self.embed_table is not None and state:
            state["embed_tokens.weight"] = self.embed_table
        return state

    def optim_state(self) -> dict[str, Any]:
        return self.strategy.optim_state(self.opt)

    def load_states(self, draft_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        if self.embed_table is not None:  # frozen: the table from the target is already the one
            draft_state = {k: v for k, v in draft_state.items() if k != "embed_tokens.weight"}
        check_state_dict(self.draft, draft_state, "checkpoint")
        self.strategy.load_states(draft_state, self.opt, optim_state)
        graphed = self.graphed is not None
        for g in self.opt.param_groups:  # a checkpoint of a run with or without CUDA graphs fits either way
            lr = float(g["lr"])
            g["lr"] = torch.tensor(lr, device=self.device) if graphed else lr
            g["initial_lr"] = float(g.get("initial_lr", self.cfg.lr))
            g["capturable"] = graphed
        if self.graphed is not None:
            self.graphed.reset()  # new optimizer state tensors: capture again
