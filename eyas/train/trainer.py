"""The training loop: TTT steps on packed batches, mixed precision, accumulation, clipping, AdamW
with warmup + cosine, checkpoints with exact resume, and logs.

Precision, by device and parallelism:
- fp32 (the CPU default): everything fp32.
- bf16 on one GPU or DDP: the model's weights ARE bf16 (no per-step weight casts, half the weight
  and gradient memory); the optimizer steps fp32 master copies and writes them back. Gradients of
  several micro-batches are summed in fp32. DDP averages bf16 gradients in fp32.
- bf16 with FSDP2: fp32 sharded weights, gathered in bf16 for compute, gradients reduced in fp32.

Normalization: a batch's loss is sum over valid rows and steps of 0.8^j CE / (valid step-0 rows
of the whole global batch). That count is only known after the forward passes (it depends on the
target's argmax), so the backward runs on the unnormalized sum and the gradients are scaled once
per optimizer step, by a device tensor: no host sync in the loop except at log intervals.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eyas.engines.head import TargetHead
from eyas.model.draft import Eagle3Draft, check_state_dict
from eyas.model.vocab import draft_to_target_ids, target_to_draft_ids
from eyas.train import distributed as D
from eyas.train.compile_cache import CACHE_FILE, save_compile_cache
from eyas.train.loss import opening_mask, target_distribution
from eyas.train.ttt import TTTConfig, TTTModel, summarize
from eyas.utils.devices import resolve_dtype
from eyas.utils.io import EyasError, atomic_path, atomic_write_json, read_json

OPENING_TOKENS = 64  # held-out accuracy is also measured on each first reply's first 64 tokens

if TYPE_CHECKING:
    from eyas.train.graphed import GraphedStep


@dataclass
class TrainConfig:
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    label_temperature: float = 1.0  # labels softmax(target logits / T); 0 = one-hot on the target's argmax
    reply_start_weight: float = 1.0  # loss weight of each reply's first reply_start_tokens tokens
    reply_start_tokens: int = 64
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.015
    warmup_steps: int = 0  # > 0 overrides warmup_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    token_budget: int = 0  # tokens per packed micro-batch; 0 = 16384 on GPU, 1024 on CPU
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int = 0  # > 0 overrides epochs
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    max_time: float = 0  # seconds; > 0: stop at the first log step past it, checkpoint, write the draft
    val_samples: int = 0  # samples held out of training, to measure the draft on data it never saw
    val_every: int = 0  # optimizer steps between validations; 0 = only at the end
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    attention: str = "auto"  # auto (flex on GPU) | flex | math
    compile: bool | None = None  # None = on for CUDA without FSDP
    cuda_graph: bool | None = None  # each optimizer step one replayed CUDA graph; None = on with compile, 1 GPU
    offload_embedding: bool | None = None  # frozen embedding table on the host; None = on for CUDA
    fsdp: bool = False
    num_workers: int = 2
    report_to: str = "auto"  # auto | tensorboard | wandb | none
    device: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype not in ("auto", "bf16", "bfloat16", "fp32", "float32"):
            raise EyasError(f"unknown --dtype '{self.dtype}': use auto, bf16 or fp32")
        return resolve_dtype(self.dtype, device)

    def resolved_budget(self, device: torch.device) -> int:
        return self.token_budget or (16384 if device.type == "cuda" else 1024)

    def schedule_options(self) -> dict[str, Any]:
        """Options a resumed run must share with the run it continues (else the curve differs)."""
        keep = ("ttt_steps", "ttt_decay", "lr", "min_lr_ratio", "warmup_ratio", "warmup_steps", "weight_decay",
                "betas", "grad_clip", "token_budget", "grad_accum", "epochs", "max_steps", "seed", "dtype")
        # options added after runs existed join the fingerprint only when set, so those runs keep theirs
        if self.label_temperature != 1.0:
            keep += ("label_temperature",)
        if self.reply_start_weight != 1.0:
            keep += ("reply_start_weight", "reply_start_tokens")
        d = asdict(self)
        return {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in keep}


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:  # step = optimizer steps done so far
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def scale_and_clip_(params: list[torch.Tensor], scale: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Multiply the gradients by `scale`, then clip them to `max_norm`, in ONE pass over them (the
    norm of scaled gradients is `scale` times theirs). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=scale.device)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) * scale
    torch._foreach_mul_(grads, scale * (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


class MasterWeights:
    """fp32 copies of bf16 parameters: what the optimizer updates."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.master = [p.detach().float().clone().requires_grad_(True) for p in params]

    def collect_grads(self) -> None:
        """Add the bf16 gradients into the fp32 ones and free them (after each micro-batch)."""
        for p, m in zip(self.params, self.master, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def push(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)


class Trainer:
    """One optimizer step at a time over lists of packed micro-batches (eyas.train.data)."""

    def __init__(self, cfg: TrainConfig, draft: Eagle3Draft, head: TargetHead, info: D.DistInfo,
                 total_steps: int) -> None:
        self.cfg, self.info, self.total_steps = cfg, info, total_steps
        dev = self.device = info.device
        self.dtype = cfg.resolved_dtype(dev)
        self.bf16 = self.dtype == torch.bfloat16
        # compile by default on one GPU / DDP; under FSDP2 only when asked (less tested there)
        compile_ = (dev.type == "cuda" and not cfg.fsdp) if cfg.compile is None else cfg.compile
        self.compiled = compile_
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.mode = "fsdp" if cfg.fsdp and info.distributed else ("master" if self.bf16 else "fp32")
        if cfg.fsdp and not info.distributed:
            self.mode = "master" if self.bf16 else "fp32"  # one process: nothing to shard

        if self.mode == "master":
            draft = draft.to(self.dtype)  # before the move: half the bytes to copy
        # The frozen embedding table (1 GB for a 128k vocabulary) never needs the device: batches
        # bring their rows (eyas.train.data looks them up in the DataLoader workers).
        self.offload = dev.type == "cuda" if cfg.offload_embedding is None else cfg.offload_embedding
        self.embed_table: torch.Tensor | None = None
        if self.offload:
            self.embed_table = draft.embed_tokens.weight.detach().cpu().contiguous()  # [V, H]
            draft.embed_tokens = None
        draft = draft.to(dev)
        self.draft = draft
        ttt_cfg = TTTConfig(steps=cfg.ttt_steps, decay=cfg.ttt_decay, attention=cfg.attention, compile=compile_,
                            reply_start_weight=cfg.reply_start_weight, reply_start_tokens=cfg.reply_start_tokens)
        model = TTTModel(draft, ttt_cfg)
        self.weights = model.weights
        trainable = [p for p in draft.parameters() if p.requires_grad]
        self.master: MasterWeights | None = None
        if self.mode == "fsdp":
            model = D.wrap_fsdp(model, list(draft.layers), self.dtype if self.bf16 else None)
            opt_params = [p for p in model.parameters() if p.requires_grad]
        else:
            if info.distributed:
                model = D.wrap_ddp(model, info)
            if self.mode == "master":
                self.master = MasterWeights(trainable)
                opt_params = self.master.master
            else:
                opt_params = trainable
        self.model = model
        self.opt_params = opt_params
        fused = dev.type == "cuda" and self.mode != "fsdp"
        # a CUDA graph needs the optimizer to read its step count and learning rate from the device
        can_graph = fused and not info.distributed and cfg.grad_accum == 1  # fused: CUDA, no FSDP
        graphed = (cfg.cuda_graph if cfg.cuda_graph is not None else compile_) and can_graph
        if cfg.cuda_graph and not can_graph:
            warnings.warn("--cuda-graph on needs one CUDA device, one process, no FSDP and --grad-accum 1; "
                          "training without CUDA graphs", stacklevel=2)
        self.opt = torch.optim.AdamW(opt_params, lr=torch.tensor(cfg.lr, device=dev) if graphed else cfg.lr,
                                     betas=tuple(cfg.betas), eps=1e-8, weight_decay=cfg.weight_decay,
                                     fused=fused or None, foreach=None if fused else True, capturable=graphed)
        if graphed:
            self.opt._warned_capturable_if_run_uncaptured = True  # the first steps run uncaptured on purpose
            for g in self.opt.param_groups:
                g["initial_lr"] = cfg.lr  # a float: the scheduler then never reads the device tensor back
        warmup = cfg.warmup_steps or max(1, round(cfg.warmup_ratio * total_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(total_steps, warmup, cfg.min_lr_ratio))

        # the target's head on the device, in the compute dtype; its embedding stays on the host
        self.head = TargetHead(torch.empty(0), head.norm_weight.to(dev, torch.float32),
                               head.lm_head.to(dev, self.dtype), head.norm_eps, head.norm_offset, head.embed_scale)
        self.vocab_ids = None if draft.config.draft_vocab_size == draft.config.vocab_size else \
            draft_to_target_ids(draft.d2t).to(dev)
        self.t2d_index = target_to_draft_ids(draft.t2d.cpu()).to(dev)
        self.step = 0
        S = cfg.ttt_steps
        self.window = torch.zeros(S, 3, dtype=torch.float32, device=dev)  # stats since the last log
        self.last_norm = torch.zeros((), device=dev)
        self.graphed: GraphedStep | None = None
        if graphed:
            from eyas.train.graphed import GraphedStep

            self.graphed = GraphedStep(self)

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
        final = b["final_hidden"].to(self.dtype)
        with torch.no_grad():
            tgt = target_distribution(self.head, final, self.vocab_ids, self.t2d_index,
                                      pad_rows=self.cfg.ttt_steps + 1, dtype=self.dtype,
                                      label_temperature=self.cfg.label_temperature)
        docs = b["document_ids"][None] if b["multi_doc"] else None
        emb = None if self.embed_table is None else b["input_embeds"][None].to(self.dtype)
        with self.autocast():
            return self.model(b["input_ids"][None], b["aux_hidden"][None].to(self.dtype), b["position_ids"][None],
                              b["loss_mask"][None], tgt.probs, tgt.ids, docs, emb, block_mask)

    def train_step(self, micro: list[dict[str, Any]]) -> torch.Tensor:
        """One optimizer step; returns this step's stats [S, 3] summed over ranks (device tensor)."""
        self.model.train()
        if self.graphed is not None and len(micro) == 1:
            stats = self.graphed(micro[0])
        else:
            stats = self.update(micro)
        self.sched.step()
        self.step += 1
        self.window += stats
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
        # master weights sum micro-batch gradients in fp32, so under DDP each one is reduced
        sync_each = self.master is not None and self.info.distributed and self.mode != "fsdp"
        for m, batch in enumerate(micro):
            last = m == len(micro) - 1
            with D.gradient_sync(self.model, last or sync_each):
                loss, st = self.forward_batch(batch, block_mask)
                loss.backward()
            stats += st
            if self.master is not None and len(micro) > 1:
                self.master.collect_grads()
        if self.mode == "fsdp":
            D.gradient_sync(self.model, True)
        if self.master is not None:
            self.master.collect_grads()
        D.all_reduce_sum_(stats)
        # DDP/FSDP averaged the gradients over ranks; make them sum / (global valid step-0 rows)
        scale = self.info.world / stats[0, 2].clamp(min=1.0)
        if self.mode == "fsdp":  # sharded gradients: torch's clipping reduces the norm across ranks
            grads = [D.local_tensor(p.grad) for p in self.opt_params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
            self.last_norm = torch.nn.utils.clip_grad_norm_(self.opt_params, self.cfg.grad_clip, foreach=True)
        else:
            self.last_norm = scale_and_clip_(self.opt_params, scale, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.push()
        return stats

    # -- checkpoints ---------------------------------------------------------------------------
    def draft_state(self) -> dict[str, torch.Tensor]:
        """The full draft state dict on the host (fp32 master weights where they exist). Collective
        under FSDP: every rank must call it; only rank 0 gets a non-empty dict."""
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            state = {k.removeprefix("draft."): v for k, v in sd.items()}
            if self.embed_table is not None and state:
                state["embed_tokens.weight"] = self.embed_table
            return state
        state = {k: v.detach().cpu() for k, v in self.draft.state_dict().items()}
        if self.embed_table is not None:
            state["embed_tokens.weight"] = self.embed_table
        if self.master is not None:
            names = {id(p): n for n, p in self.draft.named_parameters()}
            for p, m in zip(self.master.params, self.master.master, strict=True):
                state[names[id(p)]] = m.detach().cpu()
        return state

    def optim_state(self) -> dict[str, Any]:
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, self.opt,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.opt.state_dict()

    def load_states(self, draft_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        if self.embed_table is not None:  # frozen: the table from the target is already the one
            draft_state = {k: v for k, v in draft_state.items() if k != "embed_tokens.weight"}
        check_state_dict(self.draft, draft_state, "checkpoint")
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, {f"draft.{k}": v for k, v in draft_state.items()}, options=opts)
            set_optimizer_state_dict(self.model, self.opt, optim_state_dict=optim_state, options=opts)
            return
        with torch.no_grad():
            for k, v in self.draft.state_dict().items():
                v.copy_(draft_state[k])
        if self.master is not None:
            names = {id(p): n for n, p in self.draft.named_parameters()}
            with torch.no_grad():
                for p, m in zip(self.master.params, self.master.master, strict=True):
                    m.copy_(draft_state[names[id(p)]])
        self.opt.load_state_dict(optim_state)
        graphed = self.graphed is not None
        for g in self.opt.param_groups:  # a checkpoint of a run with or without CUDA graphs fits either way
            lr = float(g["lr"])
            g["lr"] = torch.tensor(lr, device=self.device) if graphed else lr
            g["initial_lr"] = float(g.get("initial_lr", self.cfg.lr))
            g["capturable"] = graphed
        if self.graphed is not None:
            self.graphed.reset()  # new optimizer state tensors: capture again


# ---------------------------------------------------------------------------------------------
# checkpoint files: OUT/train_state/step-N/
# ---------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(trainer: Trainer, root: Path, progress: dict[str, Any], keep: int) -> Path | None:
    """Collective: rank 0 writes OUT/train_state/step-N atomically and prunes old ones. With its
    config.json next to the weights, a checkpoint is also a draft folder that eval and export take."""
    draft_state, optim = trainer.draft_state(), trainer.optim_state()
    rng = rng_state()
    path = root / f"step-{trainer.step:08d}"
    if trainer.info.is_main:
        with atomic_path(path) as tmp:
            tmp.mkdir()
            save_file({k: v.contiguous() for k, v in draft_state.items()}, str(tmp / "draft.safetensors"))
            trainer.draft.config.save(tmp / "config.json")
            torch.save({"optimizer": optim, "scheduler": trainer.sched.state_dict(), "rng": rng,
                        "window": trainer.window.cpu()}, tmp / "state.pt")
            atomic_write_json(tmp / "progress.json", {**progress, "step": trainer.step})
        done = sorted(p for p in root.glob("step-*") if (p / "progress.json").is_file())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier()
    return path if trainer.info.is_main else None


def save_draft(trainer: Trainer, path: Path) -> None:
    """Collective (the state is gathered under FSDP): rank 0 writes the draft folder at `path`
    atomically, in bf16 when the run trains in bf16."""
    state = trainer.draft_state()
    if trainer.info.is_main:
        draft = Eagle3Draft(trainer.draft.config)
        draft.load_state_dict(state)
        (draft.to(torch.bfloat16) if trainer.bf16 else draft).save_pretrained(path)


BEST_DRAFT = "draft-best"


def _improves(val: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """Held-out tau_sim decides (it is what acceptance follows); the loss breaks a tie."""
    return best is None or (val["tau_sim"], -val["loss"]) > (best["tau_sim"], -best["loss"])


def latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step-*") if (p / "progress.json").is_file())
    return done[-1] if done else None


def load_checkpoint(trainer: Trainer, path: Path) -> dict[str, Any]:
    progress = read_json(path / "progress.json")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    trainer.load_states(load_file(str(path / "draft.safetensors")), state["optimizer"])
    trainer.sched.load_state_dict(state["scheduler"])
    trainer.window.copy_(state["window"].to(trainer.window.device))
    trainer.step = int(progress["step"])
    set_rng_state(state["rng"])
    return progress


# ---------------------------------------------------------------------------------------------
# logging
# ---------------------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (one line per log step; a resume drops lines after its checkpoint), plus
    TensorBoard and W&B when installed and wanted."""

    def __init__(self, out: Path, report_to: str, resume_step: int | None, run_config: dict[str, Any]) -> None:
        self.path = out / "metrics.jsonl"
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip()
                    and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(k + "\n" for k in keep))
        self.tb = self.wandb = None
        want_tb = report_to in ("auto", "tensorboard")
        want_wandb = report_to == "wandb" or (report_to == "auto" and os.environ.get("WANDB_PROJECT"))
        if want_tb:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:
                if report_to == "tensorboard":
                    raise EyasError("--report-to tensorboard needs `pip install tensorboard`") from None
        if want_wandb:
            try:
                import wandb

                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "eyas"), config=run_config,
                                        dir=str(out), resume="allow")
            except ImportError:
                if report_to == "wandb":
                    raise EyasError("--report-to wandb needs `pip install wandb`") from None

    def write(self, rec: dict[str, Any]) -> None:
        flat = {"train/loss": rec["loss"], "train/tau_sim": rec["tau_sim"], "train/lr": rec["lr"],
                "train/grad_norm": rec["grad_norm"], "train/tok_per_s": rec["tok_per_s"]}
        for j, (a, lo) in enumerate(zip(rec["acc"], rec["step_loss"], strict=True)):
            flat[f"acc/step{j}"], flat[f"loss/step{j}"] = a, lo
        self._record(rec, flat)

    def write_val(self, step: int, m: dict[str, Any]) -> None:
        """A validation record: {"step", "val": {loss, step_loss, acc, tau_sim, valid_tokens, opening}}."""
        flat = {"val/loss": m["loss"], "val/tau_sim": m["tau_sim"]}
        flat.update({f"val/acc/step{j}": a for j, a in enumerate(m["acc"])})
        if "opening" in m:
            flat["val/opening/tau_sim"] = m["opening"]["tau_sim"]
            flat.update({f"val/opening/acc/step{j}": a for j, a in enumerate(m["opening"]["acc"])})
        self._record({"step": step, "val": m}, flat)

    def _record(self, rec: dict[str, Any], flat: dict[str, float]) -> None:
        """One line of metrics.jsonl, and its scalars to TensorBoard / W&B."""
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(flat, step=rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def format_info(m: dict[str, Any]) -> str:
    acc = "/".join(f"{a:.2f}" for a in m["acc"])
    line = f"loss {m['loss']:.3f} acc {acc} tau {m['tau_sim']:.2f}"
    if "opening" in m:  # held-out only
        o = m["opening"]
        line += (f"; first {o['tokens']} tokens of first replies ({o['valid_tokens']:,}): acc "
                 + "/".join(f"{a:.2f}" for a in o["acc"]) + f" tau {o['tau_sim']:.2f}")
    return line


START_UP_NOTE_S = 5.0  # a first step slower than this gets a line saying why


def run_loop(trainer: Trainer, batches: Any, out: Path, total_steps: int, steps_per_epoch: int,
             progress_state: dict[str, Any], metrics: MetricsLog | None, engine: Any = None,
             stop_after: int = 0, log: Any = print,
             validate: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Consume `batches` (eyas.train.data.iterate_batches) until `total_steps` optimizer steps,
    logging and checkpointing; `validate()` (collective) measures held-out data every `val_every` steps
    and at the end, keeping the draft of the best one in OUT/draft-best. Returns the last logged metrics,
    with the last validation's under "val"."""
    from eyas.train.data import fill_states
    from eyas.utils.progress import progress_bar

    cfg = trainer.cfg
    root = out / "train_state"
    last: dict[str, Any] = {}
    session_tokens, t0 = 0, time.perf_counter()
    window_tokens, tw = 0, time.perf_counter()
    warm: tuple[float, int] | None = None  # (time, step) when the session's first step was done
    tokens_total = int(progress_state.get("tokens", 0))
    show = trainer.info.is_main
    bar = progress_bar(disable=None if show else True)
    quiet_bar = bar.disable and not getattr(bar, "prints_lines", False)  # then log a line per log step
    with bar:
        task = bar.add_task("train", total=total_steps, completed=trainer.step, tokens=0, info="")
        for epoch, step_in_epoch, micro in batches:
            if trainer.step >= total_steps:
                break
            if engine is not None:
                micro = [fill_states(b, engine) for b in micro]
            trainer.train_step(micro)
            n_tok = sum(int(b["num_tokens"]) for b in micro)
            cut = sum(int(b.get("truncated", 0)) for b in micro)
            if cut and show and not progress_state.get("warned_truncation"):
                progress_state["warned_truncation"] = True
                log(f"note: samples longer than the token budget ({cfg.token_budget}) are cut to it; raise "
                    "--token-budget to train on their ends")
            n_tok_global = n_tok * trainer.info.world
            session_tokens += n_tok_global
            window_tokens += n_tok_global
            tokens_total += n_tok_global
            nxt = (epoch, step_in_epoch + 1) if step_in_epoch + 1 < steps_per_epoch else (epoch + 1, 0)
            progress_state.update(epoch=nxt[0], step_in_epoch=nxt[1], tokens=tokens_total)
            bar.update(task, completed=trainer.step, tokens=session_tokens)
            is_last = trainer.step >= total_steps or (stop_after and trainer.step >= stop_after)
            if cfg.max_time and trainer.step % cfg.log_every == 0 and not is_last:
                is_last = progress_state["timed_out"] = D.broadcast_object(time.perf_counter() - t0 >= cfg.max_time)
            if trainer.step % cfg.log_every == 0 or is_last:
                m = summarize(trainer.window, trainer.weights)  # the one host sync of a log interval
                now = time.perf_counter()
                rate = window_tokens / max(now - tw, 1e-9)
                m.update(step=trainer.step, epoch=epoch, lr=float(trainer.sched.get_last_lr()[0]),
                         grad_norm=float(trainer.last_norm.full_tensor() if hasattr(trainer.last_norm, "full_tensor")
                                         else trainer.last_norm),
                         tok_per_s=rate, tokens=tokens_total)
                trainer.window.zero_()
                window_tokens, tw = 0, now
                last = m
                if show:
                    bar.update(task, info=format_info(m))
                    if metrics is not None:
                        metrics.write(m)
                    if quiet_bar:
                        since, from_step = warm or (t0, progress_state["start"])
                        eta = (total_steps - trainer.step) * (now - since) / max(1, trainer.step - from_step)
                        log(f"step {trainer.step}/{total_steps} {format_info(m)} {rate:,.0f} tok/s eta {eta:,.0f}s")
            if validate is not None and (is_last or (cfg.val_every and trainer.step % cfg.val_every == 0)):
                tv = time.perf_counter()
                val = validate()
                best = _improves(val, progress_state.get("best_val"))  # the same figure on every rank
                if best:
                    progress_state["best_val"] = {"step": trainer.step, "tau_sim": val["tau_sim"], "loss": val["loss"]}
                    save_draft(trainer, out / BEST_DRAFT)
                tw += time.perf_counter() - tv  # kept out of the training rate
                if show:
                    log(f"validation at step {trainer.step} ({val['valid_tokens']:,} held-out tokens): "
                        f"{format_info(val)}" + (f"; the best so far, in {out / BEST_DRAFT}" if best else ""))
                    if metrics is not None:
                        metrics.write_val(trainer.step, val)
                last = {**last, "val": val}
            if cfg.save_every and trainer.step % cfg.save_every == 0 and trainer.step < total_steps:
                save_checkpoint(trainer, root, dict(progress_state), cfg.keep_checkpoints)
            if trainer.step == progress_state["start"] + 1 and trainer.compiled and show \
                    and not (root / CACHE_FILE).is_file():
                save_compile_cache(root)  # all compiled by now; for a resume on another machine
            if is_last:
                break
            if warm is None:  # the first step also compiled and captured graphs: rates and ETAs count after it
                warm = time.perf_counter(), trainer.step
                if warm[0] - t0 >= START_UP_NOTE_S and show:
                    log(f"first step done after {warm[0] - t0:.0f}s of start-up (torch.compile, CUDA graph capture: "
                        "once per run); tok/s and ETA count from here")
                session_tokens = window_tokens = 0
                tw = warm[0]
                bar.reset(task, total=total_steps, completed=trainer.step, tokens=0, info="")
    progress_state["elapsed"] = time.perf_counter() - t0
    return last
