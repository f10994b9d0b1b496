"""Rewrite the assistant turns of chat data with the target itself (self-distillation for EAGLE-3).

The draft learns to predict the target, so training text written by the target matches what it
will see when serving. Every conversation keeps its structure (system prompt, user turns, number
and order of turns); each assistant turn is replaced by the target's own reply to the conversation
so far (earlier turns already rewritten). Work is saved in batches of conversations, so a run
killed at any point resumes from its last saved batch; greedy runs (and sampled ones with the
round-by-round engines, seeded per batch) then write the same file as an uninterrupted run.

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
ENGINES = ("auto", "generate", "static", "vllm", "continuous")


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


class _Conversation:
    """One conversation being rewritten turn by turn."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages = [dict(m) for m in messages]
        self.next = 0  # first message not rewritten or skipped yet

    def next_turn(self) -> int | None:
        return next((j for j in range(self.next, len(self.messages)) if _regenerable(self.messages[j])), None)

    def result(self) -> list[dict] | None:
        """The rewritten conversation ending on an assistant turn, or None when none is left."""
        c = self.messages
        while c and c[-1]["role"] != "assistant":
            c.pop()
        return c if any(m["role"] == "assistant" for m in c) else None


def _new_stats() -> dict[str, int]:
    return {"turns": 0, "tokens": 0, "unfinished": 0, "truncated": 0, "dropped": 0}


