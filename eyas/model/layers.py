"""The building blocks every draft family shares: RMSNorm, rotary embeddings, Llama's grouped-query
attention and SwiGLU MLP. Attention is pluggable: a layer computes q, k, v with rotary positions and
hands them to an `attend(q, k, v)` callable (eyas.model.attention), so training-time test, causal
prefill and KV-cached or tree decoding share the same weights and math."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from eyas.model.config import DraftConfig

# attend(q [B, nh, T, hd], k [B, nkv, T, hd], v [B, nkv, T, hd]) -> [B, nh, T, hd]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos, sin [B, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, in_dim] -> q [B, nh, T, hd], k and v [B, nkv, T, hd], rotary applied."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """attention output [B, nh, T, hd] -> [B, T, H]."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        return self.output(attend(*self.project(x, cos, sin)))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
