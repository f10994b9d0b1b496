"""Train a draft model of any family (EAGLE-3, DFlash, P-EAGLE, ...) on the target's hidden states.

Offline, from the hidden states `eyas extract` stored:

    eyas train --store STORE --out OUT

Online, with the target in the loop (no states on disk):

    eyas train --prepared DATA --online --model TARGET --out OUT

`--family` picks the draft family (eagle3 by default; eyas.model.family_facts lists them all), and so
the model (eyas.model.families) and the objective (eyas.train.objectives) from the same data.

Several GPUs: `torchrun --nproc-per-node 8 -m eyas.cli train ... [--fsdp]`. OUT/draft is the draft
checkpoint (for `eyas export` and `eyas eval`); OUT/metrics.jsonl has loss, per-step accuracy and
tau_sim; OUT/train_state/ holds checkpoints for --resume.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import typer

from eyas.assets import TARGET_FORMS
from eyas.model.config import MLA_DIMS, DraftConfig, DraftOptions
from eyas.train.config import TrainConfig
from eyas.utils.io import (
    EyasError,
    atomic_write_json,
    check_output,
    fingerprint_path,
    has_manifest,
    read_json,
    sha256_json,
    writer_lock,
)
from eyas.utils.resume import up_to_date
from eyas.utils.schema import cli_command, option, subset

TRAIN_STATE_FORMAT = "eyas.train/2"  # bump when what a checkpoint's fingerprint covers changes


@dataclass(kw_only=True)
class TrainOptions(DraftOptions, TrainConfig):
    """`eyas train`'s options: the command line and the `train:` section of an `eyas run` config."""

    help_panel: ClassVar[str] = "Data, target and output"

    out: Path = option(short="-o", help="Output folder: OUT/draft, OUT/metrics.jsonl, OUT/train_state/.")
    store: Path | None = option(None, help="Hidden-state store from `eyas extract` (offline training).")
    verify_store: bool = option(False, help="Check every store file's sha256 before training, which finds flipped "
                                "bytes; it reads every byte of the store once before the first step. Every "
                                "file's header and size are checked always.")
    prepared: Path | None = option(None, help="Prepared dataset from `eyas prepare` (with --online).")
    online: bool = option(False, help="Run the target in the loop instead of reading a store.")
    model: str | None = option(None, show_default="online: required; offline: the store's target",
                               help=f"Target: {TARGET_FORMS}.")
    engine: Literal["hf", "vllm"] = option("hf", help="What runs the target online: hf (transformers in this "
                                           "process) or vllm (tensor parallel with --tp).")
    tp: int = option(1, help="Online, vllm engine: tensor-parallel GPUs of the target. Under torchrun one target "
                     "per node (in local rank 0) feeds every rank of the node.")
    device_map: str | None = option(None, show_default="none", help="Online, hf engine: `auto` spreads a large "
                                    "target over the target's GPUs (--target-gpus); one per node under torchrun.")
    target_gpus: list[int] | None = option(None, comma=True, show_default="the GPUs after the trainers' (vllm: --tp "
                                           "of them); hf without --device-map: the trainer's",
                                           help="Online: the node's GPUs the target takes (torchrun gives trainer "
                                                "local rank r GPU r), e.g. 2,3,4,5,6,7.")
    target_options: dict[str, Any] = option(default_factory=dict, show_default="none",
                                            help="Online: more target engine options, as JSON (vllm: "
                                                 "gpu_memory_utilization, kv_cache_memory_bytes, llm_kwargs; hf: "
                                                 "attn_implementation).")
    prefetch: int = option(2, help="Online: optimizer steps of target states computed ahead of the draft (the "
                           "bounded in-memory queue between them).")
    target_dtype: str = option("auto", help="Compute dtype of the target online: auto (bf16 on GPU, fp32 on CPU), "
                               "bfloat16, float32.")
    aux_layer_ids: list[int] | None = option(None, comma=True, flag="--aux-layers",
                                             show_default="online: 2,N//2,N-3; offline: the store's",
                                             help="Aux layer ids in layer order (id k = input of decoder layer k). "
                                                  "Online: the target's layers to capture; offline: some of the "
                                                  "store's, to compare choices on one extraction.")
    init_draft: Path | None = option(None, show_default="none", help="Start from this draft's weights and "
                                     "vocabulary (eyas, vLLM, speculators, SpecForge or EAGLE layout; same target and "
                                     "aux layers) with a fresh optimizer and schedule.")
    init_head: bool = option(False, help="Start a fresh draft's lm_head from the target's own head (its rows for "
                             "the draft vocabulary, the final norm folded in) instead of random weights.")
    resume: bool = option(False, help="Continue from the latest checkpoint in OUT/train_state.")
    trust_remote_code: bool = option(False, help="Let transformers run the target repository's code.")
    preflight: bool = option(True, help="Online: first run a few samples alone and batched and check the target's "
                             "states against a plain transformers forward (aux ids, pre-norm final state, batch "
                             "invariance, tensor-parallel replies, NaN/inf); stop naming the fault.")

    def __post_init__(self) -> None:
        DraftOptions.__post_init__(self)
        TrainConfig.__post_init__(self)
        if 0 < self.draft_window < self.ttt_steps:
            raise EyasError(f"--draft-window {self.draft_window} is shorter than --ttt-steps {self.ttt_steps}: the "
                            "draft's own tokens of one chain would fall out of its window; give at least "
                            f"{self.ttt_steps}")
        if (self.store is None) == (self.prepared is None):
            raise EyasError("give exactly one of --store (offline) or --prepared (with --online)")
        if self.prepared is not None and not self.online:
            raise EyasError("--prepared trains online, with the target in the loop: add --online --model TARGET "
                            "(or run `eyas extract` and train with --store)")
        if self.tp < 1 or self.prefetch < 1:
            raise EyasError(f"--tp and --prefetch must be >= 1, got {self.tp} and {self.prefetch}")
        spread = {"--tp": self.tp > 1, "--device-map": self.device_map is not None,
                  "--target-gpus": self.target_gpus is not None, "--target-options": bool(self.target_options)}
        if not self.online and any(spread.values()):
            raise EyasError(f"{', '.join(k for k, v in spread.items() if v)}: options of the target online; offline "
                            "training reads the store (give them to `eyas extract`)")
        if (self.tp > 1 and self.engine != "vllm") or (self.device_map is not None and self.engine != "hf"):
            raise EyasError("--tp is for the vllm engine and --device-map for the hf engine")
        if self.init_head and self.init_draft is not None:
            raise EyasError("--init-head starts a fresh draft's lm_head from the target's; --init-draft brings a "
                            "trained lm_head already: drop one of them")
        from eyas.train.objectives import objective_class

        if self.reply_start_weight != 1.0 and "reply_start_weight" not in objective_class(self.family).options:
            raise EyasError(f"--reply-start-weight is an EAGLE-3 objective option; a {self.family} draft weighs its "
                            "positions otherwise (dflash: --block-gamma): drop it")


