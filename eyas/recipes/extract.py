"""Run the target over a prepared dataset and store its hidden states (aux layers + final) for training.

The store (sharded safetensors + manifest.json with per-shard sha256) is written into OUT.partial/
and renamed to OUT when complete. A killed run resumes where it stopped when the same command is
run again; a run with the same inputs and options reuses a finished store. Before it starts it
prints the disk it needs and refuses when free space is short.

Under torchrun every rank extracts a disjoint share of the shards into the same store (which must
be on a shared filesystem across nodes) and rank 0 writes the one manifest:

    torchrun --nproc-per-node 8 -m eyas.cli extract --prepared data/prepared --out data/hidden
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import typer

from eyas.assets import TARGET_FORMS
from eyas.data.target_match import check_prepared_matches_target
from eyas.engines.base import TargetEngine, group_batches
from eyas.model.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from eyas.store import (
    FORMAT,
    HiddenStore,
    ShardBuffer,
    ShardSpec,
    StoreMeta,
    StoreWriter,
    check_disk_for,
    finish_partial,
    finished_partial,
    load_shard_specs,
    partial_dir,
    prepare_partial,
    quantize_fp8,
    split_shards,
    verify_store,
)
from eyas.utils.io import (
    EyasError,
    check_output,
    has_manifest,
    human_bytes,
    read_json,
    sha256_file,
    sha256_json,
    writer_lock,
)
from eyas.utils.progress import progress_bar
from eyas.utils.resume import up_to_date
from eyas.utils.schema import cli_command, option

# ---------------------------------------------------------------------------------------------
# distributed: plain torchrun env vars; a gloo group only for barriers (no tensors move between ranks)
# ---------------------------------------------------------------------------------------------


class Ranks:
    """This process' place under torchrun (rank 0 of 1 without it)."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.group = None
        if self.world > 1:
            import torch.distributed as dist

            if torch.cuda.is_available():  # else every rank's pinned buffers would live in GPU 0's context
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=timedelta(hours=48))
                self.group = None
            elif dist.get_backend() != "gloo":
                self.group = dist.new_group(backend="gloo", timeout=timedelta(hours=48))

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            typer.echo(msg, err=True)


# ---------------------------------------------------------------------------------------------
# target facts from its config (no weights loaded: an up-to-date store is reused in a second)
# ---------------------------------------------------------------------------------------------


def target_facts(model: str | Any, aux_layer_ids: list[int] | None, trust_remote_code: bool = False) -> dict:
    from eyas.model.config import target_config_sha256

    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise EyasError(f"cannot read the config of target '{model}': {e}") from e
    else:
        config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(text.num_hidden_layers)
    ids = check_aux_layer_ids(default_aux_layer_ids(n) if aux_layer_ids is None else aux_layer_ids, n,
                              captured=True)
    return {"config": config, "num_layers": n, "aux_layer_ids": ids, "hidden_size": int(text.hidden_size),
            "config_sha256": target_config_sha256(config)}


# ---------------------------------------------------------------------------------------------
# the pipeline: capture on the device, copy into the shard's host buffer on a side stream,
# write from a thread; the host never waits for the device inside the loop
# ---------------------------------------------------------------------------------------------


def _runs(batch: list[int], cu: list[int], offsets: np.ndarray) -> list[tuple[int, int, int]]:
    """(src_row, dst_row, rows) copies for a batch, merging samples that are contiguous both in the
    flat capture and in the shard (the common case of equal lengths): one copy instead of many."""
    runs: list[list[int]] = []
    for b, local in enumerate(batch):
        src, dst, n = cu[b], int(offsets[local]), cu[b + 1] - cu[b]
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += n
        else:
            runs.append([src, dst, n])
    return [tuple(r) for r in runs]


