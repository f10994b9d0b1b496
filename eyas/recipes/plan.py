"""What a run will cost, before it starts: `eyas plan CONFIG` (also `eyas run CONFIG --dry-run`).

Per stage: samples and tokens, disk (every file, the target head included), memory per rank (target,
draft, optimizer, activations), estimated time, and whether it will be skipped as up to date or
resumed; then the commands of stages that run in several processes. It reads configs and manifests
only and finishes in seconds: no weights are loaded.

Times come from eyas.plan.rates, a table of rates measured on named cards (docs/benchmarks.md);
where a card or target has no row, the nearest row is scaled by FLOPs and the plan says so.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from eyas.utils.io import human_bytes
from eyas.utils.schema import cli_command, option


def local_card() -> str:
    """This machine's card by name (eyas.plan.rates.CARDS), or `cpu`."""
    import torch

    from eyas.plan.rates import CARDS

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).upper()
    return next((c for c in CARDS if c != "cpu" and c in name), "H100")


def human_time(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {seconds % 3600 / 60:.0f} min"


def human_count(n: float) -> str:
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n / size:.{2 if unit != 'M' else 1}f}{unit}"
    return f"{n:,.0f}"


def render(cfg: Any, config_path: Path, stages: list[Any], card: str) -> str:
    """The plan as text: one block per stage, then the totals of the stages that will run."""
    from eyas.plan.estimate import estimate_run
    from eyas.plan.rates import CARDS
    from eyas.recipes.run import stage_keys

    target, estimates = estimate_run(cfg, stages, stage_keys(stages), card, config_path)
    s = target.shape
    mem_label = "GPU memory per rank" if card != "cpu" else "Memory per process"
    lines = [f"eyas plan {config_path} on {card}: target {cfg.target} ({s.layers} layers, hidden {s.hidden}, "
             f"{human_count(s.params)} parameters, {human_count(s.active)} active; shape from {target.source})"]
    by_name = {st.name: st for st in stages}
    for e in estimates:
        procs = f", {e.processes} processes under torchrun" if e.processes != 1 else ""
        lines += ["", f"{e.name}{procs}: {e.status}",
                  f"  Samples: {e.samples:,}  Tokens: {human_count(e.tokens)}" if e.tokens else "  Samples: -",
                  f"  Disk: {human_bytes(sum(e.disk.values()))} ("
                  + ", ".join(f"{k} {human_bytes(v)}" for k, v in e.disk.items()) + ")"]
        mem = {k: v for k, v in e.memory.items() if v}
        lines.append(f"  {mem_label}: " + (f"{human_bytes(sum(mem.values()))} (" + ", ".join(
            f"{k} {human_bytes(v)}" for k, v in mem.items()) + ")" if mem else "-"))
        lines += over_memory(sum(mem.values()), e.usable, card, CARDS[card].memory_gib)
        lines.append(f"  Time: {human_time(e.seconds)}")
        lines += [f"    {n}" for n in e.notes]
        st = by_name[e.name]
        if st.refused:
            lines.append(f"  `eyas run` would refuse to start it here: {st.refused}")
        lines += ["  $ " + shlex.join(c) for c in st.commands]
    todo = [e for e in estimates if not e.status.startswith("up to date")]
    disk, seconds = sum(sum(e.disk.values()) for e in todo), sum(e.seconds for e in todo)
    lines += ["", f"Total for the {len(todo)} stage(s) that will run: Disk {human_bytes(disk)}, Time "
              f"{human_time(seconds)} (measured rates where a row matches; extrapolations say so above)"]
    return "\n".join(lines)


def over_memory(need: float, usable: tuple[float, str], card: str, card_gib: float) -> list[str]:
    """A line flagging a stage whose memory per rank is over what it may use of one card, else none."""
    share, who = usable
    if need <= share * card_gib * 2**30:
        return []
    if share >= 1:
        return [f"  ! more than one {card}'s {card_gib:g} GiB: spread it (tp, device_map, fsdp) or use a larger card"]
    return [f"  ! more than the {share:.0%} of one {card}'s {card_gib:g} GiB ({share * card_gib:.1f} GiB) that {who} "
            "fills: it would fail to start. Spread it over more GPUs (tp) or use a larger card"]


@dataclass(kw_only=True)
class PlanOptions:
    """`eyas plan`'s options."""

    config: Path = option(positional=True, help="YAML config of `eyas run` (see configs/).")
    card: str = option("auto", help="The GPU the run will use: auto (this machine's, or cpu), H100, H200, B200, "
                       "A100, L40S, cpu.")


def show_plan(config: Path, card: str = "auto", refuse: bool = False) -> str:
    """Print the plan; `refuse`: fail as `eyas run` would where it cannot start a stage's processes (else
    the plan says why)."""
    from eyas.recipes.run import build_stages, load_config

    cfg = load_config(config)
    stages = build_stages(cfg, config, refuse=refuse)
    text = render(cfg, config, stages, local_card() if card == "auto" else card)
    typer.echo(text)
    return text


cli = cli_command(PlanOptions, lambda o: show_plan(o.config, o.card))
