"""Turn chat data into training samples: the target's chat template, tokens, and a mask on assistant tokens.

INPUTS are chat files (ShareGPT .json/.jsonl, OpenAI `messages` .jsonl, .parquet/.arrow, a folder saved
with `datasets`), a hub dataset name (owner/name), or the embedded data `sharegpt` / `dummy`.
Each conversation is rendered with the --model tokenizer's own chat template; the loss mask covers
exactly the assistant replies plus their end-of-turn token. Bad rows are skipped and counted by
reason with examples (file:line); a file that cannot be read stops the job (exit code 2) and leaves
no output. A second run with the same inputs and options reuses the output. Messages may hold images
(OpenAI `image_url` or `{"type": "image"}` parts: a path, file:// or base64 data URL): they go
through the target's own processor (eyas.data.media); for a text-only target such rows are skipped.

    eyas prepare sharegpt --model smollm2 --out data/prepared --show 2
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from eyas.assets import TARGET_FORMS
from eyas.data.chat import ChatEncoder, Encoded
from eyas.data.media import ImageEncoder, SampleMedia, has_images, target_image_token_ids
from eyas.data.prepared import FORMAT, SHARD_TOKENS, PreparedDataset, PreparedWriter
from eyas.data.readers import BadRow, Row, SkipLog, Source, resolve_input
from eyas.data.target_match import check_tokenizer_merges, tokenizer_sha256, vocab_size_of
from eyas.utils.io import (
    EyasError,
    atomic_path,
    check_output,
    has_manifest,
    read_json,
    remove_leftovers,
    sha256_json,
    writer_lock,
)
from eyas.utils.progress import progress_bar
from eyas.utils.schema import cli_command, option

MASK_VERSION = 1  # bump when the mask algorithm changes: old outputs are then rebuilt, not reused
CHUNK_ROWS = 256  # conversations per task: one batched tokenization call each
console = Console(stderr=True)


@dataclass(kw_only=True)
class PrepareOptions:
    """`eyas prepare`'s options: the command line and the `prepare:` section of an `eyas run` config."""

    inputs: list[str] = option(default_factory=list, positional=True,
                               help="Chat files, saved datasets, hub names, or `sharegpt` / `dummy`.")
    model: str = option("smollm2", short="-m", help="Target whose tokenizer and chat template to use: "
                        f"{TARGET_FORMS}.")
    out: Path = option(Path("data/prepared"), short="-o", help="Output folder.")
    max_length: int = option(2048, help="Longest sample in tokens.")
    overlong: Literal["truncate", "drop"] = option("truncate", help="What happens to longer samples.")
    max_samples: int | None = option(None, help="Stop after this many samples.", show_default="all")
    num_workers: int | None = option(None, help="Worker processes (1: in-process).", show_default="one per CPU core")
    chat_template: Path | None = option(None, help="A Jinja chat template file to use instead of the model's.",
                                        show_default="the model's own")
    template_kwargs: dict[str, Any] = option(default_factory=dict, show_default="none",
                                             help='Chat template variables as a JSON object, e.g. '
                                                  '\'{"enable_thinking": false}\'.')
    trim_loops: int | None = option(None, show_default="off", help="Cut each reply this many tokens after it "
                                    "starts repeating what the assistant already wrote (16 tokens again): for data "
                                    "whose loops are an artefact the served target will not repeat, not for "
                                    "self-distilled data.")
    show: int = option(0, help="Then print this many samples with the trained tokens highlighted.")
    force: bool = option(False, help="Rebuild even if the output is up to date.")
    shard_tokens: int = option(SHARD_TOKENS, cli=False, help="Tokens per shard file.")

    def __post_init__(self) -> None:
        if self.overlong not in ("truncate", "drop"):
            raise EyasError(f"--overlong must be 'truncate' or 'drop', not {self.overlong!r}")
        if self.max_samples is not None and self.max_samples < 1:
            raise EyasError(f"--max-samples must be at least 1, not {self.max_samples}")
        if self.trim_loops is not None and self.trim_loops < 0:
            raise EyasError(f"--trim-loops must be 0 or more tokens, not {self.trim_loops}")
        if self.max_length < 2:
            raise EyasError(f"--max-length must be at least 2, not {self.max_length}")
        if self.show < 0:
            raise EyasError(f"--show must be 0 or more samples, not {self.show}")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def load_tokenizer(model: str) -> tuple[Any, str]:
    """The target's tokenizer from an alias, a local folder or a hub id; returns (tokenizer, resolved)."""
    from eyas.assets import resolve_model

    resolved = resolve_model(model)
    try:
        tokenizer = _tokenizer(resolved)
    except Exception as e:  # OSError (not found / offline), ValueError (not a tokenizer), ...
        raise EyasError(f"cannot load the tokenizer of '{model}' ({type(e).__name__}: {str(e)[:300]}). "
                        "Pass a local model folder or a hub id available offline.") from e  # fmt: skip
    check_tokenizer_merges(tokenizer, model)
    return tokenizer, resolved


