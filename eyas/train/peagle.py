"""The P-EAGLE training objective: every row at depth 0 and sampled anchors at deeper depths, one forward.

One packed row of N tokens (several documents side by side, `document_ids` telling them apart):

    depth 0:   row t reads (token t+1, fc(aux_t)) at rotary position pos[t] and predicts token t+2 (the
               target's distribution at t+1): EAGLE-3's first TTT step, over every row
    depth d:   (1 .. S-1) A_d = ceil(N * max(r^d, r_min)) anchors drawn (seeded) among the anchors of depth
               d-1 whose depth-d target is trained (COD sampling); entry (t, d) reads the mask slot's inputs
               (mask_embed, fc(mask_hidden)) at position pos[t] + d and predicts token t+2+d (target row
               t+1+d): the d-th mask slot after a verified position t at inference (eyas.model.peagle)
    attention: an entry sees the depth-0 rows up to its anchor and its anchor's entries of depths 1..d, in
               its document (eyas.model.attention.ParallelDraftAttention)
    validity:  the TTT rule of step d (eyas.train.loss.step_validity)
    loss:      soft CE (or an LK loss) summed over the valid entries of every depth, weight 1: deeper depths
               count less only because fewer anchors are drawn. Fused with the draft head
               (eyas.train.loss.fused_draft_ce); stats row d = depth d, as TTT's step rows

Nothing the draft outputs is fed back (unlike TTT), so all depths run in ONE forward of N + sum A_d
entries instead of S forwards of N. The caller (eyas.train.trainer) divides by the valid depth-0 count of
the global batch. Anchors depend only on the seed and the batch's samples: a resumed run, or another rank
count, draws the same ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.model.attention import ParallelDraftAttention
from eyas.model.peagle import PEagleDraft
from eyas.train.loss import LossSpec, TargetDist, fused_draft_ce, reference_draft_ce, step_validity
from eyas.train.ttt import compile_draft_layers


@dataclass
class ParallelConfig:
    depths: int = 7  # S: depth 0 and S-1 mask slots, the most tokens one forward proposes
    ratio: float = 0.7  # depth d keeps a share max(ratio^d, min_ratio) of the rows as anchors
    min_ratio: float = 0.2
    attention: str = "auto"  # math | flex | auto (flex on CUDA)
    seed: int = 0
    compile: bool = False  # torch.compile the layers' halves and the loss chunk (CUDA)
    loss_chunk_elems: int = 1 << 25
    fused_loss: bool = True  # False: plain autograd over full logits (reference, tests)
    loss: LossSpec = LossSpec()  # the per-row loss: soft CE or an LK loss


def depth_counts(rows: int, depths: int, ratio: float, min_ratio: float) -> list[int]:
    """Anchors drawn at depths 1 .. depths-1 of a packed row of `rows` rows (a fixed shape per row length)."""
    return [min(rows, math.ceil(rows * max(ratio**d, min_ratio))) for d in range(1, depths)]


def sample_depths(valid: torch.Tensor, counts: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """valid [S, N] (step_validity) -> per depth d >= 1: (anchors [A_d] ascending, usable [A_d] bool).

    One seeded score per row ranks the rows; depth d takes the best-scored A_d rows among the usable
    anchors of depth d-1 whose depth-d target is trained (depth 0 holds every row), so an anchor's entries
    of depths 1..d-1 are always there to attend to. Where fewer are eligible the rest are marked
    unusable, so shapes never change. Pure device ops, no host sync."""
    N = valid.shape[1]
    g = torch.Generator(device=valid.device).manual_seed(seed)
    score = torch.rand(N, generator=g, device=valid.device)
    member = torch.ones(N, dtype=torch.bool, device=valid.device)
    picks = []
    for d, count in enumerate(counts, start=1):
        eligible = member & valid[d]
        anchors = score.masked_fill(~eligible, -1.0).topk(count).indices.sort().values
        usable = eligible[anchors]
        member = torch.zeros_like(member)
        member[anchors] = usable
        picks.append((anchors, usable))
    return picks


class ParallelObjective(nn.Module):
    """The P-EAGLE draft and its loss; one forward = one packed row, so DDP/FSDP wrap it whole."""

    def __init__(self, draft: PEagleDraft, cfg: ParallelConfig) -> None:
        super().__init__()
        self.draft, self.cfg = draft, cfg
        self.weights = [1.0] * cfg.depths
        if cfg.compile:
            compile_draft_layers(draft)

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, position_ids: torch.Tensor,
                loss_mask: torch.Tensor, document_ids: torch.Tensor, target: TargetDist, seed: int,
                input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, position_ids, loss_mask, document_ids [N] (padding has a document id of its own);
        aux_hidden [N, k*H_t]; target over [N + pad] rows, pad > depths; input_embeds [N, H]: the frozen
        embeddings of input_ids when the table is off the device.

        Returns (loss: per-entry loss summed over valid entries, fp32 scalar; stats [S, 3] fp32: per depth
        loss sum, correct count, valid count)."""
        cfg, draft, dev = self.cfg, self.draft, input_ids.device
        N = input_ids.shape[0]
        valid = step_validity(loss_mask, document_ids, target.ids, cfg.depths)  # [S, N]
        counts = depth_counts(N, cfg.depths, cfg.ratio, cfg.min_ratio)
        picks = sample_depths(valid, counts, seed)

        # depth 0: row t reads token t+1 and the target's state at t; then every drawn entry's mask slot
        hidden0 = draft.fuse(aux_hidden)  # [N, H]
        emb0 = draft.embed_tokens(F.pad(input_ids[1:], (0, 1))) if input_embeds is None else \
            F.pad(input_embeds[1:], (0, 0, 0, 1))
        mask_emb, mask_hidden = draft.mask_inputs(sum(counts), hidden0.dtype)
        anchor = torch.cat([torch.arange(N, device=dev)] + [a for a, _ in picks])  # [T]
        depth = torch.cat([torch.zeros(N, dtype=torch.long, device=dev)] +
                          [torch.full((c,), d, dtype=torch.long, device=dev) for d, c in enumerate(counts, start=1)])
        attend = ParallelDraftAttention(anchor, depth, document_ids[anchor], cfg.attention)
        out = draft(None, torch.cat([hidden0, mask_hidden])[None], (position_ids[anchor] + depth)[None], attend,
                    torch.cat([emb0.to(hidden0.dtype), mask_emb])[None])[0]  # [T, H]

        hiddens = list(draft.head_input(out).split([N, *counts]))
        rows = [a + 1 + d for d, a in enumerate(anchor.split([N, *counts]))]  # the target row each entry learns
        wvalid = [valid[0].float()] + [usable.float() for _, usable in picks]
        if cfg.fused_loss:
            return fused_draft_ce(draft.lm_head.weight, hiddens, target, wvalid, cfg.loss_chunk_elems,
                                  compiled=cfg.compile, rows=rows, loss=cfg.loss)
        return reference_draft_ce(draft.lm_head.weight, hiddens, target, wvalid, rows=rows, loss=cfg.loss)
