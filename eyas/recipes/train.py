"""Train an EAGLE-3 draft model with training-time test (TTT).

Offline, from the hidden states `eyas extract` stored:   eyas train --store STORE --out OUT
Online, the target runs in the loop (no states on disk): eyas train --prepared DATA --online --model TARGET --out OUT
Several GPUs: torchrun --nproc_per_node 8 -m eyas.cli train ... [--fsdp]

OUT/draft is the draft checkpoint (for `eyas export` / `eyas eval`); OUT/metrics.jsonl has loss,
per-step accuracy and tau_sim; OUT/train_state/ holds checkpoints for --resume.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import typer

from eyas.utils.io import EyasError, atomic_write_json, fingerprint_path, read_json, sha256_json


def _target_config(name: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise EyasError(f"cannot read the target's config from '{name}' ({e}). The draft copies the target's shape "
                        "and rope: pass --model with the target's transformers folder or cached hub id.") from e


def run_train(
    out: str | os.PathLike,
    store: str | os.PathLike | None = None,
    prepared: str | os.PathLike | None = None,
    online: bool = False,
    model: str | None = None,
    draft_vocab_size: int = 32000,
    draft_intermediate_size: int = 0,
    draft_layers: int = 1,
    fc_norm: bool = False,
    norm_output: bool = False,
    aux_layer_ids: list[int] | None = None,
    engine: str = "hf",
    target_dtype: str = "auto",
    resume: bool = False,
    init_draft: str | os.PathLike | None = None,
    init_head: bool = False,
    stop_after: int = 0,
    engine_obj: Any = None,
    log: Any = None,
    **train_options: Any,
) -> dict[str, Any]:
    """Train and write OUT/draft. `train_options` are eyas.train.trainer.TrainConfig fields.
    `init_draft`: start from that draft's weights and vocabulary (any layout eyas imports) instead of
    fresh ones; `init_head`: a fresh draft's lm_head starts as the target's head over the draft vocabulary;
    `stop_after` ends the run after that many optimizer steps as if it were killed (tests);
    `engine_obj` is an already built target engine for online training; `draft_intermediate_size` widens
    (or narrows) the draft's MLP, 0 = the target's; `draft_layers` is its number of decoder layers;
    `fc_norm` and `norm_output` are EAGLE-3.1's switches (eyas.model.draft)."""
    from eyas.model.config import DraftConfig, target_config_sha256
    from eyas.model.draft import Eagle3Draft
    from eyas.model.vocab import build_draft_vocab
    from eyas.train import distributed as D
    from eyas.train.compile_cache import load_compile_cache
    from eyas.train.data import (
        PackDataset,
        Plan,
        SampleSource,
        fill_states,
        hold_out,
        iterate_batches,
        token_counts,
    )
    from eyas.train.trainer import (
        BEST_DRAFT,
        MetricsLog,
        TrainConfig,
        Trainer,
        latest_checkpoint,
        load_checkpoint,
        run_loop,
        save_checkpoint,
        save_draft,
    )

    cfg = TrainConfig(**train_options)
    if cfg.max_time < 0:
        raise EyasError(f"--max-time must be >= 0 seconds (0 = no limit), got {cfg.max_time:g}")
    if cfg.label_temperature < 0:
        raise EyasError(f"--label-temperature must be >= 0 (1 = the target's distribution, 0 = its argmax), "
                        f"got {cfg.label_temperature:g}")
    if cfg.reply_start_weight <= 0 or cfg.reply_start_tokens < 1:
        raise EyasError(f"--reply-start-weight must be > 0 and --reply-start-tokens >= 1, got "
                        f"{cfg.reply_start_weight:g} and {cfg.reply_start_tokens}")
    if draft_intermediate_size < 0:
        raise EyasError(f"--draft-intermediate-size must be >= 0 (0 = the target's), got {draft_intermediate_size}")
    if draft_layers < 1:
        raise EyasError(f"--draft-layers must be >= 1, got {draft_layers}")
    if init_head and init_draft is not None:
        raise EyasError("--init-head starts a fresh draft's lm_head from the target's; --init-draft brings a trained "
                        "lm_head already: drop one of them")
    out = Path(out)
    info = D.init_distributed(cfg.device)
    say = log or (lambda msg: typer.echo(msg, err=True) if info.is_main else None)
    if (store is None) == (prepared is None):
        raise EyasError("give exactly one of --store (offline) or --prepared (with --online)")
    if prepared is not None and not online:
        raise EyasError("--prepared trains online, with the target in the loop: add --online --model TARGET "
                        "(or run `eyas extract` and train with --store)")

    eng = None
    if store is not None:
        from eyas.store import HiddenStore

        st = HiddenStore(store, aux_layer_ids)
        manifest = st.manifest
        lengths = st.lengths
        source_id = {"store": manifest.get("options_sha256"), "num_tokens": manifest["num_tokens"]}
        from eyas.assets import resolve_model

        target_name = resolve_model(model) if model else manifest["target"]
        aux_ids = st.aux_layer_ids
        head = st.target_head()
        target_cfg = _target_config(target_name)
        if manifest.get("target_config_sha256") and target_config_sha256(target_cfg) != manifest["target_config_sha256"]:
            raise EyasError(f"the target config of '{target_name}' differs from the one the store {store} was extracted "
                            f"with ({manifest['target']}): pass --model with that target")
        source, kind, counts_path = SampleSource(store, "store", aux_ids), "store", Path(store)
    else:
        from eyas.assets import resolve_model
        from eyas.data.prepared import PreparedDataset

        ds = PreparedDataset(prepared)
        lengths = ds.lengths
        if engine_obj is not None:
            eng = engine_obj
            target_name = getattr(eng, "model_name", str(model))
        else:
            if not model:
                raise EyasError("--online needs --model TARGET (a transformers folder or cached hub id)")
            from eyas.engines import load_engine

            target_name = resolve_model(model)
            eng = load_engine(engine, target_name, aux_layer_ids=aux_layer_ids, dtype=target_dtype,
                              device=str(info.device))
        aux_ids = list(eng.aux_layer_ids)
        head = eng.target_head()
        target_cfg = getattr(eng, "config", None) or _target_config(target_name)
        source_id = {"prepared": ds.manifest.get("options_sha256"), "num_tokens": ds.num_tokens,
                     "target": target_name}
        source, kind, counts_path = SampleSource(prepared, "prepared"), "prepared", Path(prepared)

    dcfg = DraftConfig.from_target_config(target_cfg, aux_ids, draft_vocab_size, target=str(target_name))
    if draft_intermediate_size:
        dcfg.intermediate_size = draft_intermediate_size
    dcfg.num_hidden_layers = draft_layers
    dcfg.fc_norm, dcfg.norm_output = fc_norm, norm_output
    if dcfg.vocab_size != head.vocab_size:
        dcfg.vocab_size = head.vocab_size  # the lm_head's rows are what the target predicts over
        dcfg.draft_vocab_size = min(dcfg.draft_vocab_size, dcfg.vocab_size)
    init = None
    if init_draft is not None:
        init = _load_init_draft(Path(init_draft), dcfg, target_name)
        if init.config.draft_vocab_size != dcfg.draft_vocab_size:
            say(f"--init-draft: keeping its draft vocabulary of {init.config.draft_vocab_size:,} tokens "
                f"(--draft-vocab-size {dcfg.draft_vocab_size:,} applies to fresh drafts)")
        dcfg.draft_vocab_size = init.config.draft_vocab_size
    budget = cfg.resolved_budget(info.device)
    cfg.token_budget = budget
    train_ids, val_ids = hold_out(len(lengths), cfg.val_samples, cfg.seed)  # (the vocabulary still counts all)
    plan = Plan.over(lengths, train_ids, budget=budget, seed=cfg.seed, world=info.world, grad_accum=cfg.grad_accum)
    steps_per_epoch = plan.steps_per_epoch()
    if steps_per_epoch == 0 and not cfg.max_steps:
        raise EyasError(f"{len(lengths)} samples make {len(plan.packs(0))} packs of {budget} tokens: fewer than one "
                        f"optimizer step needs ({info.world} rank(s) x {cfg.grad_accum} accumulation). Lower "
                        "--token-budget or --grad-accum, or use more data")
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    # Fields added to DraftConfig after runs existed count only when set away from their default, so
    # those runs keep the fingerprint they had.
    added_later = {"num_hidden_layers": 1, "fc_norm": False, "norm_output": False}
    draft_opts = {k: v for k, v in dcfg.to_dict().items()
                  if k != "extra" and not (k in added_later and v == added_later[k])}
    options = {"source": source_id, "draft": draft_opts,
               "train": cfg.schedule_options(), "world": info.world, "kind": kind}
    if init is not None:  # (only then: runs without it keep the fingerprint they had)
        options["init"] = fingerprint_path(init_draft)
    if init_head:  # (likewise)
        options["init_head"] = True
    if cfg.val_samples:  # (likewise)
        options["val_samples"] = cfg.val_samples
    options_sha = sha256_json(options)
    mpath = out / "manifest.json"
    if mpath.is_file() and read_json(mpath).get("options_sha256") == options_sha and (out / "draft").is_dir():
        say(f"{out} is up to date (same inputs and options): reusing it")
        return read_json(mpath)

    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    if init is not None:
        draft.load_state_dict(init.state_dict())
    else:
        draft.set_vocab(*build_draft_vocab(token_counts(counts_path, kind, dcfg.vocab_size), dcfg.draft_vocab_size))
        if init_head:
            draft.init_lm_head_from_target(head.lm_head, head.norm_weight, head.norm_offset)
    draft.load_target_embedding(head.embed_tokens, head.embed_scale)
    trainer = Trainer(cfg, draft, head, info, total)
    del head  # the trainer keeps what it needs on the device

    root = out / "train_state"
    progress: dict[str, Any] = {"epoch": 0, "step_in_epoch": 0, "tokens": 0, "options_sha256": options_sha}
    ckpt = latest_checkpoint(root) if resume else None
    if ckpt is not None:
        saved = read_json(ckpt / "progress.json")
        if saved.get("options_sha256") != options_sha:
            raise EyasError(f"{ckpt} was written by a run with other data or options: resume needs the same command "
                            "(or drop --resume to start over)")
        progress = load_checkpoint(trainer, ckpt)
        say(f"resuming from {ckpt} (step {trainer.step}/{total})")
        if trainer.compiled:
            note = load_compile_cache(root)
            if note:
                say(note)
    elif info.is_main and root.exists():
        import shutil

        if resume:
            say(f"--resume: no checkpoint in {root}; starting from scratch")
        shutil.rmtree(root, ignore_errors=True)
    D.barrier()
    progress["start"] = trainer.step
    out.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(out, cfg.report_to, trainer.step if ckpt else None, options) if info.is_main else None
    say(f"training a draft for {target_name}: {sum(p.numel() for p in draft.parameters() if p.requires_grad):,} "
        f"trainable parameters, {total} steps of {info.world} x {cfg.grad_accum} x {budget} tokens, "
        f"{trainer.mode} on {info.device}")
    pad_to = budget if info.device.type == "cuda" or trainer.compiled else None  # one shape: graphs, kernels
    batches = iterate_batches(source, plan, info.rank, progress["epoch"], progress["step_in_epoch"],
                              num_workers=cfg.num_workers, pin=info.device.type == "cuda", pad_to=pad_to,
                              states=eng is None, embed_table=trainer.embed_table)
    validate = None
    if len(val_ids):
        held_out = PackDataset(source, Plan.over(lengths, val_ids, budget=budget, seed=cfg.seed, world=1, grad_accum=1,
                                                 shuffle=False).packs(0), budget, pad_to, eng is None,
                               trainer.embed_table)

        def validate() -> dict[str, Any]:
            rows = (held_out[k] for k in range(len(held_out)))
            return trainer.evaluate(rows if eng is None else (fill_states(b, eng) for b in rows))

    t0 = time.perf_counter()
    try:
        last = run_loop(trainer, batches, out, total, max(steps_per_epoch, 1), progress, metrics, engine=eng,
                        stop_after=stop_after, log=say, validate=validate)
    finally:
        if metrics is not None:
            metrics.close()
    if stop_after and trainer.step < total:
        return {"stopped_at": trainer.step, "metrics": last}
    timed_out = bool(progress.pop("timed_out", False)) and trainer.step < total
    if cfg.save_every or timed_out:
        save_checkpoint(trainer, root, dict(progress), cfg.keep_checkpoints)
    save_draft(trainer, out / "draft")  # collective under FSDP
    # a run cut by --max-time leaves its draft but is not up to date: a rerun with --resume finishes it
    result = {"format": "eyas.train/1", "options_sha256": None if timed_out else options_sha, "draft": "draft",
              "complete": not timed_out, "steps": trainer.step, "total_steps": total,
              "tokens": progress.get("tokens", 0), "seconds": time.perf_counter() - t0, "final": last,
              "options": options}
    if progress.get("best_val"):
        result["best"] = {"draft": BEST_DRAFT, **progress["best_val"]}
    if info.is_main:
        atomic_write_json(mpath, result)
        say(f"draft saved to {out / 'draft'} ({trainer.step} steps, final loss {last.get('loss', float('nan')):.3f}, "
            f"tau_sim {last.get('tau_sim', float('nan')):.2f})")
        if timed_out:
            say(f"stopped by --max-time {cfg.max_time:g}s after {trainer.step}/{total} steps (the learning rate had not "
                "decayed yet); the same command with --resume finishes the schedule")
    D.barrier()
    if eng is not None and engine_obj is None:
        eng.close()
    return result


