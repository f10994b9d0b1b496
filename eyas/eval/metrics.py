"""Acceptance and speed metrics, defined the way the EAGLE papers and vLLM count them.

- tau (acceptance length): tokens produced per verify forward, the bonus token included, i.e.
  1 + accepted draft tokens / verify steps. It equals vLLM's "mean acceptance length".
- acceptance by position j: the share of verify steps that accepted at least j draft tokens
  (`accept_rate_by_pos`), and the conditional rate P(>= j | >= j-1) (`accept_cond_by_pos`,
  EAGLE's "n-alpha").
- tokens per target forward: new tokens / target forwards, the prefill included (what the
  target's cost is divided by in practice; approaches tau on long answers).
- draft forwards per verify step: K for an EAGLE-3 chain (the tree's depth), 1 for a block
  drafter (DFlash), whose point is drafting K tokens in one forward.
- tok/s and speedup: wall-clock throughput, against the target alone on the same prompts in the
  same run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BASELINE = "target"  # the method name of the target decoding alone


@dataclass
class Generation:
    """One generated answer and how it was produced."""

    tokens: list[int]
    seconds: float
    target_forwards: int  # including the prefill
    draft_forwards: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verify step (bonus excluded)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class MethodStats:
    """Everything counted for one decoding method over a set of generations."""

    method: str
    max_accept: int  # K for a chain, the depth for a tree, 0 for the target alone
    generations: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0
    accept_hist: list[int] = field(default_factory=list)  # [max_accept + 1] steps that accepted exactly a tokens
    compared: int = 0  # generations checked against the target's own output (greedy)
    identical: int = 0

    def __post_init__(self) -> None:
        if not self.accept_hist:
            self.accept_hist = [0] * (self.max_accept + 1)

    def add(self, gen: Generation, identical: bool | None = None) -> None:
        self.generations += 1
        self.new_tokens += gen.new_tokens
        self.seconds += gen.seconds
        self.target_forwards += gen.target_forwards
        self.draft_forwards += gen.draft_forwards
        for a in gen.accepted:
            self.accept_hist[min(a, self.max_accept)] += 1
        if identical is not None:
            self.compared += 1
            self.identical += int(identical)

    def add_record(self, rec: dict[str, Any]) -> None:
        """Fold in one stored per-generation record (see `record_of`)."""
        self.generations += 1
        self.new_tokens += rec["new_tokens"]
        self.seconds += rec["seconds"]
        self.target_forwards += rec["target_forwards"]
        self.draft_forwards += rec.get("draft_forwards", 0)
        for a, c in enumerate(rec.get("accept_hist", [])):
            self.accept_hist[min(a, self.max_accept)] += c
        if rec.get("identical") is not None:
            self.compared += 1
            self.identical += int(rec["identical"])

    def merge(self, other: MethodStats) -> None:
        self.generations += other.generations
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.target_forwards += other.target_forwards
        self.draft_forwards += other.draft_forwards
        self.accept_hist = [a + b for a, b in zip(self.accept_hist, other.accept_hist, strict=True)]
        self.compared += other.compared
        self.identical += other.identical

    # -- derived -----------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return sum(self.accept_hist)

    @property
    def accepted(self) -> int:
        return sum(a * c for a, c in enumerate(self.accept_hist))

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.steps if self.steps else None

    @property
    def tokens_per_target_forward(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def draft_forwards_per_step(self) -> float | None:
        """None where not counted (the target alone; vLLM's decoding)."""
        return self.draft_forwards / self.steps if self.steps and self.draft_forwards else None

    @property
    def tok_s(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None

    @property
    def accept_rate_by_pos(self) -> list[float]:
        """[max_accept] share of steps that accepted at least j tokens, j = 1..max_accept."""
        n = self.steps
        if not n:
            return []
        out, at_least = [], n
        for a in range(self.max_accept):
            at_least -= self.accept_hist[a]
            out.append(at_least / n)
        return out

    @property
    def accept_cond_by_pos(self) -> list[float | None]:
        """[max_accept] P(accept position j | positions < j accepted)."""
        rates = [1.0] + self.accept_rate_by_pos
        return [rates[j] / rates[j - 1] if rates[j - 1] > 0 else None for j in range(1, len(rates))]

    def to_dict(self, baseline_tok_s: float | None = None) -> dict[str, Any]:
        tok_s = self.tok_s
        return {
            "method": self.method,
            "max_accept": self.max_accept,
            "tau": self.tau,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "tok_s": tok_s,
            "speedup": tok_s / baseline_tok_s if tok_s and baseline_tok_s else None,
            "accept_rate_by_pos": self.accept_rate_by_pos,
            "accept_cond_by_pos": self.accept_cond_by_pos,
            "identical_to_target": self.identical / self.compared if self.compared else None,
            "generations": self.generations,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "draft_forwards_per_step": self.draft_forwards_per_step,
            "verify_steps": self.steps,
            "accept_hist": self.accept_hist,
            "compared": self.compared,
            "identical": self.identical,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MethodStats:
        return cls(method=d["method"], max_accept=d["max_accept"], generations=d["generations"],
                   new_tokens=d["new_tokens"], seconds=d["seconds"], target_forwards=d["target_forwards"],
                   draft_forwards=d.get("draft_forwards", 0), accept_hist=list(d["accept_hist"]),
                   compared=d.get("compared", 0), identical=d.get("identical", 0))


def record_of(prompt_set: str, item: str, turn: int, method: str, gen: Generation, max_accept: int,
              identical: bool | None, prompt_tokens: int) -> dict[str, Any]:
    """One generation as a small JSON record (kept in the report for per-prompt analysis and resume)."""
    hist = [0] * (max_accept + 1)
    for a in gen.accepted:
        hist[min(a, max_accept)] += 1
    return {"set": prompt_set, "item": item, "turn": turn, "method": method, "prompt_tokens": prompt_tokens,
            "new_tokens": gen.new_tokens, "seconds": round(gen.seconds, 6), "target_forwards": gen.target_forwards,
            "draft_forwards": gen.draft_forwards, "accept_hist": hist, "identical": identical}