class Regenerator:
    """Rewrites assistant turns with one model and its tokenizer.

    Engines: "generate" (this class) runs transformers' `generate` on padded batches, turn by turn across
    a batch (any transformers version, bit-reproducible sampling); "vllm" (VllmRegenerator) sends each
    such round to vLLM at once. The streaming engines keep many conversations in flight, each with its
    next turn queued as soon as its last reply ends: "static" (StaticRegenerator) on eyas' own continuous
    batching over static KV caches with CUDA-graph decode steps, "continuous" (ContinuousRegenerator) on
    transformers' continuous batching (paged KV cache; it pays off only with a flash-attention kernel:
    with the paged-SDPA fallback it measured slower than "generate" on an H200, docs/benchmarks.md).
    """

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int = 4096,
                 template_kwargs: dict | None = None) -> None:
        self.model, self.tok, self.sampling, self.max_length = model, tokenizer, sampling, max_length
        self.template_kwargs = template_kwargs or {}
        self.device = next(model.parameters()).device
        tokenizer.padding_side = "left"  # decoder-only generation: prompts end where replies start
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.eos = _stop_ids(model.generation_config.eos_token_id, tokenizer)

    # -- the per-turn logic every engine shares --------------------------------------------------

    def _open_turn(self, conv: _Conversation, stats: dict) -> tuple[int, list[int]] | None:
        """(turn index, prompt ids) of the next reply to write; None when the conversation is done, or
        cut because that reply would not fit in --max-length."""
        j = conv.next_turn()
        if j is None:
            return None
        text = self.tok.apply_chat_template(conv.messages[:j], tokenize=False, add_generation_prompt=True,
                                            **self.template_kwargs)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) + self.sampling.max_new_tokens > self.max_length:
            conv.messages = conv.messages[:j]
            stats["truncated"] += 1
            return None
        return j, ids

    def _close_turn(self, conv: _Conversation, j: int, toks: list[int], stats: dict) -> None:
        end = next((t for t, x in enumerate(toks) if x in self.eos), None)
        if end is None:
            stats["unfinished"] += 1
            end = len(toks)
        conv.messages[j]["content"] = self.tok.decode(toks[:end], skip_special_tokens=True).strip()
        conv.messages[j].pop("reasoning_content", None)  # the old reasoning belonged to the old reply
        conv.next = j + 1
        stats["turns"] += 1
        stats["tokens"] += end + (end < len(toks))

    @staticmethod
    def _finish(conv: _Conversation, stats: dict) -> list[dict] | None:
        out = conv.result()
        stats["dropped"] += out is None
        return out

    # -- engines "generate" and "vllm": one round of turns at a time ---------------------------------

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: Any) -> None:
        """Rewrite chunks `todo` (of `chunk` conversations each), calling `on_chunk(b, conversations,
        stats)` as each is done; sampling is seeded per chunk, so a resumed run writes the same file."""
        for b in todo:
            on_chunk(b, *self.batch(convs[b * chunk:(b + 1) * chunk], seed=seed * 1_000_003 + b))

    def batch(self, convs: list[list[dict]], seed: int) -> tuple[list[list[dict] | None], dict]:
        """Rewrite every assistant turn of `convs`, turn by turn across the batch.

        Returns the new conversations (None when not even the first reply fits in --max-length) and counts.
        """
        work = [_Conversation(c) for c in convs]
        stats = _new_stats()
        live = list(range(len(work)))
        while live:
            jobs = [(b, opened) for b in live if (opened := self._open_turn(work[b], stats)) is not None]
            live = [b for b, _ in jobs]
            if not jobs:
                break
            replies = self._decode([ids for _, (_, ids) in jobs], seed)
            seed += 1
            for toks, (b, (j, _)) in zip(replies, jobs, strict=True):
                self._close_turn(work[b], j, toks, stats)
        return [self._finish(c, stats) for c in work], stats

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Replies (token ids, the stop token kept when one ended them) to left-padded prompts."""
        torch.manual_seed(seed)
        enc = self.tok.pad({"input_ids": prompts}, return_tensors="pt")
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, pad_token_id=self.tok.pad_token_id,
                                  eos_token_id=self.eos, **self.sampling.generate_kwargs())
        return out[:, ids.shape[1]:].tolist()  # [B, <=max_new_tokens]

    # -- the streaming engines: every conversation's next turn queued as soon as its last reply ends --

    def _stream(self, engine: Any, convs: list[list[dict]], chunk: int, todo: list[int], window: int,
                on_chunk: Any) -> None:
        """Rewrite chunks `todo` with up to `window` conversations in flight, one turn of each at a time in
        `engine` (`submit(key, prompt ids, rank)`; `poll()` -> [(key, reply ids)]); `on_chunk` runs as soon
        as chunk b and all before it are done, so the saved file keeps the input order. A turn is ranked by
        its conversation's place in the input, so earlier conversations finish (and are saved) first."""
        order = iter([i for b in todo for i in range(b * chunk, min((b + 1) * chunk, len(convs)))])
        work: dict[int, _Conversation] = {}
        stats = {b: _new_stats() for b in todo}
        left = {b: min((b + 1) * chunk, len(convs)) - b * chunk for b in todo}
        results: dict[int, list[dict] | None] = {}
        flying: dict[str, tuple[int, int]] = {}  # request key -> (conversation, turn)
        emit = list(todo)  # chunks in order, written as soon as complete

        def advance(i: int) -> None:
            """Queue conversation i's next turn, or finish it."""
            b = i // chunk
            opened = self._open_turn(work[i], stats[b])
            if opened is not None:
                key = f"c{i}t{opened[0]}"
                engine.submit(key, opened[1], rank=i)
                flying[key] = (i, opened[0])
                return
            results[i] = self._finish(work.pop(i), stats[b])
            left[b] -= 1
            while emit and left[emit[0]] == 0:
                e = emit.pop(0)
                lo, hi = e * chunk, min((e + 1) * chunk, len(convs))
                on_chunk(e, [results.pop(k) for k in range(lo, hi)], stats.pop(e))

        while True:
            while len(work) < window and (i := next(order, None)) is not None:
                work[i] = _Conversation(convs[i])
                advance(i)
            if not flying:
                break
            for key, toks in engine.poll():
                if key in flying:
                    i, j = flying.pop(key)
                    self._close_turn(work[i], j, toks, stats[i // chunk])
                    advance(i)


class ContinuousRegenerator(Regenerator):
    """Engine "continuous": every turn streamed through transformers' continuous batching (greedy runs
    reproduce; sampled ones depend on scheduling). `window` conversations are in flight at once."""

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int, window: int) -> None:
        super().__init__(model, tokenizer, sampling, max_length)
        self.window = window

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: Any) -> None:
        # (no inference_mode here: the manager's worker thread updates its buffers outside of it)
        from transformers import GenerationConfig

        if not hasattr(self.model, "continuous_batching_context_manager"):
            raise EyasError("--engine continuous needs transformers' continuous batching "
                            "(model.continuous_batching_context_manager, transformers >= 5); "
                            "upgrade transformers or use --engine generate")
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        window = self.window
        gk = self.sampling.generate_kwargs()
        gcfg = GenerationConfig(**gk, eos_token_id=self.eos, pad_token_id=self.tok.pad_token_id)
        sizes = {}
        if self.device.type != "cuda":  # it sizes its cache from free GPU memory; on a CPU, from the workload
            sizes = {"num_blocks": -(-min(window * self.max_length, 1 << 16) // 256), "max_batch_tokens": 2048}
        cbcfg = ContinuousBatchingConfig(seed=seed, max_requests_per_batch=min(window, 1024), block_size=256,
                                         **sizes)
        hints = WorkloadHints(max_prompt_length=self.max_length, max_generated_length=gk["max_new_tokens"],
                              num_requests=window)
        with self.model.continuous_batching_context_manager(
                generation_config=gcfg, continuous_batching_config=cbcfg, workload_hints=hints,
                block=True, timeout=10, warmup=self.device.type == "cuda") as mgr:
            self._stream(_ManagerRequests(mgr, gk["max_new_tokens"], self.eos), convs, chunk, todo, window,
                         on_chunk)


class _ManagerRequests:
    """transformers' continuous-batching manager behind the submit/poll interface `_stream` drives."""

    def __init__(self, mgr: Any, max_new_tokens: int, eos: list[int]) -> None:
        self.mgr, self.max_new_tokens, self.eos = mgr, max_new_tokens, eos

    def submit(self, key: str, prompt: list[int], rank: int | None = None) -> None:
        if self.mgr.add_request(prompt, request_id=key, max_new_tokens=self.max_new_tokens,
                                eos_token_id=self.eos) is None:
            raise EyasError("transformers' continuous batching refused a request (its worker stopped: see the "
                            "log above); use --engine generate")

    def poll(self) -> list[tuple[str, list[int]]]:
        res = self.mgr.get_result(timeout=1)
        if res is None:
            if not self.mgr.is_running():
                raise EyasError("transformers' continuous batching stopped unexpectedly (see its log "
                                "above); rerun to resume, or use --engine generate")
            return []
        if not res.is_finished():
            return []
        if res.error is not None:
            raise EyasError(f"generation failed for request {res.request_id}: {res.error}")
        return [(res.request_id, list(res.generated_tokens))]


class StaticRegenerator(Regenerator):
    """Engine "static": eyas' continuous batching over static KV caches, each decode step one CUDA
    graph (eyas.engines.graph_decode); every row that frees up takes the next waiting turn. Greedy runs
    write what "generate" writes; sampled ones are seeded once per run (a resumed run differs)."""

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int = 4096,
                 kv_cache_gb: float = 0) -> None:
        from eyas.engines.graph_decode import GraphDecoder, Sampler

        super().__init__(model, tokenizer, sampling, max_length)
        # refuses up front, before any batch: a sliding window the longest sequence outgrows, or a
        # transformers version whose internals no longer match the engine (its logits checked on a real prompt)
        self.decoder = GraphDecoder(model, max_length, sampling.max_new_tokens, self.eos, tokenizer.pad_token_id,
                                    Sampler(sampling.temperature, sampling.top_p, sampling.top_k),
                                    max_cache_bytes=kv_cache_gb * 2**30 or None)
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! Who are you?"}], tokenize=False,
                                              add_generation_prompt=True)
        self.decoder.check_model(tokenizer(probe, add_special_tokens=False)["input_ids"])

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: Any) -> None:
        torch.manual_seed(seed)
        self._stream(self.decoder, convs, chunk, todo, 2 * self.decoder.capacity, on_chunk)


