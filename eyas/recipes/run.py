"""Run the whole pipeline from one YAML config: prepare -> regenerate -> extract -> train -> export -> eval.

Each stage writes into the run's work folder and is skipped when its output is up to date with its
inputs and options (a changed option reruns that stage and everything after it). A killed run
resumes where it stopped. The final report compares tau before and after training and says how to
serve the draft with vLLM.

Config sections are the stages' own command-line options (see `eyas STAGE --help`), e.g.

    target: smollm2
    workdir: runs/smollm2
    prepare: {inputs: [sharegpt], max_samples: 2000}
    train: {max_steps: 300}
    eval: {prompts: mtbench, chain: "3,5"}
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console

from eyas.utils.io import EyasError, atomic_write_json, read_json, sha256_json

STAGES = ("prepare", "regenerate", "extract", "train", "export", "eval")
console = Console(stderr=True)


def stage_defaults(fn: Callable) -> dict[str, Any]:
    """Defaults of a typer command function, unwrapped from typer's OptionInfo/ArgumentInfo."""
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        default = p.default
        if hasattr(default, "default"):  # typer.models.ParameterInfo
            default = default.default
        out[name] = None if default is ... or default is inspect.Parameter.empty else default
    return out


def call_stage(stage: str, fn: Callable, options: dict[str, Any]) -> None:
    """Call a stage's CLI function with config options, refusing unknown keys with the valid ones."""
    defaults = stage_defaults(fn)
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise EyasError(f"config section '{stage}' has unknown option(s) {unknown}; valid: {sorted(defaults)}")
    fn(**{**defaults, **options})


def load_config(path: Path) -> dict[str, Any]:
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise EyasError(f"cannot read config {path}: {e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise EyasError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(cfg, dict):
        raise EyasError(f"{path}: the config must be a mapping of sections (target, workdir, prepare, ...)")
    allowed = {"target", "workdir", "online", *STAGES}
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise EyasError(f"{path}: unknown top-level key(s) {unknown}; valid: {sorted(allowed)}")
    return cfg


class StageLedger:
    """Remembers the options hash each stage last completed with, in WORKDIR/run_state.json."""

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / "run_state.json"
        self.state: dict[str, str] = read_json(self.path) if self.path.is_file() else {}
        self.upstream = ""

    def run(self, stage: str, options: dict[str, Any], outputs: list[Path], fn: Callable[[], None]) -> bool:
        key = sha256_json({"options": options, "upstream": self.upstream})
        done = self.state.get(stage) == key and all(p.exists() for p in outputs)
        if done:
            console.print(f"[green]✓ {stage}[/] up to date, skipped")
        else:
            console.rule(f"[bold]{stage}")
            t0 = time.time()
            fn()
            self.state[stage] = key
            atomic_write_json(self.path, self.state)
            console.print(f"[green]✓ {stage}[/] done in {time.time() - t0:.0f}s")
        self.upstream = key
        return not done


def cli(
    config: Path = typer.Argument(..., help="YAML config: target, workdir and one section per stage."),
    force: list[str] = typer.Option([], "--force", help="Rerun this stage (repeatable) even if up to date."),
) -> None:
    from eyas.recipes.pipeline import run_pipeline

    run_pipeline(load_config(config), config_path=config, force=set(force))