def _load_init_draft(path: Path, dcfg: Any, target: str) -> Any:
    """The draft --init-draft names, checked to have the shape this run trains (else a clear error)."""
    from eyas.export.formats import import_draft

    init = import_draft(path, target=target if Path(str(target)).is_dir() else None)
    have, want = init.config, dcfg
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "target_hidden_size", "aux_layer_ids", "fc_norm", "norm_output")
    diff = [f"{f} {getattr(have, f)} (this run: {getattr(want, f)})" for f in fields
            if getattr(have, f) != getattr(want, f)]
    if diff:
        raise EyasError(f"--init-draft {path} does not fit this target and its aux layers: " + "; ".join(diff) +
                        ". Start from a draft trained for the same target (and --aux-layers), or drop --init-draft")
    return init


def cli(
    out: Path = typer.Option(..., "--out", help="Output folder: OUT/draft, OUT/metrics.jsonl, OUT/train_state/."),
    store: Path = typer.Option(None, "--store", help="Hidden-state store from `eyas extract` (offline training)."),
    prepared: Path = typer.Option(None, "--prepared", help="Prepared dataset from `eyas prepare` (with --online)."),
    online: bool = typer.Option(False, "--online", help="Run the target in the loop instead of reading a store. "
                                "[default: off]"),
    model: str = typer.Option(None, "--model", help="Target model folder or cached hub id (online: required; "
                              "offline: defaults to the store's target)."),
    draft_vocab_size: int = typer.Option(32000, "--draft-vocab-size", help="Draft vocabulary: the most frequent "
                                         "trained tokens (capped at the target's vocabulary). [default: 32000]"),
    draft_intermediate_size: int = typer.Option(0, "--draft-intermediate-size", help="Width of the draft layer's MLP; "
                                                "0 = the target's. Wider fits more of the target (the engines read it "
                                                "from the exported config). [default: 0]"),
    draft_layers: int = typer.Option(1, "--draft-layers", help="Decoder layers in the draft: EAGLE-3 has one; "
                                     "later ones are plain Llama layers over the hidden state (vLLM and "
                                     "speculators serve them, SGLang does not). [default: 1]"),
    fc_norm: bool = typer.Option(False, "--fc-norm", help="EAGLE-3.1: an RMSNorm on each aux layer's state before "
                                 "fc, so a late layer's large values do not drown an early one's (vLLM and "
                                 "speculators serve it; SGLang export is refused). With --norm-output it lifted "
                                 "SmolLM2's MT-Bench tau by 6% (docs/benchmarks.md). [default: off]"),
    norm_output: bool = typer.Option(False, "--norm-output", help="EAGLE-3.1: each training-time-test step reads the "
                                     "previous step's final-normed hidden state, not the raw one (vLLM and "
                                     "speculators serve it; SGLang export is refused). [default: off]"),
    ttt_steps: int = typer.Option(7, "--ttt-steps", help="Training-time-test steps. [default: 7]"),
    label_temperature: float = typer.Option(1.0, "--label-temperature", help="The draft learns softmax(target "
                                            "logits / T): 1 = the target's distribution (EAGLE-3), 0 = a one-hot on "
                                            "its argmax, the token greedy verification accepts. On SmolLM2, 0 "
                                            "matched the target's greedy replies 3-5% less often than 1 "
                                            "(docs/benchmarks.md). [default: 1]"),
    reply_start_weight: float = typer.Option(1.0, "--reply-start-weight", help="Loss weight of the first "
                                             "--reply-start-tokens tokens of every reply (1 = all alike, EAGLE-3). "
                                             "Meant for reply starts, where a greedy chain misses most; on SmolLM2, "
                                             "3 and 6 matched the target there 3-4% less often than 1 "
                                             "(docs/benchmarks.md). [default: 1]"),
    reply_start_tokens: int = typer.Option(64, "--reply-start-tokens", help="How many tokens of a reply "
                                           "--reply-start-weight covers. [default: 64]"),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the data. [default: 1]"),
    max_steps: int = typer.Option(0, "--max-steps", help="Optimizer steps; overrides --epochs when > 0. [default: 0]"),
    lr: float = typer.Option(1e-4, "--lr", help="Peak learning rate (AdamW, warmup then cosine to 10%). "
                             "[default: 1e-4]"),
    warmup_ratio: float = typer.Option(0.015, "--warmup-ratio", help="Share of steps spent warming up. "
                                       "[default: 0.015]"),
    token_budget: int = typer.Option(0, "--token-budget", help="Tokens per packed micro-batch (per GPU); 0 = 16384 "
                                     "on GPU, 1024 on CPU (where attention over a packed row is dense, so "
                                     "shorter rows train faster). [default: 0]"),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step. [default: 1]"),
    grad_clip: float = typer.Option(0.5, "--grad-clip", help="Gradient norm clipping. [default: 0.5]"),
    save_every: int = typer.Option(1000, "--save-every", help="Checkpoint every N optimizer steps and at the end "
                                   "(0 = never; then --resume has nothing to resume from). [default: 1000]"),
    max_time: float = typer.Option(0, "--max-time", help="Wall-clock budget in seconds: past it, the run stops at the "
                                   "next log step, saves a checkpoint and writes the draft as it stands (--resume "
                                   "continues it). 0 = none. [default: 0]"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in OUT/train_state. "
                                "[default: off]"),
    init_draft: Path = typer.Option(None, "--init-draft", help="Start from this draft's weights and vocabulary "
                                    "(eyas, vLLM, speculators, SpecForge or EAGLE layout; same target and aux "
                                    "layers) with a fresh optimizer and schedule: fine-tune a draft on new data, or "
                                    "keep training one across machines. [default: none]"),
    init_head: bool = typer.Option(False, "--init-head", help="Start a fresh draft's lm_head from the target's own "
                                   "head (its rows for the draft vocabulary, the final norm folded in) instead of "
                                   "random weights, as speculators does. On SmolLM2 3,500 steps with it gave the "
                                   "MT-Bench tau of 6,000 without (docs/benchmarks.md). [default: off]"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32. [default: auto]"),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard the draft and optimizer with FSDP2 under torchrun "
                              "(default: DDP). [default: off]"),
    attention: str = typer.Option("auto", "--attention", help="TTT attention: auto (flex on GPU), flex, math. "
                                  "[default: auto]"),
    compile_: str = typer.Option("auto", "--compile", help="torch.compile the draft layer: auto (on for GPU), on, off. "
                                 "[default: auto]"),
    cuda_graph: str = typer.Option("auto", "--cuda-graph", help="Replay each optimizer step as one CUDA graph "
                                   "(one GPU, one micro-batch per step): auto (on with --compile), on, off. "
                                   "[default: auto]"),
    val_samples: int = typer.Option(0, "--val-samples", help="Hold this many samples (drawn at random, seeded) out of "
                                    "training and measure the draft on them: loss, per-step accuracy and tau_sim on "
                                    "data it never saw, next to the training figures, and the same over each first "
                                    "reply's first 64 tokens (where a chain on a new prompt stops most, so the figure "
                                    "that follows MT-Bench); the draft of the best validation "
                                    "(held-out tau_sim) is kept in OUT/draft-best. [default: 0 = none]"),
    val_every: int = typer.Option(0, "--val-every", help="Optimizer steps between validations (with --val-samples); "
                                  "0 = only at the end. [default: 0]"),
    log_every: int = typer.Option(10, "--log-every", help="Optimizer steps between log lines. [default: 10]"),
    seed: int = typer.Option(0, "--seed", help="Seed for the draft's init and the data order. [default: 0]"),
    num_workers: int = typer.Option(2, "--num-workers", help="DataLoader worker processes. [default: 2]"),
    report_to: str = typer.Option("auto", "--report-to", help="auto (TensorBoard if installed; W&B if installed and "
                                  "WANDB_PROJECT is set), tensorboard, wandb, none. [default: auto]"),
    aux_layers: str = typer.Option("", "--aux-layers", help="Comma-separated aux layer ids in layer order (id k = "
                                   "input of decoder layer k). Online: the target's layers to capture; offline: "
                                   "some of the store's, to compare choices on one extraction (default: online "
                                   "2,N//2,N-3, offline all of the store's)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda. [default: auto]"),
) -> None:
    for name, value in (("--compile", compile_), ("--cuda-graph", cuda_graph)):
        if value not in ("auto", "on", "off"):
            raise EyasError(f"{name} must be auto, on or off, got '{value}'")
    from eyas.engines.base import parse_layer_ids

    ids = parse_layer_ids(aux_layers)
    try:
        run_train(out, store=store, prepared=prepared, online=online, model=model, draft_vocab_size=draft_vocab_size,
                  draft_intermediate_size=draft_intermediate_size, draft_layers=draft_layers, fc_norm=fc_norm,
                  norm_output=norm_output, aux_layer_ids=ids,
                  resume=resume, init_draft=init_draft, init_head=init_head, ttt_steps=ttt_steps,
                  label_temperature=label_temperature,
                  reply_start_weight=reply_start_weight, reply_start_tokens=reply_start_tokens,
                  epochs=epochs, max_steps=max_steps, lr=lr,
                  warmup_ratio=warmup_ratio, token_budget=token_budget, grad_accum=grad_accum, grad_clip=grad_clip,
                  save_every=save_every, max_time=max_time, val_samples=val_samples, val_every=val_every, dtype=dtype, fsdp=fsdp, attention=attention,
                  compile=None if compile_ == "auto" else compile_ == "on",
                  cuda_graph=None if cuda_graph == "auto" else cuda_graph == "on", log_every=log_every, seed=seed,
                  num_workers=num_workers, report_to=report_to, device=device)
    finally:
        from eyas.train.distributed import cleanup

        cleanup()
