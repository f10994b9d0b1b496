"""The DFlash training objective: blocks drafted from sampled anchors, all slots in one forward.

One packed row of N tokens (several documents side by side, `document_ids` telling them apart):

    anchors:  A positions a drawn (seeded) where loss_mask[a] and loss_mask[a+1] hold, a+1 in a's
              document: a token the target produced, followed by one it must produce
    blocks:   [x_a, MASK x (B-1)] at rotary positions pos[a] .. pos[a]+B-1; slot k of block r sees
              the context positions j < a_r of a_r's document and its whole block
              (eyas.model.attention.BlockAttention); context = the target's fused states of the row
    labels:   slot k (1..B-1) predicts token a+k: the target's distribution at position a+k-1
              (eyas.train.loss.target_distribution; soft, or one-hot with label_temperature 0)
    validity: token a+k trained (loss_mask), in a's document, the target's argmax in the draft vocabulary
    loss:     sum over blocks and slots of exp(-(k-1)/gamma) * CE (or an LK loss), fused with the frozen draft head
              (eyas.train.loss.fused_draft_ce); stats row k-1 = slot k, as TTT's step rows

The caller (eyas.train.trainer) divides by the valid slot-1 count of the global batch. Anchors depend
only on the seed and the batch's samples: a resumed run, or another rank count, draws the same ones.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from eyas.model.attention import BlockAttention
from eyas.model.dflash import DFlashDraft
from eyas.model.draft import DraftModel
from eyas.train.config import TrainConfig
from eyas.train.loss import LossSpec, TargetDist, fused_draft_ce, reference_draft_ce


@dataclass
class BlockConfig:
    block_size: int = 16
    gamma: float = 7.0
    anchors: int = 64  # blocks per packed row
    attention: str = "auto"  # math | flex | auto (flex on CUDA)
    seed: int = 0
    compile: bool = False  # torch.compile the loss chunk (CUDA)
    loss_chunk_elems: int = 1 << 25
    fused_loss: bool = True  # False: plain autograd over full logits (reference, tests)
    loss: LossSpec = LossSpec()  # the per-row loss: soft CE or an LK loss


def anchor_seed(seed: int, samples: list[int]) -> int:
    """The anchors' seed of a packed batch: its samples' ids and the run's seed, nothing else."""
    return zlib.crc32(repr((seed, [int(s) for s in samples])).encode())


