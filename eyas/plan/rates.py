"""What `eyas plan` estimates from: measured rates (per stage, engine and card, each with its source),
the cards' compute, the shapes of the shipped configs' targets, and ShareGPT's token counts.

Every rate row was measured by a script under benchmarks/ or a timed `eyas run`, as docs/benchmarks.md
records (date, machine, command). Where a run's card or target has no row, `rate_for` scales the row
of the same stage and engine by compute (the cards' bf16 TFLOP/s, the work per token in FLOPs) and says
so: an extrapolation, optimistic where kernels run below the measured row's efficiency (MoE, INT4, TP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Card:
    name: str
    tflops: float  # dense bf16 (vendor figure); the CPU: its measured fp32 GEMM
    memory_gib: float


CARDS = {c.name: c for c in (
    Card("H100", 989.0, 80), Card("H200", 989.0, 141), Card("B200", 2250.0, 180), Card("A100", 312.0, 80),
    Card("L40S", 362.0, 48),
    Card("cpu", 0.121, 24),  # the project's 2-core AVX2 EPYC: 121 GFLOP/s fp32 (docs/benchmarks.md, 2026-12-03)
)}


@dataclass(frozen=True)
class TargetShape:
    """A target's shape as its config.json says (params: total; active: per token, for MoE)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: float
    active: float
    weight_bytes: float  # the checkpoint's weights as loaded on GPUs
    tied: bool = False
    max_positions: int = 4096


# The shipped configs' targets, from their config.json on the hub (used when no local copy of the config
# can be read: `eyas plan` never downloads). Kimi-K2.5: DeepseekV3 text model, routed experts in INT4.
KNOWN_TARGETS = {
    "Qwen/Qwen3-8B": TargetShape(36, 4096, 12288, 32, 8, 128, 151936, 8.19e9, 8.19e9, 16.4e9, False, 40960),
    "meta-llama/Llama-3.1-8B-Instruct": TargetShape(32, 4096, 14336, 32, 8, 128, 128256, 8.03e9, 8.03e9, 16.1e9,
                                                    False, 131072),
    "Qwen/Qwen3-30B-A3B": TargetShape(48, 2048, 6144, 32, 4, 128, 151936, 30.5e9, 3.3e9, 61.1e9, False, 40960),
    "moonshotai/Kimi-K2.5": TargetShape(61, 7168, 18432, 64, 64, 112, 163840, 1.04e12, 32.9e9, 595e9, False,
                                        262144),
}
SMOLLM2 = TargetShape(30, 576, 1536, 9, 3, 64, 49152, 134.5e6, 134.5e6, 269e6, True, 8192)
KNOWN_TARGETS.update({alias: SMOLLM2 for alias in ("smollm2", "smollm2-135m-instruct",
                                                   "huggingfacetb/smollm2-135m-instruct")})
# the measured rows' targets
MEASURED_SHAPES = {"llama-3.1-8b": KNOWN_TARGETS["meta-llama/Llama-3.1-8B-Instruct"], "smollm2-135m": SMOLLM2}


@dataclass(frozen=True)
class Rate:
    """tok/s of one stage on one card (per GPU; the CPU: the whole machine), and what it ran."""

    stage: str  # prepare | regenerate | extract | train | train-online | eval
    engine: str  # extract: hf | vllm; regenerate: the generator; eval: the backend; train: eyas
    card: str
    model: str  # a MEASURED_SHAPES key
    tokens: int  # sequence length (extract, train: tokens per packed row) of the measurement
    tok_s: float
    draft_vocab: int = 32000
    ttt_steps: int = 7
    draft_intermediate: int = 0  # 0: the target's
    source: str = ""


