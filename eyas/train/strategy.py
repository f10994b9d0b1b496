"""Where the draft's parameters live and what the optimizer steps, chosen once per run.

Parallelism:
- SingleProcess: one process holds everything.
- DDP: every rank holds all parameters; DistributedDataParallel averages the gradients (bf16
  gradients in fp32, through a comm hook: eyas.train.distributed.wrap_ddp).
- FSDP: FSDP2 (`fully_shard`) keeps fp32 sharded parameters, gathers them in the compute dtype and
  reduces gradients in fp32: its mixed-precision policy is the precision.

Precision, composed into SingleProcess and DDP:
- Fp32Weights: everything fp32, the optimizer steps the model's own parameters.
- MasterWeights (bf16): the model's weights ARE bf16 (no per-step weight casts, half the weight and
  gradient memory); the optimizer steps fp32 master copies and writes them back. Gradients of
  several micro-batches are summed in fp32.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from eyas.model.draft import DraftModel
from eyas.train import distributed as D
from eyas.train.config import TrainConfig
from eyas.train.ttt import TTTModel


def scale_and_clip_(params: list[torch.Tensor], scale: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Multiply the gradients by `scale`, then clip them to `max_norm`, in ONE pass over them (the
    norm of scaled gradients is `scale` times theirs). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=scale.device)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) * scale
    torch._foreach_mul_(grads, scale * (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


# ---------------------------------------------------------------------------------------------
# precision: what the optimizer steps on one process or under DDP
# ---------------------------------------------------------------------------------------------


class Fp32Weights:
    """fp32 training: the optimizer steps the model's own parameters; gradients accumulate in them."""

    sums_each_micro_batch = False  # gradients stay in .grad until the step: DDP reduces them once

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.opt_params: list[torch.Tensor] = self.params

    def collect_grads(self) -> None:
        """Nothing to move: the optimizer reads the parameters' own gradients."""

    def push(self) -> None:
        """Nothing to write back: the optimizer updated the parameters themselves."""

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that replace the model's in a checkpoint: none."""
        return {}

    def load(self, draft_state: dict[str, torch.Tensor]) -> None:
        """Nothing beyond the model's own parameters to restore."""


class MasterWeights(Fp32Weights):
    """fp32 copies of bf16 parameters: what the optimizer updates."""

    sums_each_micro_batch = True  # each micro-batch's bf16 gradients move into fp32: DDP reduces each

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(named)
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt_params = self.master

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

    def state(self) -> dict[str, torch.Tensor]:
        """The fp32 masters, which a checkpoint keeps instead of their bf16 roundings."""
        return {n: m.detach().cpu() for n, m in zip(self.names, self.master, strict=True)}

    @torch.no_grad()
    def load(self, draft_state: dict[str, torch.Tensor]) -> None:
        for n, m in zip(self.names, self.master, strict=True):
            m.copy_(draft_state[n])


# ---------------------------------------------------------------------------------------------
# parallelism
# ---------------------------------------------------------------------------------------------


