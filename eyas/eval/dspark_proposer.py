"""DSpark's proposer for SpeculativeDecoder (eyas.eval.spec_decode): one draft forward per verify step, then
the Markov head left to right (eyas.model.dspark).

The draft's cache holds the context only, as DFlash's (eyas.eval.block_proposer). Each round the block
[anchor, MASK x (K-1)] at rotary positions L .. L+K-1 (L = tokens in the target's cache; the anchor is the
newest token, not yet in it) attends to the whole context and to itself; slot j's output, after the Markov
bias of the token before it (the anchor, then proposal j-1), is proposal j: K proposals from a block of K,
as vLLM's DSpark speculator with `sample_from_anchor`. The block's keys are dropped after the forward.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.eval.proposer_base import ChainSpec, DraftProposer
from eyas.eval.sampling import sample, target_probs
from eyas.model.attention import KVCache
from eyas.model.dspark import DSparkDraft
from eyas.utils.io import EyasError


class DSparkProposer(DraftProposer):
    draft: DSparkDraft

    def check(self, method: Any) -> None:
        """Refuse what a block drafter cannot do before anything runs."""
        if not isinstance(method, ChainSpec):
            raise EyasError(f"{method.name}: trees are drafted by EAGLE-3 drafts only; a dspark draft proposes a "
                            "chain per block: measure it with --chain (and --tree none)")
        B = self.draft.config.block_size
        if method.k > B:
            raise EyasError(f"{method.name}: this dspark draft was trained for blocks of {B} (each slot, the "
                            f"anchor's too, one proposal): use chain lengths up to {B}")

    def forwards(self, method: Any) -> int:
        """Draft forwards per verify step: one, whatever K (the Markov head is not a forward of the draft)."""
        return 1

    def chain(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, k: int,
              temperature: float, top_p: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pending_tokens [m] (the newest last: the anchor), pending_aux [m, k*H] (the target's states at the
        m positions before the anchor not yet in the context) -> target ids [K] and (sampling) the draft's
        q [K, V] each was drawn from, given the proposals before it (lossless all the same)."""
        draft, dev = self.draft, self.device
        start, m = cache.length, pending_aux.shape[0]
        L = start + m  # the anchor's position
        context = draft.context(pending_aux[None])  # [1, m, H]
        block = draft.block_embeds(draft.embed_tokens(pending_tokens[-1:]), k)  # [1, K, H]
        cache.mask = torch.ones(1, 1, k, L + k, dtype=torch.bool, device=dev)  # the context and the block
        out = draft(block, torch.arange(L, L + k, device=dev)[None], context,
                    torch.arange(start, L, device=dev)[None], cache)[0]  # [K, H]
        cache.mask = None
        cache.crop(L)  # the context only
        prev, ids, qs = pending_tokens[-1], [], []
        for j in range(k):
            logits = draft.logits_after(out[j], prev).float()  # [V_d]
            if temperature <= 0:
                prev = self.d2t_ids[logits.argmax()]
            else:
                q = target_probs(logits[None], temperature, top_p)  # [1, V_d]
                prev = self.d2t_ids[sample(q, generator)][0]
                qs.append(q)
            ids.append(prev)
        proposals = torch.stack(ids)
        return proposals, (self._over_target_vocab(torch.cat(qs)) if qs else None)

    def tree(self, *args: Any) -> Any:
        raise EyasError("trees are drafted by EAGLE-3 drafts only; a dspark draft proposes a chain per block")