B = "docs/benchmarks.md"
RATES = (
    Rate("prepare", "tokenizer", "cpu", "smollm2-135m", 2048, 629_622, source=f"{B} Prepare, 1 worker"),
    Rate("regenerate", "static", "H200", "smollm2-135m", 2048, 29_700, source=f"{B} Regenerate, all of ShareGPT"),
    Rate("regenerate", "static", "H100", "smollm2-135m", 2048, 14_000,
         source=f"{B} Regenerate, all of ShareGPT: 13.4-14.6k tok/s on the H100"),
    Rate("extract", "hf", "H100", "llama-3.1-8b", 2048, 39_681, source=f"{B} Extract: the eyas --compile row"),
    Rate("extract", "hf", "H200", "llama-3.1-8b", 2048, 33_216, source=f"{B} Extract, one H200, eyas (uncompiled)"),
    Rate("extract", "hf", "H200", "smollm2-135m", 2048, 446_080, source=f"{B} Extract, one H200, eyas row"),
    Rate("extract", "hf", "cpu", "smollm2-135m", 256, 539, source=f"{B} The quickstart on a 2-core CPU, extract"),
    Rate("train", "eyas", "H100", "llama-3.1-8b", 2048, 25_076, source=f"{B} Train, current (H100), graphed"),
    Rate("train", "eyas", "H100", "smollm2-135m", 2048, 140_567, source=f"{B} Train, current (H100)"),
    Rate("train", "eyas", "H200", "llama-3.1-8b", 8192, 26_938, source=f"{B} Train, eyas alone (H200), graphed"),
    Rate("train", "eyas", "H200", "llama-3.1-8b", 2048, 26_164, source=f"{B} Train, eyas alone (H200), graphed"),
    Rate("train", "eyas", "H200", "smollm2-135m", 8192, 174_698, source=f"{B} Train, eyas alone (H200), graphed"),
    Rate("train", "eyas", "cpu", "smollm2-135m", 1024, 430, 8000, 3, source=f"{B} The quickstart, train"),
    Rate("train-online", "hf", "H100", "smollm2-135m", 16384, 123_540, draft_intermediate=6144,
         source=f"{B} Quality: the one-command run on one H100, median of its logged steps"),
    Rate("eval", "hf", "H200", "smollm2-135m", 96, 34.9, source=f"{B} Quality, GPU smoke config: the target alone"),
    Rate("eval", "hf", "cpu", "smollm2-135m", 48, 11.3, source=f"{B} The quickstart, eval (1,152 tokens in 102 s)"),
)

# ShareGPT (all 17,344 conversations prepare keeps) in SmolLM2's tokenizer, measured 2026-12-06 on this
# machine: mean tokens per sample when cut at max_length (other tokenizers differ by +-20%).
SHAREGPT_SAMPLES = 17_344
SHAREGPT_MEAN_TOKENS = ((128, 126.8), (256, 249.1), (512, 473.8), (1024, 847.8), (2048, 1356.7), (4096, 1453.1),
                        (8192, 1461.5), (16384, 1465.6))
SHAREGPT_TURNS = 56_640 / 16_871  # assistant turns per conversation (docs/benchmarks.md, regenerate)
DUMMY_SAMPLES, DUMMY_MEAN_TOKENS = 500, ((64, 62.0), (96, 77.0), (128, 83.1))


def mean_tokens(table: tuple[tuple[int, float], ...], max_length: int) -> float:
    """Mean tokens per sample cut at `max_length`, interpolated in the measured table."""
    xs, ys = zip(*table, strict=True)
    return float(np.interp(max_length, xs, ys))


def rate_for(stage: str, engine: str, card: str, flops: float, flops_of: Callable[[Rate], float]) -> tuple[float, str]:
    """(tok/s per GPU, how it was found) for `stage` on `card` with `flops` of work per token (FLOPs;
    decoder layers for launch-bound decoding); `flops_of(row)` is a measured row's own. The row of this
    card (else any) closest in work per token is taken as measured when it matches, else scaled by the
    work and the cards' compute."""
    rows = [r for r in RATES if r.stage == stage and r.engine == engine] or [r for r in RATES if r.stage == stage]
    on_card = [r for r in rows if r.card == card] or rows
    best = min(on_card, key=lambda r: abs(np.log(flops_of(r) / flops)))
    scale = (flops_of(best) / flops) * (CARDS[card].tflops / CARDS[best.card].tflops)
    label = (f"{best.stage} ({best.engine}) on {best.card}, {best.model} at {best.tokens} tokens: {best.tok_s:,.0f} "
             f"tok/s [{best.source}]")
    if abs(scale - 1) < 0.05 and best.card == card and best.engine == engine:
        return best.tok_s, f"measured: {label}"
    return best.tok_s * scale, f"extrapolated (x{scale:.3g}: work per token and card compute) from {label}"
