"""Pack what an offline node needs to run a config: the target, the data, eyas itself, and the run so far.

Clusters often reach no package index and kill jobs at a time limit. `eyas bundle CONFIG --out B` writes
a folder B that holds:

    config.yaml    the config, its paths pointing inside B (target, inputs, prompts, work folder)
    assets/        the target in its smallest faithful form (a GGUF file as it is: eyas converts it on
                   arrival; else its transformers folder), the chat data and the prompt files
    wheels/        eyas as a wheel, and every package it (and any --wheel) needs that the node lacks,
                   built for the node's Python (--python-version, --platform); torch and the CUDA
                   libraries only with --with-torch
    work/          the run's work folder so far (finished stages, checkpoints, partial logs)
    README.md      the three commands that run it there; manifest.json: every file's size and sha256

The total size, and each part's, is printed at the end.

B is also written as parts of at most --part-mb MiB (B.tar.gz.000, B.tar.gz.001, ...: one gzip'd tar
stream) for transfers with a size limit, with B.parts.json (each part's size and sha256, the environment
the named assets need) and B.unpack.py (eyas.recipes.bundle_unpack: standard library only), which on the
node checks and joins the parts, checks every file, installs the wheels with `pip install --no-index` and
writes B/env.sh ($EYAS_SMOLLM2_GGUF, $EYAS_SHAREGPT, $EYAS_MTBENCH at the bundle's copies). `eyas run
config.yaml` from inside B then runs the pipeline; a job killed at its time limit resumes where it stopped
when run again, and bundling B/work back the same way brings the results home.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import yaml

from eyas.utils.io import (
    EyasError,
    atomic_path,
    atomic_write_json,
    check_output,
    has_manifest,
    human_bytes,
    sha256_file,
)
from eyas.utils.schema import cli_command, option


@dataclass(kw_only=True)
class BundleOptions:
    """`eyas bundle`'s options."""

    config: Path = option(positional=True, help="The `eyas run` config to bundle.")
    out: Path = option(short="-o", help="Bundle folder to write.")
    wheel: list[str] = option(default_factory=list, show_default="none", help="Also bring this requirement and "
                              "what it needs, e.g. vllm==0.11.0; repeatable.")
    python_version: str = option("", show_default="this Python's", help="The node's Python version, as pip "
                                 "download takes it (e.g. 3.11): the wheels brought are built for it.")
    platform: list[str] = option(default_factory=list, show_default="this machine's", help="The node's platform "
                                 "tag, as pip download takes it (e.g. manylinux_2_28_x86_64; older glibc tags are "
                                 "added); repeatable.")
    node_packages: Path | None = option(None, show_default="none: bring all but torch", help="The node's `python "
                                        "-m pip freeze --all` output: what it has is left out and its versions kept.")
    dependencies: bool = option(True, help="Bring what eyas needs that the node lacks; --no-dependencies: eyas "
                                "alone, for a node that has all of it.")
    with_torch: bool = option(False, help="Also bring torch and the CUDA libraries it needs (nvidia-*, triton): "
                              "gigabytes; a GPU node usually has its own build.")
    workdir: bool = option(True, help="Bring the run's work folder as it is now, so the node resumes it.")
    part_mb: float = option(48, help="Also write the bundle as parts of at most this many MiB, with their checksums "
                            "and a join-and-install script (B.unpack.py); 0 = none.")

    def __post_init__(self) -> None:
        if self.part_mb < 0:
            raise EyasError(f"--part-mb must be >= 0 (0 = no parts), got {self.part_mb:g}")