@torch.no_grad()
def fill_shard(engine: TargetEngine, buf: ShardBuffer, seqs: list[torch.Tensor], token_budget: int, fp8: bool,
               copy_stream: Any = None, on_batch: Callable[[int, int], None] | None = None,
               media: list[Any] | None = None) -> Any:
    """Capture every sample of one shard into `buf` (`media[i]`: sample i's images, for the vision tower).
    Returns a CUDA event marking the copies' end (None on CPU)."""
    k = len(engine.aux_layer_ids)
    cuda = copy_stream is not None
    nonfinite = torch.zeros((), dtype=torch.int64, device=engine.device)
    lengths = [int(s.shape[0]) for s in seqs]
    for batch in group_batches(lengths, token_budget):
        batch_seqs = [seqs[i] for i in batch]
        flat = engine.capture_flat(batch_seqs) if media is None else \
            engine.capture_flat(batch_seqs, [media[i] for i in batch])
        aux, final = flat.aux, flat.final  # [N, k*H], [N, H] on the engine's device
        nonfinite += (~torch.isfinite(final)).sum() + (~torch.isfinite(aux)).sum()
        if fp8:
            aux, aux_s = quantize_fp8(aux, k)
            final, final_s = quantize_fp8(final, 1)
            pairs = [(aux, buf.aux), (final, buf.final), (aux_s, buf.aux_scale), (final_s, buf.final_scale)]
        else:
            pairs = [(aux.to(torch.bfloat16), buf.aux), (final.to(torch.bfloat16), buf.final)]
        runs = _runs(batch, flat.cu_seqlens, buf.offsets)
        if cuda:
            copy_stream.wait_stream(torch.cuda.current_stream(engine.device))
            with torch.cuda.stream(copy_stream):
                for src, dst in pairs:
                    for a, o, n in runs:
                        dst[o:o + n].copy_(src[a:a + n], non_blocking=True)
                    src.record_stream(copy_stream)  # keep the allocator off it until the copy ran
        else:
            for src, dst in pairs:
                for a, o, n in runs:
                    dst[o:o + n].copy_(src[a:a + n])
        if on_batch is not None:
            on_batch(len(batch), flat.cu_seqlens[-1])
    if not cuda:
        buf.nonfinite.copy_(nonfinite)
        return None
    copy_stream.wait_stream(torch.cuda.current_stream(engine.device))
    with torch.cuda.stream(copy_stream):
        buf.nonfinite.copy_(nonfinite.reshape(1), non_blocking=True)
        nonfinite.record_stream(copy_stream)
    event = torch.cuda.Event(blocking=True)  # the writer thread sleeps on it instead of spinning a core
    event.record(copy_stream)
    return event


def extract_shards(engine: TargetEngine, dataset: Any, writer: StoreWriter, shards: list[ShardSpec],
                   token_budget: int, progress: Any = None, task: Any = None) -> int:
    """Fill and submit `shards` in order; returns the number of tokens captured."""
    fp8 = writer.meta.fp8
    copy_stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
    tokens = 0

    def on_batch(samples: int, ntok: int) -> None:
        nonlocal tokens
        tokens += ntok
        if progress is not None:
            progress.update(task, advance=samples, tokens=tokens)

    for shard in shards:
        buf = writer.acquire(shard)
        items = [dataset[i] for i in range(shard.first_sample, shard.first_sample + shard.num_samples)]
        seqs = [it["input_ids"] for it in items]
        if sum(int(s.shape[0]) for s in seqs) != shard.num_tokens:
            raise EyasError(f"samples {shard.first_sample}.. of the prepared dataset changed length since the plan "
                            f"in {writer.partial} was made: delete that folder and rerun")
        n = shard.num_tokens
        buf.input_ids[:n] = torch.cat(seqs).to(torch.int32)
        buf.loss_mask[:n] = torch.cat([it["loss_mask"] for it in items]).to(torch.uint8)
        media = [dataset.media(i) for i in range(shard.first_sample, shard.first_sample + shard.num_samples)] \
            if getattr(dataset, "has_media", False) else None
        ready = fill_shard(engine, buf, seqs, token_budget, fp8, copy_stream, on_batch, media)
        writer.submit(buf, ready)
    return tokens


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------