class VllmRegenerator(Regenerator):
    """Engine "vllm": each round of turns goes to vLLM in one call (its own continuous batching and
    paged attention, tensor parallel with --tp); the turn logic is Regenerator's."""

    def __init__(self, llm: Any, tokenizer: Any, sampling: Sampling, max_length: int, eos: list[int]) -> None:
        self.llm, self.tok, self.sampling, self.max_length = llm, tokenizer, sampling, max_length
        self.template_kwargs: dict = {}
        self.eos = eos

    def _decode(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = self.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                                max_tokens=s.max_new_tokens, seed=seed, stop_token_ids=self.eos, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        replies = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            if c.finish_reason == "stop" and (not toks or toks[-1] not in self.eos):
                toks.append(self.eos[0])  # vLLM may leave the stop token out; _close_turn looks for it
            replies.append(toks)
        return replies


def _local_engine(engine: str, asked: str, model: Any, tokenizer: Any, sampling: Sampling,
                  max_length: int, kv_cache_gb: float = 0) -> Regenerator:
    """The engine "generate" or "static"; "auto" falls back to generate when static refuses the model."""
    if engine == "static":
        try:
            return StaticRegenerator(model, tokenizer, sampling, max_length, kv_cache_gb)
        except EyasError as e:
            if asked != "auto":
                raise
            typer.echo(f"note: {e}: falling back to transformers' generate", err=True)
    return Regenerator(model, tokenizer, sampling, max_length)


def _stop_ids(eos: int | list[int] | None, tokenizer: Any) -> list[int]:
    """End-of-reply ids: the generation config's, plus the tokenizer's eos."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise EyasError("the target defines no end-of-sequence token (generation_config / tokenizer): "
                        "replies would never stop")
    return ids


# ---------------------------------------------------------------------------------------------
# the resumable run: one JSON line per finished batch in OUT.partial
# ---------------------------------------------------------------------------------------------


class _OutOfTime(Exception):
    """--max-time passed: stop generating, keep what is saved."""


def _read_partial(path: Path, options_sha: str) -> dict[int, dict]:
    """Finished batches of an earlier run with the same options; a torn last line is dropped.

    Lines are split on "\n" only: replies hold U+2028 and other characters that `str.splitlines` also
    breaks on, which would cut a saved batch in two and silently redo it and every batch after it."""
    if not path.is_file():
        return {}
    batches: dict[int, dict] = {}
    lines = path.read_bytes().split(b"\n")
    try:
        head = json.loads(lines[0])
    except ValueError:  # not JSON, or not UTF-8
        head = {}
    if head.get("options_sha256") != options_sha:
        if any(line.strip() for line in lines[1:]):
            typer.echo(f"{path} holds batches of a run with other inputs or options: starting over", err=True)
        return {}
    for line in lines[1:]:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            batches[int(rec["batch"])] = rec
        except (KeyError, TypeError, ValueError):
            break  # a line cut by the kill: this batch and anything after it is redone
    return batches


def run_regenerate(
    inputs: list[str],
    out: str | os.PathLike,
    model: str | Any = "smollm2",
    tokenizer: Any = None,
    sampling: Sampling | None = None,
    batch_size: int = 0,
    max_length: int = 4096,
    max_samples: int = 0,
    dtype: str = "auto",
    device: str = "auto",
    engine: str = "auto",
    window: int = 512,
    tp: int = 1,
    trust_remote_code: bool = False,
    kv_cache_gb: float = 0,
    max_time: float = 0,
    on_batch: Any = None,
) -> Path:
    """Rewrite the assistant turns of `inputs` into `out` (JSONL). `model` may be a loaded model (with
    `tokenizer`); `on_batch(b)` runs after batch b is saved (tests use it to simulate a crash).

    Work is saved in batches of `batch_size` conversations (0: 1024 on a GPU, 32 on a CPU); engine
    "continuous" keeps `window` conversations in flight across batch boundaries; engine "static" gives its
    KV caches `kv_cache_gb` GiB (0: 60% of the free GPU memory). Past `max_time` seconds (0: no limit) the
    batches finished so far are written to `out`, marked incomplete, and the same call resumes the rest."""
    from eyas.assets import resolve_model
    from eyas.data.readers import SkipLog, resolve_input

    sampling = sampling or Sampling()
    sampling.generate_kwargs()  # validate before any work
    from eyas.utils.devices import resolve_device

    run_device = resolve_device(device) if isinstance(model, str) else next(model.parameters()).device
    batch_size = batch_size or (1024 if run_device.type == "cuda" else 32)
    if batch_size < 1 or window < 1:
        raise EyasError("--batch-size and --window must be >= 1")
    if max_time < 0:
        raise EyasError(f"--max-time must be >= 0 (0 = no limit), not {max_time}")
    if kv_cache_gb < 0:
        raise EyasError(f"--kv-cache-gb must be >= 0 (0 = 60% of the free GPU memory), not {kv_cache_gb}")
    if engine not in ENGINES:
        raise EyasError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    asked = engine
    if engine == "auto":  # the CUDA-graph engine where it pays (a GPU); on a CPU both run at the same speed
        engine = "static" if run_device.type == "cuda" else "generate"
    out = Path(out)
    sources = [resolve_input(str(i)) for i in inputs]
    model_name = resolve_model(model) if isinstance(model, str) else getattr(model.config, "name_or_path", "")
    options = {"format": FORMAT, "inputs": [s.fingerprint() for s in sources], "model": model_name,
               "sampling": asdict(sampling), "batch_size": batch_size, "max_length": max_length,
               "max_samples": max_samples, "dtype": dtype, "engine": engine}
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

    if engine == "vllm" and not isinstance(model, str):
        raise EyasError("--engine vllm loads the target itself: pass its folder or hub id, not a loaded model")
    if engine != "vllm":
        if isinstance(model, str):
            model, tokenizer = load_generator(model_name, dtype, device, trust_remote_code)
        elif tokenizer is None:
            raise EyasError("run_regenerate(model=<loaded model>) also needs its tokenizer")

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

        def save(b: int, new: list, st: dict) -> None:
            rec = {"batch": b, "conversations": new, "stats": st}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done[b] = rec
            stats.add(st)
            progress.update(task, advance=len(new), tokens=stats.tokens)
            if on_batch is not None:
                on_batch(b)
            if max_time and time.perf_counter() - t0 >= max_time and len(done) < nbatches:
                raise _OutOfTime

        todo = [b for b in range(nbatches) if b not in done]
        try:
            if todo and engine == "vllm":
                _with_vllm(model_name, sampling, max_length, tp, dtype, trust_remote_code,
                           lambda regen: regen.run(convs, batch_size, todo, sampling.seed, save))
            elif todo:
                regen = (ContinuousRegenerator(model, tokenizer, sampling, max_length, window)
                         if engine == "continuous" else
                         _local_engine(engine, asked, model, tokenizer, sampling, max_length, kv_cache_gb))
                regen.run(convs, batch_size, todo, sampling.seed, save)
        except _OutOfTime:
            pass
    dt = time.perf_counter() - t0
    complete = len(done) == nbatches

    total = Stats()
    kept = 0
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for b in sorted(done):
            total.add(done[b]["stats"])
            for c in done[b]["conversations"]:
                if c is not None:
                    f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
                    kept += 1
    total.conversations = kept
    # a run cut by --max-time is not up to date (no options_sha256): the same command resumes it
    atomic_write_json(mfile, {"format": FORMAT, "options_sha256": options_sha if complete else None, **options,
                              "complete": complete, "batches_done": len(done), "batches": nbatches,
                              "stats": asdict(total), "skipped_inputs": dict(log.counts)})
    if complete:
        partial.unlink(missing_ok=True)
    else:
        typer.echo(f"stopped by --max-time {max_time:g}s after {len(done)}/{nbatches} batches: {out} holds those; "
                   f"the same command resumes from {partial}", err=True)
    typer.echo(f"regenerated {total.turns:,} turns of {kept:,} conversations into {out}: {stats.tokens:,} new "
               f"tokens in {dt:.1f}s ({stats.tokens / max(dt, 1e-9):,.0f} tok/s); {total.unfinished} replies hit "
               f"--max-new-tokens, {total.truncated} conversations cut at --max-length, {total.dropped} dropped",
               err=True)
    return out


def _with_vllm(model: str, sampling: Sampling, max_length: int, tp: int, dtype: str, trust_remote_code: bool,
               work: Any) -> None:
    """Run `work(VllmRegenerator)` on a vLLM engine for `model`, torn down afterwards."""
    from transformers import AutoTokenizer, GenerationConfig

    from eyas.engines.vllm import import_vllm, llm_kwargs, run_llm

    import_vllm("--engine vllm", "use --engine generate")
    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos alone
        eos = None
    stop = _stop_ids(eos, tok)
    extra = {"tensor_parallel_size": tp, "trust_remote_code": trust_remote_code}
    extra |= {} if dtype == "auto" else {"dtype": dtype}
    run_llm(llm_kwargs(model, sampling.seed, max_model_len=max_length, **extra),
            lambda llm: work(VllmRegenerator(llm, tok, sampling, max_length, stop)))


def load_generator(model: str, dtype: str = "auto", device: str = "auto",
                   trust_remote_code: bool = False) -> tuple[Any, Any]:
    """The target as a causal LM with its tokenizer (bf16 on GPU, fp32 on CPU by default, SDPA attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.utils.devices import resolve_device, resolve_dtype

    dev = resolve_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=resolve_dtype(dtype, dev), attn_implementation="sdpa",
                                                  trust_remote_code=trust_remote_code)
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
    batch_size: int = typer.Option(0, "--batch-size", help="Conversations per saved batch (the unit a killed run "
                                    "resumes from); engines generate and vllm decode each round of a batch's turns "
                                    "together. 0 = 1024 on a GPU, 32 on a CPU. [default: 0]"),
    engine: str = typer.Option("auto", "--engine", help="auto: static on a GPU, generate on a CPU. generate: "
                               "transformers' generate on padded batches (reproducible sampling, any version). "
                               "static: eyas' continuous batching over static KV caches, each decode step one CUDA "
                               "graph; a finished reply's row takes the next waiting turn at once (checked against a "
                               "plain forward first; docs/benchmarks.md has its speed). vllm: vLLM generates each "
                               "round of turns (--tp for tensor parallel). "
                               "continuous: transformers' continuous batching (greedy runs reproduce; sampled ones "
                               "depend on scheduling); worth it only with a flash-attention kernel. [default: auto]"),
    window: int = typer.Option(512, "--window", help="engine continuous: conversations in flight at once. "
                               "[default: 512]"),
    tp: int = typer.Option(1, "--tp", help="engine vllm: tensor-parallel GPUs. [default: 1]"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Let transformers / vLLM run the "
                                           "target's own code (needed by e.g. Kimi-K2.5). [default: off]"),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", help="Longest reply. [default: 1024]"),
    max_length: int = typer.Option(4096, "--max-length", help="Prompt + reply token limit; a conversation ends "
                                   "before the first turn that does not fit. [default: 4096]"),
    temperature: float = typer.Option(0.8, "--temperature", help="Sampling temperature; 0 = greedy. [default: 0.8]"),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass. [default: 1.0]"),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens; 0 = off. [default: 0]"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (per batch, so resumed runs match). [default: 0]"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32. [default: auto]"),
    device: str = typer.Option("auto", "--device", help="auto (GPU if any), cpu, cuda:N. [default: auto]"),
    max_time: float = typer.Option(0, "--max-time", help="Wall-clock budget in seconds (looked at after each saved "
                                   "batch): past it, the batches finished so far are written to OUT (its manifest "
                                   "says complete: false) and the same command resumes the rest. 0 = no limit. "
                                   "[default: 0]"),
    kv_cache_gb: float = typer.Option(0, "--kv-cache-gb", help="engine static: GiB of KV cache (more rows decode "
                                      "at once); 0 = 60% of the free GPU memory. Set it to share the GPU with "
                                      "other jobs. [default: 0]"),
) -> None:
    run_regenerate(inputs, out, model=model, sampling=Sampling(temperature, top_p, top_k, max_new_tokens, seed),
                   batch_size=batch_size, max_length=max_length, max_samples=max_samples, dtype=dtype,
                   engine=engine, window=window, tp=tp, trust_remote_code=trust_remote_code,
                   device=device, kv_cache_gb=kv_cache_gb, max_time=max_time)
