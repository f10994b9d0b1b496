"""Building and loading a draft of any family: `DraftConfig.family` names it, and the family's
declaration (eyas.model.family_facts) names its model class."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.model.config import DraftConfig
from eyas.model.draft import DraftModel
from eyas.model.family_facts import family_part


def draft_class(cfg: DraftConfig) -> type[DraftModel]:
    return family_part(cfg.family, "model")


def build_draft(cfg: DraftConfig) -> DraftModel:
    """A fresh draft of the config's family."""
    return draft_class(cfg)(cfg)


def load_draft(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
               ) -> DraftModel:
    """A draft folder in eyas' own layout (contract 3), whatever its family."""
    cfg = DraftConfig.load(Path(path) / "config.json")
    return draft_class(cfg).from_pretrained(path, device=device, dtype=dtype)
