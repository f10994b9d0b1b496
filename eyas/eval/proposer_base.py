"""What every family's proposer for SpeculativeDecoder (eyas.eval.spec_decode) builds on: the decoding
methods (ChainSpec, TreeSpec), and `DraftProposer` with the draft, where it runs, the target's vocabulary
size, the draft's dtype, its vocabulary as target ids, and the step that turns draft logits into
target-id proposals. The family proposers import this module; spec_decode imports them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.eval.sampling import sample, target_probs
from eyas.model.attention import KVCache
from eyas.model.draft import DraftModel


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


class DraftProposer:
    def __init__(self, draft: DraftModel, device: torch.device, vocab: int) -> None:
        self.draft, self.device, self.vocab = draft, device, vocab
        self.dtype = draft.fc.weight.dtype
        self.d2t_ids = draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)  # [V_d] target ids

    def new_cache(self) -> KVCache:
        return KVCache(self.draft.config.sliding_window)

    def _over_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """q [K, V_d] over the draft vocabulary -> [K, V] over the target's, as the verifier compares them."""
        q_target = torch.zeros(q.shape[0], self.vocab, device=self.device)
        q_target[:, self.d2t_ids] = q
        return q_target

    def _propose_all(self, logits: torch.Tensor, temperature: float, top_p: float,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [K, V_d] from one forward -> target ids [K] and (sampling) the draft's q [K, V] they were
        drawn from (each position independently: lossless all the same)."""
        if temperature <= 0:
            return self.d2t_ids[logits.argmax(-1)], None
        q = target_probs(logits, temperature, top_p)
        return self.d2t_ids[sample(q, generator)], self._over_target_vocab(q)