@functools.lru_cache(maxsize=4)
def _tokenizer(resolved: str) -> Any:
    """Loaded once per process (the pipeline and --show ask again); never modified after loading."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolved)


# ---------------------------------------------------------------------------------------------
# Workers: each encodes chunks of rows; results come back in order
# ---------------------------------------------------------------------------------------------

_ENCODER: ChatEncoder | None = None
_IMAGES: ImageEncoder | None = None


def _init_worker(encoder: ChatEncoder, images: ImageEncoder | None) -> None:
    global _ENCODER, _IMAGES
    _ENCODER, _IMAGES = encoder, images
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: a chunk cut short never finishes


@dataclass
class ChunkResult:
    """Encoded chunk: samples concatenated, plus each row's outcome in input order."""

    input_ids: np.ndarray  # int32 [N_tok]
    loss_mask: np.ndarray  # uint8 [N_tok]
    outcomes: list[tuple]  # ("ok", length, truncated, trimmed) | ("skip", reason, where, detail)
    media: list[SampleMedia | None]  # per kept sample: its images (None: text only)


def _encode_with_images(images: ImageEncoder | None, row: Row) -> Encoded | BadRow:
    if images is None:  # a caller that gave no image encoder (eyas' prepare always gives one)
        return BadRow("image_for_text_target", "the conversation holds images and no image encoder was given")
    try:
        return images.encode(row.messages, row.where)
    except BadRow as e:
        return e


def encode_rows(rows: list[Row], encoder: ChatEncoder | None = None, images: ImageEncoder | None = None) -> ChunkResult:
    """Text-only rows are tokenized in one batch; rows with images go one by one through the processor."""
    encoder, images = encoder or _ENCODER, images or _IMAGES
    assert encoder is not None
    todo = [r for r in rows if r.skip is None and not has_images(r.messages)]
    encoded = iter(encoder.encode_batch([r.messages for r in todo]))
    ids, masks, outcomes, media = [], [], [], []
    for r in rows:
        if r.skip is not None:
            outcomes.append(("skip", r.skip, r.where, r.detail))
            continue
        e = _encode_with_images(images, r) if has_images(r.messages) else next(encoded)
        if isinstance(e, BadRow):
            outcomes.append(("skip", e.reason, r.where, e.detail))
        else:
            ids.append(e.input_ids)
            masks.append(e.loss_mask)
            media.append(getattr(e, "media", None))
            outcomes.append(("ok", len(e.input_ids), e.truncated, e.trimmed))
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))  # noqa: E731
    return ChunkResult(cat(ids, np.int32), cat(masks, np.uint8), outcomes, media)


