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
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
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
    """name -> version of the `pip freeze` lines in `path` (editable and URL lines are skipped); a line of a bare
    name is a package the node has in a version not given ("")."""
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
        elif _NAME.fullmatch(line.strip()):  # a bare name: the node has it, version unknown (kept as it is)
            pins[normalize(line.strip())] = ""
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _node_env(target: NodePython) -> dict[str, str]:
    """Marker variables of the node's Python (a Linux node)."""
    return {"python_version": target.python_version or f"{sys.version_info[0]}.{sys.version_info[1]}",
            "sys_platform": "linux", "platform_system": "Linux", "extra": ""}


def _applying(requires: list[str], env: dict[str, str]) -> list[Requirement]:
    """The requirements whose markers hold on the node."""
    reqs = [Requirement(r) for r in requires]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def wheel_requirements(wheel: Path, target: NodePython, node: dict[str, str], with_torch: bool) -> list[str]:
    """The requirements of a wheel file in hand that the node lacks (markers evaluated for the node's Python).

    Why: a package the node has is not resolved again, so its own tree (torch's CUDA libraries, pinned to
    builds an index may not hold for that platform) never enters the resolution."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8").splitlines()
    requires = [line.partition(":")[2].strip() for line in lines if line.startswith("Requires-Dist:")]
    return [str(r) for r in _applying(requires, _node_env(target))
            if normalize(r.name) not in node and (with_torch or not _TORCH_STACK.match(normalize(r.name)))]


def resolve(requirements: list[str], target: NodePython, node: dict[str, str], with_torch: bool) -> dict[str, str]:
    """name -> version of every package `requirements` need on the node and it lacks, or has in a version they
    refuse. A wheel file among them stands for its requirements that the node lacks (`wheel_requirements`): it
    is in hand already. The node's versions steer the resolution as constraints; where they make it impossible
    (a package pinning an older version of one the node has), it is resolved without them, and the node's
    packages that the result refuses come along in the versions it needs."""
    expanded: list[str] = []
    for r in requirements:
        is_wheel = r.endswith(".whl") and Path(r).is_file()
        expanded += wheel_requirements(Path(r), target, node, with_torch) if is_wheel and node else [r]
    if not expanded:
        return {}
    pins = {n: v for n, v in node.items() if v and "+" not in v and not _TORCH_STACK.match(n)}  # not local builds
    try:
        items = _dry_run(expanded, target, pins, timeout=None if not pins else 90)
    except (EyasError, subprocess.TimeoutExpired):  # impossible, or pip backtracking through old releases
        if not pins:
            raise
        items = _dry_run(expanded, target, {})
    resolved = {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    env, refused = _node_env(target), set()
    for i in items:
        for r in _applying(i["metadata"].get("requires_dist") or [], env):
            name = normalize(r.name)
            if node.get(name) and not r.specifier.contains(node[name], prereleases=True):
                refused.add(name)
    return {n: v for n, v in sorted(resolved.items())
            if (n not in node or n in refused) and (with_torch or not _TORCH_STACK.match(n))}


def _dry_run(requirements: list[str], target: NodePython, pins: dict[str, str], timeout: float | None = None
             ) -> list[dict]:
    """pip's resolution of `requirements` for the node (`pins` as constraints): its report's install items."""
    with tempfile.TemporaryDirectory(prefix="eyas-resolve-") as tmp:
        constraints = Path(tmp) / "node.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        report = Path(tmp) / "report.json"
        run_pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--target",
                 str(Path(tmp) / "t"), "-c", str(constraints), *target.pip_args(), *requirements], timeout)
        return json.loads(report.read_text())["install"]


def download(pins: dict[str, str], target: NodePython, dest: Path) -> None:
    """The wheels of `pins`, exactly those versions, into dest."""
    if pins:
        run_pip(["download", "--no-deps", "--quiet", "-d", str(dest), *target.pip_args(),
                 *[f"{n}=={v}" for n, v in pins.items()]])


def run_pip(args: list[str], timeout: float | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise EyasError(f"`pip {' '.join(args[:1] + [a for a in args[1:] if not a.startswith('/')][:12])} ...` "
                        f"failed: {done.stderr.strip()[-600:]}. A package with no wheel for this platform and "
                        "Python (--platform, --python-version) cannot travel: install it on the node another way "
                        "and list it in --node-packages")
