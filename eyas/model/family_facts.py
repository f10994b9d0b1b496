"""What each draft family is, declared once: the facts every floor reads instead of comparing names,
and where each of its parts lives.

A family's model lives in its own module (eyas.model.eagle3, .dflash, .peagle, ...). The parts that
run it sit on the floors above: its training objective (eyas.train), its proposer for speculative
decoding (eyas.eval), its serving writer (eyas.export), and the reader of its foreign checkpoints
(eyas.model.checkpoints). Each is named here as "module:attribute" and imported only by the floor that
uses it (`family_part`), so this module, on the model floor, imports none of them; the tests check that
every part exists, sits on its floor, and keeps the import graph free of cycles (tests/test_structure.py).
Adding a family is one entry here (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from eyas.utils.io import EyasError

# EAGLE-3's switches a family may accept (DraftOptions fields / values); the others refuse them
EAGLE3_SWITCHES = ("fc_norm", "norm_output", "mla", "window")  # window: --draft-window
# the floor (package prefix) each part must live on: a part never sits above the floor that reads it
PART_FLOORS = {"model": "eyas.model.", "reader": "eyas.model.", "objective": "eyas.train.",
               "proposer": "eyas.eval.", "writer": "eyas.export."}


@dataclass(frozen=True)
class Family:
    name: str
    summary: str  # one line for --help
    parts: dict[str, str]  # PART_FLOORS key -> "module:attribute"; "reader" is optional
    # DraftConfig fields the family owns: written in its configs and taken from DraftOptions; other
    # families' configs leave them out (EAGLE-3 owns none, so its configs read as before families existed)
    config_fields: tuple[str, ...] = ()
    mask_token: bool = False  # its open slots hold a mask token id (DraftConfig.mask_token_id)
    trees: bool = False  # drafts EAGLE-2 dynamic trees; the others propose one chain per forward
    switches: tuple[str, ...] = field(default=())  # the EAGLE3_SWITCHES it accepts


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("eagle3", "one draft forward per proposed token; EAGLE-2 trees", trees=True, switches=EAGLE3_SWITCHES,
           parts={"model": "eyas.model.eagle3:Eagle3Draft", "objective": "eyas.train.objectives:TTTObjective",
                  "proposer": "eyas.eval.proposers:Eagle3Proposer", "writer": "eyas.export.writers:EAGLE3"}),
    Family("dflash", "block-parallel: one forward proposes a block", mask_token=True,
           config_fields=("family", "block_size", "mask_token_id"),
           parts={"model": "eyas.model.dflash:DFlashDraft", "objective": "eyas.train.dflash:DFlashObjective",
                  "proposer": "eyas.eval.proposers:DFlashProposer", "writer": "eyas.export.dflash:DFLASH",
                  "reader": "eyas.model.dflash:dflash_config_from_foreign"}),
    Family("peagle", "P-EAGLE: EAGLE-3's model proposing a whole chain in one forward through learned mask slots",
           config_fields=("family", "mask_token_id"), mask_token=True, switches=("fc_norm",),
           parts={"model": "eyas.model.peagle:PEagleDraft", "objective": "eyas.train.objectives:PEagleObjective",
                  "proposer": "eyas.eval.proposers:PEagleProposer", "writer": "eyas.export.peagle:PEAGLE"}),
    Family("dspark", "DSpark: DFlash's block forward, then a Markov head chaining each proposal to the one before",
           config_fields=("family", "block_size", "mask_token_id", "markov_rank"), mask_token=True,
           parts={"model": "eyas.model.dspark:DSparkDraft", "objective": "eyas.train.dspark:DSparkObjective",
                  "proposer": "eyas.eval.proposers:DSparkProposer", "writer": "eyas.export.dspark:DSPARK",
                  "reader": "eyas.model.dspark:dspark_config_from_foreign"}),
)}
# every DraftConfig field some family owns
FAMILY_FIELDS = tuple(dict.fromkeys(name for f in FAMILIES.values() for name in f.config_fields))


def family(name: str) -> Family:
    """The facts of family `name`; an unknown name is refused with the ones this eyas knows."""
    if name not in FAMILIES:
        raise EyasError(f"unknown draft family {name!r}: this eyas knows {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_part(name: str, part: str) -> Any:
    """Family `name`'s `part` (a PART_FLOORS key), imported from where the family declares it."""
    module, _, attribute = family(name).parts[part].partition(":")
    return getattr(importlib.import_module(module), attribute)
