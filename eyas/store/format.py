"""What the hidden-state store's shards hold and how: the format tag, the state dtypes, and fp8 with
per-token scales (data contract 2 in docs/architecture.md). Shared by the writer and the reader."""

from __future__ import annotations

import torch

FORMAT = "eyas.hidden/1"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, g*H] -> (float8_e4m3fn [N, g*H], float32 scale [N, g]): one scale per token and layer,
    so a layer with large activations does not crush the others' precision."""
    n = x.shape[0]
    xv = x.reshape(n, groups, -1).float()  # [N, g, H]
    scale = xv.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [N, g]
    q = (xv / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(float8 [T, g*H], scale [T, g]) -> dtype [T, g*H]."""
    t, g = scale.shape
    return (q.reshape(t, g, -1).float() * scale[..., None].float()).reshape(t, -1).to(dtype)
