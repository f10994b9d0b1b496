"""Rewrite the assistant turns of chat data with the target itself (self-distillation for EAGLE-3).

The draft learns to predict the target, so training text written by the target matches what it
will see when serving. Every conversation keeps its structure (system prompt, user turns, number
and order of turns); each assistant turn is replaced by the target's own reply to the conversation
so far (earlier turns already rewritten). Generation is batched with transformers; sampling is
seeded per batch, so a run killed at any point and started again writes the same file.

The output is JSONL of {"messages": [{"role", "content"}, ...]} (OpenAI style), which `eyas prepare`
reads; OUT.manifest.json records the options, and a rerun with the same inputs and options reuses it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import typer

from eyas.utils.io import EyasError, atomic_path, atomic_write_json, read_json, sha256_json
from eyas.utils.progress import progress_bar

FORMAT = "eyas.regenerated/1"


@dataclass
class Sampling:
    """Generation options; temperature 0 means greedy."""

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    seed: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
            raise EyasError("sampling options out of range: need --temperature >= 0, 0 < --top-p <= 1, "
                            "--top-k >= 0, --max-new-tokens >= 1")
        if self.temperature == 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k or None, "max_new_tokens": self.max_new_tokens}


@dataclass
class Stats:
    conversations: int = 0
    turns: int = 0
    tokens: int = 0
    unfinished: int = 0  # replies cut by --max-new-tokens
    truncated: int = 0  # conversations cut before a turn whose prompt exceeded --max-length
    dropped: int = 0  # conversations with no turn left within --max-length

    def add(self, other: dict) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)


def _regenerable(m: dict) -> bool:
    """Assistant text turns are rewritten; tool-call turns keep their calls (their results follow)."""
    return m["role"] == "assistant" and not m.get("tool_calls")


class Regenerator:
    """Batched rewriting of assistant turns with one model and its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int = 4096,
                 template_kwargs: dict | None = None) -> None:
        self.model, self.tok, self.sampling, self.max_length = model, tokenizer, sampling, max_length
        self.template_kwargs = template_kwargs or {}
        self.device = next(model.parameters()).device
        tokenizer.padding_side = "left"  # decoder-only generation: prompts end where replies start
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        if not eos:
            raise EyasError("the target defines no end-of-sequence token (generation_config / tokenizer): "
                            "replies would never stop")
        self.eos = eos

    def _prompt(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            **self.template_kwargs)

    @torch.inference_mode()
    def batch(self, convs: list[list[dict]], seed: int) -> tuple[list[list[dict] | None], dict]:
        """Rewrite every assistant turn of `convs`, turn by turn across the batch.

        Returns the new conversations (None when not even the first reply fits in --max-length) and counts.
        """
        torch.manual_seed(seed)
        work = [[dict(m) for m in c] for c in convs]
        nxt = [0] * len(work)
        alive = [True] * len(work)
        stats = {"turns": 0, "tokens": 0, "unfinished": 0, "truncated": 0, "dropped": 0}
        gen_kwargs = self.sampling.generate_kwargs()
        while True:
            jobs: list[tuple[int, int]] = []
            for b, c in enumerate(work):
                j = next((j for j in range(nxt[b], len(c)) if _regenerable(c[j])), None) if alive[b] else None
                if j is not None:
                    jobs.append((b, j))
            if not jobs:
                break
            prompts = [self._prompt(work[b][:j]) for b, j in jobs]
            enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            plen = enc["attention_mask"].sum(1).tolist()
            keep = [i for i, n in enumerate(plen) if n + self.sampling.max_new_tokens <= self.max_length]
            for i in sorted(set(range(len(jobs))) - set(keep)):  # no room for this reply: end the conversation
                b, j = jobs[i]
                alive[b] = False
                work[b] = work[b][:j]
                stats["truncated"] += 1
            if not keep:
                continue
            jobs = [jobs[i] for i in keep]
            ids = enc["input_ids"][keep]
            mask = enc["attention_mask"][keep]
            cut = int((mask.sum(0) > 0).nonzero()[0])  # drop columns that are padding in every kept row
            ids, mask = ids[:, cut:].to(self.device), mask[:, cut:].to(self.device)
            out = self.model.generate(input_ids=ids, attention_mask=mask, pad_token_id=self.tok.pad_token_id,
                                      eos_token_id=self.eos, **gen_kwargs)
            new = out[:, ids.shape[1]:].cpu()  # [B, <=max_new_tokens]
            for r, (b, j) in enumerate(jobs):
                toks = new[r].tolist()
                end = next((t for t, x in enumerate(toks) if x in self.eos), None)
                if end is None:
                    stats["unfinished"] += 1
                    end = len(toks)
                text = self.tok.decode(toks[:end], skip_special_tokens=True).strip()
                work[b][j]["content"] = text
                work[b][j].pop("reasoning_content", None)  # the old reasoning belonged to the old reply
                nxt[b] = j + 1
                stats["turns"] += 1
                stats["tokens"] += end + (end < len(toks))
        result: list[list[dict] | None] = []
        for c in work:
            while c and c[-1]["role"] != "assistant":
                c.pop()
            if not any(m["role"] == "assistant" for m in c):
                stats["dropped"] += 1
                result.append(None)
            else:
                result.append(c)
        return result, stats


