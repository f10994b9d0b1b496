"""The DSpark training objective: DFlash's sampled blocks (eyas.train.dflash), every slot a proposal.

One packed row, as DFlash's: A anchors a, a block [x_a, MASK x (B-1)] per anchor over the row's fused
target states as context. What differs (eyas.model.dspark):

    slots:    j = 0..B-1 (the anchor's own slot too) predicts token a+j+1: the target's distribution at a+j
    Markov:   slot j is scored after the bias of the token before it, x_{a+j} (teacher forcing: the data's
              token, which is the draft's previous proposal whenever that one was accepted)
    loss:     sum over blocks and slots of exp(-j/gamma) * CE (or an LK loss), through the fused head over
              [norm(x_j) ; markov_w1[x_{a+j}]] and [lm_head ; markov_w2] side by side
    + confidence: binary CE of the confidence head against "the proposal is the target's argmax", on the
              slots' features held fixed (the head learns to read the draft, not to steer it)

stats row j = slot j; the trainer divides by the valid slot-0 count of the global batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eyas.model.attention import BlockAttention
from eyas.model.dspark import DSparkDraft
from eyas.train.dflash import BlockConfig, DFlashObjective, anchor_seed, sample_anchors
from eyas.train.loss import TargetDist, fused_draft_ce, reference_draft_ce


class DSparkObjective(DFlashObjective):
    draft: DSparkDraft

    def __init__(self, draft: DSparkDraft, cfg: BlockConfig, mask_embed: torch.Tensor | None = None) -> None:
        super().__init__(draft, cfg, mask_embed)
        self.weights = [math.exp(-j / cfg.gamma) for j in range(cfg.block_size)]

    def forward(self, batch: dict[str, Any], target_probs: torch.Tensor, target_ids: torch.Tensor,
                block_mask: Any = None, target_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks(batch["input_ids"], batch["aux_hidden"], batch["position_ids"], batch["loss_mask"],
                           batch["document_ids"], TargetDist(target_probs, target_ids, target_mass),
                           anchor_seed(self.cfg.seed, batch["samples"]), batch.get("input_embeds"))

    def blocks(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, position_ids: torch.Tensor,
               loss_mask: torch.Tensor, document_ids: torch.Tensor, target: TargetDist, seed: int,
               input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As BlockObjective.forward (the same inputs, target over [N + pad] rows, pad >= block_size);
        returns (loss, stats [B, 3])."""
        B, draft, dev = self.cfg.block_size, self.draft, input_ids.device
        anchors, usable = sample_anchors(loss_mask, document_ids, self.cfg.anchors, seed)  # [A]
        A = anchors.numel()
        rows = anchors[None] + torch.arange(B, device=dev)[:, None]  # [B, A]: slot j scored at row a + j
        lm = nn.functional.pad(loss_mask.bool(), (0, B))
        doc = nn.functional.pad(document_ids, (0, B), value=-1)
        valid = usable[None] & lm[rows + 1] & (doc[rows + 1] == document_ids[anchors][None]) & (target.ids[rows] >= 0)
        weights = torch.tensor(self.weights, dtype=torch.float32, device=dev)

        emb = draft.embed_tokens(input_ids[anchors]) if input_embeds is None else input_embeds[anchors]  # [A, H]
        block = draft.block_embeds(emb, B, self.mask_embed).reshape(1, A * B, -1)
        block_pos = (position_ids[anchors][:, None] + torch.arange(B, device=dev)).reshape(1, A * B)
        attend = BlockAttention(anchors, document_ids, B, self.cfg.attention)
        out = draft(block, block_pos, draft.context(aux_hidden[None]), position_ids[None], attend).view(A, B, -1)
        prev = nn.functional.pad(input_ids, (0, B))[rows]  # [B, A]: the token before each slot's proposal
        features = [draft.head_features(out[:, j], prev[j]) for j in range(B)]  # B x [A, H + r]
        weight = draft.head_weight()
        wvalid = valid.float() * weights[:, None]
        if self.cfg.fused_loss:
            loss, stats = fused_draft_ce(weight, features, target, wvalid, self.cfg.loss_chunk_elems,
                                         compiled=self.cfg.compile, rows=rows, loss=self.cfg.loss)
        else:
            loss, stats = reference_draft_ce(weight, features, target, wvalid, rows=rows, loss=self.cfg.loss)
        return loss + self.confidence_loss(features, weight, target.ids[rows], valid), stats

    def confidence_loss(self, features: list[torch.Tensor], weight: torch.Tensor, target_ids: torch.Tensor,
                        valid: torch.Tensor) -> torch.Tensor:
        """Binary CE of the confidence head, summed over valid slots; target_ids, valid [B, A]."""
        total = torch.zeros((), dtype=torch.float32, device=weight.device)
        for j, f in enumerate(features):
            f = f.detach()
            with torch.no_grad():
                accepted = ((f @ weight.to(f.dtype).T).argmax(-1) == target_ids[j]).float()
            bce = nn.functional.binary_cross_entropy_with_logits(self.draft.confidence_logit(f), accepted,
                                                                 reduction="none")
            total = total + (bce * valid[j].float()).sum()
        return total