class Strategy(ABC):
    """Wraps the TTT model, owns the parameters the optimizer steps and every step of a gradient's
    life (sync, accumulation, scaling, clipping, write-back), and the full state for checkpoints."""

    name: str  # Trainer.mode: "fp32" | "master" | "fsdp"
    fused_optimizer = True  # fused AdamW on CUDA
    model: nn.Module  # the wrapped TTT model
    draft: DraftModel
    opt_params: list[torch.Tensor]

    def __init__(self, info: D.DistInfo, dtype: torch.dtype) -> None:
        self.info, self.dtype = info, dtype
        self.bf16 = dtype == torch.bfloat16

    def cast(self, draft: DraftModel) -> DraftModel:
        """The draft in the dtype its weights are kept in (called before it moves to the device)."""
        return draft

    @abstractmethod
    def wrap(self, model: TTTModel) -> nn.Module:
        """The model to call for forward and backward; sets `opt_params`."""

    def grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: reduce its gradients over ranks, or not yet."""
        return D.gradient_sync(self.model, last)

    @abstractmethod
    def collect_grads(self) -> None:
        """After each micro-batch's backward."""

    @abstractmethod
    def scale_and_clip_(self, scale: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Scale the gradients of `opt_params` and clip them; returns their norm before clipping."""

    @abstractmethod
    def after_step(self) -> None:
        """After the optimizer step."""

    @abstractmethod
    def draft_state(self) -> dict[str, torch.Tensor]:
        """The full draft state on the host (collective under FSDP; empty on ranks other than 0 there)."""

    @abstractmethod
    def optim_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state (collective under FSDP)."""

    @abstractmethod
    def load_states(self, draft_state: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
                    optim_state: dict[str, Any]) -> None:
        """Restore what draft_state and optim_state gave."""


class SingleProcess(Strategy):
    """One process; bf16 keeps fp32 master weights (MasterWeights), fp32 steps the parameters."""

    precision: Fp32Weights

    def __init__(self, info: D.DistInfo, dtype: torch.dtype) -> None:
        super().__init__(info, dtype)
        self.name = "master" if self.bf16 else "fp32"

    def cast(self, draft: DraftModel) -> DraftModel:
        return draft.to(self.dtype) if self.bf16 else draft

    def wrap(self, model: TTTModel) -> nn.Module:
        self.draft = model.draft
        self.model = self.parallel(model)
        named = [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad]
        # made after DDP's wrap, which gives every rank rank 0's weights
        self.precision = (MasterWeights if self.bf16 else Fp32Weights)(named)
        self.opt_params = self.precision.opt_params
        return self.model

    def parallel(self, model: TTTModel) -> nn.Module:
        return model

    def grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return D.gradient_sync(self.model, last or self.precision.sums_each_micro_batch)

    def collect_grads(self) -> None:
        self.precision.collect_grads()

    def scale_and_clip_(self, scale: torch.Tensor, max_norm: float) -> torch.Tensor:
        return scale_and_clip_(self.opt_params, scale, max_norm)

    def after_step(self) -> None:
        self.precision.push()

    def draft_state(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().cpu() for k, v in self.draft.state_dict().items()}
        return {**state, **self.precision.state()}

    def optim_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return opt.state_dict()

    def load_states(self, draft_state: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
                    optim_state: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in self.draft.state_dict().items():
                v.copy_(draft_state[k])
        self.precision.load(draft_state)
        opt.load_state_dict(optim_state)


class DDP(SingleProcess):
    """Every rank holds all parameters; DistributedDataParallel averages gradients over ranks."""

    def parallel(self, model: TTTModel) -> nn.Module:
        return D.wrap_ddp(model, self.info)


class FSDP(Strategy):
    """FSDP2: fp32 sharded parameters gathered in the compute dtype, gradients reduced in fp32."""

    name = "fsdp"
    fused_optimizer = False  # the sharded parameters are DTensors

    def wrap(self, model: TTTModel) -> nn.Module:
        self.draft = model.draft
        self.model = D.wrap_fsdp(model, list(self.draft.layers), self.dtype if self.bf16 else None)
        self.opt_params = [p for p in self.model.parameters() if p.requires_grad]
        return self.model

    def collect_grads(self) -> None:
        """Nothing to move: FSDP2 reduces each gradient into its fp32 shard."""

    def scale_and_clip_(self, scale: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Sharded gradients: torch's clipping reduces the norm across ranks."""
        grads = [D.local_tensor(p.grad) for p in self.opt_params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)
        return torch.nn.utils.clip_grad_norm_(self.opt_params, max_norm, foreach=True)

    def after_step(self) -> None:
        """Nothing to write back: the optimizer stepped the sharded parameters themselves."""

    def draft_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix("draft."): v for k, v in sd.items()}

    def optim_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))

    def load_states(self, draft_state: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
                    optim_state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, {f"draft.{k}": v for k, v in draft_state.items()}, options=opts)
        set_optimizer_state_dict(self.model, opt, optim_state_dict=optim_state, options=opts)


def make_strategy(cfg: TrainConfig, info: D.DistInfo, dtype: torch.dtype) -> Strategy:
    """FSDP when asked under torchrun, DDP under torchrun otherwise, else one process (--fsdp on one
    process: nothing to shard)."""
    if cfg.fsdp and info.distributed:
        return FSDP(info, dtype)
    return DDP(info, dtype) if info.distributed else SingleProcess(info, dtype)