# ---------------------------------------------------------------------------------------------
# the resumable run: one JSON line per finished batch in OUT.partial
# ---------------------------------------------------------------------------------------------


def _read_partial(path: Path, options_sha: str) -> dict[int, dict]:
    """Finished batches of an earlier run with the same options; a torn last line is dropped."""
    if not path.is_file():
        return {}
    batches: dict[int, dict] = {}
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    try:
        head = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        head = {}
    if head.get("options_sha256") != options_sha:
        return {}
    for line in lines[1:]:
        try:
            rec = json.loads(line)
            batches[int(rec["batch"])] = rec
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            break  # a line cut by the kill: this batch and anything after it is redone
    return batches


def run_regenerate(
    inputs: list[str],
    out: str | os.PathLike,
    model: str | Any = "smollm2",
    tokenizer: Any = None,
    sampling: Sampling | None = None,
    batch_size: int = 32,
    max_length: int = 4096,
    max_samples: int = 0,
    dtype: str = "auto",
    device: str = "auto",
    on_batch: Any = None,
) -> Path:
    """Rewrite the assistant turns of `inputs` into `out` (JSONL). `model` may be a loaded model (with
    `tokenizer`); `on_batch(b)` runs after batch b is saved (tests use it to simulate a crash)."""
    from eyas.assets import resolve_model
    from eyas.data.readers import SkipLog, resolve_input

    sampling = sampling or Sampling()
    sampling.generate_kwargs()  # validate before any work
    if batch_size < 1:
        raise EyasError("--batch-size must be >= 1")
    out = Path(out)
    sources = [resolve_input(str(i)) for i in inputs]
    model_name = resolve_model(model) if isinstance(model, str) else getattr(model.config, "name_or_path", "")
    options = {"format": FORMAT, "inputs": [s.fingerprint() for s in sources], "model": model_name,
               "sampling": asdict(sampling), "batch_size": batch_size, "max_length": max_length,
               "max_samples": max_samples, "dtype": dtype}
    if not isinstance(model, str):
        options["model_params"] = sum(p.numel() for p in model.parameters())
    options_sha = sha256_json(options)
    mfile = out.with_name(out.name + ".manifest.json")
    if out.is_file() and mfile.is_file() and read_json(mfile).get("options_sha256") == options_sha:
        typer.echo(f"{out} is up to date (same inputs and options): reusing it", err=True)
        return out

    log = SkipLog()
    convs: list[list[dict]] = []
    for s in sources:
        for row in s.rows():
            if row.skip:
                log.add(row.skip, row.where, row.detail)
            else:
                convs.append(row.messages)
            if max_samples and len(convs) >= max_samples:
                break
        if max_samples and len(convs) >= max_samples:
            break
    if not convs:
        raise EyasError(f"no usable conversation in {', '.join(map(str, inputs))}" +
                        ("; skipped: " + "; ".join(log.lines()) if log.total else ""))

    if isinstance(model, str):
        model, tokenizer = load_generator(model_name, dtype, device)
    elif tokenizer is None:
        raise EyasError("run_regenerate(model=<loaded model>) also needs its tokenizer")
    regen = Regenerator(model, tokenizer, sampling, max_length)

    partial = out.with_name(out.name + ".partial")
    done = _read_partial(partial, options_sha)
    nbatches = -(-len(convs) // batch_size)
    # rewrite the partial file with only its valid lines, so appends never follow a torn line
    with atomic_path(partial) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"options_sha256": options_sha}) + "\n")
        for b in sorted(done):
            f.write(json.dumps(done[b], ensure_ascii=False) + "\n")
    if done:
        typer.echo(f"resuming: {len(done)}/{nbatches} batches already done in {partial}", err=True)

    stats = Stats()
    t0 = time.perf_counter()
    with progress_bar() as progress, open(partial, "a", encoding="utf-8") as f:
        task = progress.add_task("regenerate", total=len(convs), tokens=0, info="")
        progress.update(task, completed=sum(len(r["conversations"]) for r in done.values()))
        for b in range(nbatches):
            if b in done:
                continue
            chunk = convs[b * batch_size:(b + 1) * batch_size]
            new, st = regen.batch(chunk, seed=sampling.seed * 1_000_003 + b)
            rec = {"batch": b, "conversations": new, "stats": st}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done[b] = rec
            stats.add(st)
            progress.update(task, advance=len(chunk), tokens=stats.tokens)
            if on_batch is not None:
                on_batch(b)
    dt = time.perf_counter() - t0

    total = Stats()
    kept = 0
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for b in range(nbatches):
            total.add(done[b]["stats"])
            for c in done[b]["conversations"]:
                if c is not None:
                    f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
                    kept += 1
    total.conversations = kept
    atomic_write_json(mfile, {"format": FORMAT, "options_sha256": options_sha, **options,
                              "stats": asdict(total), "skipped_inputs": dict(log.counts)})
    partial.unlink(missing_ok=True)
    typer.echo(f"regenerated {total.turns:,} turns of {kept:,} conversations into {out}: {stats.tokens:,} new "
               f"tokens in {dt:.1f}s ({stats.tokens / max(dt, 1e-9):,.0f} tok/s); {total.unfinished} replies hit "
               f"--max-new-tokens, {total.truncated} conversations cut at --max-length, {total.dropped} dropped",
               err=True)
    return out


