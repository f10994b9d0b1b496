"""The serving curve: throughput and speedup of each method against the batch size a server decodes at.

A server decodes many requests at once, and a draft pays less the larger the batch (the target's
forward stops being bound by reading its weights). `eyas eval --batch-size 1,4,16,64` measures every
method and the target alone at each batch size, on the same prompts in the same run; each
measurement is one row of the report's `serving` list:

    {"batch_size": 4, "method": "chain-3", "tokens_per_s": 812.5, "speedup": 1.41, "tokens_per_forward": 2.3}

`method` is a decoding method's name or "target" (the target alone, whose speedup is 1.0);
`speedup` is against the target alone at the same batch size (None without it, or where the timing
cannot have measured decoding: then `speedup_note` says why, eyas.eval.timing); the hf engine's rows
time the methods in rounds and add `speedup_range` (the rounds' lowest and highest) and `rounds`;
`tokens_per_forward`
is new tokens per target forward where counted (None otherwise). A speculative method's row may also
hold `accept_rate_by_pos`: the share of its verify steps that accepted at least j draft tokens, at
that batch size, and `identical`: the share of its greedy answers token for token the target alone's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eyas.eval.metrics import BASELINE, MethodStats
from eyas.eval.timing import guarded_speedup
from eyas.utils.io import EyasError

MAX_BATCH_SIZE = 4096  # more concurrent requests than any one engine instance schedules


@dataclass(frozen=True)
class ServingRun:
    """What one method decoded at one batch size: all its new tokens, in `seconds` of wall-clock time
    (from the first request to the last token, not the sum of per-request times)."""

    method: str
    new_tokens: int
    seconds: float
    tokens_per_forward: float | None = None
    accept_rate_by_pos: list[float] | None = None
    identical: float | None = None  # greedy: share of answers identical to the target alone's


def parse_batch_sizes(values: Sequence[Any], flag: str = "--batch-size") -> list[int]:
    """Batch sizes as given (ints or their text), checked: each in 1..MAX_BATCH_SIZE, none twice; sorted."""
    sizes = []
    for v in values:
        if isinstance(v, bool) or not (isinstance(v, int) or isinstance(v, str) and v.strip().isdigit()):
            raise EyasError(f"{flag} {v!r}: batch sizes are whole numbers, comma-separated, e.g. 1,4,16,64")
        b = int(v)
        if not 1 <= b <= MAX_BATCH_SIZE:
            raise EyasError(f"{flag} {b}: a batch size must be between 1 and {MAX_BATCH_SIZE}")
        sizes.append(b)
    if not sizes:
        raise EyasError(f"{flag}: give at least one batch size, e.g. 1 or 1,4,16,64")
    if len(set(sizes)) != len(sizes):
        raise EyasError(f"{flag} {','.join(map(str, sizes))}: a batch size is given twice")
    return sorted(sizes)


def serving_rows(batch_size: int, runs: Sequence[ServingRun]) -> list[dict[str, Any]]:
    """The report rows of one batch size, the target alone first; speedups against its tokens/s."""
    rows = []
    base = next((r for r in runs if r.method == BASELINE), None)
    base_rate = base.new_tokens / base.seconds if base is not None and base.seconds > 0 else None
    for r in sorted(runs, key=lambda r: r.method != BASELINE):
        rate = r.new_tokens / r.seconds if r.seconds > 0 else 0.0
        speedup, note = guarded_speedup(rate / base_rate if base_rate else None, r.tokens_per_forward,
                                        base.tokens_per_forward if base is not None else None)
        row = {"batch_size": int(batch_size), "method": r.method, "tokens_per_s": rate, "speedup": speedup,
               "tokens_per_forward": r.tokens_per_forward}
        if note:
            row["speedup_note"] = note
        if r.accept_rate_by_pos is not None:
            row["accept_rate_by_pos"] = r.accept_rate_by_pos
        if r.identical is not None:
            row["identical"] = r.identical
        rows.append(row)
    return rows


def runs_of(stats: dict[str, MethodStats]) -> list[ServingRun]:
    """One ServingRun per method of a batch-1 measurement, whose generations ran one after another (so the
    sum of their times is the wall-clock time)."""
    return [ServingRun(name, s.new_tokens, s.seconds, s.tokens_per_target_forward,
                       s.accept_rate_by_pos if s.max_accept else None,
                       s.identical / s.compared if s.compared else None) for name, s in stats.items()]


def batch_sizes_of(rows: Sequence[dict[str, Any]]) -> list[int]:
    return sorted({int(r["batch_size"]) for r in rows})


def is_curve(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether the rows say more than the batch-1 table already does: a batch size other than 1."""
    return any(int(r["batch_size"]) != 1 for r in rows)


def best_speedups(rows: Sequence[dict[str, Any]]) -> list[tuple[int, str, float]]:
    """(batch size, method, speedup) of the fastest method at each batch size that has a speedup."""
    out = []
    for b in batch_sizes_of(rows):
        timed = [r for r in rows if r["batch_size"] == b and r["method"] != BASELINE and r["speedup"] is not None]
        if timed:
            best = max(timed, key=lambda r: r["speedup"])
            out.append((b, best["method"], float(best["speedup"])))
    return out
