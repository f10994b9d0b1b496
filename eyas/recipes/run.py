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


def _section(cfg: dict[str, Any], stage: str) -> dict[str, Any]:
    section = cfg.get(stage) or {}
    if not isinstance(section, dict):
        raise EyasError(f"config section '{stage}' must be a mapping of options, got {type(section).__name__}")
    return dict(section)


def make_untrained_draft(trained: Path, out: Path, seed: int = 0) -> None:
    """The same draft (config, vocabulary, embedding) with fresh weights: the 'before training' baseline."""
    import torch

    from eyas.model.draft import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(trained)
    torch.manual_seed(seed)
    draft.reset_parameters()
    draft.save_pretrained(out)


def run_pipeline(cfg: dict[str, Any], config_path: Path, force: set[str] = frozenset()) -> dict[str, Any]:
    from eyas.recipes import evaluate, export, extract, prepare, regenerate, train

    target = str(cfg.get("target") or "smollm2")
    workdir = Path(cfg.get("workdir") or Path("runs") / config_path.stem)
    workdir.mkdir(parents=True, exist_ok=True)
    online = bool(cfg.get("online", False))
    ledger = StageLedger(workdir)
    for stage in force:
        if stage not in STAGES:
            raise EyasError(f"--force {stage}: not a stage; stages: {', '.join(STAGES)}")
        ledger.state.pop(stage, None)
    paths = {name: workdir / name for name in ("regenerated", "prepared", "store", "train", "export", "eval")}
    console.print(f"[bold]eyas run[/] {config_path} → {workdir}  (target: {target}, "
                  f"{'online' if online else 'offline'} training)")

    prep = _section(cfg, "prepare")
    inputs = prep.pop("inputs", ["sharegpt"])
    regen = _section(cfg, "regenerate")
    if regen.pop("enabled", False):
        regen_out = paths["regenerated"] / "conversations.jsonl"
        regen_opts = {"inputs": inputs, "model": target, "out": regen_out, **regen}
        ledger.run("regenerate", regen_opts, [regen_out],
                   lambda: call_stage("regenerate", regenerate.cli, regen_opts))
        inputs = [str(regen_out)]

    prep_opts = {"inputs": [str(i) for i in inputs], "model": target, "out": paths["prepared"], **prep}
    ledger.run("prepare", prep_opts, [paths["prepared"] / "manifest.json"],
               lambda: call_stage("prepare", prepare.cli, prep_opts))

    train_opts = {"out": paths["train"], "model": target, **_section(cfg, "train")}
    if online:
        train_opts.update(online=True, prepared=paths["prepared"])
    else:
        ext_opts = {"prepared": paths["prepared"], "model": target, "out": paths["store"], **_section(cfg, "extract")}
        ledger.run("extract", ext_opts, [paths["store"] / "manifest.json"],
                   lambda: call_stage("extract", extract.cli, ext_opts))
        train_opts["store"] = paths["store"]
    draft_dir = paths["train"] / "draft"

    def run_train() -> None:
        call_stage("train", train.cli, {"resume": True, **train_opts})
        done = read_json(paths["train"] / "manifest.json")
        if not done.get("complete", True):  # cut by max_time: not done, and the next `eyas run` resumes it
            raise EyasError(f"train stopped at its max_time budget after {done['steps']}/{done['total_steps']} steps; "
                            f"the draft so far is in {draft_dir}. Run the same `eyas run` again to continue.")

    ledger.run("train", train_opts, [draft_dir / "model.safetensors"], run_train)

    exp_opts = {"draft": draft_dir, "format": "all", "out": paths["export"], **_section(cfg, "export")}
    ledger.run("export", exp_opts, [paths["export"]], lambda: call_stage("export", export.cli, exp_opts))

    ev = {"model": target, **_section(cfg, "eval")}
    untrained = workdir / "draft-untrained"
    before, after = paths["eval"] / "untrained", paths["eval"] / "trained"

    def run_eval() -> None:
        make_untrained_draft(draft_dir, untrained)
        call_stage("eval", evaluate.cli, {**ev, "draft": str(untrained), "out": before, "label": "untrained",
                                          "baseline": False, "force": True})
        call_stage("eval", evaluate.cli, {**ev, "draft": str(draft_dir), "out": after, "label": "trained",
                                          "compare": [str(before / "report.json")], "force": True})

    ledger.run("eval", ev, [after / "report.json", before / "report.json"], run_eval)
    return final_report(workdir, before, after, paths["export"])


def _overall_tau(report: Path) -> dict[str, float]:
    data = read_json(report)
    return {m: float(v["tau"]) for m, v in data["results"]["all"].items() if v.get("tau") is not None}


def serve_command(readme: Path) -> str | None:
    """The `vllm serve ...` command of an export README, joined across its `\\` continuation lines."""
    if not readme.is_file():
        return None
    lines = readme.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("vllm serve")), None)
    if start is None:
        return None
    parts = []
    for line in lines[start:]:
        parts.append(line.strip().rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(parts)


def final_report(workdir: Path, before: Path, after: Path, export_dir: Path) -> dict[str, Any]:
    """Print what a person wants at the end: did training help, where is the draft, how to serve it."""
    from rich.table import Table

    tau_before, tau_after = _overall_tau(before / "report.json"), _overall_tau(after / "report.json")
    speed = {m: v.get("speedup") for m, v in read_json(after / "report.json")["results"]["all"].items()}
    table = Table(title="acceptance length tau (MT-Bench style prompts), before and after training")
    for col in ("method", "tau untrained", "tau trained", "speedup (trained)"):
        table.add_column(col, justify="right")
    for method in tau_after:
        sp = speed.get(method)
        table.add_row(method, f"{tau_before.get(method, float('nan')):.2f}", f"{tau_after[method]:.2f}",
                      f"{sp:.2f}x" if isinstance(sp, (int, float)) else "-")
    out = Console()
    out.print(table)
    out.print(f"report: {after / 'report.md'}   plots: {', '.join(str(p) for p in sorted(after.glob('*.png')))}")
    serve = serve_command(export_dir / "vllm" / "README.md")
    out.print(f"exported drafts: {export_dir}  (vllm/, sglang/, speculators/)")
    if serve:
        out.print("serve with vLLM:")
        out.print(serve, markup=False, highlight=False, soft_wrap=True)
    summary = {"tau_untrained": tau_before, "tau_trained": tau_after, "export": str(export_dir), "serve": serve}
    atomic_write_json(workdir / "summary.json", summary)
    return summary


def cli(
    config: Path = typer.Argument(..., help="YAML config: target, workdir, online, and one section per stage "
                                  "holding that stage's options (see configs/)."),
    force: list[str] = typer.Option([], "--force", help="Rerun this stage (repeatable) even if up to date."),
) -> None:
    run_pipeline(load_config(config), config_path=config, force=set(force))