def load_generator(model: str, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """The target as a causal LM with its tokenizer (bf16 on GPU by default, SDPA attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.engines.hf import resolve_device, resolve_dtype

    dev = resolve_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(model)
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=resolve_dtype(dtype), attn_implementation="sdpa")
    except (OSError, ValueError) as e:
        raise EyasError(f"cannot load target '{model}' for generation: {e}") from e
    if tok.chat_template is None:
        raise EyasError(f"{model}: the tokenizer has no chat template; regenerate needs one to build prompts")
    return lm.to(dev).eval(), tok


def cli(
    inputs: list[str] = typer.Option(..., "--input", "-i", help="Chat data: .json/.jsonl (ShareGPT or OpenAI "
                                     "messages), parquet, a saved dataset, or sharegpt/dummy. Repeatable."),
    out: Path = typer.Option(..., "--out", help="Output JSONL of {'messages': [...]}, read by `eyas prepare`."),
    model: str = typer.Option("smollm2", "--model", help="Target model folder or hub id in the local cache. "
                              "[default: smollm2]"),
    max_samples: int = typer.Option(0, "--max-samples", help="Use only the first N conversations; 0 = all. "
                                    "[default: 0]"),
    batch_size: int = typer.Option(32, "--batch-size", help="Conversations generated together. [default: 32]"),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", help="Longest reply. [default: 1024]"),
    max_length: int = typer.Option(4096, "--max-length", help="Prompt + reply token limit; a conversation ends "
                                   "before the first turn that does not fit. [default: 4096]"),
    temperature: float = typer.Option(0.8, "--temperature", help="Sampling temperature; 0 = greedy. [default: 0.8]"),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass. [default: 1.0]"),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens; 0 = off. [default: 0]"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (per batch, so resumed runs match). [default: 0]"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16), bfloat16, float32. [default: auto]"),
    device: str = typer.Option("auto", "--device", help="auto (GPU if any), cpu, cuda:N. [default: auto]"),
) -> None:
    run_regenerate(inputs, out, model=model, sampling=Sampling(temperature, top_p, top_k, max_new_tokens, seed),
                   batch_size=batch_size, max_length=max_length, max_samples=max_samples, dtype=dtype,
                   device=device)
