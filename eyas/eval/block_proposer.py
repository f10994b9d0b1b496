"""DFlash's proposer for SpeculativeDecoder (eyas.eval.spec_decode): one draft forward per verify step.

The draft's cache holds the context only: every layer's keys and values of the target's fused aux
states, one entry per position in the target's cache. Each round the new entries join it, and the
block [anchor, MASK x K] at rotary positions L .. L+K (L = tokens in the target's cache; the anchor
is the newest token, not yet in it) attends to the whole context and to itself, as in training
(eyas.train.dflash) and in vLLM. Slots 1..K are the K proposals, verified as a chain; the block's
keys are dropped after the forward. Trees are EAGLE-3's.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.eval.proposer_base import ChainSpec, DraftProposer
from eyas.model.attention import KVCache
from eyas.model.dflash import DFlashDraft
from eyas.utils.io import EyasError


class BlockProposer(DraftProposer):
    draft: DFlashDraft
    proposals_per_block = -1  # a block of B proposes B - 1 tokens (the anchor's slot proposes none)

    def check(self, method: Any) -> None:
        """Refuse what a block drafter cannot do before anything runs."""
        family = self.draft.config.family
        if not isinstance(method, ChainSpec):
            raise EyasError(f"{method.name}: trees are drafted by EAGLE-3 drafts only; a {family} draft proposes a "
                            "chain per block: measure it with --chain (and --tree none)")
        B = self.draft.config.block_size
        most = B + self.proposals_per_block
        if method.k > most:
            raise EyasError(f"{method.name}: this {family} draft was trained for blocks of {B} ({most} proposals "
                            f"each): use chain lengths up to {most}")

    def forwards(self, method: Any) -> int:
        """Draft forwards per verify step: one, whatever K."""
        return 1

    def chain(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, k: int,
              temperature: float, top_p: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pending_tokens [m] (the newest last: the anchor), pending_aux [m, k*H] (the target's states at
        the m positions before the anchor not yet in the context) -> target ids [K] and (sampling) the
        draft's q [K, V] they were drawn from (each slot independently: lossless all the same)."""
        logits = self.draft.logits(self.block_outputs(cache, pending_tokens, pending_aux, k + 1))[1:].float()
        return self._propose_all(logits, temperature, top_p, generator)  # [K, V_d] -> K proposals

    def block_outputs(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, size: int
                      ) -> torch.Tensor:
        """The pending entries join the context; the block [anchor, MASK x (size-1)] at positions L .. L+size-1
        attends to the whole context and itself -> its outputs [size, H]; the block's keys are dropped."""
        draft, dev = self.draft, self.device
        start, m = cache.length, pending_aux.shape[0]
        L = start + m  # the anchor's position
        context = draft.context(pending_aux[None])  # [1, m, H]
        block = draft.block_embeds(draft.embed_tokens(pending_tokens[-1:]), size)  # [1, size, H]
        cache.mask = torch.ones(1, 1, size, L + size, dtype=torch.bool, device=dev)  # the context and the block
        out = draft(block, torch.arange(L, L + size, device=dev)[None], context,
                    torch.arange(start, L, device=dev)[None], cache)  # [1, size, H]
        cache.mask = None
        cache.crop(L)  # the context only
        return out[0]

    def tree(self, *args: Any) -> Any:
        raise EyasError(f"trees are drafted by EAGLE-3 drafts only; a {self.draft.config.family} draft proposes a "
                        "chain per block")
