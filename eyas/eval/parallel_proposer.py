"""P-EAGLE's proposer for SpeculativeDecoder (eyas.eval.spec_decode): one draft forward per verify step.

The draft's KV cache is EAGLE-3's: entry t holds (token t+1, the target's fused state at t) at rotary
position t. Each round the pending entries (the newest last: the token the target just produced, with
the state before it) join it in the same causal forward as K-1 mask slots (the learned mask embedding and
fc(mask_hidden)) at positions L .. L+K-2, L = tokens in the target's cache. The outputs at the newest
entry and at the K-1 slots are the K proposals, verified as a chain; the slots' keys are dropped after the
forward. This is vLLM's parallel drafting (eyas.model.peagle); trees are EAGLE-3's.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.eval.proposer_base import ChainSpec, DraftProposer
from eyas.model.attention import KVCache
from eyas.model.peagle import PEagleDraft
from eyas.utils.io import EyasError


class ParallelProposer(DraftProposer):
    draft: PEagleDraft

    def check(self, method: Any) -> None:
        """Refuse what one parallel forward cannot draft before anything runs."""
        if not isinstance(method, ChainSpec):
            raise EyasError(f"{method.name}: trees are drafted by EAGLE-3 drafts only; a peagle draft proposes a "
                            "chain in one forward: measure it with --chain (and --tree none)")

    def forwards(self, method: Any) -> int:
        """Draft forwards per verify step: one, whatever K."""
        return 1

    def chain(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, k: int,
              temperature: float, top_p: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pending_tokens [m] (the newest last), pending_aux [m, k*H] (the target's states at the m positions
        before them) -> target ids [K] and (sampling) the draft's q [K, V] they were drawn from (each
        position independently: lossless all the same)."""
        draft, dev = self.draft, self.device
        start, m = cache.length, pending_tokens.numel()
        L = start + m  # tokens in the target's cache
        mask_emb, mask_hidden = draft.mask_inputs(k - 1, self.dtype)
        emb = torch.cat([draft.embed_tokens(pending_tokens).to(self.dtype), mask_emb])  # [m + K-1, H]
        hidden = torch.cat([draft.fuse(pending_aux.to(self.dtype)), mask_hidden])
        cache.mask = None  # causal over the new entries, everything cached before them
        out = draft(None, hidden[None], torch.arange(start, L + k - 1, device=dev)[None], cache, emb[None])
        cache.crop(L)  # the verified entries only
        logits = draft.logits(out)[0, m - 1:].float()  # [K, V_d]
        return self._propose_all(logits, temperature, top_p, generator)

    def tree(self, *args: Any) -> Any:
        raise EyasError("trees are drafted by EAGLE-3 drafts only; a peagle draft proposes a chain in one forward")
