"""torch.compile's artifacts kept with a training run, so that a run resumed on another machine (a spot
instance, another node, a fresh container) does not compile everything again.

Why: a fresh run spends minutes in torch.compile building the draft layer's halves, the loss chunk and
flex attention, forward and backward (docs/benchmarks.md, "Cold start"). Torch caches those on
local disk (TORCHINDUCTOR_CACHE_DIR), which a new machine does not have;
`torch.compiler.save_cache_artifacts` packs what this process compiled into one blob that
`load_cache_artifacts` puts back into the local caches. The blob lives in OUT/train_state/, next to
the checkpoints it speeds up. A blob from another torch version or GPU is only a miss: torch keys every
artifact by its inputs, and a blob that cannot be read is ignored with a note.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.utils.io import atomic_path

CACHE_FILE = "compile-cache.bin"


def _count(info: object) -> int:
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(v) for v in artifacts.values())


def load_compile_cache(root: Path) -> str | None:
    """Seed torch.compile's local caches from root/compile-cache.bin; a line to log, or None if absent."""
    path = root / CACHE_FILE
    if not path.is_file():
        return None
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # another torch's format: compiling from scratch is the worst case
        path.unlink(missing_ok=True)  # this run writes a new one
        return f"ignored the compile cache {path} ({type(e).__name__}: {str(e)[:120]}); compiling from scratch"
    return f"compile cache: {_count(info)} artifacts loaded from {path}"


def save_compile_cache(root: Path) -> int:
    """Write what this process compiled to root/compile-cache.bin (atomically); the artifacts saved."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    blob, info = saved
    root.mkdir(parents=True, exist_ok=True)
    with atomic_path(root / CACHE_FILE) as tmp:
        tmp.write_bytes(blob)
    return _count(info)
