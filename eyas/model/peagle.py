"""The P-EAGLE draft (parallel drafting with EAGLE-3's model), readable top to bottom.

The model is EAGLE-3's (eyas.model.draft: fc over the aux states, a first layer over [embedding ;
hidden], more plain layers, the draft-vocabulary head) plus two learned inputs for the positions whose
token and target state do not exist yet:

    mask_hidden [1, k*H_t]  stands for the target's aux states there (fused by fc like real ones)
    mask_embed  [H]         stands for the token embedding there (the mask token's row)

One causal forward proposes K tokens. With n the newest verified position (its token the one the
target just produced), the draft reads, position by position:

    p <= n:          (token p+1, fc(aux_p))                 as EAGLE-3's first step
    n+1 .. n+K-1:    (mask_embed, fc(mask_hidden))           the K-1 mask slots

and the outputs at n, n+1, ..., n+K-1 are the K proposals (tokens n+2 .. n+K+1), verified as a chain.
Nothing is fed back: no second forward. vLLM serves exactly this as an EAGLE-3 draft with
`parallel_drafting` (llama_eagle3.py + the generic proposer's mask slots), reading `mask_hidden` from
the checkpoint and the mask embedding from the checkpoint's own embed_tokens (eyas.export.peagle
writes `mask_embed` into the row `mask_token_id`; vLLM keeps a draft embedding that differs from the
target's). The training objective is eyas.train.peagle, the proposer eyas.eval.proposers.

Why a learned row and not the whole embedding: the paper unfreezes the target embedding so the mask
token's row can learn; only that row is ever read at a mask slot, so one [H] parameter learns the same
thing, keeps the frozen table off the optimizer (and on the host where the trainer offloads it), and
serves in vLLM unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.utils.io import EyasError


class PEagleDraft(Eagle3Draft):
    def __init__(self, cfg: DraftConfig) -> None:
        check_peagle_config(cfg)
        super().__init__(cfg)
        self.mask_hidden = nn.Parameter(torch.empty(1, cfg.num_aux_layers * cfg.target_hidden_size))
        self.mask_embed = nn.Parameter(torch.empty(cfg.hidden_size))
        self.reset_masks()

    def reset_masks(self) -> None:
        """Random, not zero: both go through an RMSNorm, whose gradient at zero is huge."""
        with torch.no_grad():
            self.mask_hidden.normal_(0.0, 1.0)
            self.mask_embed.normal_(0.0, 0.02)

    def mask_inputs(self, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [count, H], hidden states [count, H]) of `count` mask slots: what every slot reads."""
        hidden = self.fuse(self.mask_hidden.to(self.fc.weight.dtype))  # [1, H]
        H = self.config.hidden_size
        return self.mask_embed.to(dtype).expand(count, H), hidden.to(dtype).expand(count, H)


def check_peagle_config(cfg: DraftConfig) -> None:
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise EyasError(f"mask_token_id {cfg.mask_token_id} is not a token of the target's vocabulary [0, "
                        f"{cfg.vocab_size}): pass --mask-token-id")
    if cfg.norm_output:
        raise EyasError("norm_output changes what a chained step reads; a peagle draft never chains: drop it")
