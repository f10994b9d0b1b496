"""Pieces every benchmark shares: device sync, the matmul ceiling that MFU is measured against, and how
a figure is repeated and judged.

Why repeats: one draw of a GPU benchmark moves by 10-20% between runs on the same kind of card (clocks,
compile choices, allocator state). Every case therefore runs `repeats` times, interleaved (round r runs
each case once, starting one case later than round r - 1), so that drift over the run falls on every
case alike; a figure is the median of its draws with their range, and a ratio is taken per round
(draws of the same round side by side) before its median and range. A ratio meets its goal only when its
whole range does: a range that crosses the goal is "not met".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from eyas.data.prepared import PreparedWriter

T = TypeVar("T")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def matmul_ceiling(dev: torch.device, n: int, iters: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an n x n x n GEMM on random data (never zeros): the best the device does."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t)


@dataclass(frozen=True)
class Spread:
    """The median of a figure's draws and their range."""

    median: float
    low: float
    high: float
    draws: int

    def show(self, fmt: str = ",.0f", suffix: str = "") -> str:
        """'24,844 (24,120-25,003, 3 runs)'; one draw has no range."""
        if self.draws == 1:
            return f"{self.median:{fmt}}{suffix} (1 run)"
        return f"{self.median:{fmt}}{suffix} ({self.low:{fmt}}-{self.high:{fmt}}{suffix}, {self.draws} runs)"


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("no draws to summarise")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def interleaved(cases: Sequence[Callable[[], T]], repeats: int) -> list[list[T]]:
    """Run every case `repeats` times, round by round, each round starting one case later than the
    last; returns each case's results in round order (results[case][round])."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    results: list[list[T]] = [[] for _ in cases]
    for r in range(repeats):
        for k in range(len(cases)):
            i = (r + k) % len(cases)
            results[i].append(cases[i]())
    return results


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> Spread:
    """ours[r] / theirs[r] per round r (the draws measured side by side), then their median and range."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} draws against {len(theirs)}: ratios pair draws of the same round")
    return spread([a / b for a, b in zip(ours, theirs, strict=True)])


def verdict(ratio: Spread, goal: float) -> str:
    """'met' only when the whole range is at or above the goal."""
    if ratio.low >= goal:
        return "met"
    if ratio.high >= goal:
        return "not met (its range crosses the goal)"
    return "not met"


def random_prepared(folder: Path, lengths: list[int], vocab: int, max_length: int, tag: str) -> Path:
    """A prepared dataset of random sequences of the given lengths, the loss on their last three quarters:
    what the speed benchmarks train on (the tokens' values do not change a step's cost)."""
    rng = np.random.default_rng(0)
    w = PreparedWriter(folder, vocab_size=vocab)
    for n in lengths:
        mask = np.zeros(n, dtype=np.uint8)
        mask[n // 4:] = 1
        w.add(rng.integers(0, vocab, n), mask)
    w.finish(tokenizer="random", chat_template_sha256="", max_length=max_length, skipped={}, truncated=0,
             options_sha256=tag, sources=[])
    return folder


def random_llama(dims: Sequence[int], tokens: int, dev: torch.device, dtype: torch.dtype, rope_theta: float,
                 tie: bool) -> torch.nn.Module:
    """A random-weight Llama of dims (hidden, FFN, layers, heads, KV heads, vocabulary), built in `dtype` on
    `dev`: no download, no float32 copy of a large target."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    h, ffn, layers, heads, kv, vocab = dims
    cfg = LlamaConfig(hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=max(8192, 2 * tokens),
                      rope_theta=rope_theta, tie_word_embeddings=tie)
    torch.manual_seed(0)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
