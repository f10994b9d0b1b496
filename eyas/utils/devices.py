"""Where and in what precision work runs: one rule for every stage."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from eyas.utils.io import EyasError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
T = TypeVar("T")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' -> this rank's GPU (LOCAL_RANK under torchrun) when there is one, else the CPU."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on a GPU, fp32 on a CPU: most server CPUs (AVX2, no AVX512-BF16/AMX) run bf16 matmuls
    about 100x slower than fp32, so bf16 there is opt-in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise EyasError(f"unknown dtype '{dtype}'; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def run_on_stream(stream: torch.cuda.Stream, fn: Callable[[], T]) -> T:
    """`fn()` on `stream`, ordered after the work already queued on the current stream and before
    what comes next on it. CUDA graph capture wants its eager warm-up steps on a side stream, so the
    workspaces libraries make lazily belong to that stream and not to the graph."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        out = fn()
    current.wait_stream(stream)
    return out


@contextmanager
def matmul_precision(dtype: torch.dtype) -> Iterator[None]:
    """float32 work computed in float32 (TF32 off) while inside, the flags as they were afterwards.

    Why: training turns TF32 on for speed, process-wide; an eval that follows it in the same process (`eyas
    run`) would otherwise verify in TF32, and greedy output would stop being identical to the target's."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    exact = dtype == torch.float32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not exact and flags[0]
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