@dataclass
class Source:
    """Where the samples come from and the target the draft is built against."""

    kind: str  # "store" | "prepared"
    path: Path
    lengths: np.ndarray
    target_name: str
    target_config: Any
    aux_layer_ids: list[int]
    head: Any  # TargetHead
    identity: dict[str, Any]  # what the fingerprint records about the data
    engine: Any = None  # online: the target engine (None on ranks another rank's target feeds)
    owns_engine: bool = False
    feed: Any = None  # online: eyas.train.online.TargetFeed, the states ahead of the draft


class TrainRecipe:
    """`eyas train` as named setup steps (source, draft config, fingerprint, trainer, resume), then the
    loop and the finish. `engine` is an already built target engine for online training; `stop_after`
    ends the run after that many optimizer steps as if it were killed (tests)."""

    def __init__(self, opts: TrainOptions, *, engine: Any = None, log: Any = None, stop_after: int = 0) -> None:
        from eyas.train import distributed as D

        self.opts, self.stop_after = opts, stop_after
        self.started = time.perf_counter()  # --max-time counts from here: start-up spends the budget too
        self.info = D.init_distributed(opts.device)
        self.say = log or (lambda msg: typer.echo(msg, err=True) if self.info.is_main else None)
        self.out = Path(opts.out)
        self.budget = opts.token_budget or (16384 if self.info.device.type == "cuda" else 1024)
        self.source = self.setup_source(engine)
        self._counts: torch.Tensor | None = None
        self.dcfg, self.init = self.setup_draft_config()
        self.setup_schedule()
        self.options = self.fingerprint()
        self.options_sha = sha256_json(self.options)

    # -- setup steps ---------------------------------------------------------------------------

    def setup_source(self, engine: Any) -> Source:
        """The store (offline) or the prepared dataset and a running target (online)."""
        from eyas.assets import resolve_model

        o = self.opts
        if o.store is not None:
            from eyas.model.config import target_fingerprint_differs
            from eyas.store import HiddenStore

            st = HiddenStore(o.store, o.aux_layer_ids, verify=o.verify_store)
            m = st.manifest
            name = resolve_model(o.model) if o.model else m["target"]
            cfg = read_target_config(name, o.trust_remote_code)
            if target_fingerprint_differs(m.get("target_config_sha256") or "", cfg, f"the store {o.store}"):
                raise EyasError(f"the target config of '{name}' differs from the one the store {o.store} was "
                                f"extracted with ({m['target']}): pass --model with that target")
            head = st.target_head()
            st.check_values(head)
            return Source("store", Path(o.store), st.lengths, name, cfg, st.aux_layer_ids, head,
                          {"store": m.get("options_sha256"), "num_tokens": m["num_tokens"]})
        from eyas.data.prepared import PreparedDataset
        from eyas.train.online import open_online_target

        ds = PreparedDataset(o.prepared)
        if ds.has_media:  # the online batches carry token ids only: image samples would lose their images
            raise EyasError(f"{o.prepared} holds samples with images, which online training does not run the vision "
                            "tower for yet: `eyas extract` it (the store then holds their states) and train on it")
        owns = engine is None
        if owns and not o.model:
            raise EyasError("--online needs --model TARGET (a transformers folder or cached hub id)")
        if owns:
            from eyas.data.target_match import check_prepared_matches_target

            check_prepared_matches_target(ds.manifest, o.prepared, resolve_model(o.model), o.trust_remote_code)
        target = open_online_target(o, self.info, ds.lengths, self.budget, engine)  # None on ranks fed by another
        engine = target.engine
        if target.feed.layout.clients:
            self.say(f"one target per node: rank {self.info.rank} runs it and sends ranks "
                     f"{target.feed.layout.clients} their states")
        if o.preflight and engine is not None:
            from eyas.engines.preflight import preflight_engine, preflight_samples

            preflight_engine(engine, preflight_samples(ds), trust_remote_code=o.trust_remote_code, log=self.say)
        name = target.name
        cfg = target.config or read_target_config(name, o.trust_remote_code)
        return Source("prepared", Path(o.prepared), ds.lengths, name, cfg, target.aux_layer_ids, target.head,
                      {"prepared": ds.manifest.get("options_sha256"), "num_tokens": ds.num_tokens, "target": name},
                      engine=engine, owns_engine=owns, feed=target.feed)

    def setup_draft_config(self) -> tuple[DraftConfig, Any]:
        """The draft's config from every draft option at once, and the draft --init-draft names."""
        from eyas.model.config import text_config
        from eyas.model.dflash import choose_mask_token
        from eyas.model.family_facts import family

        src = self.source
        dcfg = DraftConfig.from_target_config(src.target_config, src.aux_layer_ids, target=str(src.target_name),
                                              options=subset(self.opts, DraftOptions), vocab_size=src.head.vocab_size)
        if self.opts.init_draft is None:
            if family(dcfg.family).mask_token and dcfg.mask_token_id < 0:
                pad = getattr(text_config(src.target_config), "pad_token_id", None)
                dcfg.mask_token_id = choose_mask_token(self.token_counts(), pad)
            return dcfg, None
        init = load_init_draft(Path(self.opts.init_draft), dcfg, src.target_name)
        if init.config.draft_vocab_size != dcfg.draft_vocab_size:
            self.say(f"--init-draft: keeping its draft vocabulary of {init.config.draft_vocab_size:,} tokens "
                     f"(--draft-vocab-size {dcfg.draft_vocab_size:,} applies to fresh drafts)")
            dcfg = DraftConfig(**{**dcfg.to_dict(), "draft_vocab_size": init.config.draft_vocab_size})
        dcfg.mask_token_id = init.config.mask_token_id  # the same, or chosen by default for it
        return dcfg, init

    def token_counts(self) -> torch.Tensor:
        """[V] how often each token id is trained on (the draft vocabulary, DFlash's mask token)."""
        from eyas.train.data import token_counts

        if self._counts is None:
            self._counts = token_counts(self.source.path, self.source.kind, self.source.head.vocab_size)
        return self._counts

    def setup_schedule(self) -> None:
        """Held-out samples and the packing plan; the number of steps."""
        from eyas.train.data import PackSchedule, hold_out

        o, lengths = self.opts, self.source.lengths
        self.train_ids, self.val_ids = hold_out(len(lengths), o.val_samples, o.seed)  # the vocabulary counts all
        self.plan = PackSchedule.over(lengths, self.train_ids, budget=self.budget, seed=o.seed, world=self.info.world,
                              grad_accum=o.grad_accum)
        self.steps_per_epoch = self.plan.steps_per_epoch()
        if self.steps_per_epoch == 0 and not o.max_steps:
            raise EyasError(f"{len(lengths)} samples make {len(self.plan.packs(0))} packs of {self.budget} tokens: "
                            f"fewer than one optimizer step needs ({self.info.world} rank(s) x {o.grad_accum} "
                            "accumulation). Lower --token-budget or --grad-accum, or use more data")
        self.total = o.max_steps or o.epochs * self.steps_per_epoch

    def fingerprint(self) -> dict[str, Any]:
        """Everything the trained draft depends on: a rerun with the same reuses OUT, and a resume must match."""
        from eyas.train.objectives import objective_class

        o = self.opts
        schedule = {**o.schedule_options(objective_class(self.dcfg.family).options), "token_budget": self.budget}
        return {"format": TRAIN_STATE_FORMAT, "source": self.source.identity, "kind": self.source.kind,
                "draft": {k: v for k, v in self.dcfg.to_dict().items() if k != "extra"}, "train": schedule,
                "world": self.info.world, "init": fingerprint_path(o.init_draft) if self.init is not None else None,
                "init_head": o.init_head}

    def setup_trainer(self) -> Any:
        from eyas.model.families import build_draft
        from eyas.model.vocab import build_draft_vocab
        from eyas.train.trainer import Trainer

        src, o = self.source, self.opts
        torch.manual_seed(o.seed)
        draft = build_draft(self.dcfg)
        if self.init is not None:
            draft.load_state_dict(self.init.state_dict())
        else:
            draft.set_vocab(*build_draft_vocab(self.token_counts(), self.dcfg.draft_vocab_size))
            if o.init_head or draft.head_from_target:
                draft.init_lm_head_from_target(src.head.lm_head, src.head.norm_weight, src.head.norm_offset)
        draft.load_target_embedding(src.head.embed_tokens, src.head.embed_scale)
        cfg = subset(o, TrainConfig)
        cfg.token_budget = self.budget
        trainer = Trainer(cfg, draft, src.head, self.info, self.total)
        src.head = None  # the trainer keeps what it needs on the device
        return trainer

    def setup_resume(self, trainer: Any) -> tuple[dict[str, Any], bool]:
        """(progress, resumed): the latest checkpoint's when --resume finds one made with these options."""
        from eyas.train import distributed as D
        from eyas.train.checkpointer import latest_checkpoint, load_checkpoint
        from eyas.train.compile_cache import load_compile_cache

        root = self.out / "train_state"
        progress: dict[str, Any] = {"epoch": 0, "step_in_epoch": 0, "tokens": 0, "options_sha256": self.options_sha}
        ckpt = latest_checkpoint(root) if self.opts.resume else None
        if trainer.compiled and (note := load_compile_cache(root)):  # a resumed or a repeated run: no compiling
            self.say(note)
        if ckpt is not None:
            if read_json(ckpt / "progress.json").get("options_sha256") != self.options_sha:
                raise EyasError(f"{ckpt} was written by a run with other data or options (or an older eyas): resume "
                                "needs the same command (or drop --resume to start over)")
            progress = load_checkpoint(trainer, ckpt)
            self.say(f"resuming from {ckpt} (step {trainer.step}/{self.total})")
        elif self.info.is_main and root.exists():
            if self.opts.resume:
                self.say(f"--resume: no checkpoint in {root}; starting from scratch")
            shutil.rmtree(root, ignore_errors=True)
        D.barrier()
        progress["start"] = trainer.step
        return progress, ckpt is not None

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        mpath = self.out / "manifest.json"
        if up_to_date(mpath, self.options_sha, self.out / "draft"):
            self.say(f"{self.out} is up to date (same inputs and options): reusing it")
            self.close()
            return read_json(mpath)
        trainer = self.setup_trainer()
        progress, resumed = self.setup_resume(trainer)
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            last, seconds = self.loop(trainer, progress, resumed)
            if self.stop_after and trainer.step < self.total:
                return {"stopped_at": trainer.step, "metrics": last}
            return self.finish(trainer, progress, last, seconds)
        finally:
            self.close()

    def loop(self, trainer: Any, progress: dict[str, Any], resumed: bool) -> tuple[dict[str, Any], float]:
        from eyas.train.data import PackDataset, PackSchedule, SampleSource, iterate_batches
        from eyas.train.loop import run_loop
        from eyas.train.metrics import MetricsLog

        src, o, info = self.source, self.opts, self.info
        online = src.feed is not None
        metrics = MetricsLog(self.out, o.report_to, trainer.step if resumed else None, self.options) \
            if info.is_main else None
        self.say(f"training a draft for {src.target_name}: "
                 f"{sum(p.numel() for p in trainer.draft.parameters() if p.requires_grad):,} trainable parameters, "
                 f"{self.total} steps of {info.world} x {o.grad_accum} x {self.budget} tokens, {trainer.mode} on "
                 f"{info.device}")
        pad_to = self.budget if info.device.type == "cuda" or trainer.compiled else None  # one shape for kernels
        sample_source = SampleSource(src.path, src.kind, src.aux_layer_ids if src.kind == "store" else None)
        loader = dict(num_workers=o.num_workers, pin=info.device.type == "cuda", pad_to=pad_to,
                      embed_table=trainer.embed_table)
        if online:  # the target's states computed ahead of the draft (eyas.train.online)
            steps = min(self.total, self.stop_after or self.total) - trainer.step
            batches = src.feed.batches(sample_source, self.plan, progress["epoch"], progress["step_in_epoch"], steps,
                                       **loader)
        else:
            batches = iterate_batches(sample_source, self.plan, info.rank, progress["epoch"], progress["step_in_epoch"],
                                      states=True, **loader)
        validate = None
        if len(self.val_ids):
            packs = PackSchedule.over(src.lengths, self.val_ids, budget=self.budget, seed=o.seed, world=1, grad_accum=1,
                              shuffle=False).packs(0)
            held_out = PackDataset(sample_source, packs, self.budget, pad_to, not online, trainer.embed_table)

            def validate() -> dict[str, Any]:
                rows = (held_out[k] for k in range(len(held_out)))
                return trainer.evaluate(rows if not online else (src.feed.fill(b) for b in rows))

        t0 = time.perf_counter()
        try:
            last = run_loop(trainer, batches, self.out, self.total, max(self.steps_per_epoch, 1), progress, metrics,
                            stop_after=self.stop_after, log=self.say, validate=validate, started=self.started)
        finally:
            if online:
                src.feed.close()
            if metrics is not None:
                metrics.close()
        return last, time.perf_counter() - t0

    def finish(self, trainer: Any, progress: dict[str, Any], last: dict[str, Any], seconds: float) -> dict[str, Any]:
        """The draft, a last checkpoint and the manifest; a run cut by --max-time is not up to date."""
        from eyas.train import distributed as D
        from eyas.train.checkpointer import BEST_DRAFT, save_checkpoint, save_draft

        o = self.opts
        timed_out = bool(progress.pop("timed_out", False)) and trainer.step < self.total
        if o.save_every or timed_out:
            save_checkpoint(trainer, self.out / "train_state", dict(progress), o.keep_checkpoints)
        save_draft(trainer, self.out / "draft")  # collective under FSDP
        result = {"format": TRAIN_STATE_FORMAT, "options_sha256": None if timed_out else self.options_sha,
                  "draft": "draft", "complete": not timed_out, "steps": trainer.step, "total_steps": self.total,
                  "tokens": progress.get("tokens", 0), "seconds": seconds, "final": last, "options": self.options}
        if progress.get("best_val"):
            result["best"] = {"draft": BEST_DRAFT, **progress["best_val"]}
        if self.info.is_main:
            atomic_write_json(self.out / "manifest.json", result)
            self.say(f"draft saved to {self.out / 'draft'} ({trainer.step} steps, final loss "
                     f"{last.get('loss', float('nan')):.3f}, tau_sim {last.get('tau_sim', float('nan')):.2f})")
            if timed_out:
                self.say(f"stopped by --max-time {o.max_time:g}s after {trainer.step}/{self.total} steps (the "
                         "learning rate had not decayed yet); the same command with --resume finishes the schedule")
        D.barrier()
        return result

    def close(self) -> None:
        if self.source.feed is not None:
            self.source.feed.close()
        if self.source.owns_engine and self.source.engine is not None:
            self.source.engine.close()
            self.source.engine = None


