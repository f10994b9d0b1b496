"""Training checkpoints (OUT/train_state/step-N/) with exact resume, the written draft folders, and
the rule that picks the best draft of the validations."""

from __future__ import annotations

import pickle
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eyas.model.families import build_draft
from eyas.train import distributed as D
from eyas.utils.io import EyasError, atomic_path, atomic_write_json, read_json

if TYPE_CHECKING:
    from eyas.train.trainer import Trainer

BEST_DRAFT = "draft-best"


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values: what `torch.load(weights_only=True)` reads back."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                      int(has_gauss), float(gauss)],
            "python": random.getstate(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    kind, keys, *rest = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(trainer: Trainer, root: Path, progress: dict[str, Any], keep: int) -> Path | None:
    """Collective: rank 0 writes OUT/train_state/step-N atomically and prunes old ones. With its
    config.json next to the weights, a checkpoint is also a draft folder that eval and export take."""
    draft_state, optim = trainer.draft_state(), trainer.optim_state()
    rng = rng_state()
    path = root / f"step-{trainer.step:08d}"
    if trainer.info.is_main:
        with atomic_path(path) as tmp:
            tmp.mkdir()
            save_file({k: v.contiguous() for k, v in draft_state.items()}, str(tmp / "draft.safetensors"))
            trainer.draft.config.save(tmp / "config.json")
            torch.save({"optimizer": optim, "scheduler": trainer.sched.state_dict(), "rng": rng,
                        "window": trainer.window.cpu()}, tmp / "state.pt")
            atomic_write_json(tmp / "progress.json", {**progress, "step": trainer.step})
        done = sorted(p for p in root.glob("step-*") if (p / "progress.json").is_file())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    D.barrier()
    return path if trainer.info.is_main else None


def save_draft(trainer: Trainer, path: Path) -> None:
    """Collective (the state is gathered under FSDP): rank 0 writes the draft folder at `path`
    atomically, in bf16 when the run trains in bf16."""
    state = trainer.draft_state()
    if trainer.info.is_main:
        draft = build_draft(trainer.draft.config)
        draft.load_state_dict(state)
        (draft.to(torch.bfloat16) if trainer.bf16 else draft).save_pretrained(path)


def improves(val: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """Held-out tau_sim decides (it is what acceptance follows); the loss breaks a tie."""
    return best is None or (val["tau_sim"], -val["loss"]) > (best["tau_sim"], -best["loss"])


def latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step-*") if (p / "progress.json").is_file())
    return done[-1] if done else None


def load_checkpoint(trainer: Trainer, path: Path) -> dict[str, Any]:
    progress = read_json(path / "progress.json")
    state = read_train_state(path / "state.pt")
    trainer.load_states(load_file(str(path / "draft.safetensors")), state["optimizer"])
    trainer.sched.load_state_dict(state["scheduler"])
    trainer.window.copy_(state["window"].to(trainer.window.device))
    trainer.step = int(progress["step"])
    set_rng_state(state["rng"])
    return progress


def read_train_state(path: Path) -> dict[str, Any]:
    """state.pt read with `weights_only=True`: tensors and plain values only, so a pickle planted in a run
    folder (run folders travel with `eyas bundle`) cannot run code on --resume. An older eyas stored
    numpy's generator state as an array: rebuilding a plain array is allowed too, so its checkpoints resume."""
    core = getattr(np, "_core", None) or np.core
    arrays = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(arrays):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        raise EyasError(f"{path} holds {found.group(1) if found else 'an object'}, not only tensors and plain values: "
                        "resume does not unpickle it (that could run code). It was not written by eyas; drop "
                        "--resume, or delete the run folder's train_state, to train from scratch") from None