def default_token_budget(device: torch.device, hidden_size: int) -> int:
    """16k tokens per forward for an 8B-sized target on a GPU; more for small targets, which would
    otherwise spend their time launching kernels; 4k on a CPU."""
    if device.type != "cuda":
        return 4096
    return min(65536, 16384 * max(1, 4096 // max(1, hidden_size)))


@dataclass(kw_only=True)
class ExtractOptions:
    """`eyas extract`'s options: the command line and the `extract:` section of an `eyas run` config."""

    prepared: Path | None = option(None, help="Prepared dataset folder (from `eyas prepare`).")
    out: Path = option(help="Store folder to write (OUT.partial/ holds an unfinished run).")
    model: str = option("smollm2", help=f"Target: {TARGET_FORMS}.")
    engine: Literal["hf", "vllm"] = option("hf", help="What runs the target: hf (transformers in this process) or "
                                           "vllm (tensor parallel with --tp).")
    aux_layer_ids: list[int] | None = option(None, comma=True, flag="--aux-layers",
                                             show_default="2,N//2,N-3",
                                             help="Aux layer ids in layer order (id k = input of decoder layer k).")
    dtype: str = option("auto", help="Compute dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float32. States are "
                        "stored as bfloat16 (or fp8).")
    token_budget: int = option(0, help="Padded tokens per forward batch; 0 = 16384 on GPU (up to 65536 for small "
                               "targets), 4096 on CPU.")
    max_samples: int = option(0, help="Extract only the first N samples; 0 = all.")
    verify: bool = option(False, help="Check every shard's sha256 against the manifest (alone, with just --out, or "
                          "after extracting).")
    fp8: bool = option(False, help="Store float8_e4m3fn with per-token scales (half the disk).")
    compile: bool | None = option(None, show_default="on for a GPU target on one device", help="torch.compile the "
                                  "target's decoder layers (hf engine): fused norms, rotary and activations, after a "
                                  "one-off compile. A target that does not compile runs uncompiled, with a warning.")
    tp: int = option(1, help="Tensor-parallel GPUs (vllm engine).")
    device: str = option("auto", help="auto (this rank's GPU, else CPU), cpu, cuda:N.")
    device_map: str | None = option(None, help="`auto` spreads a large target over this node's GPUs (hf engine).",
                                    show_default="none")
    shard_mb: float = option(512, help="Target shard size in MiB.")
    kv_cache_gib: float = option(0, help="Memory for vLLM's KV cache in GiB (vllm engine); 0 = on a GPU vLLM's "
                                 "default share of its memory, on a CPU the VLLM_CPU_KVCACHE_SPACE environment "
                                 "variable, else 4 GiB but at most a quarter of the free memory. Lower it when vLLM "
                                 "cannot allocate its cache.")
    trust_remote_code: bool = option(False, help="Let transformers / vLLM run the model repository's code.")
    allow_missing_weights: bool = option(False, help="Load a target whose checkpoint lacks some of its model's weights "
                                         "(the hf engine fills them with random values, vLLM leaves them "
                                         "uninitialized); without it that is an error naming them.")
    preflight: bool = option(True, help="First run a few samples alone and batched and check the states against a "
                             "plain transformers forward (aux ids, pre-norm final state, batch invariance, tensor-"
                             "parallel replies, NaN/inf); stop naming the fault. Costs seconds.")

    def __post_init__(self) -> None:
        if self.token_budget < 0 or self.max_samples < 0 or self.tp < 1 or self.shard_mb <= 0 or self.kv_cache_gib < 0:
            raise EyasError("--token-budget, --max-samples and --kv-cache-gib must be >= 0, --tp >= 1 and "
                            "--shard-mb > 0")
        if self.kv_cache_gib and self.engine != "vllm":
            raise EyasError("--kv-cache-gib sizes vLLM's KV cache: it needs --engine vllm")
        if (self.device_map is not None or self.compile is True) and self.engine != "hf":
            raise EyasError("--device-map and --compile are for the hf engine; vLLM spreads a target with --tp "
                            "and compiles it itself")


def run_extract(opts: ExtractOptions, *, dataset: Any = None, engine_obj: TargetEngine | None = None,
                on_shard: Callable[[ShardSpec], None] | None = None, stats: dict | None = None) -> Path:
    """Extract hidden states into the store at `opts.out` (or reuse an up-to-date one). Returns it.

    `dataset` (anything with len, .lengths and [i] -> {input_ids, loss_mask}) overrides reading
    `opts.prepared`; `engine_obj` overrides building an engine (and decides the target and layers);
    `on_shard` is called after each shard is on disk (tests use it to simulate a crash); `stats`
    receives this rank's tokens, seconds (first batch to last shard on disk), bytes written and total
    seconds (benchmarks read it). One writer per store: a second one gets an error naming this one.
    """
    def store(p: Path) -> bool:
        return has_manifest(p / "manifest.json", FORMAT)

    check_output(opts.out, "extract", store)
    check_output(partial_dir(opts.out), "extract", lambda p: store(p) or (p / "plan.json").is_file(),
                 name=f"--out {opts.out}: its work folder")  # a killed run's shards, resumed from there
    with writer_lock(opts.out, "extract"):
        return _run_extract(opts, dataset, engine_obj, on_shard, stats)


def _run_extract(opts: ExtractOptions, dataset: Any, engine_obj: TargetEngine | None,
                 on_shard: Callable[[ShardSpec], None] | None, stats: dict | None) -> Path:
    t_start = time.perf_counter()
    out, ranks = Path(opts.out), Ranks()
    dataset = dataset if dataset is not None else _open_prepared(opts.prepared)
    meta, lengths = lay_out_store(opts, dataset, engine_obj)
    if up_to_date(out / "manifest.json", meta.options_sha256):
        ranks.log(f"store {out} is up to date (same inputs and options): reusing it")
        return out
    if finished_partial(out, meta.options_sha256):  # a run killed between its manifest and its rename
        ranks.barrier()  # every rank looked before rank 0 renames
        if ranks.rank == 0:
            finish_partial(out)
            ranks.log(f"store {out}: finished the interrupted run's last step")
        ranks.barrier()
        return out
    if ranks.rank == 0:
        plan = prepare_partial(out, meta, split_shards(lengths, meta.bytes_per_token(),
                                                      max(1, int(opts.shard_mb * (1 << 20))), ranks.world))
    ranks.barrier()
    if ranks.rank != 0:
        plan = load_shard_specs(out)
    # the engine: built after the cheap checks, so a bad option fails in a second, not after loading 100 GB
    eng = engine_obj or _load_engine(opts, meta.aux_layer_ids)
    ranks.log(compute_note(eng, opts))
    if opts.preflight:
        from eyas.engines.preflight import preflight_engine, preflight_inputs

        seqs, media = preflight_inputs(dataset)
        preflight_engine(eng, seqs, media=media, trust_remote_code=opts.trust_remote_code,
                         allow_missing_weights=opts.allow_missing_weights, log=ranks.log)
    tokens, dt, writer = _extract(opts, eng, dataset, meta, lengths, plan, ranks, on_shard)
    ranks.barrier()
    if ranks.rank == 0:
        head = eng.target_head()
        meta.norm_eps, meta.norm_offset, meta.embed_scale = head.norm_eps, head.norm_offset, head.embed_scale
        meta.vocab_size = head.vocab_size
        writer.finalize(head)
        ranks.log(f"store {out}: {len(lengths)} samples, {int(lengths.sum()):,} tokens, {len(plan)} shards")
    ranks.barrier()
    if engine_obj is None:
        eng.close()
    if stats is not None:
        stats.update(tokens=tokens, seconds=dt, bytes=writer.bytes_written,
                     total_seconds=time.perf_counter() - t_start)
    return out


def compute_note(eng: TargetEngine, opts: ExtractOptions) -> str:
    """What the target computes in and where, as train and eval say theirs: --dtype and --device resolved."""
    dtype = str(getattr(eng, "dtype", opts.dtype)).removeprefix("torch.")
    if eng.name == "vllm":  # vLLM's workers compute; captures come back to this process
        where = f"{'cuda' if torch.cuda.is_available() else 'cpu'} (vLLM, tensor parallel {eng.tp})"
    elif opts.device_map is not None:
        where = f"the devices --device-map {opts.device_map} chose"
    else:
        where = str(eng.device)
    return f"extracting with the {eng.name} engine: the target computes in {dtype} on {where}"


def _open_prepared(prepared: Path | None) -> Any:
    if prepared is None:
        raise EyasError("give --prepared DIR (the output of `eyas prepare`) to extract from")
    from eyas.data.prepared import PreparedDataset

    return PreparedDataset(prepared)


def lay_out_store(opts: ExtractOptions, dataset: Any, engine_obj: TargetEngine | None) -> tuple[StoreMeta, np.ndarray]:
    """The store's metadata and fingerprint, and the lengths of the samples it will hold: everything
    that decides whether an existing store is up to date, from configs only (no weights loaded)."""
    from eyas.assets import resolve_model

    mfile = Path(opts.prepared) / "manifest.json" if opts.prepared else None
    prepared_sha = sha256_file(mfile) if mfile is not None and mfile.is_file() else sha256_json(
        np.asarray(dataset.lengths).tolist())
    if engine_obj is not None:  # an engine built by the caller decides the target and the layers
        target_name = getattr(engine_obj, "model_name", opts.model)
        facts = target_facts(engine_obj.model, engine_obj.aux_layer_ids, opts.trust_remote_code)
    else:
        target_name = resolve_model(opts.model)
        facts = target_facts(target_name, opts.aux_layer_ids, opts.trust_remote_code)
        if mfile is not None and mfile.is_file():
            check_prepared_matches_target(read_json(mfile), opts.prepared, target_name, opts.trust_remote_code)
    n = len(dataset) if not opts.max_samples else min(opts.max_samples, len(dataset))
    if n == 0:
        raise EyasError(f"{opts.prepared}: the prepared dataset has no samples")
    store_dtype = "float8_e4m3fn" if opts.fp8 else "bfloat16"
    options = {"prepared_sha256": prepared_sha, "target": target_name, "target_config_sha256": facts["config_sha256"],
               "aux_layer_ids": facts["aux_layer_ids"], "dtype": store_dtype, "compute_dtype": str(opts.dtype),
               "num_samples": n, "engine": opts.engine, "shard_mb": float(opts.shard_mb)}
    text = facts["config"].get_text_config() if hasattr(facts["config"], "get_text_config") else facts["config"]
    meta = StoreMeta(target=target_name, target_config_sha256=facts["config_sha256"], num_layers=facts["num_layers"],
                     aux_layer_ids=facts["aux_layer_ids"], hidden_size=facts["hidden_size"],
                     vocab_size=int(getattr(text, "vocab_size", 0)), dtype=store_dtype,
                     prepared=str(Path(opts.prepared).resolve()) if opts.prepared else "",
                     prepared_sha256=prepared_sha, norm_eps=0.0, options_sha256=sha256_json(options))
    return meta, np.asarray(dataset.lengths, dtype=np.int64)[:n]


def _load_engine(opts: ExtractOptions, aux_layer_ids: list[int]) -> TargetEngine:
    from eyas.assets import resolve_model
    from eyas.engines import load_engine
    from eyas.utils.devices import resolve_device

    kw: dict[str, Any] = {"trust_remote_code": opts.trust_remote_code,
                          "allow_missing_weights": opts.allow_missing_weights}
    if opts.engine == "hf":
        compiled = opts.compile
        if compiled is None:  # worth it where kernels are fast enough for the fusing to show: a GPU
            compiled = opts.device_map is None and resolve_device(opts.device).type == "cuda"
        kw.update(device_map=opts.device_map, compile=compiled)
    elif opts.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(opts.kv_cache_gib * (1 << 30))
    return load_engine(opts.engine, resolve_model(opts.model), aux_layer_ids=aux_layer_ids, dtype=opts.dtype,
                       device=opts.device, tp=opts.tp, **kw)


def _extract(opts: ExtractOptions, eng: TargetEngine, dataset: Any, meta: StoreMeta, lengths: np.ndarray,
             plan: list[ShardSpec], ranks: Ranks, on_shard: Any) -> tuple[int, float, StoreWriter]:
    """Write this rank's shards; returns (tokens, seconds, the writer). Finished shards survive a crash."""
    out = Path(opts.out)
    device = getattr(eng, "device", torch.device("cpu"))
    budget = opts.token_budget or default_token_budget(device, meta.hidden_size)
    writer = StoreWriter(out, meta, lengths, plan, ranks.rank, ranks.world, pin=device.type == "cuda",
                         on_shard=on_shard)
    try:
        if ranks.rank == 0:
            check_disk_for(writer, ranks.log)
        todo = writer.todo()
        done_before = sum(1 for s in plan if writer.done(s))
        if done_before:
            ranks.log(f"resuming: {done_before}/{len(plan)} shards already written in {partial_dir(out)}")
        t0 = time.perf_counter()
        with progress_bar() as progress:
            task = progress.add_task(f"extract[{ranks.rank}]" if ranks.world > 1 else "extract",
                                     total=sum(s.num_samples for s in todo), tokens=0, info="")
            tokens = extract_shards(eng, dataset, writer, todo, budget, progress, task)
            progress.update(task, info="writing")
            writer.close()
        dt = time.perf_counter() - t0
    except BaseException:
        writer.abort()  # finished shards stay in OUT.partial for the resume
        raise
    typer.echo(f"rank {ranks.rank}: {tokens:,} tokens in {dt:.1f}s ({tokens / max(dt, 1e-9):,.0f} tok/s), "
               f"{human_bytes(writer.bytes_written)} written", err=True)
    return tokens, dt, writer


def run_extract_command(opts: ExtractOptions) -> None:
    """The command: extract (with --prepared), then check the store's checksums (with --verify)."""
    if opts.prepared is not None:
        run_extract(opts)
    elif not opts.verify:
        raise EyasError("give --prepared DIR to extract (or --verify to check an existing store at --out)")
    if opts.verify and int(os.environ.get("RANK", "0")) == 0:
        out = Path(opts.out)
        if not (out / "manifest.json").is_file():
            raise EyasError(f"{out}/manifest.json not found: nothing to verify")
        checked = verify_store(out)
        store = HiddenStore(out)
        typer.echo(f"store {out}: {checked} files OK ({len(store)} samples, {store.num_tokens:,} tokens)", err=True)


cli = cli_command(ExtractOptions, run_extract_command)
