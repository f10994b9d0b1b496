"""Evaluate a draft on prompt sets: every method and the target alone on the same prompts, interleaved.

    result = evaluate_draft(model, tokenizer, draft, mtbench_set(), chain=[3, 5, 7], tree=[TreeSpec(60, 7, 10)])
    result.overall()["chain-3"].tau

Turn by turn, the target alone decodes every prompt first; its answer is the reference for the greedy
identity check and the answer that the next turn of the conversation is asked after. Then each method
decodes the same prompts. Everything goes through eyas.eval.batch_decode (static caches, CUDA graphs on a
GPU; greedy or sampled), at each of `batch_sizes` in turn: the target alone and every method at that batch
size, in timing rounds that take turns (eyas.eval.timing), so the speedups at each size are measured side
by side (`EvalResult.serving`); with `verify_budget` the methods follow the batch size (eyas.eval.budget).
The metrics per method and the records come from the first batch size.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.eval.batch_decode import BatchDecoder
from eyas.eval.budget import proposes, sweep_plan, union
from eyas.eval.metrics import BASELINE, Generation, MethodStats, record_of
from eyas.eval.prompts import PromptItem, PromptSet, render_prompt
from eyas.eval.proposer_base import ChainSpec, Method, Proposer, TreeSpec
from eyas.eval.proposers import make_proposer
from eyas.eval.target import HFTarget, stop_token_ids
from eyas.eval.timing import Timings, rotated, split_rounds, withhold_impossible
from eyas.model.config import target_fingerprint_differs
from eyas.model.draft import DraftModel
from eyas.utils.io import EyasError
from eyas.utils.progress import progress_bar


@dataclass
class EvalResult:
    """Metrics per prompt set and method (`sets[set][method]`), the settings, and per-generation records."""

    meta: dict[str, Any]
    methods: list[str]  # decoding methods in run order, the target alone excluded
    sets: dict[str, dict[str, MethodStats]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    serving: list[dict[str, Any]] = field(default_factory=list)  # rows of eyas.eval.serving, per batch size
    recommendation: dict[str, Any] | None = None  # eyas.eval.recommend: what to serve at which concurrency

    def overall(self) -> dict[str, MethodStats]:
        """All prompt sets merged."""
        out: dict[str, MethodStats] = {}
        for stats in self.sets.values():
            for name, s in stats.items():
                if name not in out:
                    out[name] = MethodStats(name, s.max_accept)
                out[name].merge(s)
        return out

    def table(self) -> dict[str, dict[str, dict[str, Any]]]:
        """{set or 'all': {method: metrics dict with speedup against the target alone}}. 'all' takes the speedup
        of the first batch size's serving row where it was timed in rounds (the median over the rounds)."""
        out = {}
        for set_name, stats in [*self.sets.items(), ("all", self.overall())]:
            base = stats.get(BASELINE)
            out[set_name] = {m: s.to_dict(base.tok_s if base else None) for m, s in stats.items()}
            withhold_impossible(out[set_name], base.tokens_per_target_forward if base else None, self.serving,
                                (self.meta.get("batch_sizes") or [1])[0], rounds_speedup=set_name == "all")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": "eyas.eval/1", "meta": self.meta, "methods": self.methods, "results": self.table(),
                "serving": self.serving, "recommendation": self.recommendation, "records": self.records}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        if d.get("format") != "eyas.eval/1":
            raise EyasError(f"not an eyas eval report (format {d.get('format')!r}, expected eyas.eval/1)")
        sets = {name: {m: MethodStats.from_dict(v) for m, v in stats.items()}
                for name, stats in d["results"].items() if name != "all"}
        return cls(meta=d["meta"], methods=d["methods"], sets=sets, records=d.get("records", []),
                   serving=d.get("serving", []), recommendation=d.get("recommendation"))


def check_draft_fits(draft: DraftModel, target_model: torch.nn.Module) -> None:
    """Refuse a draft trained for another target with a message that says what differs."""
    cfg = draft.config
    tcfg = target_model.config
    tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    problems = []
    if cfg.vocab_size != tcfg.vocab_size:
        problems.append(f"vocab {cfg.vocab_size} vs the target's {tcfg.vocab_size}")
    if cfg.target_hidden_size != tcfg.hidden_size:
        problems.append(f"target hidden size {cfg.target_hidden_size} vs {tcfg.hidden_size}")
    if target_fingerprint_differs(cfg.target_config_sha256, target_model.config, "the draft"):
        problems.append("the target config fingerprint differs")
    if problems:
        raise EyasError(f"the draft (for target {cfg.target or '?'}) does not fit this target: " + "; ".join(problems)
                        + ". Evaluate it with the target it was trained for (--model).")


