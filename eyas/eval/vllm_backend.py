"""`eyas eval --engine vllm`: the same measurement through vLLM's own EAGLE-3 speculative decoding.

The draft is exported to vLLM's layout (eyas.export) in a temporary folder. The target alone runs
first (its answers make MT-Bench's second turns, as in the hf backend), then one vLLM instance per
chain length K on the same prompts, one request at a time (batch 1, like the hf backend). tau and
acceptance by position come from vLLM's own counters (`vllm:spec_decode_*`), so they are what
vLLM reports in production. vLLM verifies chains only here: trees are measured with --engine hf.

Batch sizes above 1 (`--batch-size 1,4,16`) are served the way a server sees them: every prompt of
the run goes through vLLM's scheduler with at most that many requests in flight, a finished request
making room for the next one, for the target alone and then each chain in the same instance as its
batch-1 measurement. Each batch size gives one row per method of the serving curve (eyas.eval.serving).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from eyas.engines.vllm.runtime import import_vllm, llm_kwargs, run_llm
from eyas.eval.metrics import BASELINE, Generation, MethodStats
from eyas.eval.prompts import PromptSet, render_prompt
from eyas.eval.proposer_base import ChainSpec
from eyas.eval.runner import EvalResult
from eyas.eval.serving import ServingRun, runs_of, serving_rows
from eyas.utils.io import EyasError


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters now: num_drafts, num_draft_tokens, num_accepted_tokens,
    num_accepted_tokens_per_pos (summed over vLLM's engines)."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_"):
            continue
        key = m.name.removeprefix("vllm:spec_decode_")
        value = getattr(m, "values", None)
        if value is not None:
            prev = out.get(key, [0] * len(value))
            out[key] = [a + b for a, b in zip(prev, value, strict=False)]
        elif isinstance(getattr(m, "value", None), (int, float)):
            out[key] = out.get(key, 0) + m.value
    return out


def hist_from_counters(before: dict[str, Any], after: dict[str, Any], k: int) -> list[int]:
    """vLLM counts steps (num_drafts) and accepted tokens per position; the steps that accepted exactly a
    tokens follow as at_least(a) - at_least(a+1), with at_least(0) = steps."""
    pa, pb = after.get("num_accepted_tokens_per_pos") or [], before.get("num_accepted_tokens_per_pos") or []
    per_pos = [int((pa[j] if j < len(pa) else 0) - (pb[j] if j < len(pb) else 0)) for j in range(k)]
    at_least = [int(after.get("num_drafts", 0) - before.get("num_drafts", 0)), *per_pos, 0]
    return [at_least[a] - at_least[a + 1] for a in range(k + 1)]


def evaluate_with_vllm(target_path: str, draft: str, sets: list[PromptSet], chains: list[int], temperature: float,
                       top_p: float, max_new_tokens: int, seed: int = 0, log: Callable[[str], None] = print,
                       extra_llm_kwargs: dict[str, Any] | None = None, batch_sizes: Sequence[int] = (1,)
                       ) -> EvalResult:
    """Chains of each K through vLLM and the target alone, on the same prompts, at each batch size (requests in
    flight); returns an EvalResult whose `serving` holds one row per batch size and method."""
    import torch
    from transformers import AutoTokenizer

    vllm = import_vllm("--engine vllm", "measure with --engine hf (transformers; chains and trees)")
    from vllm import SamplingParams

    from eyas.export.families import export_draft, family_writer
    from eyas.export.writers import ServeOptions
    from eyas.model.checkpoints import import_draft

    if not chains:
        raise EyasError("--engine vllm measures chains (--chain K,...); trees are measured with --engine hf")
    if draft == "random":
        raise EyasError("--engine vllm needs a draft folder; `random` is for --engine hf")
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    cuda = torch.cuda.is_available()
    kwargs = llm_kwargs(target_path, seed, max_model_len=8192 if cuda else 2048, disable_log_stats=False)
    kwargs.update(extra_llm_kwargs or {})
    if max(batch_sizes) > 256:  # the LLM class's smallest default: more would wait in vLLM's queue
        kwargs.setdefault("max_num_seqs", max(batch_sizes))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    methods = [ChainSpec(k) for k in chains]
    meta = {"backend": "vllm", "vllm": vllm.__version__, "temperature": temperature, "top_p": top_p,
            "max_new_tokens": max_new_tokens, "seed": seed, "device": "cuda" if cuda else "cpu",
            "gpu": torch.cuda.get_device_name() if cuda else None, "dtype": str(kwargs.get("dtype", "auto")),
            "chain": chains, "tree": [], "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result = EvalResult(meta=meta, methods=[m.name for m in methods])
    measure = _VllmMeasurement(tokenizer, params, sets, result, greedy=temperature <= 0,
                               batch_sizes=sorted(batch_sizes))
    log("vllm: the target alone")
    run_llm(kwargs, measure.target_alone)
    with tempfile.TemporaryDirectory(prefix="eyas-eval-vllm-") as tmp:
        model = import_draft(draft, target=target_path)
        draft_dir = export_draft(model, Path(tmp) / "vllm", "vllm",
                                 ServeOptions(verifier=target_path, dtype="bfloat16" if cuda else "float32"))
        for m in methods:
            log(f"vllm: {m.name}")
            writer = family_writer(model.config)
            spec = {"method": writer.vllm_method, **writer.vllm_options, "model": str(draft_dir),
                    "num_speculative_tokens": m.k}
            run_llm({**kwargs, "speculative_config": spec}, partial(measure.chain, m))
    result.serving = measure.serving_curve()
    return result


@dataclass
class _VllmMeasurement:
    """The prompts, settings and result that the target-alone run and every chain's run share. It holds
    no vLLM instance: each run gets its own `llm` and drops it (see run_llm)."""

    tokenizer: Any
    params: Any  # vllm.SamplingParams
    sets: list[PromptSet]
    result: EvalResult
    greedy: bool
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    # per set: (item id, turn, prompt ids, the target's tokens), filled by the target-alone run
    prompts: dict[str, list[tuple[str, int, list[int], list[int]]]] = field(default_factory=dict)
    served: dict[int, list[ServingRun]] = field(default_factory=dict)  # batch size above 1 -> one run per method

    def generate(self, llm: Any, ids: list[int]) -> Generation:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], self.params, use_tqdm=False)[0].outputs[0]
        return Generation(list(out.token_ids), time.perf_counter() - t0, target_forwards=0)

    def target_alone(self, llm: Any) -> None:
        """The target alone: answers (for the next turns), reference tokens and speed."""
        first = next((it for s in self.sets for it in s.items), None)
        if first is not None:  # compile / warm up before timing
            self.generate(llm, first.token_ids
                          or render_prompt(self.tokenizer, [{"role": "user", "content": first.turns[0]}]))
        for pset in self.sets:
            stats = self.result.sets.setdefault(pset.name, {BASELINE: MethodStats(BASELINE, 0)})
            rows = self.prompts.setdefault(pset.name, [])
            for item in pset.items:
                messages = [{"role": "system", "content": item.system}] if item.system else []
                for turn_idx, turn in enumerate([None] if item.token_ids is not None else item.turns):
                    if item.token_ids is not None:
                        ids = list(item.token_ids)
                    else:
                        messages.append({"role": "user", "content": turn})
                        ids = render_prompt(self.tokenizer, messages)
                    gen = self.generate(llm, ids)
                    gen.target_forwards = gen.new_tokens
                    stats[BASELINE].add(gen)
                    rows.append((item.id, turn_idx, ids, gen.tokens))
                    answer = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": answer})
                    self.result.records.append({
                        "set": pset.name, "item": item.id, "turn": turn_idx, "method": BASELINE,
                        "prompt_tokens": len(ids), "new_tokens": gen.new_tokens, "seconds": round(gen.seconds, 6),
                        "target_forwards": gen.new_tokens, "accept_hist": [0], "identical": None, "answer": answer})
        self.serve(llm, BASELINE, 0)

    def chain(self, m: ChainSpec, llm: Any) -> None:
        """Chain-of-K decoding of the target-alone run's prompts; acceptance from vLLM's counters."""
        if any(s.items for s in self.sets):  # warm up before timing
            self.generate(llm, self.prompts[self.sets[0].name][0][2])
        for pset in self.sets:
            stats = self.result.sets[pset.name].setdefault(m.name, MethodStats(m.name, m.k))
            before = spec_counters(llm)
            for item_id, turn_idx, ids, ref in self.prompts[pset.name]:
                gen = self.generate(llm, ids)
                identical = gen.tokens == ref if self.greedy else None
                stats.add(gen, identical)
                self.result.records.append({
                    "set": pset.name, "item": item_id, "turn": turn_idx, "method": m.name, "prompt_tokens": len(ids),
                    "new_tokens": gen.new_tokens, "seconds": round(gen.seconds, 6), "identical": identical})
            after = spec_counters(llm)
            stats.accept_hist = hist_from_counters(before, after, m.k)
            stats.target_forwards = stats.steps + stats.generations  # verify steps + prefills
        self.serve(llm, m.name, m.k)

    def serve(self, llm: Any, method: str, k: int) -> None:
        """Every prompt of the run at each batch size above 1: at most that many requests in flight in vLLM's
        scheduler, a finished one replaced by the next waiting; tokens/s over the wall-clock time, and (a
        chain of `k`) acceptance from vLLM's counters."""
        rows = [row for rows in self.prompts.values() for row in rows]
        prompts = [ids for _, _, ids, _ in rows]
        for b in (b for b in self.batch_sizes if b > 1):
            before = spec_counters(llm)
            tokens, seconds = serve_in_flight(llm, prompts, self.params, b)
            new = sum(len(t) for t in tokens)
            same = sum(t == ref for t, (*_, ref) in zip(tokens, rows, strict=True)) / len(rows) if k and self.greedy \
                else None
            run = ServingRun(method, new, seconds, 1.0 if not k else None)
            if k:
                stats = MethodStats(method, k, generations=len(prompts), new_tokens=new, seconds=seconds,
                                    accept_hist=hist_from_counters(before, spec_counters(llm), k))
                stats.target_forwards = stats.steps + stats.generations
                run = ServingRun(method, new, seconds, stats.tokens_per_target_forward, stats.accept_rate_by_pos, same)
            self.served.setdefault(b, []).append(run)

    def serving_curve(self) -> list[dict[str, Any]]:
        """The serving rows: batch 1 from the one-request-at-a-time measurement, the others from `serve`."""
        rows = []
        if 1 in self.batch_sizes:
            rows += serving_rows(1, runs_of(self.result.overall()))
        for b, runs in sorted(self.served.items()):
            rows += serving_rows(b, runs)
        return rows


def serve_in_flight(llm: Any, prompts: list[list[int]], params: Any, in_flight: int) -> tuple[list[list[int]], float]:
    """Every prompt through vLLM's scheduler with at most `in_flight` requests at once, as a server under that
    much load sees them; returns each prompt's new tokens (in prompt order) and the wall-clock seconds."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    waiting = list(range(len(prompts)))[::-1]
    tokens: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()

    def submit() -> None:
        i = waiting.pop()
        engine.add_request(f"eyas-serve-{in_flight}-{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)

    for _ in range(min(in_flight, len(prompts))):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                if waiting:
                    submit()
    return tokens, time.perf_counter() - t0
