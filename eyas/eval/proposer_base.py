"""What every family's proposer for SpeculativeDecoder (eyas.eval.spec_decode) starts from: the draft, where it
runs, the target's vocabulary size, the draft's dtype and its vocabulary as target ids, and the step that
turns draft logits into target-id proposals. Kept apart from spec_decode so the family proposers can
import it without a cycle."""

from __future__ import annotations

import torch

from eyas.eval.sampling import sample, target_probs
from eyas.model.attention import KVCache
from eyas.model.draft import DraftModel


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
