"""What every family's proposer (eyas.eval.proposers) builds on: the decoding methods (ChainSpec, TreeSpec),
what each row brings to a round (`Pending`), the draft cache's masks, and `Proposer`: the draft, its
dtype, its vocabulary as target ids, and the step that turns draft logits into target-id proposals,
greedy or sampled.

The alignment is EAGLE-3's (and vLLM's): draft entry t holds token t+1 and the target's state at t, at
rotary position t. Each row carries `count` pending entries (the tokens the last verify accepted and the
target's next token, with the target's states before them; at most `M`, the tail is padding), and `cached`
tokens in the target's cache, so its draft cache holds cached - count entries. Padding entries write their
keys to the cache's last slot, which no query attends to; a query at rotary position p attends to the
slots <= p that hold its row's entries, so keys a row drafted and dropped are overwritten before they
are read again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.eval.sampling import Sampling
from eyas.model.attention import StaticKVCache
from eyas.model.draft import DraftModel
from eyas.utils.io import EyasError


@dataclass(frozen=True)
class ChainSpec:
    """K draft tokens in a chain, verified together."""

    k: int

    @property
    def name(self) -> str:
        return f"chain-{self.k}"

    @property
    def max_accept(self) -> int:
        return self.k


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 dynamic tree: `depth` draft steps (the longest path), `top_k` children per expanded
    node and `top_k` nodes expanded per step, the best `total` nodes by cumulative draft log-prob
    kept and verified (plus the root, so the target sees total + 1 tokens)."""

    total: int
    depth: int
    top_k: int

    @property
    def name(self) -> str:
        return f"tree-{self.total}:{self.depth}:{self.top_k}"

    @property
    def max_accept(self) -> int:
        return self.depth

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """'60:7:10' -> total 60, depth 7, top-k 10."""
        parts = text.split(":")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tree spec {text!r} must be TOTAL:DEPTH:TOPK, e.g. 60:7:10")
        total, depth, top_k = (int(p) for p in parts)
        if min(total, depth, top_k) < 1:
            raise ValueError(f"tree spec {text!r}: every number must be >= 1")
        return cls(total, depth, top_k)


Method = ChainSpec | TreeSpec


@dataclass
class Pending:
    """What every row brings to a round (device tensors, B rows)."""

    tokens: torch.Tensor  # [B, M] target ids, the newest at count - 1
    aux: torch.Tensor  # [B, M, k*H] the target's aux states before them
    count: torch.Tensor  # [B] pending entries
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


Proposal = tuple[torch.Tensor, torch.Tensor | None]  # target ids [B, K]; sampled: the draft's q [B, K, V]


class Proposer:
    """A family's drafting for B rows over a static draft cache, in fixed shapes (one CUDA graph a round).
    `chain` returns K target ids per row and, when sampling, the distributions q they were drawn from (over
    the target's vocabulary, as the verifier compares them); EAGLE-3's `tree` an EAGLE-2 tree."""

    trees = False  # drafts EAGLE-2 trees
    proposals_per_block = 0  # block drafters: proposals a block of B makes beyond B (None: no block limit)

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft.eval()
        self.dtype = draft.fc.weight.dtype
        self.vocab = int(draft.config.vocab_size)
        self.d2t_ids = draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)  # [V_d] target ids
        self.window = int(getattr(draft.config, "sliding_window", 0) or 0)

    def check(self, method: Method) -> None:
        """Refuse what this family cannot draft before anything runs."""
        family = self.draft.config.family
        if isinstance(method, TreeSpec) and not self.trees:
            raise EyasError(f"{method.name}: trees are drafted by EAGLE-3 drafts only; a {family} draft proposes a "
                            "chain per forward: measure it with --chain (and --tree none)")
        block = getattr(self.draft.config, "block_size", None)
        if isinstance(method, ChainSpec) and self.proposals_per_block is not None and block:
            most = block + self.proposals_per_block
            if method.k > most:
                raise EyasError(f"{method.name}: this {family} draft was trained for blocks of {block} ({most} "
                                f"proposals each): use chain lengths up to {most}")

    def forwards(self, method: Method) -> int:
        """Draft forwards per round."""
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

    def pick(self, logits: torch.Tensor, sampling: Sampling | None) -> Proposal:
        """Draft logits [B, K, V_d] -> target ids [B, K] and (sampling) q [B, K, V_d], each position drawn on
        its own (lossless all the same: the verifier compares with the q each was drawn from)."""
        logits = logits.float()
        if sampling is None:
            return self.d2t_ids[logits.argmax(-1)], None
        q = sampling.probs(logits)
        return self.d2t_ids[sampling.draw(q)], q

    def over_target_vocab(self, q: torch.Tensor | None) -> torch.Tensor | None:
        """q [B, K, V_d] over the draft's vocabulary -> [B, K, V] over the target's."""
        if q is None:
            return None
        out = q.new_zeros(*q.shape[:-1], self.vocab)
        return out.scatter_(-1, self.d2t_ids.expand_as(q), q)
