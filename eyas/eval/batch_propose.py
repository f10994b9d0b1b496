"""Every family's drafting for the batched decoder (eyas.eval.batch_decode): B rows at once, over a static
draft cache (eyas.model.attention.StaticKVCache), in fixed shapes, so a whole round can be one CUDA graph.

The alignment is eyas.eval.spec_decode's: draft entry t holds token t+1 and the target's state at t, at
rotary position t. Each row carries `pend_n` pending entries (the tokens the last verify accepted and the
target's next token, with the target's states before them; at most `M`, the tail is padding), and `L`
tokens in the target's cache, so its draft cache holds L - pend_n entries. Padding entries write their
keys to the cache's last slot, which no query attends to; a query at rotary position p attends to the
slots <= p that hold its row's entries, so keys a row drafted and dropped are overwritten before they
are read again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.model.attention import StaticKVCache
from eyas.model.dflash import DFlashDraft
from eyas.model.draft import DraftModel
from eyas.model.eagle3 import Eagle3Draft


@dataclass
class Pending:
    """What every row brings to a round (device tensors, B rows)."""

    tokens: torch.Tensor  # [B, M] target ids, the newest at pend_n - 1
    aux: torch.Tensor  # [B, M, k*H] the target's aux states before them
    count: torch.Tensor  # [B] pend_n
    cached: torch.Tensor  # [B] L, tokens in the target's cache

    @property
    def newest(self) -> torch.Tensor:
        """[B] the token the target chose last (not yet in its cache)."""
        return self.tokens.gather(1, (self.count - 1)[:, None])[:, 0]

    def positions(self, cache: StaticKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending entries' rotary positions [B, M] and the slots their keys go to (padding: the last)."""
        j = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        pos = (self.cached - self.count)[:, None] + j
        return pos, torch.where(j < self.count[:, None], pos, cache.length - 1)


def causal_by_position(cache: StaticKVCache, positions: torch.Tensor) -> torch.Tensor:
    """positions [B, T] -> mask [B, 1, T, length]: each query sees the slots up to its own position (and, for a
    sliding-window draft, only the last `window` of them)."""
    slots = torch.arange(cache.length, device=positions.device)
    seen = slots <= positions[..., None]
    if cache.window:
        seen &= slots > positions[..., None] - cache.window
    return seen[:, None]


