"""Timing rounds, and the speedups they can honestly give.

A speedup is a ratio of two wall-clock rates, and a machine shared with other work (a laptop, a CI runner,
a 2-core VM) can slow either side at any moment. So the evaluation times in rounds: a round decodes the
same prompts with the target alone and with every method, one after another (the order rotated from
round to round, each decoder warmed up before its first round), and a method's speedup is the median of
its per-round ratios against the target alone, with their range.

A speedup is also bounded: a verify forward costs at least a one-token forward of the target, so decoding
with a draft cannot run faster than (its tokens per target forward) / (the target alone's) times the
target alone. A measured speedup above that bound, in the median or in any one round, or a target alone
whose own speed moved by more than `NOISY_RATE_SPREAD` between rounds, says the clock measured the
machine's other work, not decoding: the row then carries no speedup, and `speedup_note` says why.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from eyas.eval.metrics import BASELINE

NOISY_RATE_SPREAD = 2.0  # the target alone's fastest round / slowest round beyond which timing is not decode's
MAX_ROUNDS = 4  # rounds a turn's prompts are split into at one batch size (each at least a batch of prompts)
T = TypeVar("T")


@dataclass
class Draw:
    """What one method decoded in one round."""

    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def per_forward(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None


@dataclass
class Timings:
    """Every draw of an evaluation, by (batch size, method, round), and the identity counts per (batch, method)."""

    draws: dict[tuple[int, str], dict[Hashable, Draw]] = field(default_factory=dict)
    identity: dict[tuple[int, str], list[int]] = field(default_factory=dict)  # [compared, identical]

    def add(self, batch: int, method: str, round_key: Hashable, tokens: int, seconds: float, forwards: int,
            identical: bool | None) -> None:
        d = self.draws.setdefault((batch, method), {}).setdefault(round_key, Draw())
        d.tokens += int(tokens)
        d.seconds += float(seconds)
        d.forwards += int(forwards)
        same = self.identity.setdefault((batch, method), [0, 0])
        if identical is not None:
            same[0] += 1
            same[1] += int(identical)

    def rows(self, batch: int) -> list[dict[str, Any]]:
        """The serving rows of one batch size (eyas.eval.serving), the target alone first."""
        names = sorted((m for b, m in self.draws if b == batch), key=lambda m: m != BASELINE)
        base = self.draws.get((batch, BASELINE), {})
        rows = []
        for name in names:
            draws = self.draws[(batch, name)]
            total = _sum(draws.values())
            row = {"batch_size": int(batch), "method": name, "tokens_per_s": total.rate or 0.0, "speedup": None,
                   "tokens_per_forward": total.per_forward, "rounds": len(draws)}
            if name == BASELINE:
                row["speedup"] = 1.0 if total.rate else None
            elif base:
                row.update(paired_speedup(draws, base))
            compared, same = self.identity.get((batch, name), [0, 0])
            if compared:
                row["identical"] = same / compared
            rows.append(row)
        return rows


def _sum(draws: Any) -> Draw:
    draws = list(draws)
    return Draw(sum(d.tokens for d in draws), sum(d.seconds for d in draws), sum(d.forwards for d in draws))


def bound(method_per_forward: float | None, target_per_forward: float | None) -> float | None:
    """The most a method's decoding can outrun the target alone's: its tokens per target forward over the target
    alone's (1.0 where the target's were not counted)."""
    if not method_per_forward:
        return None
    return method_per_forward / (target_per_forward or 1.0)


def paired_speedup(draws: dict[Hashable, Draw], base: dict[Hashable, Draw]) -> dict[str, Any]:
    """A method's speedup over the rounds it shares with the target alone: the median of the per-round ratios
    and their range, or None and `speedup_note` where the timing cannot be decode's."""
    ratios, limits = [], []
    for key, d in draws.items():
        b = base.get(key)
        if b is not None and d.rate and b.rate:
            ratios.append(d.rate / b.rate)
            limits.append(bound(d.per_forward, b.per_forward))
    if not ratios:
        return {"speedup": None}
    out: dict[str, Any] = {"speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
    total, base_total = _sum(draws.values()), _sum(base.values())
    note = noise_note(out["speedup"], bound(total.per_forward, base_total.per_forward), ratios, limits,
                      [b.rate for b in base.values() if b.rate])
    if note:
        out.update({"speedup": None, "speedup_range": None, "speedup_note": note})
    return out


def noise_note(speedup: float, limit: float | None, ratios: Sequence[float], limits: Sequence[float | None],
               base_rates: Sequence[float]) -> str | None:
    """Why a measured speedup cannot be decode's (None when it can): the sentence the report and the closing
    words print instead of the number."""
    eps = 1e-9
    if limit is not None and speedup > limit + eps:
        return (f"it measured {speedup:.2f}x, more than the {limit:.2f} tokens per target forward allow (a verify "
                "forward costs at least a one-token forward): the machine's other work was timed, not decoding")
    over = [(r, lim) for r, lim in zip(ratios, limits, strict=True) if lim is not None and r > lim + eps]
    if over:
        r, lim = max(over)
        return (f"one timing round measured {r:.2f}x, more than the {lim:.2f} tokens per target forward allow: "
                "the machine's other work was timed, not decoding")
    if len(base_rates) > 1 and max(base_rates) > NOISY_RATE_SPREAD * min(base_rates):
        return (f"the target alone ran between {min(base_rates):.1f} and {max(base_rates):.1f} tok/s from one "
                "timing round to the next on the same kind of prompts: the machine was busy with other work")
    return None


def split_rounds(jobs: Sequence[T], batch: int) -> list[list[T]]:
    """A turn's jobs as timing rounds: up to MAX_ROUNDS contiguous parts, each at least `batch` jobs (so a round
    keeps `batch` requests in flight), one part when there are fewer."""
    n = len(jobs)
    parts = max(1, min(MAX_ROUNDS, n // max(batch, 1)))
    cuts = [n * i // parts for i in range(parts + 1)]
    return [list(jobs[cuts[i]:cuts[i + 1]]) for i in range(parts) if cuts[i + 1] > cuts[i]]


def rotated(items: Sequence[T], start: int) -> list[T]:
    """`items` from position start % len, round-robin: each round starts with the next decoder, so drift over
    the run falls on all of them alike."""
    if not items:
        return []
    s = start % len(items)
    return [*items[s:], *items[:s]]


def guarded_speedup(speedup: float | None, method_per_forward: float | None,
                    target_per_forward: float | None) -> tuple[float | None, str | None]:
    """A single (unpaired) speedup, kept only when it is possible: (speedup, None) or (None, why)."""
    if speedup is None:
        return None, None
    note = noise_note(speedup, bound(method_per_forward, target_per_forward), [], [], [])
    return (None, note) if note else (speedup, None)


def withhold_impossible(table: dict[str, dict[str, Any]], target_per_forward: float | None,
                        serving: Sequence[dict[str, Any]], first_batch: int, rounds_speedup: bool) -> None:
    """A metrics table ({method: MethodStats.to_dict}) with no speedup the timing cannot have given: each is
    checked against its bound, and withheld where the `serving` row of `first_batch` (the same decoding, timed
    in rounds) was; with `rounds_speedup`, that row's speedup (the median over the rounds) replaces it."""
    timed = {r["method"]: r for r in serving if r["batch_size"] == first_batch}
    for m, row in table.items():
        row["speedup"], note = guarded_speedup(row["speedup"], row["tokens_per_target_forward"], target_per_forward)
        served = timed.get(m, {})
        if rounds_speedup and "rounds" in served:
            row["speedup"] = served["speedup"]
        note = note or served.get("speedup_note")
        if note:
            row["speedup"], row["speedup_note"] = None, note
