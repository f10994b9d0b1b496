"""The draft families eyas trains, by name: `DraftConfig.family` picks the model class here.

A family is one model module (eyas.model.draft for EAGLE-3, eyas.model.dflash for DFlash,
eyas.model.peagle for P-EAGLE) plus one training objective (eyas.train.objectives), one proposer
(eyas.eval.spec_decode) and one writer (eyas.export.writers), each found by the same name;
docs/architecture.md says how to add one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.model.config import DraftConfig
from eyas.model.dflash import DFlashDraft
from eyas.model.draft import DraftModel, Eagle3Draft
from eyas.model.peagle import PEagleDraft
from eyas.utils.io import EyasError

DRAFT_MODELS: dict[str, type[DraftModel]] = {"eagle3": Eagle3Draft, "dflash": DFlashDraft, "peagle": PEagleDraft}


def draft_class(cfg: DraftConfig) -> type[DraftModel]:
    if cfg.family not in DRAFT_MODELS:
        raise EyasError(f"unknown draft family {cfg.family!r}: this eyas knows {', '.join(DRAFT_MODELS)}")
    return DRAFT_MODELS[cfg.family]


def build_draft(cfg: DraftConfig) -> DraftModel:
    """A fresh draft of the config's family."""
    return draft_class(cfg)(cfg)


def load_draft(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
               ) -> DraftModel:
    """A draft folder in eyas' own layout (contract 3), whatever its family."""
    cfg = DraftConfig.load(Path(path) / "config.json")
    return draft_class(cfg).from_pretrained(path, device=device, dtype=dtype)