class BatchProposer:
    """A family's drafting for B rows; `chain` returns target ids [B, K]."""

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self.dtype = draft.fc.weight.dtype
        self.d2t_ids = draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)
        self.window = int(getattr(draft.config, "sliding_window", 0) or 0)

    def forwards(self, method) -> int:
        return 1

    def prefill(self, cache: StaticKVCache, row: int, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """Write the entries of a new prompt (tokens [n], aux [n, k*H]) at slots 0..n-1 of `row`."""
        if tokens.numel() == 0:
            return
        pos = torch.arange(tokens.numel(), device=tokens.device)[None]
        cache.row, cache.slots, cache.mask = row, pos, causal_by_position(cache, pos)
        try:
            self._write(cache, tokens, aux, pos)
        finally:
            cache.row = None

    def _write(self, cache: StaticKVCache, tokens: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor) -> None:
        self.draft(tokens[None], self.draft.fuse(aux[None]), pos, cache)


class Eagle3Batch(BatchProposer):
    """EAGLE-3: the pending entries in one forward, then K-1 chained steps or an EAGLE-2 tree."""

    draft: Eagle3Draft

    def forwards(self, method) -> int:
        return getattr(method, "k", None) or method.depth

    def _extend(self, cache: StaticKVCache, p: Pending) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending entries into the cache -> the newest one's output [B, 1, H] and logits [B, V_d]."""
        pos, cache.slots = p.positions(cache)
        cache.mask = causal_by_position(cache, pos)
        out = self.draft(p.tokens, self.draft.fuse(p.aux), pos, cache)
        root = out.gather(1, (p.count - 1)[:, None, None].expand(-1, 1, out.shape[-1]))
        return root, self.draft.logits(root)[:, 0].float()

    def chain(self, cache: StaticKVCache, p: Pending, k: int) -> torch.Tensor:
        hidden, logits = self._extend(cache, p)
        tokens = []
        for j in range(k):
            t = self.d2t_ids[logits.argmax(-1)]  # [B]
            tokens.append(t)
            if j < k - 1:
                pos = (p.cached + j)[:, None]
                cache.slots, cache.mask = pos, causal_by_position(cache, pos)
                hidden = self.draft(t[:, None], hidden, pos, cache)
                logits = self.draft.logits(hidden)[:, 0].float()
        return torch.stack(tokens, dim=1)

    def tree(self, cache: StaticKVCache, p: Pending, spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's dynamic tree for every row (eyas.eval.spec_decode.Eagle3Proposer._draft_tree, batched):
        step d's k frontier entries go to slots L + (d-1)k .. and see the row's prefix and their own
        ancestors. Returns target ids [B, N], parent index [B, N] in 0..N (0 = the root) and depth [B, N]."""
        root, logits = self._extend(cache, p)
        dev, L = root.device, p.cached
        B, H = root.shape[0], root.shape[-1]
        k = min(spec.top_k, logits.shape[-1])
        score, tok = torch.log_softmax(logits, dim=-1).topk(k)  # [B, k]
        pool_score, pool_tok = [score], [tok]
        pool_parent = [torch.full((B, k), -1, device=dev)]
        pool_depth = [torch.ones(B, k, dtype=torch.long, device=dev)]
        frontier_idx = torch.arange(k, device=dev).expand(B, k)
        frontier_score, frontier_tok = score, tok
        hidden = root.expand(B, k, H)
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)
        ancestors = eye[:, :, :0]
        prefix = (torch.arange(cache.length, device=dev) < L[:, None])[:, None].expand(B, k, cache.length)
        size = k
        for d in range(1, spec.depth):
            ancestors = torch.cat([ancestors, eye], dim=2)  # [B, k, d*k] over the tree entries, this step's last
            tree_slots = L[:, None] + torch.arange(d * k, device=dev)
            cache.slots = tree_slots[:, -k:]
            seen = prefix
            if cache.window:  # from position L - 1 + d, only the last `window` positions of the context
                seen = prefix & (torch.arange(cache.length, device=dev) >= (L + d - cache.window)[:, None])[:, None]
            cache.mask = seen.scatter(2, tree_slots[:, None].expand(B, k, d * k), ancestors)[:, None]
            out = self.draft(self.d2t_ids[frontier_tok], hidden, (L - 1 + d)[:, None].expand(B, k), cache)
            c_score, c_tok = torch.log_softmax(self.draft.logits(out).float(), dim=-1).topk(k, dim=-1)  # [B, k, k]
            c_score = (frontier_score[..., None] + c_score).flatten(1)
            pool_score.append(c_score)
            pool_tok.append(c_tok.flatten(1))
            pool_parent.append(frontier_idx.repeat_interleave(k, dim=1))
            pool_depth.append(torch.full((B, k * k), d + 1, device=dev))
            best = c_score.topk(k).indices  # [B, k] the next frontier
            rows = best // k
            frontier_idx, frontier_score = size + best, c_score.gather(1, best)
            frontier_tok = c_tok.flatten(1).gather(1, best)
            hidden = out.gather(1, rows[..., None].expand(B, k, H))
            ancestors = ancestors.gather(1, rows[..., None].expand(B, k, d * k))
            size += k * k
        scores = torch.cat(pool_score, dim=1)
        n = min(spec.total, scores.shape[1])
        # as in the one-row tree: a stable sort keeps the selection closed under ancestors, and re-sorting
        # by pool index puts parents before children
        chosen = torch.sort(torch.sort(-scores, dim=1, stable=True).indices[:, :n], dim=1).values
        parents = torch.cat(pool_parent, dim=1).gather(1, chosen)
        found = torch.searchsorted(chosen, parents.clamp_min(0).contiguous())
        parent_pos = torch.where(parents < 0, 0, found + 1)
        tokens = self.d2t_ids[torch.cat(pool_tok, dim=1).gather(1, chosen)]
        return tokens, parent_pos, torch.cat(pool_depth, dim=1).gather(1, chosen)


class DFlashBatch(BatchProposer):
    """DFlash: the pending context and the block [anchor, MASK x K] in one forward (eyas.eval.block_proposer)."""

    draft: DFlashDraft

    def _write(self, cache: StaticKVCache, tokens: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor) -> None:
        # the context's keys only: a one-slot block rides along, its key parked in the unattended slot
        block = self.draft.block_embeds(self.draft.embed_tokens(tokens[-1:]), 1)
        n = tokens.numel()
        cache.slots = torch.cat([pos, torch.full((1, 1), cache.length - 1, device=pos.device)], dim=1)
        cache.mask = causal_by_position(cache, torch.full((1, 1), n - 1, device=pos.device))
        self.draft(block, torch.full((1, 1), n, device=pos.device), self.draft.context(aux[None]), pos, cache)

    def chain(self, cache: StaticKVCache, p: Pending, k: int) -> torch.Tensor:
        draft = self.draft
        ctx_pos, ctx_slots = p.positions(cache)
        block_pos = p.cached[:, None] + torch.arange(k + 1, device=ctx_pos.device)
        cache.slots = torch.cat([ctx_slots, block_pos], dim=1)
        cache.mask = causal_by_position(cache, block_pos[:, -1:])  # the context and the whole block
        block = draft.block_embeds(draft.embed_tokens(p.newest), k + 1)  # [B, K+1, H]
        out = draft(block, block_pos, draft.context(p.aux), ctx_pos, cache)
        return self.d2t_ids[draft.logits(out[:, 1:]).float().argmax(-1)]


class PEagleBatch(BatchProposer):
    """P-EAGLE: the pending entries and K-1 mask slots in one causal forward (eyas.eval.parallel_proposer)."""

    def chain(self, cache: StaticKVCache, p: Pending, k: int) -> torch.Tensor:
        draft, dtype = self.draft, self.dtype
        B, M = p.tokens.shape
        dev = p.tokens.device
        pend_pos, pend_slots = p.positions(cache)
        mask_pos = p.cached[:, None] + torch.arange(k - 1, device=dev)
        mask_emb, mask_hidden = draft.mask_inputs(k - 1, dtype)
        emb = torch.cat([draft.embed_tokens(p.tokens).to(dtype), mask_emb.expand(B, k - 1, -1)], dim=1)
        hidden = torch.cat([draft.fuse(p.aux).to(dtype), mask_hidden.expand(B, k - 1, -1)], dim=1)
        pos = torch.cat([pend_pos, mask_pos], dim=1)
        cache.slots, cache.mask = torch.cat([pend_slots, mask_pos], dim=1), causal_by_position(cache, pos)
        out = draft(None, hidden, pos, cache, emb)
        take = torch.cat([(p.count - 1)[:, None], M + torch.arange(k - 1, device=dev).expand(B, k - 1)], dim=1)
        out = out.gather(1, take[..., None].expand(B, k, out.shape[-1]))
        return self.d2t_ids[draft.logits(out).float().argmax(-1)]


BATCH_PROPOSERS = {"eagle3": Eagle3Batch, "dflash": DFlashBatch, "peagle": PEagleBatch}


def make_batch_proposer(draft: DraftModel) -> BatchProposer:
    """The batched drafting of the draft's family (families without one decode one prompt at a time)."""
    return BATCH_PROPOSERS[draft.config.family](draft)
