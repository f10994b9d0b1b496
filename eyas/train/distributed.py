"""Process-group setup and model wrapping for `torchrun`: DDP or FSDP2 (`fully_shard`), CPU or GPU.

Without torchrun everything here is a no-op on one process, so the same trainer code runs on a
laptop CPU, one GPU, or N GPUs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the torchrun process group when launched by torchrun (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                                device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, world, local, dev)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (asynchronous on the device; no host sync)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _fp32_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and these would be strings
    """DDP comm hook for bf16 gradients: average in fp32, so 8 ranks' sums do not round at 8 bits."""
    buf = bucket.buffer()
    world = dist.get_world_size(state)
    t = buf.to(torch.float32).div_(world)
    fut = dist.all_reduce(t, group=state, async_op=True).get_future()

    def done(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(done)


def wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)
    if any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
        ddp.register_comm_hook(None, _fp32_allreduce_hook)
    return ddp


def _fsdp_api() -> tuple[Any, Any]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def wrap_fsdp(model: nn.Module, layers: list[nn.Module], param_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: fp32 sharded parameters, gathered in `param_dtype` for compute, gradients reduced in
    fp32. The decoder layer runs once per TTT step, so it stays gathered through the forward
    (reshard_after_forward=False) instead of being all-gathered 7 times."""
    fully_shard, MixedPrecisionPolicy = _fsdp_api()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp)
    return model


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync") and not hasattr(model, "no_sync")


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if hasattr(model, "no_sync"):  # DDP
        return contextlib.nullcontext() if enabled else model.no_sync()
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 gradients), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model
