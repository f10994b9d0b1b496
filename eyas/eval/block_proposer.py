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

    def check(self, method: Any) -> None:
        """Refuse what a block drafter cannot do before anything runs."""
        if not isinstance(method, ChainSpec):
            raise EyasError(f"{method.name}: trees are drafted by EAGLE-3 drafts only; a dflash draft proposes a "
                            "chain per block: measure it with --chain (and --tree none)")
        B = self.draft.config.block_size
        if method.k > B - 1:
            raise EyasError(f"{method.name}: this dflash draft was trained for blocks of {B} (the anchor + {B - 1} "
                            f"proposals): use chain lengths up to {B - 1}")

    def forwards(self, method: Any) -> int:
        """Draft forwards per verify step: one, whatever K."""
        return 1

    def chain(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, k: int,
              temperature: float, top_p: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pending_tokens [m] (the newest last: the anchor), pending_aux [m, k*H] (the target's states at
        the m positions before the anchor not yet in the context) -> target ids [K] and (sampling) the
        draft's q [K, V] they were drawn from (each slot independently: lossless all the same)."""
        draft, dev = self.draft, self.device
        start, m = cache.length, pending_aux.shape[0]
        L = start + m  # the anchor's position
        context = draft.context(pending_aux[None])  # [1, m, H]
        block = draft.block_embeds(draft.embed_tokens(pending_tokens[-1:]), k + 1)  # [1, K+1, H]
        cache.mask = torch.ones(1, 1, k + 1, L + k + 1, dtype=torch.bool, device=dev)  # the context and the block
        out = draft(block, torch.arange(L, L + k + 1, device=dev)[None], context,
                    torch.arange(start, L, device=dev)[None], cache)  # [1, K+1, H]
        cache.mask = None
        cache.crop(L)  # the context only
        logits = draft.logits(out)[0, 1:].float()  # [K, V_d]
        return self._propose_all(logits, temperature, top_p, generator)

    def tree(self, *args: Any) -> Any:
        raise EyasError("trees are drafted by EAGLE-3 drafts only; a dflash draft proposes a chain per block")
