"""Rewrite the assistant turns of chat data with the target itself (self-distillation for EAGLE-3).

The draft learns to predict the target, so training text written by the target (eyas.generate) matches
what it will see when serving. Work is saved in batches of conversations: a killed run resumes from its
last saved batch, and greedy runs (and sampled ones in rounds, seeded per batch) write the same file as an
uninterrupted run. The output is JSONL of {"messages": [{"role", "content"}, ...]}, which `eyas prepare`
reads; OUT.manifest.json records the options, and a rerun with the same inputs and options reuses it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import typer

from eyas.assets import TARGET_FORMS
from eyas.data.readers import SkipLog, Source, resolve_input
from eyas.generate import GENERATORS, Sampling, Stats, generator_target, resolve_generator, run_generator
from eyas.utils.io import (
    EyasError,
    atomic_path,
    atomic_write_json,
    check_output,
    has_manifest,
    sha256_json,
    writer_lock,
)
from eyas.utils.progress import progress_bar
from eyas.utils.resume import PartialLog, up_to_date
from eyas.utils.schema import cli_command, option, subset

FORMAT = "eyas.regenerated/1"


@dataclass(kw_only=True)
class RegenerateOptions(Sampling):
    """`eyas regenerate`'s options: the command line and the `regenerate:` section of an `eyas run` config."""

    help_panel: ClassVar[str] = "Data, target and output"

    inputs: list[str] = option(positional=True, help="Chat data: .json/.jsonl (ShareGPT or OpenAI messages), parquet, "
                               "a saved dataset, or sharegpt/dummy.")
    out: Path = option(short="-o", help="Output JSONL of {'messages': [...]}, read by `eyas prepare`.")
    model: str = option("smollm2", help=f"Target: {TARGET_FORMS}.")
    max_samples: int = option(0, help="Use only the first N conversations; 0 = all.")
    batch_size: int = option(0, help="Conversations per saved batch (the unit a killed run resumes from); "
                             "generators generate and vllm decode each round of a batch's turns together. 0 = 1024 on "
                             "a GPU, 32 on a CPU.")
    engine: Literal["auto", "generate", "static", "vllm", "continuous"] = option(
        "auto", old_name="generator", help="What runs the target (the generator). auto: static on a GPU, generate "
        "on a CPU. generate: transformers' generate on padded batches "
        "(reproducible sampling). static: eyas' continuous batching over static KV caches, each decode step one CUDA "
        "graph. vllm: vLLM generates each round of turns (--tp for tensor parallel). continuous: transformers' "
        "continuous batching; worth it only with a flash-attention kernel.")
    window: int = option(512, help="engine continuous: conversations in flight at once.")
    tp: int = option(1, help="engine vllm: tensor-parallel GPUs.")
    trust_remote_code: bool = option(False, help="Let transformers / vLLM run the target's own code.")
    max_length: int = option(4096, help="Prompt + reply token limit; a conversation ends before the first turn that "
                             "does not fit.")
    dtype: str = option("auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32.")
    device: str = option("auto", help="auto (GPU if any), cpu, cuda:N.")
    max_time: float = option(0, help="Wall-clock budget in seconds (looked at after each saved batch): past it, the "
                             "batches finished so far are written to OUT (its manifest says complete: false) and the "
                             "same command resumes the rest. 0 = no limit.")
    kv_cache_gb: float = option(0, help="engine static: GiB of KV cache (more rows decode at once); 0 = 60% of "
                                "the free GPU memory.")
    preflight: bool = option(True, help="First check the generator's greedy replies to a few prompts against the "
                             "target's own next token (a plain transformers forward); stop when they part.")

    def __post_init__(self) -> None:
        Sampling.__post_init__(self)
        if self.engine not in GENERATORS:
            raise EyasError(f"--engine must be one of {', '.join(GENERATORS)}, not {self.engine!r}")
        if self.batch_size < 0 or self.window < 1 or self.tp < 1 or self.max_samples < 0:
            raise EyasError("--batch-size and --max-samples must be >= 0, --window and --tp >= 1")
        if self.max_time < 0:
            raise EyasError(f"--max-time must be >= 0 (0 = no limit), not {self.max_time}")
        if self.kv_cache_gb < 0:
            raise EyasError(f"--kv-cache-gb must be >= 0 (0 = 60% of the free GPU memory), not {self.kv_cache_gb}")


def run_regenerate(opts: RegenerateOptions, *, model: Any = None, tokenizer: Any = None, on_batch: Any = None) -> Path:
    """Rewrite the assistant turns of `opts.inputs` into `opts.out` (JSONL); returns it. `model` (with its
    `tokenizer`) is an already loaded target that replaces `opts.model`; `on_batch(b)` runs after batch b
    is saved (tests use it to simulate a crash). Past `max_time` the batches finished so far are written,
    marked incomplete, and the same call resumes the rest. One writer per output file: a second one gets an
    error naming this one."""
    out = check_output(opts.out, "regenerate", lambda p: has_manifest(p.with_name(p.name + ".manifest.json"), FORMAT),
                       file=True)
    with writer_lock(out, "regenerate"):
        return _run_regenerate(opts, out, model, tokenizer, on_batch)


