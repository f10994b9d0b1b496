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


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_take_the_users_umask(tmp_path, umask):
    """safetensors writes 0600 files and mkdtemp makes 0700 folders: whatever a writer leaves, an output
    written through atomic_path (drafts, stores, prepared data, reports) gets the modes a plain
    open/mkdir would, so a server running as another user can read a shared draft."""
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        with atomic_path(tmp_path / "draft") as tmp:
            tmp.mkdir()
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "run.sh").write_text("#!/bin/sh\n")
            os.chmod(tmp / "sub" / "run.sh", 0o700)
        with atomic_path(tmp_path / "report.json") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.stat(tmp_path / p).st_mode)

    assert mode("draft/model.safetensors") == mode("report.json") == 0o666 & ~umask
    assert mode("draft") == mode("draft/sub") == 0o777 & ~umask
    assert mode("draft/sub/run.sh") == 0o777 & ~umask  # executables stay executable


def test_a_killed_writers_leftovers_are_removed_by_the_next_write(tmp_path):
    """A kill inside atomic_path leaves `.tmp-NAME-PID@HOST-XXXXXXXX` (or `.old-NAME-PID@HOST`); the next
    atomic write in that folder removes them once that process is gone, and leaves a live writer's, another
    machine's (a shared filesystem) and others' files."""
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = socket.gethostname()
    gone = [f".tmp-out-{dead}@{host}-abc12345", f".old-out-{dead}@{host}", f".tmp-other-{dead}@{host}-x_y12345"]
    kept = [f".tmp-out-{os.getpid()}@{host}-live0001", f".tmp-out-{dead}@other-node-abc12345", ".tmp-notes"]
    for name in gone + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "half.bin").write_bytes(b"x" * 10)
    atomic_write_json(tmp_path / "out", {"ok": True})
    assert {p.name for p in tmp_path.iterdir()} == {"out", *kept}
