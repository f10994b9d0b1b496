"""Evaluate a draft on prompt sets: every method and the target alone on the same prompts, interleaved.

    result = evaluate_draft(model, tokenizer, draft, mtbench_set(), chain=[3, 5, 7], tree=[TreeSpec(60, 7, 10)])
    result.overall()["chain-3"].tau

Per prompt (and per turn) the target alone runs first; its answer is the reference for the greedy
identity check and the answer that the next turn of the conversation is asked after. Then each
method runs on the same prompt, so all see the same machine state and the speedups are fair.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.eval.metrics import BASELINE, MethodStats, record_of
from eyas.eval.prompts import PromptItem, PromptSet, render_prompt
from eyas.eval.proposer_base import ChainSpec, Method, TreeSpec
from eyas.eval.spec_decode import Generation, SpeculativeDecoder, target_generate
from eyas.eval.target import HFTarget, stop_token_ids
from eyas.model.config import target_config_sha256
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
        """{set or 'all': {method: metrics dict with speedup against the target alone}}."""
        out = {}
        for set_name, stats in [*self.sets.items(), ("all", self.overall())]:
            base = stats.get(BASELINE)
            base_tok_s = base.tok_s if base else None
            out[set_name] = {m: s.to_dict(base_tok_s) for m, s in stats.items()}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": "eyas.eval/1", "meta": self.meta, "methods": self.methods, "results": self.table(),
                "serving": self.serving, "records": self.records}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        if d.get("format") != "eyas.eval/1":
            raise EyasError(f"not an eyas eval report (format {d.get('format')!r}, expected eyas.eval/1)")
        sets = {name: {m: MethodStats.from_dict(v) for m, v in stats.items()}
                for name, stats in d["results"].items() if name != "all"}
        return cls(meta=d["meta"], methods=d["methods"], sets=sets, records=d.get("records", []),
                   serving=d.get("serving", []))


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
    if cfg.target_config_sha256 and cfg.target_config_sha256 != target_config_sha256(target_model.config):
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
) -> EvalResult:
    """Speculative decoding of every prompt with each method (chains of K, trees), and the target alone.

    target_model: a transformers causal LM (its dtype and device are used as they are).
    prompts: prompt sets, plain user messages, or token-id lists.
    done / on_record: resume support; `done` maps (set, item, turn, method) to stored records.
    stop_ids: end-of-sequence ids; None takes them from the tokenizer and the model's configs, an empty
    set always generates max_new_tokens (like vLLM's ignore_eos).
    """
    check_draft_fits(draft, target_model)
    device = next(target_model.parameters()).device
    if draft.fc.weight.device != device:
        draft.to(device)
    methods = _methods(chain, tree)
    sets = _as_sets(prompts)
    target = HFTarget(target_model, list(draft.config.aux_layer_ids))
    stops = stop_token_ids(target_model, tokenizer) if stop_ids is None else set(stop_ids)
    decoder = SpeculativeDecoder(target, draft, stops)
    for m in methods:
        decoder.proposer.check(m)  # e.g. trees are EAGLE-3's
    result = EvalResult(meta=_meta(target_model, draft, target, decoder, methods, temperature, top_p, max_new_tokens,
                                   seed),
                        methods=[m.name for m in methods])
    limit = _max_positions(target_model) - max_new_tokens - max([m.max_accept if isinstance(m, ChainSpec) else m.total
                                                                 for m in methods] + [0]) - 2
    run = _Evaluation(target, decoder, tokenizer, methods, result, temperature, top_p, stops, max_new_tokens,
                      baseline, seed, limit, done or {}, on_record)
    try:
        if (target.device.type == "cuda") if warmup is None else warmup:
            run.warm_up(sets)
        total = sum(s.num_turns for s in sets) * (len(methods) + int(baseline))
        with progress_bar(disable=None if progress is None else not progress) as bar:
            run.bar, run.task = bar, bar.add_task("eval", total=total, tokens=0, info="")
            for pset in sets:
                run.prompt_set(pset)
        result.meta["skipped_too_long"] = run.skipped
    finally:
        target.close()
    return result


def _meta(target_model: torch.nn.Module, draft: DraftModel, target: HFTarget, decoder: SpeculativeDecoder,
          methods: list[Method], temperature: float, top_p: float, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """The settings and machine a report's numbers were measured with."""
    dev = target.device
    return {"target": getattr(target_model.config, "_name_or_path", "") or draft.config.target,
            "draft": "",
            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed,
            "device": str(dev), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "dtype": str(target.dtype).replace("torch.", ""),
            "draft_dtype": str(decoder.draft_dtype).replace("torch.", ""),
            "torch": torch.__version__, "host": platform.node(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "chain": [m.k for m in methods if isinstance(m, ChainSpec)],
            "tree": [m.name for m in methods if isinstance(m, TreeSpec)], "backend": "hf"}


@dataclass
class _Evaluation:
    """What every generation of one `evaluate_draft` call shares: the decoders, the settings, the records to
    resume from, and the result and progress bar being filled."""

    target: HFTarget
    decoder: SpeculativeDecoder
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
    bar: Any = None
    task: Any = None
    skipped: int = 0  # turns (and the later turns of their prompt) too long for the target
    tokens: int = 0  # new tokens generated in this call (resumed records excluded), for the progress bar

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generate(self, method: Method | None, ids: list[int], gen_seed: int, n_new: int) -> Generation:
        """One generation with a method, or with the target alone (method None)."""
        g = torch.Generator(device=self.target.device).manual_seed(gen_seed) if not self.greedy else None
        if method is None:
            return target_generate(self.target, ids, n_new, self.temperature, self.top_p, self.stops, g)
        return self.decoder.generate(ids, method, n_new, self.temperature, self.top_p, g)

    def warm_up(self, sets: list[PromptSet]) -> None:
        """A short generation of every method on the first prompt: kernels, allocator and autotuning settle
        before anything is timed."""
        first = next((it for s in sets for it in s.items), None)
        if first is None:
            return
        ids = first.token_ids or render_prompt(self.tokenizer, [{"role": "user", "content": first.turns[0]}])
        for m in [None, *self.methods]:
            self.generate(m, ids[:self.limit], self.seed, min(16, self.max_new_tokens))

    def prompt_set(self, pset: PromptSet) -> None:
        stats = {BASELINE: MethodStats(BASELINE, 0)} if self.baseline else {}
        stats.update({m.name: MethodStats(m.name, m.max_accept) for m in self.methods})
        self.result.sets[pset.name] = stats
        for item_idx, item in enumerate(pset.items):
            self.prompt(pset.name, stats, item_idx, item)

    def prompt(self, set_name: str, stats: dict[str, MethodStats], item_idx: int, item: PromptItem) -> None:
        """Every turn of one prompt, each asked after the target's answer to the turn before."""
        messages = [{"role": "system", "content": item.system}] if item.system else []
        turns = [None] if item.token_ids is not None else item.turns
        for turn_idx, turn in enumerate(turns):
            if item.token_ids is not None:
                ids = list(item.token_ids)
            else:
                messages.append({"role": "user", "content": turn})
                ids = render_prompt(self.tokenizer, messages)
            if len(ids) > self.limit:
                self.skipped += 1
                self.bar.advance(self.task, len(self.methods) + int(self.baseline))
                break  # later turns would be longer still
            answer = self.turn(set_name, stats, item_idx, item.id, turn_idx, ids)
            messages.append({"role": "assistant", "content": answer or ""})

    def turn(self, set_name: str, stats: dict[str, MethodStats], item_idx: int, item_id: str, turn_idx: int,
             ids: list[int]) -> str | None:
        """The target alone, then each method, on one turn's prompt; returns the target's answer text."""
        gen_seed = self.seed + 7919 * item_idx + 104729 * turn_idx
        reference: list[int] | None = None  # the target's tokens, which greedy methods must reproduce
        answer: str | None = None
        for m_idx, m in enumerate([None, *self.methods] if self.baseline else self.methods):
            name = m.name if m is not None else BASELINE
            key = (set_name, item_id, turn_idx, name)
            if key in self.done:
                rec = self.done[key]
                stats[name].add_record(rec)
                self.result.records.append(rec)
                if reference is None and m is None:
                    reference = rec.get("answer_ids")
                self.bar.advance(self.task)
            else:
                gen = self.generate(m, ids, gen_seed + m_idx, self.max_new_tokens)
                if reference is None and m is None:
                    reference = gen.tokens
                rec = self.record(set_name, stats, item_id, turn_idx, m, ids, gen, reference, answer is None)
            if answer is None and rec.get("answer") is not None:
                answer = rec["answer"]
        return answer

    def record(self, set_name: str, stats: dict[str, MethodStats], item_id: str, turn_idx: int, m: Method | None,
               ids: list[int], gen: Generation, reference: list[int] | None, with_answer: bool) -> dict[str, Any]:
        """Count a new generation, record it (with the answer text if `with_answer`) and show it on the bar."""
        name = m.name if m is not None else BASELINE
        identical = (gen.tokens == reference) if (self.greedy and m is not None and reference is not None) else None
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