def run_train(opts: TrainOptions, *, engine: Any = None, log: Any = None, stop_after: int = 0) -> dict[str, Any]:
    """Train and write OUT/draft (or reuse an up-to-date OUT); returns OUT/manifest.json's content. One
    writer per run folder: a second one gets an error naming this one."""
    check_output(opts.out, "train", is_train_folder)
    with writer_lock(opts.out, "train"):
        return TrainRecipe(opts, engine=engine, log=log, stop_after=stop_after).run()


def is_train_folder(path: Path) -> bool:
    """Did `eyas train` write `path`: its manifest, or what a run writes before it (resumed): checkpoints,
    metrics, TensorBoard's folder (made first)?"""
    return (has_manifest(path / "manifest.json", TRAIN_STATE_FORMAT) or (path / "train_state").is_dir()
            or (path / "metrics.jsonl").is_file() or (path / "tensorboard").is_dir())


def read_target_config(name: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise EyasError(f"cannot read the target's config from '{name}' ({e}). The draft copies the target's shape "
                        "and rope: pass --model with the target's transformers folder or cached hub id.") from e


def load_init_draft(path: Path, dcfg: DraftConfig, target: str) -> Any:
    """The draft --init-draft names, checked to have the shape this run trains (else a clear error)."""
    from eyas.model.checkpoints import import_draft

    init = import_draft(path, target=target if Path(str(target)).is_dir() else None)
    have, want = init.config, dcfg
    fields = ("family", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "target_hidden_size", "aux_layer_ids", "fc_norm",
              "norm_output", "block_size", "attention", *MLA_DIMS)
    diff = [f"{f} {getattr(have, f)} (this run: {getattr(want, f)})" for f in fields
            if getattr(have, f) != getattr(want, f)]
    if want.mask_token_id >= 0 and have.mask_token_id != want.mask_token_id:
        diff.append(f"mask_token_id {have.mask_token_id} (this run: {want.mask_token_id})")
    if diff:
        raise EyasError(f"--init-draft {path} does not fit this target and its aux layers: " + "; ".join(diff) +
                        ". Start from a draft trained for the same target (and --aux-layers), or drop --init-draft")
    return init


def _command(opts: TrainOptions) -> None:
    from eyas.train.distributed import cleanup

    try:
        run_train(opts)
    finally:
        cleanup()


cli = cli_command(TrainOptions, _command)
