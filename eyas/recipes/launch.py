"""Stages that want several processes: `eyas run` starts them under torchrun, or refuses before any stage
runs and prints the exact command. It never quietly runs one process where a config asked for more.

A stage asks for several processes with its section's `nproc: N`, with the run's `gpus: N` (extract with
the hf engine: one process per GPU; train: the GPUs the target does not take), or with `train.fsdp: true`
(one process per visible GPU). Only `extract` and `train` run under torchrun; a stage that asks for one
process runs inside `eyas run` as before.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from eyas.utils.io import EyasError, read_json
from eyas.utils.schema import to_cli_args

MULTI_PROCESS = ("extract", "train")


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def target_gpu_count(opts: Any) -> int:
    """GPUs an online target takes beside the trainers (vllm's --tp, or --target-gpus)."""
    if not getattr(opts, "online", False):
        return 0
    if opts.target_gpus:
        return len(opts.target_gpus)
    return opts.tp if opts.engine == "vllm" else 0


def wanted_processes(section: dict[str, Any], gpus: int, stage: str, opts: Any) -> tuple[int, str]:
    """(processes, what asked for them) for one stage's options."""
    if "nproc" in section:
        n = section["nproc"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EyasError(f"{stage}.nproc = {n!r}: expected a whole number of processes >= 1")
        return n, f"{stage}.nproc: {n}"
    if gpus > 1:
        if stage == "extract":
            return (gpus, f"gpus: {gpus}") if opts.engine == "hf" else (1, "")  # vllm: --tp GPUs, one process
        return max(1, gpus - target_gpu_count(opts)), f"gpus: {gpus}"
    if stage == "train" and opts.fsdp:
        return max(0, visible_gpus() - target_gpu_count(opts)), "train.fsdp: true"
    return 1, ""


def torchrun_command(stage: str, opts: Any, nproc: int) -> list[str]:
    """The command that runs `eyas STAGE` with these options in `nproc` processes of this node."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "eyas.cli", stage, *to_cli_args(opts)]


def refusal(stage: str, opts: Any, nproc: int, why: str) -> str | None:
    """Why `eyas run` cannot start these processes itself (None: it can)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "`eyas run` is itself running under torchrun; start it as one process"
    if stage == "extract" and opts.engine == "vllm":
        return "the vllm engine runs one process with --tp GPUs; use `tp` instead of several processes"
    gpus, device = visible_gpus(), str(getattr(opts, "device", "auto"))
    explicit = why.startswith(f"{stage}.nproc")
    if nproc < 2 and not explicit:
        return f"{why} shards over several processes and this machine has {gpus} GPU(s) for them; set train.nproc " \
               "(with device: cpu for CPU processes) or drop fsdp"
    if gpus == 0 and device != "cpu" and not explicit:
        return f"this machine has no GPU for it ({why}); set {stage}.nproc (and device: cpu) for CPU processes"
    if gpus and device != "cpu" and nproc + target_gpu_count(opts) > gpus:
        return f"{nproc} processes (+ {target_gpu_count(opts)} target GPUs) need more than the {gpus} GPUs here"
    return None


def assign_processes(cfg: Any, stages: list[Any], train: Callable[..., None], refuse: bool = True) -> None:
    """Give each stage its process count and, where several, the torchrun commands that replace its
    in-process run (`train(schedules, run=...)` trains each schedule); raise, before any stage runs,
    naming the command where eyas cannot start them (`refuse=False`: note why in `Stage.refused`)."""
    for st in stages:
        section = getattr(cfg, st.name, {}) or {}
        options = st.options if isinstance(st.options, list) else [st.options]
        if st.name not in MULTI_PROCESS:
            if "nproc" in section:
                raise EyasError(f"{st.name}.nproc: only extract and train run in several processes")
            continue
        nproc, why = wanted_processes(section, int(cfg.gpus or 0), st.name, options[0])
        if nproc == 1 and not why.startswith("train.fsdp"):  # fsdp in one process shards nothing: refused
            continue
        commands = [torchrun_command(st.name, o, max(nproc, 1)) for o in options]
        problem = refusal(st.name, options[0], nproc, why)
        st.refused = problem
        if problem and refuse:
            shown = "\n".join("  " + shlex.join(c) for c in commands)
            raise EyasError(f"{st.name}: {why} asks for {nproc} processes, which `eyas run` cannot start here: "
                            f"{problem}. Run the stage yourself where it can run (after the stages before it):\n"
                            f"{shown}")
        st.nproc, st.commands = nproc, commands
        if st.name == "extract":
            st.run = lambda s=st: run_commands(s)
        else:
            st.run = lambda opts=options, n=nproc: train(opts, run=functools.partial(launched_train, nproc=n))


def run_commands(stage: Any) -> None:
    """Run a stage's torchrun commands one after the other; a failed one stops the run."""
    for cmd in stage.commands:
        run_command(cmd)


def run_command(cmd: list[str]) -> None:
    print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        raise EyasError(f"this command failed (exit code {done.returncode}); its output is above:\n  "
                        f"{shlex.join(cmd)}")


def launched_train(opts: Any, nproc: int) -> dict[str, Any]:
    """`run_train` in `nproc` processes under torchrun: what it wrote in OUT/manifest.json."""
    run_command(torchrun_command("train", opts, nproc))
    return read_json(opts.out / "manifest.json")
