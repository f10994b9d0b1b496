"""Attention patterns for the drafts: causal prefill, training-time test (TTT), DFlash's blocks,
P-EAGLE's parallel depths, KV-cached decoding.

Each is an `attend(q, k, v)` callable for a draft's `forward`:
q [B, nh, T, hd], k and v [B, nkv, S, hd] (grouped-query heads allowed) -> [B, nh, T, hd].
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, nkv, S, hd] -> [B, nh, S, hd] for grouped-query attention written out by hand."""
    rep = num_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention (flash / memory-efficient SDPA kernels where present)."""
    return F.scaled_dot_product_attention(q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), is_causal=True)


class _PerLayer:
    """A stateful `attend` for a draft of several decoder layers: `layer(0)` is this instance, `layer(i)`
    a child (`_spawn`) with keys of its own that reads the shared settings through `_parent`."""

    _parent: Any
    _later: list

    def _spawn(self) -> Any:
        raise NotImplementedError

    def layer(self, i: int) -> Any:
        if i == 0 or self._parent is not None:
            return self
        while len(self._later) < i:
            child = self._spawn()
            child._parent = self
            self._later.append(child)
        return self._later[i - 1]


class TTTAttention(_PerLayer):
    """EAGLE-3's training-time-test pattern, one instance per batch, called once per step.

    Step 0 is causal over its own keys. At step j the query of row t sees the step-0 keys of rows
    0..t and the keys of steps 1..j at row t itself: exactly what the draft sees at inference when
    it extends row t by j tokens of its own (rotary positions t + j are set by the caller).

    `document_ids` [B, T] (optional) packs several sequences in one row: a query only sees step-0
    keys of its own document (ids must be contiguous runs; padding gets an id of its own).

    backend "math" writes the scores out (any device; the reference); "flex" runs torch's
    flex_attention over the step-0 keys only (one causal/document block mask, reused by every step)
    and merges the few same-row keys of later steps through the returned log-sum-exp, so no key is
    ever copied or concatenated across steps, and every step calls the same compiled kernel with the
    same shapes; "auto" picks flex on CUDA. `steps` is accepted for compatibility and not needed.
    `block_mask` (flex only): the mask of `document_ids` when the caller built it already (not with a window).
    `window` W > 0 (a sliding-window draft): a query at position p sees keys at positions > p - W, as vLLM's
    sliding window serves it: at step j (position t + j) the step-0 keys of rows > t + j - W, and always the
    same-row keys of steps 1..j (W >= steps); one mask per step.
    A draft of several decoder layers calls `layer(i)` for each: same pattern and masks, its own keys.
    """

    def __init__(self, backend: str = "auto", steps: int | None = None,
                 document_ids: torch.Tensor | None = None, block_mask: Any = None, window: int = 0) -> None:
        self.backend = resolve_ttt_backend(backend)
        self.window = window
        self._window_masks: dict[tuple[str, int], Any] = {}  # (kind, step) -> the windowed mask of that step
        self.document_ids = document_ids
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._block_mask = block_mask  # flex: prebuilt for these document_ids (CUDA-graphed training)
        self._dense_mask: torch.Tensor | None = None
        self._parent: TTTAttention | None = None  # layer 0's instance, which owns the masks
        self._later: list[TTTAttention] = []  # layers 1.. (layer 0 is this instance)

    def _spawn(self) -> TTTAttention:
        return TTTAttention(self.backend, document_ids=self.document_ids, window=self.window)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _heads_last_layout(self._attend(q, k, v))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        step = len(self.keys) - 1
        if self.backend == "flex":
            return self._flex(q)
        if step == 0:
            if self.document_ids is None and not self.window:
                return causal_attend(q, k, v)
            mask = self.dense_mask(q.shape[2], q.device)
            return F.scaled_dot_product_attention(q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]),
                                                  attn_mask=mask)
        return _ttt_math(q, self.keys, self.values, self.dense_mask(q.shape[2], q.device, step))

    def dense_mask(self, T: int, device: torch.device, step: int = 0) -> torch.Tensor:
        """[B or 1, 1, T, T] bool: causal, within the same document when documents are given, and inside the
        window as step `step` sees it when there is one."""
        if self._parent is not None:
            return self._parent.dense_mask(T, device, step)
        if self.window:
            if ("dense", step) not in self._window_masks:
                rows = torch.arange(T, device=device)
                inside = (rows[:, None] - rows[None, :]) < self.window - step
                self._window_masks["dense", step] = self._full_dense_mask(T, device) & inside
            return self._window_masks["dense", step]
        return self._full_dense_mask(T, device)

    def _full_dense_mask(self, T: int, device: torch.device) -> torch.Tensor:
        if self._dense_mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
            if self.document_ids is not None:
                doc = self.document_ids.to(device)
                mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
            self._dense_mask = mask
        return self._dense_mask

    def block_mask(self, T: int, device: torch.device, step: int = 0) -> Any:
        """flex attention's mask: causal, within the same document when documents are given, and inside the
        window as step `step` sees it when there is one."""
        if self._parent is not None:
            return self._parent.block_mask(T, device, step)
        if self.window:
            if ("block", step) not in self._window_masks:
                docs = self.document_ids if self.document_ids is not None else torch.zeros(1, T, dtype=torch.long)
                self._window_masks["block", step] = document_block_mask(docs.to(device), self.window - step)
            return self._window_masks["block", step]
        if self._block_mask is None:
            self._block_mask = (_causal_block_mask(T, str(device)) if self.document_ids is None
                                else document_block_mask(self.document_ids.to(device)))
        return self._block_mask

    def _flex(self, q: torch.Tensor) -> torch.Tensor:
        mask = self.block_mask(q.shape[2], q.device, len(self.keys) - 1)
        out, lse = _flex_lse(q, self.keys[0], self.values[0], mask)
        if len(self.keys) == 1:
            return out
        return _merge_same_row(q, out, lse, self.keys[1:], self.values[1:])


def _heads_last_layout(out: torch.Tensor) -> torch.Tensor:
    """out [B, nh, T, hd] as a view of a [B, T, nh, hd] buffer (no copy when it is one already, as
    flex's step-0 output is): every TTT step hands the layer's second half one memory layout, so its
    compiled graph is built once (a stride guard would compile it again), and o_proj reads it as is."""
    B, nh, T, hd = out.shape
    x = out.transpose(1, 2)
    if x.stride() != (T * nh * hd, nh * hd, hd, 1):  # a size-1 batch dim may carry any stride, too
        x = x.clone(memory_format=torch.contiguous_format)
    return x.transpose(1, 2)


def _ttt_math(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              mask: torch.Tensor) -> torch.Tensor:
    B, nh, T, hd = q.shape
    scale = hd**-0.5
    k0, v0 = _expand_kv(keys[0], nh), _expand_kv(values[0], nh)
    scores = (q @ k0.transpose(-1, -2)).float() * scale  # [B, nh, T, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    later_k = torch.stack([_expand_kv(k, nh) for k in keys[1:]], dim=-2)  # [B, nh, T, j, hd]
    later_v = torch.stack([_expand_kv(v, nh) for v in values[1:]], dim=-2)
    diag = (q.unsqueeze(-2) * later_k).sum(-1).float() * scale  # [B, nh, T, j]
    probs = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1).to(q.dtype)
    out = probs[..., :T] @ v0  # [B, nh, T, hd]
    return out + (probs[..., T:].unsqueeze(-1) * later_v).sum(-2)


def _merge_same_row(q: torch.Tensor, out0: torch.Tensor, lse0: torch.Tensor, keys: list[torch.Tensor],
                    values: list[torch.Tensor]) -> torch.Tensor:
    """Add the same-row keys of steps 1..j to attention over the step-0 keys, given its output and
    log-sum-exp: softmax over [lse0, s_1..s_j] weighs out0 and v_1..v_j. Grouped-query heads are
    handled by views ([B, g, r, T, hd]), never by copying keys. Values may be narrower than the keys
    (an MLA layer's v_head_dim)."""
    B, nh, T, hd = q.shape
    g = keys[0].shape[1]
    r = nh // g
    qg = q.view(B, g, r, T, hd)
    scores = [lse0.view(B, g, r, T).float()]
    for k in keys:  # s_i = q . k_i at the same row, [B, g, r, T]
        scores.append((qg * k.unsqueeze(2)).sum(-1, dtype=torch.float32) * hd**-0.5)
    w = torch.softmax(torch.stack(scores, dim=-1), dim=-1)  # [B, g, r, T, 1 + j]
    out = out0.view(B, g, r, T, -1) * w[..., :1]
    for i, v in enumerate(values, start=1):
        out = out + v.unsqueeze(2) * w[..., i:i + 1]
    return out.to(q.dtype).view(B, nh, T, -1)


def resolve_ttt_backend(backend: str) -> str:
    """"auto" -> "flex" on CUDA (when this torch has it), else "math"; checks the name."""
    if backend == "auto":
        backend = "flex" if torch.cuda.is_available() and _flex_available() else "math"
    if backend not in ("math", "flex"):
        raise ValueError(f"unknown TTT attention backend {backend!r} (math, flex, auto)")
    return backend


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

    # One compiled kernel per sequence length (the trainer pads every batch to one length).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _flex_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention returning (out [B, nh, T, hd], natural-log lse [B, nh, T]); compiled on CUDA."""
    from torch.nn.attention import flex_attention as fa

    flex = _compiled_flex() if q.is_cuda else fa.flex_attention
    gqa = k.shape[1] != q.shape[1]
    if hasattr(fa, "AuxRequest"):
        out, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@functools.lru_cache(maxsize=16)
def _causal_block_mask(T: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, B=None, H=None, Q_LEN=T, KV_LEN=T, device=device)


def document_block_mask(document_ids: torch.Tensor, window: int = 0):
    """Causal within each document of `document_ids` [B, T]; with `window` > 0, only keys less than `window`
    rows back."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    limit = torch.full((), window, dtype=torch.long, device=doc.device)  # a tensor: one mask_mod for every step

    def window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < limit) & (doc[b, q_idx] == doc[b, kv_idx])

    B, T = doc.shape
    # compiled on CUDA: the eager builder materializes the [B, T, T] mask (GBs at T = 16k)
    return create_block_mask(window_mod if window else mask_mod, B=B, H=None, Q_LEN=T, KV_LEN=T,
                             device=str(doc.device), _compile=doc.is_cuda)


class _FixedPatternAttention:
    """One attention pattern for every layer of a training forward: built once on first use, as a dense
    mask ("math") or a flex block mask ("flex"); subclasses say what the pattern is (`dense_mask`,
    `block_mask`) and set `backend` and `_mask = None`."""

    backend: str
    _mask: Any

    def dense_mask(self) -> torch.Tensor:
        raise NotImplementedError

    def block_mask(self) -> Any:
        raise NotImplementedError

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == "flex":
            if self._mask is None:
                self._mask = self.block_mask()
            return _flex_lse(q, k, v, self._mask)[0]
        if self._mask is None:
            self._mask = self.dense_mask()
        nh = q.shape[1]
        return F.scaled_dot_product_attention(q, _expand_kv(k, nh), _expand_kv(v, nh), attn_mask=self._mask)


class BlockAttention(_FixedPatternAttention):
    """DFlash's training pattern (eyas.model.dflash): A blocks of B slots over one packed row of N
    context positions. Keys are [context (N) ; the blocks side by side (A*B)]; the query of slot k of
    block r (anchor a_r) sees the context positions j < a_r of the anchor's document and every slot of
    its own block, nothing else: what the draft sees at inference when it drafts from a_r.

    anchors [A] (ascending positions in the row), document_ids [N]. backend "math" builds the dense
    [A*B, N + A*B] mask (any device; the reference), "flex" a flex-attention block mask (CUDA);
    "auto" picks flex on CUDA. The pattern is the same in every layer: one instance serves all."""

    def __init__(self, anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int,
                 backend: str = "auto") -> None:
        self.backend = resolve_ttt_backend(backend)
        self.anchors, self.docs, self.block_size = anchors, document_ids, block_size
        self._mask: Any = None

    def dense_mask(self) -> torch.Tensor:
        """[A*B, N + A*B] bool, True where a query may attend."""
        N, Q, dev = self.docs.numel(), self.anchors.numel() * self.block_size, self.docs.device
        a = self.anchors.repeat_interleave(self.block_size)  # [Q] each slot's anchor
        context = (self.docs[None, :] == self.docs[a][:, None]) & (torch.arange(N, device=dev)[None] < a[:, None])
        block = torch.arange(Q, device=dev) // self.block_size
        return torch.cat([context, block[:, None] == block[None, :]], dim=1)

    def block_mask(self) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        N, B, Q = self.docs.numel(), self.block_size, self.anchors.numel() * self.block_size
        anchors, docs = self.anchors, self.docs

        def mask_mod(b, h, q_idx, kv_idx):
            a = anchors[q_idx // B]
            in_context = (kv_idx < a) & (docs[kv_idx.clamp(max=N - 1)] == docs[a])
            return torch.where(kv_idx < N, in_context, (kv_idx - N) // B == q_idx // B)

        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=Q, KV_LEN=N + Q, device=str(docs.device),
                                 _compile=docs.is_cuda)


class ParallelDraftAttention(_FixedPatternAttention):
    """P-EAGLE's training pattern (eyas.train.peagle): one causal forward over a packed row's N rows
    (depth 0) followed by sampled (anchor, depth) entries. Entry e has an anchor a_e (its row; a depth-0
    entry is its own anchor), a depth d_e and a document. Query q sees key k iff they share a document and
    either k is a depth-0 entry with a_k <= a_q, or k is an entry of q's own anchor with 1 <= d_k <= d_q:
    the verified positions up to the anchor and the mask slots before it, what the draft sees when it
    proposes from a_q at inference (eyas.model.peagle).

    anchor, depth, docs [T] (one value per entry). backend "math" builds the dense [T, T] mask (any
    device; the reference), "flex" a flex-attention block mask (CUDA); "auto" picks flex on CUDA. The
    pattern is the same in every layer: one instance serves all."""

    def __init__(self, anchor: torch.Tensor, depth: torch.Tensor, docs: torch.Tensor, backend: str = "auto") -> None:
        self.backend = resolve_ttt_backend(backend)
        self.anchor, self.depth, self.docs = anchor, depth, docs
        self._mask: Any = None

    def dense_mask(self) -> torch.Tensor:
        """[T, T] bool, True where a query may attend."""
        a, d = self.anchor, self.depth
        same_doc = self.docs[:, None] == self.docs[None, :]
        verified = (d[None, :] == 0) & (a[None, :] <= a[:, None])
        own_slots = (d[None, :] >= 1) & (a[None, :] == a[:, None]) & (d[None, :] <= d[:, None])
        return same_doc & (verified | own_slots)

    def block_mask(self) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        a, d, docs = self.anchor, self.depth, self.docs

        def mask_mod(b, h, q_idx, kv_idx):
            verified = (d[kv_idx] == 0) & (a[kv_idx] <= a[q_idx])
            own_slots = (d[kv_idx] >= 1) & (a[kv_idx] == a[q_idx]) & (d[kv_idx] <= d[q_idx])
            return (docs[kv_idx] == docs[q_idx]) & (verified | own_slots)

        T = a.numel()
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device=str(a.device),
                                 _compile=a.is_cuda)


class KVCache(_PerLayer):
    """Growing per-sequence key/value cache for decoding with the draft.

    `attend` appends the new keys and attends over everything cached, with `mask` [B or 1, 1, T_new,
    S_total] (True = may attend) when given (tree drafting), else causal in the new rows. A draft of
    several decoder layers keeps one cache per layer (`layer(i)`); `mask`, `crop` and `keep` given to
    this one apply to all of them. `window` W > 0 (a sliding-window draft): without a mask, a new row sees
    only the cached entries less than W back (cache index = position, as in chain decoding).
    """

    def __init__(self, window: int = 0) -> None:
        self.window = window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._parent: KVCache | None = None  # layer 0's cache, which holds the mask
        self._later: list[KVCache] = []  # layers 1..

    def _spawn(self) -> KVCache:
        return KVCache(self.window)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, length: int) -> None:
        """Drop cached positions from `length` on (rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        for child in self._later:
            child.crop(length)

    def keep(self, index: torch.Tensor) -> None:
        """Keep only cached positions `index` (1-D, ascending): e.g. the accepted path of a tree."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(2, index), self.v.index_select(2, index)
        for child in self._later:
            child.keep(index)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        nh, T = q.shape[1], q.shape[2]
        mask = self.mask if self._parent is None else self._parent.mask
        if mask is None:
            S = self.k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=past)
            if self.window:
                rows, cols = torch.arange(past, past + T, device=q.device), torch.arange(S, device=q.device)
                mask &= (rows[:, None] - cols[None, :]) < self.window
        return F.scaled_dot_product_attention(q, _expand_kv(self.k, nh), _expand_kv(self.v, nh), attn_mask=mask)


class StaticKVCache(_PerLayer):
    """A draft's key/value cache for batched decoding: `rows` sequences of `length` slots per layer,
    preallocated, so a decoding step has fixed shapes and can be captured as a CUDA graph.

    Before each forward the caller sets `slots` [B, T_k] (where each new key goes; a slot is the key's
    rotary position, padding goes to the last slot, which no query attends to) and `mask` [B, 1, T_q,
    length] (True = may attend). `row` set to an int runs the forward for that row alone (a prefill).
    The settings given to this instance (layer 0) apply to every layer's cache (`layer(i)`). `window` W > 0:
    the draft attends through a sliding window, which the caller's masks apply (a query at position p sees
    slots > p - W)."""

    def __init__(self, rows: int, length: int, window: int = 0) -> None:
        self.rows, self.length, self.window = rows, length, window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.row: int | None = None
        self._parent: StaticKVCache | None = None
        self._later: list[StaticKVCache] = []

    def _spawn(self) -> StaticKVCache:
        return StaticKVCache(self.rows, self.length, self.window)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        owner = self._parent or self
        if self.k is None:
            self.k = k.new_zeros(self.rows, k.shape[1], self.length, k.shape[3])
            self.v = v.new_zeros(self.rows, v.shape[1], self.length, v.shape[3])
        keys, values = self.k, self.v
        if owner.row is not None:
            keys, values = keys[owner.row:owner.row + 1], values[owner.row:owner.row + 1]
        at = owner.slots[:, None, :, None]
        keys.scatter_(2, at.expand(-1, k.shape[1], -1, k.shape[3]), k)
        values.scatter_(2, at.expand(-1, v.shape[1], -1, v.shape[3]), v)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=owner.mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])
