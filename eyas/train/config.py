"""How a draft is trained (part of `eyas train`'s schema) and the learning-rate schedule it describes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from eyas.train.loss import LossSpec
from eyas.utils.devices import resolve_dtype
from eyas.utils.io import EyasError
from eyas.utils.schema import option


@dataclass(kw_only=True)
class TrainConfig:
    """How the draft is trained: objective, schedule, batching, precision, checkpoints and logs."""

    help_panel: ClassVar[str] = "Training"

    ttt_steps: int = option(7, help="Training-time-test steps: how many tokens ahead the draft learns to chain "
                            "(peagle: the depths trained, the most tokens one forward proposes).")
    ttt_decay: float = option(0.8, help="Loss weight of TTT step j is decay^j.")
    label_temperature: float = option(1.0, help="The draft learns softmax(target logits / T): 1 = the target's "
                                      "distribution (EAGLE-3), 0 = a one-hot on its argmax, the token greedy "
                                      "verification accepts.")
    reply_start_weight: float = option(1.0, help="Loss weight of the first --reply-start-tokens tokens of every "
                                       "reply (1 = all alike, EAGLE-3).")
    reply_start_tokens: int = option(64, help="How many tokens of a reply --reply-start-weight covers.")
    block_gamma: float = option(7.0, help="dflash: loss weight of block slot k (1..block size - 1) is "
                                "exp(-(k-1) / gamma): the early slots, which every accepted draft needs, count most.")
    block_anchors: int = option(0, show_default="0: token budget / block size",
                                help="dflash: blocks trained per packed micro-batch, their anchors drawn (seeded) "
                                     "among trained positions.")
    cod_ratio: float = option(0.7, help="peagle: depth d >= 1 trains on a share max(ratio^d, --cod-min-ratio) of "
                              "the rows as anchors (nested: an anchor of depth d is one of depth d-1), so deeper "
                              "depths cost less (P-EAGLE's COD sampling).")
    cod_min_ratio: float = option(0.2, help="peagle: the share of rows every depth keeps at least.")
    loss: Literal["ce", "lk-alpha", "lk-lambda"] = option(
        "ce", help="Per-token loss: ce (soft cross-entropy to the target's distribution, EAGLE-3's), lk-alpha "
                   "(-log of the acceptance rate sum_v min(p, q)) or lk-lambda (KL blended into 1 - acceptance as "
                   "the draft improves), the LK losses of arXiv 2602.23881.")
    lk_eta: float = option(3.0, help="lk-lambda: the blend is lam * KL + (1 - lam) * (1 - acceptance) with lam = "
                           "exp(-eta * acceptance) per token (the paper's best eta is 3).")
    lr: float = option(1e-4, help="Peak learning rate (AdamW, warmup then cosine to --min-lr-ratio of it).")
    min_lr_ratio: float = option(0.1, help="Where the cosine ends, as a share of --lr.")
    warmup_ratio: float = option(0.015, help="Share of steps spent warming up.")
    warmup_steps: int = option(0, help="Warm-up steps; > 0 overrides --warmup-ratio.")
    weight_decay: float = option(0.0, help="AdamW weight decay.")
    betas: tuple[float, float] = option((0.9, 0.95), help="AdamW betas.")
    grad_clip: float = option(0.5, help="Gradient norm clipping.")
    token_budget: int = option(0, help="Tokens per packed micro-batch (per GPU); 0 = 16384 on GPU, 1024 on CPU "
                               "(where attention over a packed row is dense, so shorter rows train faster).")
    grad_accum: int = option(1, help="Micro-batches per optimizer step.")
    epochs: int = option(1, help="Passes over the data.")
    max_steps: int = option(0, help="Optimizer steps; overrides --epochs when > 0.")
    save_every: int = option(1000, help="Checkpoint every N optimizer steps and at the end (0 = never; then "
                             "--resume has nothing to resume from).")
    max_time: float = option(0, help="Wall-clock budget in seconds, start-up included: past it, the run stops at the "
                             "next log step, saves a checkpoint and writes the draft as it stands (--resume "
                             "continues). 0 = none.")
    val_samples: int = option(0, help="Hold this many samples (drawn at random, seeded) out of training and measure "
                              "the draft on them (loss, per-step accuracy, tau_sim, and the same over each first "
                              "reply's first 64 tokens); the best validation's draft is kept in OUT/draft-best.")
    val_every: int = option(0, help="Optimizer steps between validations (with --val-samples); 0 = only at the end.")
    keep_checkpoints: int = option(2, help="Checkpoints kept in OUT/train_state (the newest).")
    log_every: int = option(10, help="Optimizer steps between log lines.")
    seed: int = option(0, help="Seed for the draft's init and the data order.")
    dtype: Literal["auto", "bf16", "bfloat16", "fp32", "float32"] = option(
        "auto", help="auto (bf16 on GPU, fp32 on CPU), bf16 or fp32.")
    attention: Literal["auto", "flex", "math"] = option("auto", help="TTT attention kernel: auto (flex on GPU).")
    compile: bool | None = option(None, show_default="auto: on for one GPU or DDP",
                                  help="torch.compile the draft layer and the loss.")
    compile_in_background: bool = option(True, help="With --compile: the first steps run eagerly while a thread "
                                         "compiles the draft, which then takes over (the first step comes before "
                                         "the compiler is done; not with --fsdp). --no-compile-in-background: "
                                         "compile first.")
    cuda_graph: bool | None = option(None, show_default="auto: on with --compile on one GPU",
                                     help="Replay each optimizer step as one CUDA graph (one GPU, one micro-batch "
                                          "per step).")
    offload_embedding: bool | None = option(None, show_default="auto: on for CUDA",
                                            help="Keep the frozen embedding table on the host.")
    fsdp: bool = option(False, help="Shard the draft and optimizer with FSDP2 under torchrun (default: DDP).")
    num_workers: int = option(2, help="DataLoader worker processes.")
    report_to: Literal["auto", "tensorboard", "wandb", "none"] = option(
        "auto", help="auto: TensorBoard if installed; W&B if installed and WANDB_PROJECT is set.")
    device: str = option("auto", help="auto, cpu, cuda.")

    def __post_init__(self) -> None:
        if self.max_time < 0:
            raise EyasError(f"--max-time must be >= 0 seconds (0 = no limit), got {self.max_time:g}")
        if self.label_temperature < 0:
            raise EyasError(f"--label-temperature must be >= 0 (1 = the target's distribution, 0 = its argmax), "
                            f"got {self.label_temperature:g}")
        if self.reply_start_weight <= 0 or self.reply_start_tokens < 1:
            raise EyasError(f"--reply-start-weight must be > 0 and --reply-start-tokens >= 1, got "
                            f"{self.reply_start_weight:g} and {self.reply_start_tokens}")
        if self.ttt_steps < 1 or self.lr < 0 or self.grad_accum < 1 or self.epochs < 1 or self.max_steps < 0:
            raise EyasError("--ttt-steps, --grad-accum and --epochs must be >= 1, --lr and --max-steps >= 0")
        if self.token_budget < 0 or self.val_samples < 0 or self.val_every < 0 or self.save_every < 0:
            raise EyasError("--token-budget, --val-samples, --val-every and --save-every must be >= 0")
        if self.log_every < 1 or self.keep_checkpoints < 1:
            raise EyasError("--log-every and --keep-checkpoints must be >= 1")
        if not 0 < self.cod_min_ratio <= self.cod_ratio <= 1:
            raise EyasError(f"--cod-ratio and --cod-min-ratio must satisfy 0 < min ratio <= ratio <= 1, got "
                            f"{self.cod_ratio:g} and {self.cod_min_ratio:g}")
        if self.lk_eta < 0:
            raise EyasError(f"--lk-eta must be >= 0, got {self.lk_eta:g}")
        if self.block_gamma <= 0 or self.block_anchors < 0:
            raise EyasError(f"--block-gamma must be > 0 and --block-anchors >= 0, got {self.block_gamma:g} and "
                            f"{self.block_anchors}")

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype not in ("auto", "bf16", "bfloat16", "fp32", "float32"):
            raise EyasError(f"unknown --dtype '{self.dtype}': use auto, bf16 or fp32")
        return resolve_dtype(self.dtype, device)

    def resolved_budget(self, device: torch.device) -> int:
        return self.token_budget or (16384 if device.type == "cuda" else 1024)

    def schedule_options(self, objective: tuple[str, ...]) -> dict[str, Any]:
        """Options a resumed run must share with the run it continues (else the curve differs): the
        schedule's and those the training objective reads (`objective`, eyas.train.objectives)."""
        keep = ("label_temperature", "lr", "min_lr_ratio", "warmup_ratio", "warmup_steps", "weight_decay", "betas",
                "grad_clip", "token_budget", "grad_accum", "epochs", "max_steps", "seed", "dtype", "val_samples",
                *objective)
        if self.loss == "ce":  # the default loss: runs from before --loss existed keep their fingerprint
            keep = tuple(k for k in keep if k not in ("loss", "lk_eta"))
        return {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in keep}

    def loss_spec(self) -> LossSpec:
        """The per-row loss every objective's fused head computes (eyas.train.loss)."""
        return LossSpec(self.loss, self.lk_eta)


def lr_lambda(total: int, warmup: int, min_ratio: float):
    """Linear warmup over `warmup` steps, then a cosine from 1 down to `min_ratio` at step `total`."""

    def f(step: int) -> float:  # step = optimizer steps done so far
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f
