"""Run the whole pipeline from one YAML config: prepare -> regenerate -> extract -> train -> export -> eval.

Every section of the config is checked against its stage's options before any stage starts, so a
wrong key or type fails in a second, not after an hour of extraction. Each stage writes into the run's
work folder and is skipped when its output is up to date with its inputs and options (a changed
option reruns that stage and everything after it). A killed run resumes where it stopped. The final
report compares tau before and after training and says how to serve the draft with vLLM.

Config sections are the stages' own options (see `eyas STAGE --help`), e.g.

    target: smollm2
    workdir: runs/smollm2
    prepare: {inputs: [sharegpt], max_samples: 2000}
    train: {max_steps: 300}
    eval: {prompts: mtbench, chain: "3,5"}
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from eyas.recipes.launch import assign_processes
from eyas.utils.io import EyasError, atomic_write_json, check_output, read_json, sha256_json
from eyas.utils.resume import up_to_date
from eyas.utils.schema import from_mapping, option, to_mapping

STAGES = ("prepare", "regenerate", "extract", "train", "export", "eval", "serving")
console = Console(stderr=True)


@dataclass(kw_only=True)
class RunConfig:
    """The top level of an `eyas run` config: the target, the work folder, and one section per stage."""

    target: str = "smollm2"
    workdir: Path | None = None
    online: bool = False
    gpus: int = 0  # GPUs of this node the run may use: extract and train then start that many processes
    compare_untrained: bool = True  # also measure the draft untrained (the 'before training' mark)
    prepare: dict[str, Any] = field(default_factory=dict)
    regenerate: dict[str, Any] = field(default_factory=dict)
    extract: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    export: dict[str, Any] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)
    # the trained draft timed again as a server runs it (e.g. bf16, batch sizes 1..64), the eval section's options
    # overridden by these; empty: no such stage (the eval's own timing stands)
    serving: dict[str, Any] = field(default_factory=dict)


@dataclass
class Stage:
    """One stage of a run: its validated options (a list for training schedules), the outputs that show it
    finished, and how to run it."""

    name: str
    options: Any
    outputs: list[Path]
    run: Callable[[], None]
    nproc: int = 1  # processes; several: `commands` start them under torchrun (eyas.recipes.launch)
    commands: list[list[str]] = field(default_factory=list)
    refused: str | None = None  # why `eyas run` cannot start those processes here


def load_config(path: Path) -> RunConfig:
    """The config file, parsed and checked at the top level (each section is checked by `build_stages`)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise EyasError(f"cannot read config {path}: {e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise EyasError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(raw, dict):
        raise EyasError(f"{path}: the config must be a mapping of sections (target, workdir, prepare, ...)")
    allowed = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise EyasError(f"{path}: unknown top-level key(s) {unknown}; valid: {sorted(allowed)}")
    raw = {k: ({} if v is None and k in STAGES else v) for k, v in raw.items()}
    return from_mapping(RunConfig, raw, str(path))


def _section(cfg: RunConfig, path: Path, stage: str, cls: type, owned: dict[str, Any],
             section: dict[str, Any] | None = None) -> Any:
    """The stage's options from its section plus what the run itself sets (`owned`), checked as a whole."""
    section = dict(getattr(cfg, stage) if section is None else section)
    section.pop("enabled", None)
    section.pop("nproc", None)  # how many processes run it: eyas.recipes.launch
    taken = sorted(set(section) & set(owned))
    if taken:
        raise EyasError(f"{path}: {stage}.{taken[0]} is set by `eyas run` itself (the work folder's paths, the "
                        "target); remove it from the config")
    return from_mapping(cls, {**owned, **section}, f"{path}: {stage}")


def build_stages(cfg: RunConfig, path: Path, refuse: bool = True) -> list[Stage]:
    """Every stage of the run with validated options, in order; raises on any bad section, and (with
    `refuse`) on a stage whose processes `eyas run` cannot start here."""
    from eyas.recipes import evaluate, export, extract, prepare, regenerate

    work = Path(cfg.workdir or Path("runs") / path.stem)
    paths = {name: work / name for name in ("regenerated", "prepared", "store", "train", "export", "eval", "serving")}
    inputs = cfg.prepare.get("inputs") or ["sharegpt"]
    if not isinstance(inputs, list):  # else `inputs: dummy` would read as the inputs d, u, m, m, y
        raise EyasError(f"{path}: prepare.inputs = {inputs!r}: expected a list of text, e.g. inputs: [{inputs}]")
    stages = []
    if cfg.regenerate.get("enabled", False):
        out = paths["regenerated"] / "conversations.jsonl"
        opts = _section(cfg, path, "regenerate", regenerate.RegenerateOptions,
                        {"inputs": inputs, "model": cfg.target, "out": out})
        stages.append(Stage("regenerate", opts, [out], lambda o=opts: regenerate.run_regenerate(o)))
        inputs = [str(out)]
    prep = _section(cfg, path, "prepare", prepare.PrepareOptions, {"model": cfg.target, "out": paths["prepared"]},
                    {**cfg.prepare, "inputs": [str(i) for i in inputs]})
    stages.append(Stage("prepare", prep, [paths["prepared"] / "manifest.json"], lambda: prepare.prepare(prep)))
    train_owned: dict[str, Any] = {"out": paths["train"], "model": cfg.target, "resume": True}
    if cfg.online:
        train_owned |= {"online": True, "prepared": paths["prepared"]}
    else:
        ext = _section(cfg, path, "extract", extract.ExtractOptions,
                       {"prepared": paths["prepared"], "model": cfg.target, "out": paths["store"]})
        stages.append(Stage("extract", ext, [paths["store"] / "manifest.json"], lambda: extract.run_extract(ext)))
        train_owned["store"] = paths["store"]
    train_stage = _train_stage(cfg, path, train_owned)
    stages.append(train_stage)
    draft = Path(train_stage.options[-1].out) / "draft"
    exp = _section(cfg, path, "export", export.ExportOptions, {"draft": draft, "out": paths["export"],
                                                               "format": "all"})
    stages.append(Stage("export", exp, [paths["export"]], lambda: export.run_export(exp)))
    stages.append(_eval_stage(cfg, path, draft, paths["eval"], work / "draft-untrained"))
    if cfg.serving:
        serve = _section(cfg, path, "serving", evaluate.EvalOptions, {"model": cfg.target, "draft": str(draft),
                         "out": paths["serving"], "label": "serving"}, section={**cfg.eval, **cfg.serving})
        stages.append(Stage("serving", serve, [paths["serving"] / "report.json"], lambda: evaluate.run_eval(serve)))
    assign_processes(cfg, stages, train=_train, refuse=refuse)  # several processes: torchrun, or a refusal now
    return stages


def _eval_stage(cfg: RunConfig, path: Path, draft: Path, out: Path, untrained: Path) -> Stage:
    """The trained draft measured against the target alone and, with `compare_untrained`, against the same
    draft untrained (the 'before training' mark; it doubles the decoding)."""
    from eyas.recipes import evaluate

    before, after = out / "untrained", out / "trained"
    owned = {"model": cfg.target, "draft": str(draft), "out": after, "label": "trained"}
    if not cfg.compare_untrained:
        trained = _section(cfg, path, "eval", evaluate.EvalOptions, owned)
        return Stage("eval", trained, [after / "report.json"], lambda: evaluate.run_eval(trained))
    ev_untrained = _section(cfg, path, "eval", evaluate.EvalOptions,
                            {"model": cfg.target, "draft": str(untrained), "out": before, "label": "untrained",
                             "baseline": False},
                            section={**cfg.eval, "sweep": False})  # tau before training, not speed: no sweep
    ev_trained = _section(cfg, path, "eval", evaluate.EvalOptions,
                          {**owned, "compare": [str(before / "report.json")]})

    def run_eval() -> None:
        make_untrained_draft(draft, untrained)
        evaluate.run_eval(ev_untrained)
        evaluate.run_eval(ev_trained)

    return Stage("eval", ev_trained, [after / "report.json", before / "report.json"], run_eval)


def _train_stage(cfg: RunConfig, path: Path, owned: dict[str, Any]) -> Stage:
    """Training as one stage of one or more schedules. With `schedules:` (a list of option mappings) in the
    train section, schedule i trains from schedule i-1's draft (`init_draft`) with the section's options
    overridden by its own, in OUT/schedule-i/; each resumes on its own and a finished one is up to date."""
    from eyas.recipes.train import TrainOptions

    section = dict(cfg.train)
    schedules = section.pop("schedules", None)
    if schedules is None:
        opts = [_section(cfg, path, "train", TrainOptions, owned, section)]
        return Stage("train", opts, [Path(owned["out"]) / "draft" / "model.safetensors"], lambda: _train(opts))
    if not isinstance(schedules, list) or not schedules or not all(isinstance(s, dict) for s in schedules):
        raise EyasError(f"{path}: train.schedules must be a list of option mappings, e.g. [{{max_steps: 3500}}, "
                        "{max_steps: 2400, lr: 0.0002}]")
    root, opts = Path(owned["out"]), []
    for i, sched in enumerate(schedules):
        mine = {**owned, "out": root / f"schedule-{i}"}
        if i:
            mine["init_draft"] = root / f"schedule-{i - 1}" / "draft"
            sched = {k: v for k, v in sched.items() if k != "init_head"}  # a later schedule starts from a draft
        opts.append(_section(cfg, path, f"train.schedules[{i}]", TrainOptions, mine, {**section, **sched}))
    return Stage("train", opts, [Path(opts[-1].out) / "draft" / "model.safetensors"], lambda: _train(opts))


def _train(schedules: list[Any], run: Callable[[Any], dict[str, Any]] | None = None) -> None:
    """Train each schedule in turn, in this process (`run_train`) or as `run` starts it (under torchrun)."""
    from eyas.recipes.train import run_train

    for opts in schedules:
        done = (run or run_train)(opts)
        if not done.get("complete", True):  # cut by max_time: not done, and the next `eyas run` resumes it
            raise EyasError(f"train stopped at its max_time budget after {done['steps']}/{done['total_steps']} "
                            f"steps; the draft so far is in {Path(opts.out) / 'draft'}. Run the same `eyas run` "
                            "again to continue.")


def make_untrained_draft(trained: Path, out: Path, seed: int = 0) -> None:
    """The same draft (its family, config, vocabulary and every frozen tensor: the target's embedding, and
    its head where the family reads it frozen) with fresh trainable weights: the 'before training' baseline."""
    import torch

    from eyas.model.families import build_draft, load_draft

    draft = load_draft(trained)
    torch.manual_seed(seed)
    fresh = build_draft(draft.config)
    kept = {n for n, p in draft.named_parameters() if not p.requires_grad} | {n for n, _ in draft.named_buffers()}
    fresh.load_state_dict({k: v for k, v in draft.state_dict().items() if k in kept}, strict=False)
    fresh.save_pretrained(out)


def stage_keys(stages: list[Stage]) -> list[str]:
    """Each stage's key in the run's ledger: its options and everything upstream of it, so a changed
    option reruns that stage and the ones after it."""
    keys, upstream = [], ""
    for st in stages:
        options = [to_mapping(o) for o in st.options] if isinstance(st.options, list) else to_mapping(st.options)
        upstream = sha256_json({"options": options, "upstream": upstream})
        keys.append(upstream)
    return keys


def run_pipeline(cfg: RunConfig, config_path: Path, force: set[str] = frozenset()) -> dict[str, Any]:
    for stage in force:
        if stage not in STAGES:
            raise EyasError(f"--force {stage}: not a stage; stages: {', '.join(STAGES)}")
    stages = build_stages(cfg, config_path)  # every section checked before anything runs
    work = Path(cfg.workdir or Path("runs") / config_path.stem)
    ledger = work / "run_state.json"  # also what marks the folder as a run's, from its start
    check_output(work, "run", lambda p: (p / ledger.name).is_file(), name="workdir")
    if not ledger.is_file():
        atomic_write_json(ledger, {})
    console.print(f"[bold]eyas run[/] {config_path} → {work}  (target: {cfg.target}, "
                  f"{'online' if cfg.online else 'offline'} training)")
    for st, key in zip(stages, stage_keys(stages), strict=True):
        if st.name not in force and up_to_date(ledger, key, *st.outputs, entry=st.name):
            console.print(f"[green]✓ {st.name}[/] up to date, skipped")
            continue
        console.rule(f"[bold]{st.name}")
        t0 = time.time()
        st.run()
        state = read_json(ledger) if ledger.is_file() else {}
        state[st.name] = {"options_sha256": key, "seconds": round(time.time() - t0, 1)}
        atomic_write_json(ledger, state)
        console.print(f"[green]✓ {st.name}[/] done in {time.time() - t0:.0f}s")
    paths = {s.name: s for s in stages}
    serving = Path(paths["serving"].options.out) if "serving" in paths else None
    return final_report(work, Path(paths["eval"].options.out).parent / "untrained", Path(paths["eval"].options.out),
                        Path(paths["export"].options.out), serving)


def _overall_tau(report: Path) -> dict[str, float]:
    data = read_json(report)
    return {m: float(v["tau"]) for m, v in data["results"]["all"].items() if v.get("tau") is not None}


def serve_command(readme: Path) -> str | None:
    """The `vllm serve ...` command of an export README, on one line."""
    from eyas.export.families import serve_command_in

    return serve_command_in(readme.read_text()) if readme.is_file() else None


def final_report(workdir: Path, before: Path, after: Path, export_dir: Path, serving: Path | None = None
                 ) -> dict[str, Any]:
    """Print what a person wants at the end: did training help, where is the draft, how to serve it. Speed
    comes from the serving stage's report where the run has one, else from the eval's."""
    from rich.table import Table

    tau_after = _overall_tau(after / "report.json")
    tau_before = _overall_tau(before / "report.json") if (before / "report.json").is_file() else {}
    timed = read_json((serving or after) / "report.json")
    speed = {m: "too noisy" if v.get("speedup_note") else v.get("speedup") for m, v in timed["results"]["all"].items()}
    before = bool(tau_before)  # measured only with compare_untrained
    table = Table(title="acceptance length tau (MT-Bench style prompts)" + (", before and after training" * before))
    for col in ("method", *["tau untrained"] * before, "tau trained", "speedup (trained)"):
        table.add_column(col, justify="right")
    for method in tau_after:
        sp = speed.get(method)
        table.add_row(method, *[f"{tau_before.get(method, float('nan')):.2f}"] * before, f"{tau_after[method]:.2f}",
                      f"{sp:.2f}x" if isinstance(sp, (int, float)) else sp or "-")
    out = Console()
    out.print(table)
    out.print(f"report: {after / 'report.md'}   plots: {', '.join(str(p) for p in sorted(after.glob('*.png')))}")
    serve = serve_command(export_dir / "vllm" / "README.md")
    out.print(f"exported drafts: {export_dir}  (vllm/, sglang/, speculators/)")
    if serve:
        out.print("serve with vLLM:")
        out.print(serve, markup=False, highlight=False, soft_wrap=True)
    words = in_words(read_json(after / "report.json"), tau_before, export_dir, timed)
    out.print("\n" + words, highlight=False)
    summary = {"tau_untrained": tau_before, "tau_trained": tau_after, "export": str(export_dir), "serve": serve,
               "in_words": words}
    atomic_write_json(workdir / "summary.json", summary)
    return summary


def in_words(report: dict[str, Any], tau_before: dict[str, float], export_dir: Path,
             timed: dict[str, Any] | None = None) -> str:
    """What the eval's numbers mean for someone who has just run the pipeline, in plain sentences; the speed
    from `timed` (the serving stage's report) where given."""
    results = {m: v for m, v in report["results"]["all"].items() if v.get("tau") is not None}
    if not results:
        return "The eval measured no method, so there is nothing to summarize."
    best = max(results, key=lambda m: results[m]["tau"])
    tau = results[best]["tau"]
    per_forward = results[best].get("tokens_per_target_forward")
    lines = [f"What this means: each verify step of the target produced {tau:.2f} tokens on average with {best} "
             "(tau; the target alone produces 1.00)"
             + (f", {per_forward:.2f} per target forward counting the prefill" if per_forward else "")
             + (f"; the untrained draft gave tau {tau_before[best]:.2f}." if best in tau_before else ".")]
    lines += speed_in_words(timed or report, export_dir)
    if str(report["meta"].get("target", "")).rstrip("/").endswith("SmolLM2-135M-Instruct"):
        lines.append("On a GPU, the best draft measured for this target (about an hour of training) reaches "
                     "tau 3.51 (chain of 7; 3.41 tokens per target forward) and tau 5.08 (tree) on all 80 MT-Bench "
                     "questions (docs/benchmarks.md).")
    return "\n".join(lines)


def speed_in_words(report: dict[str, Any], export_dir: Path) -> list[str]:
    """The measured speedup of the fastest method at each batch size, and, where the draft did not pay, why; where
    the timing could not give a speedup, that instead of a number; and what to serve at which concurrency."""
    rows = report.get("serving") or [  # a report without a serving curve (older, or --no-baseline): its batch-1 table
        {"batch_size": 1, "method": m, "speedup": v.get("speedup"), "speedup_note": v.get("speedup_note"),
         "tokens_per_s": v.get("tok_s")} for m, v in report["results"]["all"].items()]
    lines = _measured_speed(report, rows, export_dir)
    noisy = {}
    for r in rows:
        if r.get("speedup_note"):
            noisy.setdefault(r["batch_size"], f"{r['method']}: {r['speedup_note']}")
    lines += [f"At batch size {b} the timing was too noisy to give a speedup ({why})." for b, why in noisy.items()]
    rec = report.get("recommendation")
    if rec:
        lines += recommendation_in_words(rec, report, rows, export_dir)
    return lines


def recommendation_in_words(rec: dict[str, Any], report: dict[str, Any], rows: list[dict[str, Any]],
                            export_dir: Path) -> list[str]:
    """What to serve at the eval's --serve-at, with the exported folders in the serve commands."""
    from eyas.eval.recommend import in_words as recommendation_words
    from eyas.eval.recommend import recommendation
    from eyas.model.config import DraftConfig

    config = Path(str(report["meta"].get("draft", ""))) / "config.json"
    folders = {fmt: export_dir / fmt for fmt in ("vllm", "sglang") if (export_dir / fmt).is_dir()}
    if config.is_file() and folders:
        with contextlib.suppress(EyasError):  # else the eval's own commands stand
            rec = {**(recommendation(rows, rec["serve_at"], DraftConfig.load(config), folders,
                                     str(report["meta"].get("target", ""))) or rec), "device": rec.get("device")}
    return [w for w in recommendation_words(rec) if not w.startswith("At batch size")]  # said above


def _measured_speed(report: dict[str, Any], rows: list[dict[str, Any]], export_dir: Path) -> list[str]:
    from eyas.eval.serving import best_speedups

    best = best_speedups(rows)
    if not best:
        return []
    meta = report["meta"]
    device = meta.get("gpu") or meta.get("device", "this machine")
    on_cpu = not meta.get("gpu") and str(meta.get("device", "")).startswith("cpu")
    at = [f"{s:.2f}x at batch size {b} ({m})" for b, m, s in best]
    where = f"on {device}, in the same engine on the same prompts"
    faster, slower = [b for b, _, s in best if s > 1], [b for b, _, s in best if s <= 1]
    if not slower:
        every = " at every batch size measured" if len(best) > 1 else ""
        return [f"Decoding with the draft ran faster than the target alone{every}: {_joined(at)}, {where}."]
    if faster:
        return [f"Against the target alone, decoding with the draft ran {_joined(at)}, {where}: it paid at batch "
                f"size {_joined([str(b) for b in faster])}, not at {_joined([str(b) for b in slower])}. The more "
                "requests in flight, the less a target forward is bound by reading its weights, and the more the "
                "draft's extra tokens cost to verify."]
    lines = [f"Decoding with the draft was slower here than the target alone: {_joined(at)}, {where}."]
    if on_cpu:
        lines.append("A speedup needs more tokens per target forward than a verify step costs in target-alone steps; "
                     "on a CPU a forward over a few tokens costs far more than over one (small matrix products run "
                     "at vector speed), so a draft trained for minutes cannot pay for itself. "
                     f"`python benchmarks/verify_step.py --draft {export_dir / 'vllm'}` shows where the time goes.")
    return lines


def _joined(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass(kw_only=True)
class RunOptions:
    """`eyas run`'s options."""

    config: Path = option(positional=True, help="YAML config: target, workdir, online, and one section per stage "
                          "holding that stage's options (see configs/).")
    force: list[str] = option(default_factory=list, help="Rerun this stage even if up to date: prepare, regenerate, "
                              "extract, train, export or eval; repeatable.")
    dry_run: bool = option(False, help="Print the plan and stop: what `eyas plan` prints (samples, tokens, disk, "
                           "memory, time, what is up to date) and the commands of stages run under torchrun.")


def run_command(o: RunOptions) -> None:
    """`eyas run` without --dry-run (eyas.cli wires --dry-run to `eyas plan`'s printout)."""
    run_pipeline(load_config(o.config), config_path=o.config, force=set(o.force))
