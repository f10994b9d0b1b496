"""Hidden-state extraction speed: hardware ceiling, bare forward, a naive loop and `eyas extract`, in one run.

    PYTHONPATH=. python3 benchmarks/extract.py            # GPU: Llama-3.1-8B shape and SmolLM2 shape
    PYTHONPATH=. python3 benchmarks/extract.py --smoke    # CPU, tiny sizes: checks the script runs

Rows, per target shape (random weights, bf16, SDPA, sequences of --seq-len tokens):
  bare forward   the decoder alone (no lm_head, no capture, nothing leaves the device): the upper bound
  bare forward, compiled   the same with each decoder layer torch.compiled, as `--compile` does (with --compile)
  naive e2e      what peers do: model(..., output_hidden_states=True), then for each sample .cpu() and
                 torch.save of its aux + final states
  eyas e2e       `run_extract` into a real store: hooks, D2H copies on a side stream into pinned shard
                 buffers, safetensors + sha256 written by a thread; timed from the first batch until the
                 last shard is on disk (the one-off target_head/manifest write is shown separately)
Goals on the 8B shape: eyas >= 85% of the bare forward and >= 2.5x the naive loop. Every row is drawn
--repeats times (default 3), interleaved; a figure is the median of its draws with their range, a ratio is
taken per round, and a goal is met only by the ratio's whole range (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    interleaved,
    matmul_ceiling,  # noqa: E402
    paired_ratio,
    spread,
    sync,
    verdict,
)

from eyas.data.prepared import PreparedWriter  # noqa: E402
from eyas.engines.base import group_batches  # noqa: E402
from eyas.engines.hf import HFEngine, compile_layers, uncompile_layers  # noqa: E402
from eyas.recipes.extract import ExtractOptions, default_token_budget, run_extract  # noqa: E402

SHAPES = {
    # Llama-3.1-8B: 32 layers, hidden 4096, FFN 14336, 32 query / 8 kv heads, vocab 128256
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    # SmolLM2-135M: 30 layers, hidden 576, FFN 1536, 9 / 3 heads, vocab 49152
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}





def build_model(shape: str, dev: torch.device):
    """Random weights, created directly on the device in bf16 (seconds, even for 8B)."""
    import transformers as tf

    cfg = tf.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(dev):
        model = tf.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def flops_per_token(cfg, seq_len: int) -> float:
    """2 x non-embedding parameters + causal attention (QK^T and AV over seq_len/2 keys on average)."""
    h, L, i = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    params = L * (h * h * 2 + h * kv * 2 + 3 * h * i)
    return 2 * params + L * 2 * seq_len * h


def make_prepared(path: Path, n: int, seq_len: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    w = PreparedWriter(path, vocab_size=vocab)
    for _ in range(n):
        w.add(rng.integers(0, vocab, seq_len), np.ones(seq_len, np.uint8))
    w.finish(tokenizer="random", chat_template_sha256="", max_length=seq_len, skipped={}, truncated=0,
             options_sha256="bench", sources=["random"])


def batches_of(n: int, seq_len: int, budget: int, vocab: int, dev: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq_len), generator=g)
    return [ids[b].to(dev) for b in group_batches([seq_len] * n, budget)]


@torch.inference_mode()
def bare_forward(model, batches: list[torch.Tensor], dev: torch.device, compiled: bool = False) -> float:
    text = model.model
    if compiled:
        compile_layers(text.layers)  # as `--compile` does
    text(input_ids=batches[0], use_cache=False)  # warm-up (kernels, allocator, compile)
    sync(dev)
    t = time.perf_counter()
    for ids in batches:
        text(input_ids=ids, use_cache=False)
    sync(dev)
    dt = time.perf_counter() - t
    uncompile_layers(text.layers)
    return dt


@torch.inference_mode()
def naive_e2e(model, batches: list[torch.Tensor], aux_ids: list[int], out: Path, dev: torch.device) -> float:
    out.mkdir(parents=True, exist_ok=True)
    model(input_ids=batches[0][:1], output_hidden_states=True, use_cache=False)
    sync(dev)
    t = time.perf_counter()
    i = 0
    for ids in batches:
        hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        for b in range(ids.shape[0]):
            aux = torch.cat([hs[k][b] for k in aux_ids], dim=-1).cpu()
            torch.save({"input_ids": ids[b].cpu(), "aux_hidden": aux, "final_hidden": hs[-1][b].cpu()},
                       out / f"{i}.pt")
            i += 1
    sync(dev)
    return time.perf_counter() - t


def eyas_e2e(model, prepared: Path, out: Path, budget: int, dev: torch.device, fp8: bool,
             compiled: bool = False) -> dict:
    engine = HFEngine(model, dtype="bfloat16", device=dev, compile=compiled)
    z = torch.zeros(8, dtype=torch.long)
    engine.capture([z, z])  # warm-up, as for the other rows (and the compile: batch > 1, as in the run)
    engine.capture([z, z[:7]])  # ragged batches carry a mask: their graph too
    stats: dict = {}
    run_extract(ExtractOptions(prepared=prepared, out=out, model="bench", token_budget=budget, fp8=fp8,
                               compile=compiled), engine_obj=engine, stats=stats)
    engine.close()
    return stats


def bench_shape(shape: str, args, dev: torch.device, work: Path, ceiling: float) -> list[tuple]:
    """Every row of one target shape --repeats times, interleaved: (shape, row, [tok/s per round], note)."""
    model = build_model(shape, dev)
    cfg = model.config
    n, T = args.samples or (192 if shape == "llama-8b" else 768), args.seq_len
    budget = args.token_budget or default_token_budget(dev, cfg.hidden_size)
    N = cfg.num_hidden_layers
    aux_ids = [2, N // 2, N - 3]
    tokens = n * T
    batches = batches_of(n, T, budget, cfg.vocab_size, dev)
    prepared = work / f"prepared-{shape}"
    make_prepared(prepared, n, T, cfg.vocab_size)
    print(f"# {shape}: {n} x {T} tokens, token budget {budget}, aux layers {aux_ids}", flush=True)

    def naive() -> tuple[float, str]:
        t = naive_e2e(model, batches, aux_ids, work / "naive", dev)
        shutil.rmtree(work / "naive", ignore_errors=True)
        return tokens / t, ""

    def eyas(fp8: bool, compiled: bool) -> tuple[float, str]:
        st = eyas_e2e(model, prepared, work / "store", budget, dev, fp8, compiled)
        shutil.rmtree(work / "store", ignore_errors=True)
        return st["tokens"] / st["seconds"], (f"{st['bytes'] / st['seconds'] / 2**30:.2f} GiB/s to disk; "
                                              f"+{st['total_seconds'] - st['seconds']:.1f}s one-off (plan, head, "
                                              "manifest)")

    def bare(compiled: bool) -> tuple[float, str]:
        rate = tokens / bare_forward(model, batches, dev, compiled=compiled)
        tflops = rate * flops_per_token(cfg, T) / 1e12
        return rate, f"{tflops:.3g} TFLOP/s = {tflops / ceiling:.0%} of ceiling"

    cases = {"bare forward": lambda: bare(False)}
    if args.compile:
        cases["bare forward, compiled"] = lambda: bare(True)
    cases["naive e2e (torch.save)"] = naive
    for fp8, compiled in [(False, False)] + [(True, False)] * args.fp8 + [(False, True)] * args.compile:
        cases["eyas e2e" + (" fp8" if fp8 else "") + (", compiled" if compiled else "")] = \
            lambda fp8=fp8, compiled=compiled: eyas(fp8, compiled)

    def noted(name: str, case):
        def run() -> tuple[float, str]:
            rate, note = case()
            print(f"#   {name}: {rate:,.0f} tok/s {note}", flush=True)
            return rate, note
        return run

    draws = interleaved([noted(k, f) for k, f in cases.items()], args.repeats)
    return [(shape, name, [d[0] for d in got], got[-1][1]) for name, got in zip(cases, draws, strict=True)]


def print_report(rows: list[tuple]) -> None:
    """Medians (ranges) of every row, per-round ratios to the bare forward and the naive loop, and the goals
    on the 8B shape judged on those ratios' whole range."""
    print("\n| target shape | step | tok/s, median (range) | vs bare forward | vs naive | notes (last draw) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for shape in dict.fromkeys(r[0] for r in rows):
        rs = {r[1]: r for r in rows if r[0] == shape}
        bare, naive = rs["bare forward"][2], rs["naive e2e (torch.save)"][2]
        for _, step, rates, note in rs.values():
            print(f"| {shape} | {step} | {spread(rates).show()} | {paired_ratio(rates, bare).show('.2f')} | "
                  f"{paired_ratio(rates, naive).show('.2f')} | {note} |")
    rs = {r[1]: r[2] for r in rows if r[0] == "llama-8b"}
    for name in [n for n in rs if n.startswith("eyas e2e") and "fp8" not in n]:
        a = paired_ratio(rs[name], rs["bare forward" + name.removeprefix("eyas e2e")])
        b = paired_ratio(rs[name], rs["naive e2e (torch.save)"])
        print(f"\ngoals on llama-8b, {name}: eyas/bare {a.show('.2f')} (>= 0.85: {verdict(a, 0.85)}), "
              f"eyas/naive {b.show('.2f')} (>= 2.5: {verdict(b, 2.5)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks that the script runs")
    p.add_argument("--shapes", default="llama-8b,smollm2", help="comma-separated: llama-8b, smollm2, tiny")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--samples", type=int, default=0, help="sequences per row (0: 192 for 8B, 768 for SmolLM2)")
    p.add_argument("--token-budget", type=int, default=0, help="0: eyas' default for the shape")
    p.add_argument("--fp8", action="store_true", help="also time eyas with fp8 storage")
    p.add_argument("--compile", action="store_true", help="also time the bare forward and eyas with --compile")
    p.add_argument("--repeats", type=int, default=3, help="draws of every row, interleaved (medians, ranges)")
    p.add_argument("--work-dir", default=None, help="where stores are written (deleted after each row)")
    args = p.parse_args()
    os.environ.setdefault("EYAS_NO_PROGRESS", "1")
    if args.smoke:
        dev = torch.device("cpu")
        torch.set_num_threads(1)  # steadier figures on a shared CPU
        args.shapes, args.seq_len, args.samples = "tiny", 64, args.samples or 24
        ceiling = matmul_ceiling(dev, 256, 5) / 1e12
    else:
        if not torch.cuda.is_available():
            sys.exit("no GPU: run with --smoke on a CPU")
        dev = torch.device("cuda", 0)
        ceiling = matmul_ceiling(dev, 8192, 100) / 1e12
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-", dir=args.work_dir))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"# device: {name}; torch {torch.__version__}; seq_len {args.seq_len}; bf16 matmul ceiling "
          f"{ceiling:.3g} TFLOP/s", flush=True)
    rows = []
    try:
        for shape in args.shapes.split(","):
            rows += bench_shape(shape, args, dev, work, ceiling)
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # the shape's model is gone with bench_shape's frame
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print_report(rows)


if __name__ == "__main__":
    main()
