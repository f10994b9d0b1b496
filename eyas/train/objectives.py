"""Training objectives by draft family: what the trainer runs on one packed batch.

An objective is an nn.Module wrapping the draft (so DDP/FSDP wrap it whole) with
- `forward(batch, target_probs, target_ids, block_mask=None, target_mass=None) -> (loss, stats [S, 3])`:
  batch is a packed micro-batch on the device (eyas.train.data.collate_pack; floats in the compute
  dtype), the target distribution is eyas.train.loss.target_distribution's with `pad_rows` rows after it
  (`target_mass` too when the LK losses need it: TrainConfig.loss);
  loss is summed over valid rows (the trainer divides by stats[0, 2] of the global batch), stats
  rows are per step / block slot: CE sum, correct count, valid count;
- `weights` [S]: each stats row's loss weight (eyas.train.ttt.summarize);
- `pad_rows`, and `graphable`: whether one optimizer step may be replayed as a CUDA graph.
`objective_class(family).options` names the TrainConfig fields it reads (they join the run's fingerprint).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from eyas.model.draft import DraftModel
from eyas.model.family_facts import family_part
from eyas.train.config import TrainConfig
from eyas.train.dflash import anchor_seed
from eyas.train.loss import TargetDist
from eyas.train.peagle import ParallelConfig, ParallelObjective
from eyas.train.ttt import TTTConfig, TTTModel


class TTTObjective(TTTModel):
    """EAGLE-3: training-time test (eyas.train.ttt) on a packed batch."""

    options: ClassVar[tuple[str, ...]] = ("ttt_steps", "ttt_decay", "reply_start_weight", "reply_start_tokens",
                                          "loss", "lk_eta")
    graphable = True

    @classmethod
    def build(cls, draft: DraftModel, cfg: TrainConfig, compiled: bool, embed_table: Any) -> TTTObjective:
        built = cls(draft, TTTConfig(steps=cfg.ttt_steps, decay=cfg.ttt_decay, attention=cfg.attention,
                                     compile=compiled,  # FSDP gathers weights in its forward: compile first
                                     compile_in_background=cfg.compile_in_background and not cfg.fsdp,
                                     reply_start_weight=cfg.reply_start_weight,
                                     reply_start_tokens=cfg.reply_start_tokens, loss=cfg.loss_spec()))
        built.graphable = not draft.config.sliding_window  # a window's masks differ per step: built per batch
        return built

    @property
    def pad_rows(self) -> int:
        return self.cfg.steps + 1

    def forward(self, batch: dict[str, Any], target_probs: torch.Tensor, target_ids: torch.Tensor,
                block_mask: Any = None, target_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        docs = batch["document_ids"][None] if batch["multi_doc"] else None
        emb = batch["input_embeds"][None] if "input_embeds" in batch else None
        return super().forward(batch["input_ids"][None], batch["aux_hidden"][None], batch["position_ids"][None],
                               batch["loss_mask"][None], target_probs, target_ids, docs, emb, block_mask, target_mass)


class PEagleObjective(ParallelObjective):
    """P-EAGLE: depth 0 over every row and COD-sampled deeper depths in one forward (eyas.train.peagle)."""

    options: ClassVar[tuple[str, ...]] = ("ttt_steps", "cod_ratio", "cod_min_ratio", "loss", "lk_eta")
    graphable = False  # the anchors are drawn from a host seed per batch

    @classmethod
    def build(cls, draft: DraftModel, cfg: TrainConfig, compiled: bool, embed_table: Any) -> PEagleObjective:
        return cls(draft, ParallelConfig(depths=cfg.ttt_steps, ratio=cfg.cod_ratio, min_ratio=cfg.cod_min_ratio,
                                         attention=cfg.attention, seed=cfg.seed, compile=compiled,
                                         loss=cfg.loss_spec()))

    @property
    def pad_rows(self) -> int:
        return self.cfg.depths + 1

    def forward(self, batch: dict[str, Any], target_probs: torch.Tensor, target_ids: torch.Tensor,
                block_mask: Any = None, target_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(batch["input_ids"], batch["aux_hidden"], batch["position_ids"], batch["loss_mask"],
                               batch["document_ids"], TargetDist(target_probs, target_ids, target_mass),
                               anchor_seed(self.cfg.seed, batch["samples"]), batch.get("input_embeds"))


def objective_class(family: str) -> Any:
    """The objective class family `family` declares (eyas.model.family_facts)."""
    return family_part(family, "objective")


def make_objective(draft: DraftModel, cfg: TrainConfig, compiled: bool, embed_table: torch.Tensor | None) -> Any:
    """The training objective of the draft's family; `embed_table`: the frozen embedding when the
    trainer keeps it on the host (the draft then has none)."""
    return objective_class(draft.config.family).build(draft, cfg, compiled, embed_table)
