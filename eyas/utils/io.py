"""Crash-safe file writes, cross-process locks and content hashes shared by every stage."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
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

    Works for a file or a directory: a reader never sees a half-written result. A crash leaves at
    most a `.tmp-*` (or `.old-*`) sibling named after its process, which the next atomic write in that
    folder (or a stage's up-to-date check) removes once that process is gone. What is written takes the
    user's umask (writers such as safetensors' make 0600 files), so a server running as another user
    can read it.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-{_owner()}-", dir=dest.parent))
    target = tmp / dest.name
    try:
        yield target
        if target.is_file():
            with open(target, "rb") as f:
                os.fsync(f.fileno())
        apply_umask(target)
        replace_path(target, dest)
        _fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_path(src: Path, dest: Path) -> None:
    """Move `src` onto `dest`; an existing folder `dest` is set aside first (renames cannot replace a
    non-empty folder) and removed after, so `dest` is the old or the new one at every instant but one."""
    if dest.is_dir() and not dest.is_symlink():
        old = dest.with_name(f".old-{dest.name}-{_owner()}")
        os.replace(dest, old)
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dest)


# what atomic_path and replace_path leave when killed: .tmp-NAME-PID@HOST-XXXXXXXX (mkdtemp) and
# .old-NAME-PID@HOST; the host, because a folder on a shared filesystem is written from several machines
_LEFTOVER = re.compile(r"\.(?:tmp|old)-.+-(\d+)@(.+?)(?:-[a-z0-9_]{8})?")


def _owner() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def remove_leftovers(folder: Path) -> None:
    """Delete what writers killed mid-way left in `folder` (their process, on this machine, is gone); a
    live writer's temporary files, and another machine's, are left alone."""
    if not folder.is_dir():
        return
    host = socket.gethostname()
    with os.scandir(folder) as entries:
        stale = [e for e in entries if e.name.startswith((".tmp-", ".old-")) and (m := _LEFTOVER.fullmatch(e.name))
                 and m.group(2) == host and not _alive(int(m.group(1)))]
    for e in stale:
        shutil.rmtree(e.path, ignore_errors=True) if e.is_dir(follow_symlinks=False) else os.unlink(e.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def current_umask() -> int:
    """The process' umask, read without changing it where Linux shows it (os.umask sets as it reads)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give `path` (a file, or a folder and all it holds) the modes a plain `open`/`mkdir` would:
    0666 (0777 for folders and executables) less the umask."""
    mask = current_umask()
    if not path.exists():
        return
    todo = [path]
    if path.is_dir():
        todo += [p for p in path.rglob("*") if not p.is_symlink()]
    for p in todo:
        full = 0o777 if p.is_dir() or p.stat().st_mode & 0o111 else 0o666
        os.chmod(p, full & ~mask)


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


@contextlib.contextmanager
def writer_lock(out: str | os.PathLike, stage: str) -> Iterator[None]:
    """One writer per output folder: `eyas STAGE` holds `.OUT.lock` next to OUT (OUT itself is renamed into
    place) while it runs, and removes it when done; a second writer gets an error naming the holder (pid,
    host, start). The lock is the kernel's (flock), so a killed holder holds none: the file it left is taken
    over. Under torchrun only rank 0 (RANK unset or 0) takes it, for all ranks."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    out = Path(out)
    path = out.with_name(f".{out.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    f = _locked(path, out)
    try:
        f.seek(0)
        f.truncate()
        f.write(f"`eyas {stage}`, pid {os.getpid()} on {socket.gethostname()}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        f.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before the unlock: a writer that opens it later makes a file (and lock) of its own
        f.close()


def _locked(path: Path, out: Path) -> Any:
    """`path` opened and flocked, the file the path names now (one removed by its holder meanwhile is retried)."""
    while True:
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for as long as the lock
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not written its name yet"
            f.close()
            raise EyasError(f"{out} is being written by another eyas process ({holder}); two writers would "
                            "corrupt it. Wait for it to finish (a rerun then resumes or reuses its output), stop it, "
                            "or pick another --out") from None
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()  # its holder removed it between our open and our lock: take the new one


def has_manifest(path: str | os.PathLike, fmt: str) -> bool:
    """Does the JSON file `path` record eyas' format `fmt` (any version: "eyas.export/1" matches "eyas.export/2")?"""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).split("/")[0] == fmt.split("/")[0]


def check_output(out: str | os.PathLike, stage: str, owned: Callable[[Path], bool], *, name: str = "--out",
                 file: bool = False) -> Path:
    """Refuse, before any work, an output path that `eyas STAGE` must not replace or cannot write.

    Accepted: a missing path, an empty folder, and what `owned` recognizes as the stage's own earlier output
    (its manifest: a rerun resumes, reuses or replaces it). Refused, in one EyasError line naming the path and
    what to do: a folder eyas did not write (a stage renames its output into place, which would delete it), a
    file where a folder goes (or, with `file`, a folder where the stage's file goes, or a file it did not
    write), a file among the parents, and a place this process cannot create files in (tried, not guessed
    from permission bits: root passes those on a read-only disk). `name` is how the user gave the path."""
    out = Path(out)
    where = f"{name} {out}"
    for parent in reversed(out.parents):
        if parent.exists() and not parent.is_dir():
            raise EyasError(f"{where}: {parent} is a file, not a folder, so nothing can be written under it. "
                            f"Choose another {name}, or move that file away")
    if out.is_dir():
        if file:
            raise EyasError(f"{where} is a folder; `eyas {stage}` writes a file there and would replace the folder. "
                            f"Give {name} a file path, e.g. {out / 'conversations.jsonl'}")
        held = sorted(e.name for e in out.iterdir() if not _LEFTOVER.fullmatch(e.name))
        if held and not owned(out):
            more = f" and {len(held) - 1} more" if len(held) > 1 else ""
            raise EyasError(f"{where} is a folder that `eyas {stage}` did not write (it holds {held[0]}{more}, and no "
                            f"eyas {stage} manifest); eyas does not write over what it did not make. Choose a new or "
                            f"empty folder for {name}, or remove this one yourself")
    elif out.exists():
        if not file:
            raise EyasError(f"{where} is a file, not a folder: `eyas {stage}` writes a folder there. Choose another "
                            f"{name}, or move the file away")
        if not owned(out):
            raise EyasError(f"{where} exists and `eyas {stage}` did not write it (no eyas manifest beside it), so it "
                            f"will not be replaced. Choose another {name}, or remove the file yourself")
    _check_writable(out.parent, where, name)
    if out.is_dir():  # some stages write inside it (checkpoints, a redrawn report)
        _check_writable(out, where, name)
    return out


def _check_writable(folder: Path, where: str, name: str) -> None:
    """Create (and remove) a folder in `folder`, or its nearest existing parent, as the stage's writes will."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".tmp-probe-{_owner()}-", dir=probe))
    except OSError as e:
        raise EyasError(f"{where}: cannot write in {probe} ({e.strerror or e}). Choose a {name} on a disk and "
                        "folder this user can write, or fix that folder's permissions") from None


def as_os_error(e: BaseException) -> OSError | None:
    """`e` as an OSError when it is one, or reports one: safetensors' writer says "I/O error: No space left on
    device (os error 28)" in an error of its own, with no path."""
    if isinstance(e, OSError):
        return e
    m = re.search(r"I/O error: (.+?) \(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return OSError(int(m.group(2)), f"writing a safetensors file: {m.group(1)}") if m else None


def os_error_line(e: OSError) -> str:
    """An OSError that escaped a stage (a disk filled up, a folder turned read-only mid-run), as the one line
    `eyas: error:` prints: what failed, on which path, and what to do."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    what = f"{paths}: {e.strerror}" if paths and e.strerror else e.strerror or str(e)
    todo = {errno.ENOSPC: "free some space (or choose another output folder) and rerun the same command: finished "
                          "work is kept",
            errno.EDQUOT: "free some space within your quota and rerun the same command",
            errno.EACCES: "choose an output folder this user can write, or fix the permissions, and rerun",
            errno.EPERM: "choose an output folder this user can write, or fix the permissions, and rerun",
            errno.EROFS: "the disk is mounted read-only: choose an output folder on a writable disk",
            errno.ENOTDIR: "a file stands where a folder is needed: move it away or choose another path",
            errno.EISDIR: "a folder stands where a file is needed: move it away or choose another path",
            errno.EEXIST: "something already exists there: move it away or choose another path",
            errno.ENOENT: "check that the path exists (and was not removed while eyas ran)",
            errno.EFBIG: "a file outgrew this process' file-size limit (ulimit -f) or the filesystem's: raise the "
                         "limit or choose another output folder, then rerun the same command"}
    hint = todo.get(e.errno, "check the path and the disk, then rerun the same command")
    return f"{what}. {hint[0].upper()}{hint[1:]}"


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
