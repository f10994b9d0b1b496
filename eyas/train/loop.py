"""The training loop around a Trainer: optimizer steps until the last one, with log lines, held-out
validations (the best draft kept), checkpoints, the compile cache and the first step's start-up."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eyas.train import distributed as D
from eyas.train import startup
from eyas.train.checkpointer import BEST_DRAFT, improves, save_checkpoint, save_draft
from eyas.train.compile_cache import CACHE_FILE, save_compile_cache
from eyas.train.metrics import MetricsLog, format_info
from eyas.train.ttt import summarize
from eyas.utils.io import EyasError

if TYPE_CHECKING:
    from eyas.train.trainer import Trainer

START_UP_NOTE_S = 5.0  # a first step slower than this gets a line saying why
MAX_EMPTY_FRACTION = 0.5  # a run whose steps so far are mostly without one valid token stops


class _Session:
    """What the loop's steps share: the run's fixed parts, this session's token counts and clocks
    (a resumed run starts a new session), the progress bar and the last logged metrics."""

    def __init__(self, trainer: Trainer, out: Path, total_steps: int, progress_state: dict[str, Any],
                 metrics: MetricsLog | None, log: Any, started: float | None = None) -> None:
        from eyas.utils.progress import progress_bar

        self.trainer, self.cfg, self.out, self.root = trainer, trainer.cfg, out, out / "train_state"
        self.total_steps, self.progress, self.metrics, self.log = total_steps, progress_state, metrics, log
        self.last: dict[str, Any] = {}
        self.session_tokens, self.t0 = 0, time.perf_counter()
        self.started = self.t0 if started is None else started  # where the --max-time budget began
        self.window_tokens, self.tw = 0, time.perf_counter()
        self.window_loss_tokens = 0  # trained (loss-masked) tokens this rank saw since the last log
        self.steps_seen = self.empty_seen = 0  # this session's steps, and those with no valid token
        self.last_log_step = trainer.step
        self.warm: tuple[float, int] | None = None  # (time, step) when the session's first step was done
        self.first_batch_s: float | None = None  # seconds until the session's first batch was in hand
        self.compile0 = startup.compile_seconds()
        self.cache_saved = False  # the compile cache was written (or found) in this session
        self.tokens_total = int(progress_state.get("tokens", 0))
        self.show = trainer.info.is_main
        self.bar = progress_bar(disable=None if self.show else True)
        self.quiet_bar = self.bar.disable and not getattr(self.bar, "prints_lines", False)  # then a line per log
        self.task: Any = None

    def count_tokens(self, micro: list[dict[str, Any]], epoch: int, step_in_epoch: int,
                     steps_per_epoch: int) -> None:
        """Count the step's tokens (over all ranks) and record where the next step starts."""
        trainer, progress = self.trainer, self.progress
        n_tok = sum(int(b["num_tokens"]) for b in micro)
        self.window_loss_tokens += sum(int(b["loss_mask"].sum()) for b in micro)  # host tensors: no device sync
        cut = sum(int(b.get("truncated", 0)) for b in micro)
        if cut and self.show and not progress.get("warned_truncation"):
            progress["warned_truncation"] = True
            self.log(f"note: samples longer than the token budget ({self.cfg.token_budget}) are cut to it; raise "
                     "--token-budget to train on their ends")
        n_tok_global = n_tok * trainer.info.world
        self.session_tokens += n_tok_global
        self.window_tokens += n_tok_global
        self.tokens_total += n_tok_global
        nxt = (epoch, step_in_epoch + 1) if step_in_epoch + 1 < steps_per_epoch else (epoch + 1, 0)
        progress.update(epoch=nxt[0], step_in_epoch=nxt[1], tokens=self.tokens_total)
        self.bar.update(self.task, completed=trainer.step, tokens=self.session_tokens)

    def is_last(self, stop_after: int) -> Any:
        """The last step of the run, or of this process (`stop_after`), or the first log step past
        --max-time (rank 0's clock decides for all ranks)."""
        trainer, cfg = self.trainer, self.cfg
        is_last = trainer.step >= self.total_steps or (stop_after and trainer.step >= stop_after)
        if cfg.max_time and trainer.step % cfg.log_every == 0 and not is_last:
            over = time.perf_counter() - self.started >= cfg.max_time
            is_last = self.progress["timed_out"] = D.broadcast_object(over)
        return is_last

    def log_step(self, epoch: int) -> None:
        """Summarize the window since the last log step: metrics.jsonl, the bar, a line when it is quiet."""
        trainer = self.trainer
        m = summarize(trainer.window, trainer.weights)  # the one host sync of a log interval
        self.check_health(m, int(trainer.window_empty), bool(torch.isfinite(trainer.window).all()))
        now = time.perf_counter()
        rate = self.window_tokens / max(now - self.tw, 1e-9)
        m.update(step=trainer.step, epoch=epoch, lr=float(trainer.sched.get_last_lr()[0]),
                 grad_norm=float(trainer.last_norm.full_tensor() if hasattr(trainer.last_norm, "full_tensor")
                                 else trainer.last_norm),
                 tok_per_s=rate, tokens=self.tokens_total)
        trainer.window.zero_()
        trainer.window_empty.zero_()
        self.window_tokens, self.window_loss_tokens, self.tw = 0, 0, now
        self.last = m
        if not self.show:
            return
        self.bar.update(self.task, info=format_info(m))
        if self.metrics is not None:
            self.metrics.write(m)
        if self.quiet_bar:
            since, from_step = self.warm or (self.t0, self.progress["start"])
            eta = (self.total_steps - trainer.step) * (now - since) / max(1, trainer.step - from_step)
            self.log(f"step {trainer.step}/{self.total_steps} {format_info(m)} {rate:,.0f} tok/s eta {eta:,.0f}s")

    def check_health(self, m: dict[str, Any], empty: int, finite: bool) -> None:
        """Stop on a loss that is not finite (the weights are spoiled: no draft is saved from them) and on a
        run whose steps are mostly without one valid token (it would report success on nothing); count
        the empty steps in the metrics."""
        step = self.trainer.step
        if not finite or not math.isfinite(m["loss"]):
            raise EyasError(f"the training loss is {m['loss']} at step {step}: the draft's weights are no longer "
                            "finite, so the run stops and saves no draft from them. Lower --lr, check the store for "
                            "NaN states (`eyas extract` with its preflight), or train in fp32 (--dtype fp32)")
        window_steps, self.last_log_step = step - self.last_log_step, step
        self.steps_seen += window_steps
        self.empty_seen += empty
        m["empty_steps"] = empty
        if self.empty_seen > MAX_EMPTY_FRACTION * self.steps_seen:
            why = ("their batches hold no trained (loss-masked) token: the data has no assistant replies"
                   if self.window_loss_tokens == 0 and empty == window_steps else
                   "at their trained positions the target's next token is outside the draft vocabulary (raise "
                   "--draft-vocab-size, or prepare the data with this target's tokenizer)")
            raise EyasError(f"{self.empty_seen} of the {self.steps_seen} training steps up to step {step} had no "
                            f"valid token (loss 0, gradient 0): {why}. The run stops rather than report a draft "
                            "trained on nothing")

    def validate(self, validate: Callable[[], dict[str, Any]]) -> None:
        """Measure the held-out samples (collective); keep the draft of the best validation in OUT/draft-best."""
        trainer, best_path = self.trainer, self.out / BEST_DRAFT
        tv = time.perf_counter()
        val = validate()
        best = improves(val, self.progress.get("best_val"))  # the same figure on every rank
        if best:
            self.progress["best_val"] = {"step": trainer.step, "tau_sim": val["tau_sim"], "loss": val["loss"]}
            save_draft(trainer, best_path)
        self.tw += time.perf_counter() - tv  # kept out of the training rate
        if self.show:
            self.log(f"validation at step {trainer.step} ({val['valid_tokens']:,} held-out tokens): "
                     f"{format_info(val)}" + (f"; the best so far, in {best_path}" if best else ""))
            if self.metrics is not None:
                self.metrics.write_val(trainer.step, val)
        self.last = {**self.last, "val": val}

    def warm_up(self) -> None:
        """After the session's first step, which may also have compiled the draft: rates and ETAs
        count from here."""
        self.warm = time.perf_counter(), self.trainer.step
        before = startup.take()  # what ran before this loop (the target's start)
        total = self.warm[0] - self.t0 + sum(before.values())
        if total >= START_UP_NOTE_S and self.show:
            self.log(f"first step done after {total:.0f}s of start-up ({self.start_up_parts(before)}); tok/s and ETA "
                     "count from here")
        self.session_tokens = self.window_tokens = 0
        self.tw = self.warm[0]
        self.bar.reset(self.task, total=self.total_steps, completed=self.trainer.step, tokens=0, info="")


    def compiled_now(self) -> None:
        """Once the compiled draft runs: save the compile cache (for a resume on another machine) and, where
        it compiled in the background, say from which step."""
        self.cache_saved = True
        if self.trainer.background is not None:
            into = time.perf_counter() - self.t0
            self.log(f"the draft runs compiled from step {self.trainer.step + 1} on, {into:.0f}s into training "
                     "(torch.compile ran in the background meanwhile)")
        if not (self.root / CACHE_FILE).is_file():
            save_compile_cache(self.root)

    def start_up_parts(self, before: dict[str, float]) -> str:
        """Where the start-up's seconds went, in words: only what happened here. torch.compile runs inside the
        first batch (the target's graphs) and the first step (the draft's), so it is a share of those."""
        batch = self.first_batch_s or 0.0
        parts = [f"{name} {s:.1f}s" for name, s in before.items()]
        parts += [f"first batch {batch:.1f}s", f"first step {self.warm[0] - self.t0 - batch:.1f}s"]
        compiled = startup.compile_seconds() - self.compile0
        if compiled >= 0.05:
            parts.append(f"of which torch.compile {compiled:.1f}s, once per run")
        graphed = self.trainer.graphed
        if graphed is not None and graphed.capture_s:
            parts.append(f"CUDA graph capture {graphed.capture_s:.1f}s")
        return ", ".join(parts)


