"""Pieces every benchmark shares: device sync and the matmul ceiling that MFU is measured against."""

from __future__ import annotations

import time

import torch


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def matmul_ceiling(dev: torch.device, n: int, iters: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an n x n x n GEMM on random data (never zeros): the best the device does."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t)