def _methods(chain: Sequence[int], tree: Sequence[TreeSpec | str]) -> list[Method]:
    methods: list[Method] = [ChainSpec(int(k)) for k in chain]
    methods += [t if isinstance(t, TreeSpec) else TreeSpec.parse(t) for t in tree]
    if any(isinstance(m, ChainSpec) and m.k < 1 for m in methods):
        raise EyasError("chain lengths must be >= 1")
    return methods


def _as_sets(prompts: PromptSet | Sequence[PromptSet] | Sequence[str] | Sequence[Sequence[int]]) -> list[PromptSet]:
    if isinstance(prompts, PromptSet):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, PromptSet) for p in prompts):
        return prompts  # type: ignore[return-value]
    if prompts and all(isinstance(p, str) for p in prompts):
        return [PromptSet.from_texts("prompts", prompts)]  # type: ignore[arg-type]
    return [PromptSet("prompts", [PromptItem(str(i), token_ids=list(p)) for i, p in enumerate(prompts)])]


def _turns(item: PromptItem) -> int:
    return 1 if item.token_ids is not None else len(item.turns)


def _max_positions(model: torch.nn.Module) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", 1 << 30) or 1 << 30)


@torch.inference_mode()
def evaluate_draft(
    target_model: torch.nn.Module,
    tokenizer: Any,
    draft: DraftModel,
    prompts: PromptSet | Sequence[PromptSet] | Sequence[str] | Sequence[Sequence[int]],
    chain: Sequence[int] = (3,),
    tree: Sequence[TreeSpec | str] = (),
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    baseline: bool = True,
    seed: int = 0,
    warmup: bool | None = None,
    progress: bool | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    done: dict[tuple, dict[str, Any]] | None = None,
    stop_ids: set[int] | None = None,
    batch_sizes: Sequence[int] = (1,),
    verify_budget: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> EvalResult:
    """Speculative decoding of every prompt with each method (chains of K, trees), and the target alone.

    target_model: a transformers causal LM (its dtype and device are used as they are).
    prompts: prompt sets, plain user messages, or token-id lists.
    done / on_record: resume support; `done` maps (set, item, turn, method) to stored records.
    stop_ids: end-of-sequence ids; None takes them from the tokenizer and the model's configs, an empty
    set always generates max_new_tokens (like vLLM's ignore_eos).
    batch_sizes: prompts decoded together; the first gives the metrics and records.
    verify_budget: sweep chains and trees per batch size within this many verify tokens per round
    (eyas.eval.budget), the methods asked for included; None measures those alone.
    clock: what times the decoding (seconds); the tests pass a noisy one.
    """
    check_draft_fits(draft, target_model)
    device = next(target_model.parameters()).device
    if draft.fc.weight.device != device:
        draft.to(device)
    methods = _methods(chain, tree)
    sets = _as_sets(prompts)
    batch_sizes = list(batch_sizes) or [1]
    if min(batch_sizes) < 1:
        raise EyasError(f"batch sizes {batch_sizes} must be >= 1")
    target = HFTarget(target_model, list(draft.config.aux_layer_ids))
    stops = stop_token_ids(target_model, tokenizer) if stop_ids is None else set(stop_ids)
    proposer = make_proposer(draft)
    for m in methods:
        proposer.check(m)  # e.g. trees are EAGLE-3's
    plan = {b: methods for b in batch_sizes}
    if verify_budget is not None:
        plan = sweep_plan(batch_sizes, methods, verify_budget, lambda m: proposes(proposer, m))
        methods = union(plan)
    result = EvalResult(meta=_meta(target_model, draft, target, proposer, methods, temperature, top_p, max_new_tokens,
                                   seed),
                        methods=[m.name for m in methods])
    result.meta["batch_sizes"] = batch_sizes
    result.meta["verify_budget"] = verify_budget
    limit = _max_positions(target_model) - max_new_tokens - max([m.max_accept if isinstance(m, ChainSpec) else m.total
                                                                 for m in methods] + [0]) - 2
    run = _Evaluation(target, proposer, tokenizer, methods, result, temperature, top_p, stops, max_new_tokens,
                      baseline, seed, limit, done or {}, on_record, batch_sizes, plan, clock)
    try:
        _check_static_caches(target_model, sets, tokenizer)
        if (baseline or target.device.type == "cuda") if warmup is None else warmup:
            run.warm_up(sets)
        total = sum(s.num_turns for s in sets) * (len(plan[batch_sizes[0]]) + int(baseline))
        with progress_bar(disable=None if progress is None else not progress) as bar:
            run.bar, run.task = bar, bar.add_task("eval", total=total, tokens=0, info="")
            for pset in sets:
                run.prompt_set(pset)
        result.meta["skipped_too_long"] = run.skipped
        result.serving = run.serving_table()
    finally:
        target.close()
    return result


def _check_static_caches(target_model: torch.nn.Module, sets: list[PromptSet], tokenizer: Any) -> None:
    """Refuse, before anything is timed, a target that does not decode right over static caches
    (GraphDecoder.check_model: a plain forward against the static cache's)."""
    from eyas.generate.graph_decode import GraphDecoder

    first = next((it for s in sets for it in s.items), None)
    ids = (first.token_ids or render_prompt(tokenizer, [{"role": "user", "content": first.turns[0]}])
           if first is not None else [0, 1])
    ids = list(ids)[-64:]
    try:
        GraphDecoder(target_model, len(ids) + 8, 1, [], 0, lanes=[(len(ids) + 8, 2)]).check_model(ids)
    except EyasError as e:
        raise EyasError(f"eval decodes over static KV caches, which this target refuses: {e}") from e


def _meta(target_model: torch.nn.Module, draft: DraftModel, target: HFTarget, proposer: Proposer,
          methods: list[Method], temperature: float, top_p: float, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """The settings and machine a report's numbers were measured with."""
    dev = target.device
    return {"target": getattr(target_model.config, "_name_or_path", "") or draft.config.target,
            "draft": "",
            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed,
            "device": str(dev), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "dtype": str(target.dtype).replace("torch.", ""),
            "draft_dtype": str(proposer.dtype).replace("torch.", ""),
            "torch": torch.__version__, "host": platform.node(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "chain": [m.k for m in methods if isinstance(m, ChainSpec)],
            "tree": [m.name for m in methods if isinstance(m, TreeSpec)], "backend": "hf"}


@dataclass
class _Evaluation:
    """What every generation of one `evaluate_draft` call shares: the decoders, the settings, the records to
    resume from, and the result and progress bar being filled."""

    target: HFTarget
    proposer: Proposer
    tokenizer: Any
    methods: list[Method]
    result: EvalResult
    temperature: float
    top_p: float
    stops: set[int]
    max_new_tokens: int
    baseline: bool
    seed: int
    limit: int  # the longest prompt that leaves room for max_new_tokens and the longest speculation
    done: dict[tuple, dict[str, Any]]
    on_record: Callable[[dict[str, Any]], None] | None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    plan: dict[int, list[Method]] = field(default_factory=dict)  # the methods measured at each batch size
    clock: Callable[[], float] = time.perf_counter
    bar: Any = None
    task: Any = None
    skipped: int = 0  # turns (and the later turns of their prompt) too long for the target
    tokens: int = 0  # new tokens generated in this call (resumed records excluded), for the progress bar
    batch_decoders: dict[tuple[str, int], BatchDecoder] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)  # every timing round's draws (eyas.eval.timing)
    rounds: int = 0  # timing rounds so far: each starts with the next decoder

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def warm_up(self, sets: list[PromptSet]) -> None:
        """A generation of every method at every batch size on the first prompt: kernels, allocator, caches and
        autotuning settle before anything is timed."""
        items = [it for s in sets for it in s.items]
        if not items:
            return
        ids = self.first_turn(items[0])[:self.limit]
        fits = [n for n in (len(self.first_turn(it)) for it in items) if n <= self.limit]
        longest = max(fits or [len(ids)])  # the first turns' decoders: built once, not again for a longer prompt
        for batch in self.batch_sizes:  # every decoder that will be timed, built and run once
            for m in [None, *self.plan[batch]]:
                self.batch_decoder(m, batch, longest)
                self.decode(m, batch, [list(ids)], [self.seed])

    def first_turn(self, item: PromptItem) -> list[int]:
        """An item's first prompt, as `prompt_set` renders it."""
        if item.token_ids is not None:
            return list(item.token_ids)
        system = [{"role": "system", "content": item.system}] if item.system else []
        return render_prompt(self.tokenizer, [*system, {"role": "user", "content": item.turns[0]}])

    def prompt_set(self, pset: PromptSet) -> None:
        """Turn by turn: every conversation's turn is decoded (by the target, then each method) before the
        next turn, which is asked after the target's answers."""
        stats = {BASELINE: MethodStats(BASELINE, 0)} if self.baseline else {}
        stats.update({m.name: MethodStats(m.name, m.max_accept) for m in self.methods})
        self.result.sets[pset.name] = stats
        talks = {i: [{"role": "system", "content": it.system}] if it.system else [] for i, it in enumerate(pset.items)}
        for turn_idx in range(max((_turns(it) for it in pset.items), default=0)):
            jobs = []
            for i in list(talks):
                item = pset.items[i]
                if turn_idx >= _turns(item):
                    del talks[i]
                    continue
                if item.token_ids is not None:
                    ids = list(item.token_ids)
                else:
                    talks[i].append({"role": "user", "content": item.turns[turn_idx]})
                    ids = render_prompt(self.tokenizer, talks[i])
                if len(ids) > self.limit:  # later turns would be longer still
                    self.skipped += 1
                    self.bar.advance(self.task, (len(self.methods) + int(self.baseline)) * (_turns(item) - turn_idx))
                    del talks[i]
                    continue
                jobs.append((i, item, ids))
            answers = self.turn(pset.name, stats, turn_idx, jobs)
            for i, _, _ in jobs:
                talks[i].append({"role": "assistant", "content": answers.get(i) or ""})

    def turn(self, set_name: str, stats: dict[str, MethodStats], turn_idx: int,
             jobs: list[tuple[int, PromptItem, list[int]]]) -> dict[int, str | None]:
        """The target alone and each method on one turn of every job (item index, item, prompt ids), at each batch
        size, in timing rounds (eyas.eval.timing); returns the target's answer text per item index."""
        answers: dict[int, str | None] = {i: None for i, _, _ in jobs}
        every = [None, *self.methods] if self.baseline else list(self.methods)
        for b_idx, batch in enumerate(self.batch_sizes):
            methods = [m for m in every if m is None or m in self.plan[batch]]
            for r_idx, part in enumerate(split_rounds(jobs, batch)):
                round_key = (set_name, turn_idx, r_idx)
                stored = {(i, m): self.done[(set_name, item.id, turn_idx, m.name if m else BASELINE)]
                          for i, item, _ in part for m in methods
                          if b_idx == 0 and (set_name, item.id, turn_idx, m.name if m else BASELINE) in self.done}
                gens = {}
                for m in rotated(methods, self.rounds):  # round-robin: each round starts with the next decoder
                    todo = [(i, ids) for i, _, ids in part if (i, m) not in stored]
                    seeds = [self.seed + 7919 * i + 104729 * turn_idx + every.index(m) for i, _ in todo]
                    gens[m] = dict(zip([i for i, _ in todo], self.decode(m, batch, [p for _, p in todo], seeds),
                                       strict=True))
                self.rounds += 1
                reference: dict[int, list[int] | None] = {}
                for m in methods:  # the target alone first: its answers are the reference
                    for i, item, ids in part:
                        if (i, m) in stored:
                            rec = stored[(i, m)]
                            self.resumed(batch, round_key, stats, m, rec, answers, reference, i)
                            continue
                        gen = gens[m][i]
                        if m is None:
                            reference[i] = gen.tokens
                        ref = reference.get(i)
                        same = gen.tokens == ref if self.greedy and m is not None and ref is not None else None
                        self.timings.add(batch, m.name if m else BASELINE, round_key, gen.new_tokens, gen.seconds,
                                         gen.target_forwards, same)
                        if b_idx == 0:
                            rec = self.record(set_name, stats, item.id, turn_idx, m, ids, gen, same, answers[i] is None)
                            answers[i] = answers[i] or rec.get("answer")
        return answers

    def resumed(self, batch: int, round_key: tuple, stats: dict[str, MethodStats], m: Method | None,
                rec: dict[str, Any], answers: dict[int, str | None], reference: dict[int, list[int] | None],
                i: int) -> None:
        """Count a resumed run's record of a generation as if it had been decoded in this round."""
        name = m.name if m is not None else BASELINE
        stats[name].add_record(rec)
        self.timings.add(batch, name, round_key, rec["new_tokens"], rec["seconds"], rec["target_forwards"],
                         rec.get("identical"))
        self.result.records.append(rec)
        self.bar.advance(self.task)
        if m is None:
            reference[i] = rec.get("answer_ids")
        answers[i] = answers[i] or rec.get("answer")

    def decode(self, m: Method | None, batch: int, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        """Every prompt with method m (None: the target alone), batched over static caches and timed with `clock`
        (a batch's wall time shared among its answers by their new tokens); sampling draws from the decoder's
        generator seeded with the first seed."""
        if not prompts:
            return []
        dec = self.batch_decoder(m, batch, max(len(p) for p in prompts))
        return self.timed(lambda: dec.run(prompts, seeds[0]))

    def timed(self, run: Callable[[], list[Generation]]) -> list[Generation]:
        """The generations `run` returns, their `seconds` the wall time it took (read from `clock`, the device
        synchronized), shared by their new tokens."""
        dev = self.target.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = self.clock()
        gens = run()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = self.clock() - t0
        total = sum(g.new_tokens for g in gens) or 1
        for g in gens:
            g.seconds = seconds * g.new_tokens / total
        return gens

    def batch_decoder(self, m: Method | None, batch: int, longest: int) -> BatchDecoder:
        """The decoder of (method, batch size), its graphs captured before it is timed; built again with
        longer caches when a prompt outgrows them."""
        key = (m.name if m is not None else BASELINE, batch)
        need = longest + self.max_new_tokens + BatchDecoder.margin(m)
        dec = self.batch_decoders.get(key)
        if dec is None or dec.length < need:
            self.batch_decoders.pop(key, None)
            dec = BatchDecoder(self.target, self.proposer if m is not None else None, m, batch, -(-need // 256) * 256,
                               self.max_new_tokens, sorted(self.stops), temperature=self.temperature,
                               top_p=self.top_p, seed=self.seed)
            dec.prepare()
            self.batch_decoders[key] = dec
        return dec

    def serving_table(self) -> list[dict[str, Any]]:
        """The serving rows (eyas.eval.serving) of every batch size, generations resumed from records included,
        each with the share of greedy answers identical to the target's at that batch size."""
        return [row for batch in self.batch_sizes for row in self.timings.rows(batch)]

    def record(self, set_name: str, stats: dict[str, MethodStats], item_id: str, turn_idx: int, m: Method | None,
               ids: list[int], gen: Generation, identical: bool | None, with_answer: bool) -> dict[str, Any]:
        """Count a new generation, record it (with the answer text if `with_answer`) and show it on the bar."""
        name = m.name if m is not None else BASELINE
        stats[name].add(gen, identical)
        rec = record_of(set_name, item_id, turn_idx, name, gen, 0 if m is None else m.max_accept, identical, len(ids))
        if with_answer and self.tokenizer is not None:
            rec["answer"] = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            rec["answer_ids"] = gen.tokens
        self.result.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        self.tokens += gen.new_tokens
        taus = " ".join(f"{n}: tau {s.tau:.2f}" for n, s in stats.items() if s.tau is not None)
        self.bar.update(self.task, advance=1, tokens=self.tokens, info=f"{set_name} {taus}")
        return rec


@torch.inference_mode()
def greedy_acceptance(target_model: torch.nn.Module, tokenizer: Any, draft: DraftModel,
                      prompts: PromptSet | Sequence[PromptSet] | Sequence[str] | Sequence[Sequence[int]],
                      k: int = 3, max_new_tokens: int = 64, ignore_eos: bool = False) -> dict[str, Any]:
    """Greedy chain-of-K acceptance in vLLM's counters, to compare with what vLLM reports for the same draft.

    Returns num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos [K] (steps that
    accepted position j, vLLM's `num_accepted_tokens_per_pos`), mean_acceptance_length (= tau).
    """
    res = evaluate_draft(target_model, tokenizer, draft, prompts, chain=[k], tree=(), temperature=0.0,
                         max_new_tokens=max_new_tokens, baseline=False, warmup=False, progress=False,
                         stop_ids=set() if ignore_eos else None)
    s = res.overall()[ChainSpec(k).name]
    n = s.steps
    return {"num_drafts": n, "num_draft_tokens": n * k, "num_accepted_tokens": s.accepted,
            "accepted_per_pos": [round(r * n) for r in s.accept_rate_by_pos],
            "mean_acceptance_length": s.tau, "acceptance_rate": s.accepted / (n * k) if n else None}
