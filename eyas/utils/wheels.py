"""Wheels for a Python elsewhere: what a set of requirements needs on a node that reaches no package index.

pip does the work: `pip install --dry-run --report` resolves the whole dependency tree for the node's
platform and Python version (reading metadata, not downloading wheels), the node's own packages given
as constraints so that what it has is kept; `pip download --no-deps` then fetches exactly the rest.
torch and the CUDA libraries it pulls in (nvidia-*, cuda-*, triton) are left out unless asked: a GPU
node has its own build, matched to its driver, and they weigh gigabytes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from eyas.utils.io import EyasError

_TORCH_STACK = re.compile(r"^(torch|triton|pytorch-triton.*|nvidia-.+|cuda-.+)$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


@dataclass(frozen=True)
class NodePython:
    """The node's Python: pip's --python-version (e.g. 3.11) and --platform tags (e.g. manylinux_2_28_x86_64);
    empty means this machine's."""

    python_version: str = ""
    platforms: tuple[str, ...] = ()

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:"]  # a node without an index has no compilers to build sdists either
        if self.python_version:
            args += ["--python-version", self.python_version]
        for p in expand_platforms(self.platforms):
            args += ["--platform", p]
        return args


def expand_platforms(platforms: tuple[str, ...]) -> list[str]:
    """manylinux_2_N_ARCH runs wheels of every older glibc too (PEP 600); pip takes the tags literally, so
    each is listed, with the legacy aliases manylinux2014/2010/1."""
    out: list[str] = []
    for p in platforms:
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", p)
        if not m:
            out.append(p)
            continue
        glibc, arch = int(m.group(1)), m.group(2)
        out += [f"manylinux_2_{k}_{arch}" for k in range(glibc, 4, -1)]
        out += [f"{alias}_{arch}" for alias, k in (("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5))
                if glibc >= k]
    return list(dict.fromkeys(out))


def node_pins(path: Path | None) -> dict[str, str]:
    """name -> version of the `pip freeze` lines in `path` (editable and URL lines are skipped)."""
    if path is None:
        return {}
    if not Path(path).is_file():
        raise EyasError(f"--node-packages {path}: no such file. Write it on the node with: `python -m pip "
                        f"freeze --all > {Path(path).name}`")
    pins = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(wheel: Path, target: NodePython, node: dict[str, str], with_torch: bool) -> list[str]:
    """The requirements of a wheel file in hand that the node lacks (markers evaluated for the node's Python).

    Why: a package the node has is not resolved again, so its own tree (torch's CUDA libraries, pinned to
    builds an index may not hold for that platform) never enters the resolution."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8").splitlines()
    env = {"python_version": target.python_version or f"{sys.version_info[0]}.{sys.version_info[1]}",
           "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.partition(":")[2].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = normalize(req.name)
        if name not in node and (with_torch or not _TORCH_STACK.match(name)):
            out.append(str(req))
    return out


def resolve(requirements: list[str], target: NodePython, node: dict[str, str], with_torch: bool) -> dict[str, str]:
    """name -> version of every package `requirements` need on the node and it lacks. A wheel file among
    them stands for its requirements that the node lacks (`wheel_requirements`): it is in hand already."""
    expanded: list[str] = []
    for r in requirements:
        is_wheel = r.endswith(".whl") and Path(r).is_file()
        expanded += wheel_requirements(Path(r), target, node, with_torch) if is_wheel and node else [r]
    requirements = expanded
    if not requirements:
        return {}
    with tempfile.TemporaryDirectory(prefix="eyas-resolve-") as tmp:
        constraints = Path(tmp) / "node.txt"
        # the node's versions steer the resolver where PyPI has them (not local builds such as torch 2.5+cu121)
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in node.items()
                                       if "+" not in v and not _TORCH_STACK.match(n)))
        report = Path(tmp) / "report.json"
        run_pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--target",
                 str(Path(tmp) / "t"), "-c", str(constraints), *target.pip_args(), *requirements])
        resolved = {normalize(i["metadata"]["name"]): i["metadata"]["version"]
                    for i in json.loads(report.read_text())["install"]}
    return {n: v for n, v in sorted(resolved.items()) if n not in node and (with_torch or not _TORCH_STACK.match(n))}


def download(pins: dict[str, str], target: NodePython, dest: Path) -> None:
    """The wheels of `pins`, exactly those versions, into dest."""
    if pins:
        run_pip(["download", "--no-deps", "--quiet", "-d", str(dest), *target.pip_args(),
                 *[f"{n}=={v}" for n, v in pins.items()]])


def run_pip(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise EyasError(f"`pip {' '.join(args[:1] + [a for a in args[1:] if not a.startswith('/')][:12])} ...` "
                        f"failed: {done.stderr.strip()[-600:]}. A package with no wheel for this platform and "
                        "Python (--platform, --python-version) cannot travel: install it on the node another way "
                        "and list it in --node-packages")