def run_loop(trainer: Trainer, batches: Any, out: Path, total_steps: int, steps_per_epoch: int,
             progress_state: dict[str, Any], metrics: MetricsLog | None, stop_after: int = 0, log: Any = print,
             validate: Callable[[], dict[str, Any]] | None = None,
             started: float | None = None) -> dict[str, Any]:
    """Consume `batches` (eyas.train.data.iterate_batches; online, eyas.train.online.TargetFeed.batches with
    the target's states filled in) until `total_steps` optimizer steps, logging and checkpointing;
    `validate()` (collective) measures held-out data every `val_every` steps and at the end, keeping the
    draft of the best one in OUT/draft-best; --max-time counts from `started` (the command's start), else from
    here. Returns the last logged metrics, with the last validation's under "val"."""
    cfg = trainer.cfg
    run = _Session(trainer, out, total_steps, progress_state, metrics, log, started)
    with run.bar:
        run.task = run.bar.add_task("train", total=total_steps, completed=trainer.step, tokens=0, info="")
        for epoch, step_in_epoch, micro in batches:
            if trainer.step >= total_steps:
                break
            if run.first_batch_s is None:
                run.first_batch_s = time.perf_counter() - run.t0
            trainer.train_step(micro)
            run.count_tokens(micro, epoch, step_in_epoch, steps_per_epoch)
            is_last = run.is_last(stop_after)
            validating = validate is not None and (is_last or (cfg.val_every and trainer.step % cfg.val_every == 0))
            saving = cfg.save_every and trainer.step % cfg.save_every == 0 and trainer.step < total_steps
            if trainer.step % cfg.log_every == 0 or is_last or validating or saving:
                run.log_step(epoch)  # also checks the run's health before anything is kept from it
            if validating:
                run.validate(validate)
            if saving:
                save_checkpoint(trainer, run.root, dict(progress_state), cfg.keep_checkpoints)
            if trainer.compiled and run.show and not run.cache_saved and trainer.compile_ready():
                run.compiled_now()
            if is_last:
                break
            if run.warm is None:
                run.warm_up()
    progress_state["elapsed"] = time.perf_counter() - run.t0
    return run.last