def sample_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor, count: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask, document_ids [N] -> (anchors [A] ascending, usable [A] bool), A = min(count, N): A
    eligible positions drawn without replacement (fewer when fewer exist: the rest are marked unusable,
    so the shape never changes). Pure device ops, no host sync."""
    N = loss_mask.shape[0]
    lm = loss_mask.bool()
    eligible = torch.zeros_like(lm)
    eligible[:-1] = lm[:-1] & lm[1:] & (document_ids[:-1] == document_ids[1:])
    g = torch.Generator(device=lm.device).manual_seed(seed)
    score = torch.rand(N, generator=g, device=lm.device).masked_fill(~eligible, -1.0)
    anchors = score.topk(min(count, N)).indices.sort().values
    return anchors, eligible[anchors]


class BlockObjective(nn.Module):
    """The DFlash draft and its loss; one forward = one packed row, so DDP/FSDP wrap it whole.
    `mask_embed` [H]: the mask token's embedding, given when the trainer keeps the table on the host."""

    def __init__(self, draft: DFlashDraft, cfg: BlockConfig, mask_embed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.draft, self.cfg = draft, cfg
        self.weights = [math.exp(-(k - 1) / cfg.gamma) for k in range(1, cfg.block_size)]
        self.register_buffer("mask_embed", mask_embed, persistent=False)

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, position_ids: torch.Tensor,
                loss_mask: torch.Tensor, document_ids: torch.Tensor, target: TargetDist, seed: int,
                input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, position_ids, loss_mask, document_ids [N] (padding has a document id of its own);
        aux_hidden [N, k*H_t]; target over [N + pad] rows, pad >= block_size; input_embeds [N, H]: the
        frozen embeddings of input_ids when the table is off the device.

        Returns (loss: weighted CE summed over valid slots, fp32 scalar; stats [B-1, 3] fp32: per slot
        CE sum, correct count, valid count)."""
        B, S = self.cfg.block_size, self.cfg.block_size - 1
        draft, dev = self.draft, input_ids.device
        anchors, usable = sample_anchors(loss_mask, document_ids, self.cfg.anchors, seed)  # [A]
        A = anchors.numel()

        # labels: slot k of the block at a is scored against the target's distribution at a + k - 1
        rows = anchors[None] + torch.arange(S, device=dev)[:, None]  # [S, A]
        lm = nn.functional.pad(loss_mask.bool(), (0, B))  # [N + B]
        doc = nn.functional.pad(document_ids, (0, B), value=-1)
        valid = usable[None] & lm[rows + 1] & (doc[rows + 1] == document_ids[anchors][None]) & (target.ids[rows] >= 0)
        weights = torch.tensor(self.weights, dtype=torch.float32, device=dev)
        wvalid = valid.float() * weights[:, None]  # [S, A]

        # the blocks, side by side in one sequence, over the whole row as context
        emb = draft.embed_tokens(input_ids[anchors]) if input_embeds is None else input_embeds[anchors]  # [A, H]
        block = draft.block_embeds(emb, B, self.mask_embed).reshape(1, A * B, -1)  # [1, A*B, H]
        block_pos = (position_ids[anchors][:, None] + torch.arange(B, device=dev)).reshape(1, A * B)
        attend = BlockAttention(anchors, document_ids, B, self.cfg.attention)
        out = draft(block, block_pos, draft.context(aux_hidden[None]), position_ids[None], attend)  # [1, A*B, H]
        slots = draft.head_input(out).view(A, B, -1)
        hiddens = [slots[:, k] for k in range(1, B)]  # S x [A, H]
        if self.cfg.fused_loss:
            return fused_draft_ce(draft.lm_head.weight, hiddens, target, wvalid, self.cfg.loss_chunk_elems,
                                  compiled=self.cfg.compile, rows=rows, loss=self.cfg.loss)
        return reference_draft_ce(draft.lm_head.weight, hiddens, target, wvalid, rows=rows, loss=self.cfg.loss)


class DFlashObjective(BlockObjective):
    """DFlash: blocks drafted from sampled anchors (eyas.train.dflash) on a packed batch."""

    options: ClassVar[tuple[str, ...]] = ("block_gamma", "block_anchors", "loss", "lk_eta")
    graphable = False  # the anchors are drawn from a host seed per batch

    @classmethod
    def build(cls, draft: DraftModel, cfg: TrainConfig, compiled: bool, embed_table: Any) -> DFlashObjective:
        B = draft.config.block_size
        device = next(draft.parameters()).device
        anchors = cfg.block_anchors or max(1, cfg.resolved_budget(device) // B)
        mask = None if embed_table is None else embed_table[draft.config.mask_token_id].to(device)
        return cls(draft, BlockConfig(block_size=B, gamma=cfg.block_gamma, anchors=anchors, attention=cfg.attention,
                                      seed=cfg.seed, compile=compiled, loss=cfg.loss_spec()), mask)

    @property
    def pad_rows(self) -> int:
        return self.cfg.block_size

    def forward(self, batch: dict[str, Any], target_probs: torch.Tensor, target_ids: torch.Tensor,
                block_mask: Any = None, target_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(batch["input_ids"], batch["aux_hidden"], batch["position_ids"], batch["loss_mask"],
                               batch["document_ids"], TargetDist(target_probs, target_ids, target_mass),
                               anchor_seed(self.cfg.seed, batch["samples"]), batch.get("input_embeds"))
