"""Crash-safe file writes, cross-process locks and content hashes shared by every stage."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EyasError(Exception):
    """A user-facing error: the CLI prints its message (no traceback) and exits with `exit_code`."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; rename it onto `dest` only if the block succeeds.

    Works for a file or a directory: a reader never sees a half-written result, and a crash
    leaves at most a `.tmp-*` sibling behind, which the next run ignores and replaces.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    target = tmp / dest.name
    try:
        yield target
        if target.is_file():
            with open(target, "rb") as f:
                os.fsync(f.fileno())
        if dest.is_dir() and not dest.is_symlink():
            old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
            os.replace(dest, old)
            os.replace(target, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(target, dest)
        _fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(dest: str | os.PathLike, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(dest: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(dest, text.encode("utf-8"))


def atomic_write_json(dest: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(dest, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Exclusive advisory lock across processes (e.g. two jobs converting the same model)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint_path(path: str | os.PathLike) -> str:
    """Content hash of a file, or of a checkpoint folder's configs and weights (what a reused output must
    match); a prepared dataset or store folder is pinned by its manifest."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    if (path / "manifest.json").is_file() and not (path / "model.safetensors").is_file():
        return sha256_file(path / "manifest.json")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin", ".pt"))
    return sha256_json({p.name: sha256_file(p) for p in files})


def sha256_json(obj: Any) -> str:
    """Stable hash of a JSON-able object: used to decide whether a stage's output is up to date."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def check_free_disk(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Refuse to start a long write that cannot finish (better now than after an hour)."""
    path = Path(path)
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need_bytes > free:
        raise EyasError(
            f"{what} needs about {human_bytes(need_bytes)} on {probe}, but only {human_bytes(free)} is free. "
            "Free some space, choose another output folder, or use a smaller --max-samples / fp8 storage."
        )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
