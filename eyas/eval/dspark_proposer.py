"""DSpark's proposer for SpeculativeDecoder (eyas.eval.spec_decode): one draft forward per verify step, then
the Markov head left to right (eyas.model.dspark).

The draft's cache holds the context only, as DFlash's (eyas.eval.block_proposer). Each round the block
[anchor, MASK x (K-1)] at rotary positions L .. L+K-1 (L = tokens in the target's cache; the anchor is the
newest token, not yet in it) attends to the whole context and to itself; slot j's output, after the Markov
bias of the token before it (the anchor, then proposal j-1), is proposal j: K proposals from a block of K,
as vLLM's DSpark speculator with `sample_from_anchor`. The block's keys are dropped after the forward.
"""

from __future__ import annotations

import torch

from eyas.eval.block_proposer import BlockProposer
from eyas.eval.sampling import sample, target_probs
from eyas.model.attention import KVCache
from eyas.model.dspark import DSparkDraft


class DSparkProposer(BlockProposer):
    draft: DSparkDraft
    proposals_per_block = 0  # every slot proposes, the anchor's too

    def chain(self, cache: KVCache, pending_tokens: torch.Tensor, pending_aux: torch.Tensor, k: int,
              temperature: float, top_p: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pending_tokens [m] (the newest last: the anchor), pending_aux [m, k*H] (the target's states at the m
        positions before the anchor not yet in the context) -> target ids [K] and (sampling) the draft's
        q [K, V] each was drawn from, given the proposals before it (lossless all the same)."""
        out = self.block_outputs(cache, pending_tokens, pending_aux, k)  # [K, H]: a block of K, K proposals
        prev, ids, qs = pending_tokens[-1], [], []
        for j in range(k):
            logits = self.draft.logits_after(out[j], prev).float()  # [V_d]
            if temperature <= 0:
                prev = self.d2t_ids[logits.argmax()]
            else:
                q = target_probs(logits[None], temperature, top_p)  # [1, V_d]
                prev = self.d2t_ids[sample(q, generator)][0]
                qs.append(q)
            ids.append(prev)
        return torch.stack(ids), (self._over_target_vocab(torch.cat(qs)) if qs else None)