def _chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for r in rows:
        chunk.append(r)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded_chunks(chunks: Iterator[list[Row]], encoder: ChatEncoder, num_workers: int,
                    images: ImageEncoder | None = None) -> Iterator[ChunkResult]:
    """encode_rows over chunks, in order, with at most 2 chunks in flight per worker (bounded memory)."""
    if num_workers <= 1:
        for c in chunks:
            yield encode_rows(c, encoder, images)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # workers are the parallelism (and no fork warning)
    try:
        pool = ctx.Pool(num_workers, initializer=_init_worker, initargs=(encoder, images))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    pending: deque = deque()
    try:
        for c in chunks:
            pending.append(pool.apply_async(encode_rows, (c,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        # Done, closed early (--max-samples), a chunk failed or Ctrl-C: the workers finish the chunks in
        # flight, then exit. Pool.terminate() while a task is still being sent, or a result written, can
        # deadlock for good (seen: `eyas prepare --max-samples 400 --num-workers 16` hung 2 runs of 27).
        for r in pending:
            r.wait()
        pool.close()
        pool.join()


def _rows(sources: list[Source]) -> Iterator[Row]:
    """Rows of every source in order; a source with no readable row at all is an error, not a skip."""
    for src in sources:
        n_rows = n_readable = 0
        for row in src.rows():
            n_rows += 1
            n_readable += row.skip not in ("not_json", "not_utf8")
            yield row
        if n_readable == 0:
            what = "is empty" if n_rows == 0 else f"has no readable row ({n_rows:,} rows are not JSON/UTF-8)"
            raise EyasError(f"{src.spec} {what}. Give ShareGPT or OpenAI-style chat data (JSON, JSONL, parquet).")


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _chat_encoder(cfg: PrepareOptions, tokenizer: Any) -> ChatEncoder:
    """The encoder of --model's tokenizer with its chat template, or --chat-template's."""
    template = None
    if cfg.chat_template is not None:
        try:
            template = Path(cfg.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise EyasError(f"cannot read --chat-template {cfg.chat_template}: {e.strerror or e}") from e
    try:
        return ChatEncoder(tokenizer, template, cfg.template_kwargs, cfg.max_length, cfg.overlong, cfg.trim_loops)
    except ValueError as e:  # no chat template
        raise EyasError(f"'{cfg.model}' has no chat template ({e}). Pass one with --chat-template FILE.") from e


def prepare(cfg: PrepareOptions) -> Path:
    """Run the stage; returns the output folder (reused when inputs and options are unchanged). One writer
    per output folder: a second one gets an error naming this one."""
    if not cfg.inputs:
        raise EyasError("no inputs: give chat files or dataset names, e.g. `eyas prepare sharegpt`")
    out = check_output(cfg.out, "prepare", lambda p: has_manifest(p / "manifest.json", FORMAT))
    with writer_lock(out, "prepare"):
        return _prepare(cfg, out)


def _prepare(cfg: PrepareOptions, out: Path) -> Path:
    sources = [resolve_input(name) for name in cfg.inputs]  # fails fast on a missing file
    tokenizer, resolved = load_tokenizer(cfg.model)
    encoder = _chat_encoder(cfg, tokenizer)
    template_sha, tokenizer_sha = sha256_json(encoder.chat_template), tokenizer_sha256(tokenizer)
    options_sha = sha256_json({
        "format": FORMAT, "mask_version": MASK_VERSION, "inputs": [s.fingerprint() for s in sources],
        "tokenizer": tokenizer_sha, "chat_template": template_sha,
        "template_kwargs": cfg.template_kwargs, "max_length": cfg.max_length, "overlong": cfg.overlong,
        "max_samples": cfg.max_samples,
        **({"trim_loops": cfg.trim_loops} if cfg.trim_loops is not None else {}),  # older outputs stay valid
    })  # fmt: skip
    manifest_path = out / "manifest.json"
    remove_leftovers(out.parent)  # what a run killed mid-way left next to OUT
    if not cfg.force and manifest_path.is_file():
        old = read_json(manifest_path)
        if old.get("options_sha256") == options_sha and old.get("format") == FORMAT:
            console.print(f"[green]✓ prepare[/] {out} is up to date ({old['num_samples']:,} samples, "
                          f"{old['num_tokens']:,} tokens): reused")  # fmt: skip
            return out

    vocab_size = vocab_size_of(tokenizer, resolved)
    images = ImageEncoder(encoder, resolved, target_image_token_ids(resolved))  # its processor loads on an image
    workers = cfg.num_workers if cfg.num_workers is not None else default_workers()
    log = SkipLog()
    truncated = trimmed = n_rows = 0
    t0 = time.perf_counter()
    with atomic_path(out) as tmp:
        writer = PreparedWriter(tmp, vocab_size, cfg.shard_tokens, images.placeholder_ids)
        results = _encoded_chunks(_chunks(_rows(sources), CHUNK_ROWS), encoder, workers, images)
        try:
            with progress_bar() as bar:
                task = bar.add_task("prepare", total=cfg.max_samples, tokens=0, info="")
                for res in results:
                    lengths, full = [], False
                    for outcome in res.outcomes:
                        if outcome[0] == "skip":
                            log.add(*outcome[1:])
                        elif cfg.max_samples is not None and writer.num_samples + len(lengths) >= cfg.max_samples:
                            full = True
                            break
                        else:
                            lengths.append(outcome[1])
                            truncated += outcome[2]
                            trimmed += outcome[3]
                        n_rows += 1
                    n = sum(lengths)  # the chunk's kept samples come first in its arrays
                    writer.add_many(res.input_ids[:n], res.loss_mask[:n], np.array(lengths, dtype=np.int64),
                                    res.media[:len(lengths)])
                    bar.update(task, completed=writer.num_samples, tokens=writer.num_tokens,
                               info=f"{log.total:,} skipped")  # fmt: skip
                    if full:
                        break
        finally:
            results.close()  # stops the workers (e.g. when --max-samples cut the input short)
        if writer.num_samples == 0:
            raise EyasError("no usable conversation in the inputs. Skipped rows:\n" + "\n".join(log.lines()))
        # no wall-clock time in the manifest: the same data prepared again is the same bytes, so the stages
        # that fingerprint it (extract, train) stay up to date
        manifest = writer.finish(
            tokenizer=resolved, tokenizer_sha256=tokenizer_sha, chat_template_sha256=template_sha,
            max_length=cfg.max_length,
            overlong=cfg.overlong, skipped=dict(log.counts), truncated=truncated, options_sha256=options_sha,
            trim_loops=cfg.trim_loops, trimmed_tokens=trimmed,
            sources=[s.name for s in sources], skipped_examples=log.examples, rows_read=n_rows,
        )  # fmt: skip
    _summary(out, manifest, log, time.perf_counter() - t0)
    return out


def _summary(out: Path, m: dict[str, Any], log: SkipLog, seconds: float) -> None:
    t = Table(title=f"prepared → {out}", show_header=False, box=None)
    t.add_row("samples", f"{m['num_samples']:,}  ({m['num_samples'] / seconds:,.0f} conversations/s)")
    t.add_row("tokens", f"{m['num_tokens']:,}  ({m['num_tokens'] / seconds:,.0f} tokens/s)")
    t.add_row("trained tokens", f"{m['num_loss_tokens']:,} ({m['num_loss_tokens'] / max(m['num_tokens'], 1):.0%})")
    t.add_row("truncated", f"{m['truncated']:,} (to {m['max_length']:,} tokens)")
    if m.get("trim_loops") is not None:
        t.add_row("loop tails cut", f"{m['trimmed_tokens']:,} tokens (kept {m['trim_loops']} after each loop starts)")
    t.add_row("skipped", f"{log.total:,}")
    t.add_row("time", f"{seconds:.1f} s")
    console.print(t)
    for line in log.lines():
        console.print(Text(line, style="yellow"), soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# --show: the mask, by eye
# ---------------------------------------------------------------------------------------------


def _elide(s: str, limit: int = 800) -> str:
    if len(s) <= limit:
        return s
    return f"{s[: limit // 2]} …[{len(s) - limit * 3 // 4:,} characters]… {s[-limit // 4:]}"


def show_samples(path: Path, n: int, tokenizer: Any, out: Console | None = None) -> None:
    """Print n samples spread over the dataset, trained tokens highlighted (marked ⟦…⟧ without colour),
    each image's placeholder tokens shown as one ⟪image: N tokens⟫ mark."""
    out = out or Console(highlight=False)
    ds = PreparedDataset(path)
    if n <= 0 or len(ds) == 0:
        return
    placeholders = set(ds.manifest.get("media", {}).get("image_token_ids", []))
    plain = out.color_system is None
    for i in sorted({int(x) for x in np.linspace(0, len(ds) - 1, min(n, len(ds)))}):
        sample = ds[i]
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
        out.rule(f"sample {i}: {len(ids):,} tokens, {sum(mask):,} trained")
        text = Text()
        start = 0
        kind = [(m, t in placeholders) for t, m in zip(ids, mask, strict=True)]
        for k in range(1, len(ids) + 1):  # decode each run of equal mask values (and image tokens) as one piece
            if k == len(ids) or kind[k] != kind[start]:
                piece = _elide(tokenizer.decode(ids[start:k], skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False))  # fmt: skip
                if kind[start][1]:
                    text.append(f"⟪image: {k - start} tokens⟫", style="bold magenta")
                elif mask[start]:
                    text.append(f"⟦{piece}⟧" if plain else piece, style="bold black on green")
                else:
                    text.append(piece, style="dim")
                start = k
        out.print(text)
    out.rule("trained tokens: ⟦…⟧" if plain else "[bold black on green] trained tokens [/] highlighted")


def run_prepare(opts: PrepareOptions) -> Path:
    """The command: prepare (or, with only --show, look at an existing output), then show samples."""
    out = Path(opts.out)
    if not opts.inputs and opts.show and (out / "manifest.json").is_file():
        path = out  # just look at an existing output
    else:
        path = prepare(opts)
    if opts.show:
        manifest = read_json(path / "manifest.json")
        tokenizer, _ = load_tokenizer(manifest["tokenizer"])
        show_samples(path, opts.show, tokenizer)
    return path


cli = cli_command(PrepareOptions, run_prepare)