def run_bundle(opts: BundleOptions, log: Any = print) -> Path:
    """Write the bundle folder (atomically) and, with --part-mb, its tar parts; returns the folder."""
    from eyas.recipes.run import build_stages, load_config

    cfg = load_config(opts.config)
    build_stages(cfg, opts.config)  # a config that would not run is refused here, not on the node
    out = check_output(opts.out, "bundle", lambda p: has_manifest(p / "manifest.json", "eyas.bundle/1"))
    with atomic_path(out) as tmp:
        tmp.mkdir()
        raw = yaml.safe_load(Path(opts.config).read_text(encoding="utf-8")) or {}
        raw, env = bring_assets(raw, cfg, tmp)
        work = Path(cfg.workdir or Path("runs") / Path(opts.config).stem)
        if opts.workdir and work.is_dir():
            shutil.copytree(work, tmp / "work", symlinks=True)
        raw["workdir"] = "work"
        (tmp / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        brought = bring_wheels(opts, tmp / "wheels")
        (tmp / "README.md").write_text(readme(out.name, opts, brought))
        files = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        atomic_write_json(tmp / "manifest.json", {"format": "eyas.bundle/1", "config": str(opts.config),
                                                  "files": files})
    sizes: dict[str, int] = {}
    for f in out.rglob("*"):
        if f.is_file():
            part = f.relative_to(out).parts[0] if len(f.relative_to(out).parts) > 1 else "."
            sizes[part] = sizes.get(part, 0) + f.stat().st_size
    breakdown = ", ".join(f"{name}/ {human_bytes(n)}" for name, n in sorted(sizes.items()) if name != ".")
    log(f"bundle {out}: {len(files) + 1} files, {human_bytes(sum(sizes.values()))} in all ({breakdown}); on the node: "
        f"see {out / 'README.md'}")
    if opts.part_mb:
        parts = write_parts(out, int(opts.part_mb * (1 << 20)), env, opts.wheel)
        log(f"{len(parts)} parts of at most {opts.part_mb:g} MiB ({parts[0].name} ...), {out.name}.parts.json and "
            f"{out.name}.unpack.py: carry them to the node, then `python3 {out.name}.unpack.py` there")
    return out


def named_asset_env(src: Path) -> str | None:
    """The variable that points eyas at its own copy of `src`, when `src` is one of its named assets."""
    from eyas import assets

    for finder, var in ((assets.smollm2_gguf, "EYAS_SMOLLM2_GGUF"), (assets.sharegpt_path, "EYAS_SHAREGPT"),
                        (assets.mtbench_path, "EYAS_MTBENCH")):
        try:
            if finder().resolve() == src.resolve():
                return var
        except EyasError:  # that asset's package is not installed here
            continue
    return None


def bring_assets(raw: dict[str, Any], cfg: Any, dest: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Copy the target, the chat data and the prompt files into dest/assets; return the config pointing there,
    and the variables (eyas.assets') that point the named ones at their copies, as paths inside dest."""
    from eyas.assets import mtbench_path
    from eyas.data.readers import resolve_input

    assets = dest / "assets"
    assets.mkdir()
    target, source = bring_target(cfg.target, assets)
    raw["target"] = target.relative_to(dest).as_posix()
    copies = [(source, target)] if source else []  # (the original, its copy) of each file that may be named
    inputs = []
    for i, name in enumerate((raw.get("prepare") or {}).get("inputs") or ["sharegpt"]):
        source = resolve_input(str(name))
        src = Path(source.spec)
        if source.kind == "hub" or not src.exists():
            raise EyasError(f"prepare input {name!r} is not a local file or folder (a hub dataset resolves only "
                            "online): save it to disk first (datasets' save_to_disk) and name that folder")
        dst = assets / "inputs" / f"{i}-{src.name}"
        dst.parent.mkdir(exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
        inputs.append(dst.relative_to(dest).as_posix())
        copies.append((src, dst))
    raw.setdefault("prepare", {})
    raw["prepare"] = {**(raw["prepare"] or {}), "inputs": inputs}
    ev = raw.get("eval") or {}
    prompts = []
    for part in str(ev.get("prompts", "mtbench")).split(","):
        name, _, path = part.strip().partition("=")
        src = Path(path or name).expanduser()
        if name.lower() == "mtbench" and not path:
            src = mtbench_path()
        elif not src.exists():
            raise EyasError(f"eval prompts {part!r}: only mtbench and local files travel in a bundle")
        dst = assets / "prompts" / src.name
        dst.parent.mkdir(exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
        prompts.append(f"{name or src.stem}={dst.relative_to(dest).as_posix()}")
        copies.append((src, dst))
    raw["eval"] = {**ev, "prompts": ",".join(prompts)}
    env = {var: dst.relative_to(dest).as_posix() for src, dst in copies if dst.is_file()
           for var in [named_asset_env(src)] if var}
    return raw, env


def bring_target(name: str, assets: Path) -> tuple[Path, Path | None]:
    """The target in its smallest faithful form: a GGUF file as it is (the alias: the GGUF it ships as), since
    eyas converts it on arrival; anything else as the transformers folder it resolves to. Returns the copy,
    and the GGUF it copied (None: a folder)."""
    from eyas.assets import gguf_named, resolve_model

    try:
        gguf = gguf_named(str(name))
    except EyasError:  # the alias without its package (a converted copy in the cache): the folder travels
        gguf = None
    (assets / "target").mkdir()
    if gguf is not None:
        shutil.copy2(gguf, assets / "target" / gguf.name)
        return assets / "target" / gguf.name, gguf
    shutil.copytree(Path(resolve_model(name)), assets / "target", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.gguf", ".cache"))
    return assets / "target", None


def bring_wheels(opts: BundleOptions, dest: Path) -> dict[str, str]:
    """eyas itself as a wheel (from this source tree), and every package it and --wheel need that the node
    lacks, built for the node's Python; returns name -> version of those."""
    from eyas.utils import wheels

    dest.mkdir()
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise EyasError(f"eyas is not installed from a source tree ({root} has no pyproject.toml): install it "
                        "from its repository to bundle it")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(dest), str(root)], capture_output=True, text=True)
    if done.returncode != 0:
        raise EyasError(f"building eyas' wheel from {root} failed: {done.stderr.strip()[-400:]}")
    for junk in dest.glob("*.tmp"):
        junk.unlink()
    if not opts.dependencies:
        return {}
    node = wheels.NodePython(opts.python_version, tuple(opts.platform))
    eyas_wheel = next(dest.glob("eyas-*.whl"))
    pins = wheels.resolve([str(eyas_wheel), *opts.wheel], node, wheels.node_pins(opts.node_packages),
                          opts.with_torch)
    pins.pop("eyas", None)
    wheels.download(pins, node, dest)
    return pins


def write_parts(folder: Path, part_bytes: int, env: dict[str, str], wheel: list[str]) -> list[Path]:
    """folder as one gzip'd tar stream cut into files of at most `part_bytes` (folder.tar.gz.000, .001, ...),
    with folder.parts.json (each part's size and sha256; `env`: variable -> path inside the folder; `wheel`:
    the extra requirements to install) and folder.unpack.py, the script that joins and installs them."""
    base = folder.parent
    for old in [*base.glob(f"{folder.name}.tar.*"), base / f"{folder.name}.parts.json",
                base / f"{folder.name}.unpack.py"]:
        old.unlink(missing_ok=True)
    writer = _PartWriter(base / f"{folder.name}.tar.gz", part_bytes)
    with gzip.GzipFile(fileobj=writer, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w|") as tar:
        tar.add(folder, arcname=folder.name)
    writer.close()
    parts = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in writer.parts]
    atomic_write_json(base / f"{folder.name}.parts.json", {"format": "eyas.bundle-parts/1", "folder": folder.name,
                                                           "parts": parts, "env": env, "wheels": list(wheel)})
    shutil.copyfile(Path(__file__).with_name("bundle_unpack.py"), base / f"{folder.name}.unpack.py")
    return writer.parts


class _PartWriter:
    """A file-like sink that starts a new part file every `limit` bytes."""

    def __init__(self, stem: Path, limit: int) -> None:
        self.stem, self.limit, self.parts = stem, max(1, limit), []
        self.f = None
        self.left = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self.left == 0:
                self.close()
                self.parts.append(self.stem.with_name(f"{self.stem.name}.{len(self.parts):03d}"))
                self.f, self.left = open(self.parts[-1], "wb"), self.limit  # noqa: SIM115 - closed in close()
            n = min(self.left, len(view))
            self.f.write(view[:n])
            view, self.left = view[n:], self.left - n
        return len(data)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def readme(name: str, opts: BundleOptions, brought: dict[str, str]) -> str:
    made_for = f"Python {opts.python_version or '.'.join(map(str, sys.version_info[:2]))} on " + \
        (", ".join(opts.platform) or "the platform of the machine that made it")
    has = "the packages of the --node-packages file" if opts.node_packages else "Python"
    needs = "" if opts.with_torch else " and torch"
    return "\n".join([
        f"# eyas bundle `{name}`",
        "",
        f"Made for {made_for}. On a node with {has}{needs}, and no package index:",
        "",
        "```bash",
        f"python3 {name}.unpack.py   # if it came as parts: checks, joins, installs, writes env.sh",
        f"cd {name}",
        "pip install --no-index --find-links wheels eyas" + "".join(f" '{w}'" for w in opts.wheel)
        + "   # if it came as this folder",
        ". ./env.sh                  # only to run configs from elsewhere: points eyas' named assets here",
        "eyas run config.yaml        # killed at a time limit? run it again: it resumes",
        "```",
        "",
        f"wheels/ holds eyas and the {len(brought)} packages it needs that the node lacks"
        + (f" ({', '.join(brought)})." if brought else "."),
        "A GGUF target is converted to a transformers folder on the first run (under $EYAS_CACHE).",
        "Paths in config.yaml are relative to this folder. `work/` holds the run; bring it back with",
        "`tar -c work | ...` or `eyas bundle` on the node.",
        "",
    ])


cli = cli_command(BundleOptions, lambda opts: run_bundle(opts, log=typer.echo))
