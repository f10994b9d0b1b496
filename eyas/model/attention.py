"""Attention patterns for the draft: causal prefill, training-time test (TTT), KV-cached decoding.

Each is an `attend(q, k, v)` callable for `Eagle3Draft.forward`:
q [B, nh, T, hd], k and v [B, nkv, T, hd] (grouped-query heads allowed) -> [B, nh, T, hd].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, nkv, S, hd] -> [B, nh, S, hd] for grouped-query attention written out by hand."""
    rep = num_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention (flash / memory-efficient SDPA kernels where present)."""
    return F.scaled_dot_product_attention(q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), is_causal=True)


class TTTAttention:
    """EAGLE-3's training-time-test pattern, one instance per batch, called once per step.

    Step 0 is causal over its own keys. At step j the query of row t sees the step-0 keys of rows
    0..t and the keys of steps 1..j at row t itself: exactly what the draft sees at inference when
    it extends row t by j tokens of its own (rotary positions t + j are set by the caller).

    backend "math" writes the scores out (any device; the reference); "flex" uses
    torch's flex_attention with a block mask (O(T) memory, fast on GPU); "auto" picks flex on CUDA.
    `steps` (the total number of TTT steps), when given, lets flex see one key length for every
    step (future steps are zero blocks it skips), so the compiled kernel is built once, not per step.
    """

    def __init__(self, backend: str = "auto", steps: int | None = None) -> None:
        if backend == "auto":
            backend = "flex" if torch.cuda.is_available() and _flex_available() else "math"
        if backend not in ("math", "flex"):
            raise ValueError(f"unknown TTT attention backend {backend!r} (math, flex, auto)")
        self.backend = backend
        self.steps = steps
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) == 1:
            return causal_attend(q, k, v)
        if self.backend == "flex":
            return _ttt_flex(q, self.keys, self.values, self.steps)
        return _ttt_math(q, self.keys, self.values)


def _ttt_math(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    B, nh, T, hd = q.shape
    scale = hd**-0.5
    k0, v0 = _expand_kv(keys[0], nh), _expand_kv(values[0], nh)
    scores = (q @ k0.transpose(-1, -2)).float() * scale  # [B, nh, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    later_k = torch.stack([_expand_kv(k, nh) for k in keys[1:]], dim=-2)  # [B, nh, T, j, hd]
    later_v = torch.stack([_expand_kv(v, nh) for v in values[1:]], dim=-2)
    diag = (q.unsqueeze(-2) * later_k).sum(-1).float() * scale  # [B, nh, T, j]
    probs = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1).to(q.dtype)
    out = probs[..., :T] @ v0  # [B, nh, T, hd]
    return out + (probs[..., T:].unsqueeze(-1) * later_v).sum(-2)


@functools.cache
def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # One compiled kernel per sequence length (the trainer pads lengths to a few buckets).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=256)
def _ttt_block_mask(T: int, visible_steps: int, total_steps: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        step, pos = kv_idx // T, kv_idx % T
        return ((step == 0) & (pos <= q_idx)) | ((step > 0) & (step < visible_steps) & (pos == q_idx))

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T * total_steps, device=device)


def _ttt_flex(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              total_steps: int | None = None) -> torch.Tensor:
    T, seen = q.shape[2], len(keys)
    total = max(total_steps or seen, seen)
    pad = [torch.zeros_like(keys[0])] * (total - seen)
    k = torch.cat(keys + pad, dim=2)  # [B, nkv, total*T, hd]
    v = torch.cat(values + pad, dim=2)
    block_mask = _ttt_block_mask(T, seen, total, str(q.device))
    flex = _compiled_flex() if q.is_cuda else _eager_flex()
    return flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


class KVCache:
    """Growing per-sequence key/value cache for decoding with the draft.

    `attend` appends the new keys and attends over everything cached, with `mask` [B or 1, 1, T_new,
    S_total] (True = may attend) when given (tree drafting), else causal in the new rows.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, length: int) -> None:
        """Drop cached positions from `length` on (rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only cached positions `index` (1-D, ascending): e.g. the accepted path of a tree."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(2, index), self.v.index_select(2, index)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        nh, T = q.shape[1], q.shape[2]
        mask = self.mask
        if mask is None:
            S = self.k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, _expand_kv(self.k, nh), _expand_kv(self.v, nh), attn_mask=mask)
