"""Atomic writes and locks: a crash never leaves half an output; concurrent converters don't collide."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from eyas.utils.io import EyasError, atomic_path, atomic_write_json, check_free_disk, file_lock, read_json


def test_atomic_dir_replaces_whole_or_nothing(tmp_path):
    out = tmp_path / "out"
    with atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "a.txt").write_text("one")
    assert (out / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError), atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "a.txt").write_text("two")
        raise RuntimeError("crash mid-write")
    assert (out / "a.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp debris left


def test_atomic_json(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"x": 1})
    assert read_json(tmp_path / "m.json") == {"x": 1}


def _hold_lock(path, delay, q):
    with file_lock(path):
        q.put(("in", time.monotonic()))
        time.sleep(delay)
        q.put(("out", time.monotonic()))


def test_file_lock_excludes_other_processes(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hold_lock, args=(tmp_path / "l", 0.3, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    events = sorted([q.get() for _ in range(4)], key=lambda e: e[1])
    assert [e[0] for e in events] == ["in", "out", "in", "out"]


def test_disk_check_refuses_with_clear_message(tmp_path):
    check_free_disk(tmp_path, 1024, "test")
    with pytest.raises(EyasError, match="needs about .* free"):
        check_free_disk(tmp_path / "new" / "dir", 1 << 60, "the hidden-state store")