def _run_regenerate(opts: RegenerateOptions, out: Path, model: Any, tokenizer: Any, on_batch: Any) -> Path:
    from eyas.assets import resolve_model
    from eyas.utils.devices import resolve_device

    sampling = subset(opts, Sampling)
    run_device = resolve_device(opts.device) if model is None else next(model.parameters()).device
    batch_size = opts.batch_size or (1024 if run_device.type == "cuda" else 32)
    name = resolve_generator(opts.engine, run_device)
    sources = [resolve_input(str(i)) for i in opts.inputs]
    model_name = resolve_model(opts.model) if model is None else getattr(model.config, "name_or_path", "")
    options = {"format": FORMAT, "inputs": [s.fingerprint() for s in sources], "model": model_name,
               "sampling": asdict(sampling), "batch_size": batch_size, "max_length": opts.max_length,
               "max_samples": opts.max_samples, "dtype": opts.dtype, "engine": name}
    if model is not None:
        options["model_params"] = sum(p.numel() for p in model.parameters())
    if up_to_date(out.with_name(out.name + ".manifest.json"), sha256_json(options), out):
        typer.echo(f"{out} is up to date (same inputs and options): reusing it", err=True)
        out.with_name(out.name + ".partial").unlink(missing_ok=True)  # a run killed just after writing OUT
        return out

    convs, log = _read_conversations(sources, opts.max_samples, opts.inputs)
    model, tokenizer = generator_target(name, model_name if model is None else model, tokenizer, opts.dtype,
                                        opts.device, opts.trust_remote_code)

    def rewrite(todo: list[int], save: Any) -> None:
        def work(gen: Any) -> None:
            if opts.preflight:
                from eyas.generate.preflight import preflight_generator

                preflight_generator(gen, model, convs, trust_remote_code=opts.trust_remote_code,
                                    log=lambda msg: typer.echo(msg, err=True))
            gen.run(convs, batch_size, todo, sampling.seed, save)

        run_generator(name, model, tokenizer, sampling, opts.max_length, work,
                      fallback=opts.engine == "auto", window=opts.window, kv_cache_gb=opts.kv_cache_gb,
                      tp=opts.tp, dtype=opts.dtype, trust_remote_code=opts.trust_remote_code)

    return _run(out, options, len(convs), rewrite, opts.max_time, on_batch, skipped=dict(log.counts))


def _read_conversations(sources: list[Source], max_samples: int,
                        inputs: list[str]) -> tuple[list[list[dict]], SkipLog]:
    """The first `max_samples` (0: all) usable conversations of `sources`, and a log of the skipped ones."""
    log = SkipLog()
    convs: list[list[dict]] = []
    for s in sources:
        for row in s.rows():
            if row.skip:
                log.add(row.skip, row.where, row.detail)
            else:
                convs.append(row.messages)
            if max_samples and len(convs) >= max_samples:
                return convs, log
    if not convs:
        raise EyasError(f"no usable conversation in {', '.join(map(str, inputs))}" +
                        ("; skipped: " + "; ".join(log.lines()) if log.total else ""))
    return convs, log


class _OutOfTime(Exception):
    """--max-time passed: stop generating, keep what is saved."""


def _run(out: Path, options: dict, num_convs: int, rewrite: Any, max_time: float, on_batch: Any,
         skipped: dict) -> Path:
    """Run `rewrite(todo, save)` over the batches OUT.partial does not hold yet, appending each one saved;
    then write OUT from every finished batch, and its manifest (up to date only when all are finished)."""
    options_sha, nbatches = sha256_json(options), -(-num_convs // options["batch_size"])
    partial = PartialLog(out.with_name(out.name + ".partial"), options_sha)
    if partial.stale:
        typer.echo(f"{partial.path} holds batches of a run with other inputs or options: starting over", err=True)
    done = {int(r["batch"]): r for r in partial.records}
    if done:
        typer.echo(f"resuming: {len(done)}/{nbatches} batches already done in {partial.path}", err=True)
    stats = Stats()
    t0 = time.perf_counter()
    with progress_bar() as progress, partial:
        task = progress.add_task("regenerate", total=num_convs, tokens=0, info="")
        progress.update(task, completed=sum(len(r["conversations"]) for r in done.values()))

        def save(b: int, new: list, st: dict) -> None:
            rec = {"batch": b, "conversations": new, "stats": st}
            partial.append(rec)
            done[b] = rec
            stats.add(st)
            progress.update(task, advance=len(new), tokens=stats.tokens)
            if on_batch is not None:
                on_batch(b)
            if max_time and time.perf_counter() - t0 >= max_time and len(done) < nbatches:
                raise _OutOfTime

        todo = [b for b in range(nbatches) if b not in done]
        try:
            if todo:
                rewrite(todo, save)
        except _OutOfTime:
            pass
    dt, complete = time.perf_counter() - t0, len(done) == nbatches
    total = Stats()
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for b in sorted(done):
            total.add(done[b]["stats"])
            for c in done[b]["conversations"]:
                if c is not None:
                    f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
                    total.conversations += 1
    # a run cut by --max-time is not up to date (no options_sha256): the same command resumes it
    atomic_write_json(out.with_name(out.name + ".manifest.json"), {
        "format": FORMAT, "options_sha256": options_sha if complete else None, **options, "complete": complete,
        "batches_done": len(done), "batches": nbatches, "stats": asdict(total), "skipped_inputs": skipped})
    if complete:
        partial.remove()
    else:
        typer.echo(f"stopped by --max-time {max_time:g}s after {len(done)}/{nbatches} batches: {out} holds those; "
                   f"the same command resumes from {partial.path}", err=True)
    typer.echo(f"regenerated {total.turns:,} turns of {total.conversations:,} conversations into {out}: "
               f"{stats.tokens:,} new tokens in {dt:.1f}s ({stats.tokens / max(dt, 1e-9):,.0f} tok/s); "
               f"{total.unfinished} replies hit --max-new-tokens, {total.truncated} conversations cut at "
               f"--max-length, {total.dropped} dropped", err=True)
    return out


cli = cli_command(RegenerateOptions, run_regenerate)
