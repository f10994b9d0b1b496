"""Join an eyas bundle's parts on a node that has Python and no package index: `python3 B.unpack.py`.

`eyas bundle --part-mb N` writes, next to the folder B, the parts B.tar.gz.000, .001, ... (one gzip'd tar
stream cut at N MiB), B.parts.json (every part's size and sha256, and the environment the bundle's named
assets need) and this script, copied as B.unpack.py. Standard library only: it runs before eyas is installed.

    python3 B.unpack.py [--dest DIR] [--no-install] [--pip-arg=--user ...]

checks every part against B.parts.json (a missing or damaged part is named: carry it again), joins them into
DIR/B (default: beside the parts), checks every file against B/manifest.json, installs eyas and its wheels
from B/wheels with `pip install --no-index`, and writes B/env.sh: the EYAS_* variables that point eyas' named
assets (the SmolLM2 GGUF, ShareGPT, MT-Bench) at the bundle's copies, for configs run from elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


class Joined:
    """The parts read one after the other as one stream (nothing joined on disk)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.f = list(paths), None

    def read(self, n: int = -1) -> bytes:
        out = b""
        while n < 0 or len(out) < n:
            if self.f is None:
                if not self.paths:
                    break
                self.f = open(self.paths.pop(0), "rb")  # noqa: SIM115 - closed when it runs dry
            block = self.f.read(-1 if n < 0 else n - len(out))
            if not block:
                self.f.close()
                self.f = None
            out += block
        return out


def check_parts(index: dict, here: Path) -> list[Path]:
    """Every part present with its recorded size and sha256, in order."""
    paths = []
    for part in index["parts"]:
        path = here / part["name"]
        if not path.is_file():
            fail(f"part {path} is missing: carry it here (all {len(index['parts'])} parts are needed)")
        if path.stat().st_size != part["bytes"] or sha256(path) != part["sha256"]:
            fail(f"part {path} is damaged (size or sha256 differs from {index['folder']}.parts.json): carry it again")
        paths.append(path)
    return paths


def unpack(index: dict, here: Path, dest: Path) -> Path:
    """Extract the joined parts into dest and check every file against the bundle's manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=Joined(check_parts(index, here)), mode="r|gz") as tar:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, **kw)
    folder = dest / index["folder"]
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    bad = [name for name, meta in manifest["files"].items()
           if not (folder / name).is_file() or sha256(folder / name) != meta["sha256"]]
    if bad:
        fail(f"{len(bad)} files of {folder} differ from its manifest.json (first: {bad[0]}): make the bundle again")
    return folder


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).resolve().parent
    stem = Path(__file__).name.removesuffix(".unpack.py")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=here, help="where the bundle folder goes (default: beside the parts)")
    ap.add_argument("--no-install", action="store_true", help="join and check only; install nothing")
    ap.add_argument("--pip-arg", action="append", default=[], help="passed on to pip install, e.g. --pip-arg=--user "
                    "or --pip-arg=--break-system-packages; repeatable")
    args = ap.parse_args(argv)
    index_path = here / f"{stem}.parts.json"
    if not index_path.is_file():
        fail(f"{index_path} is missing: carry it with the parts")
    index = json.loads(index_path.read_text(encoding="utf-8"))
    folder = unpack(index, here, args.dest.resolve())
    env = {k: str(folder / v) for k, v in index.get("env", {}).items()}
    (folder / "env.sh").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()), encoding="utf-8")
    print(f"{folder}: {len(index['parts'])} parts joined, every file checked against manifest.json")
    if not args.no_install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder / "wheels"),
               *args.pip_arg, "eyas", *index.get("wheels", [])]
        if subprocess.run(cmd).returncode != 0:
            fail(f"{shlex.join(cmd)} failed (above): the node lacks a package the bundle does not bring; make it "
                 "again with --node-packages from this node's `pip freeze --all`")
        print("installed eyas and its wheels from", folder / "wheels")
    print(f"next: cd {shlex.quote(str(folder))} && . ./env.sh && eyas run config.yaml")


if __name__ == "__main__":
    main()
