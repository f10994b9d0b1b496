"""Which speculation to measure at which batch size: a verify budget shared by the rows.

A verify forward over a few tokens per row costs about what a one-token forward costs, as long as the
whole batch's verify tokens stay under the card's compute knee (below it the forward is bound by reading
the weights; above it, by the arithmetic). A wide tree pays at batch 1 and sinks a batch of 64: 60 verify
tokens per row are 3,840 per round. So the candidates follow the load: at batch size B, the methods whose
verify tokens per row (K + 1 for a chain of K, TOTAL + 1 for a tree) fit `budget // B` are swept, the
chain of 1 always, plus what the user asked for. The budget only bounds what is tried; which candidate
wins at each batch size, and so where the knee lies on this card for this target, the sweep measures.
With the default methods (--chain 3,5,7 --tree 60:7:10) the sweep decodes at most twice as many
methods per batch size as they do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from eyas.eval.proposer_base import ChainSpec, Method, TreeSpec
from eyas.utils.io import EyasError

DEFAULT_VERIFY_BUDGET = 1024  # verify tokens per round, all rows together
CHAIN_LADDER = (1, 2, 3, 5, 7)
TREE_LADDER = (TreeSpec(60, 7, 10), TreeSpec(30, 6, 6), TreeSpec(15, 5, 4), TreeSpec(8, 4, 2))


def verify_tokens(method: Method | None) -> int:
    """Tokens one row puts through one verify forward: the newest token and the speculation."""
    if method is None:
        return 1
    return method.k + 1 if isinstance(method, ChainSpec) else method.total + 1


def per_row_budget(budget: int, batch_size: int) -> int:
    """Verify tokens a row may use at this batch size (at least a chain of 1's two)."""
    return max(2, budget // max(batch_size, 1))


def sweep_plan(batch_sizes: Sequence[int], asked: Sequence[Method], budget: int,
               can_draft: Callable[[Method], bool]) -> dict[int, list[Method]]:
    """The methods measured at each batch size: those asked for, then the ladder's chains and trees that the
    draft can propose (`can_draft`) and that fit the batch size's per-row budget. A larger batch measures a
    subset of a smaller one's."""
    ladder: list[Method] = [ChainSpec(k) for k in CHAIN_LADDER] + list(TREE_LADDER)
    ladder = [m for m in ladder if m not in asked and can_draft(m)]
    plan = {}
    for b in batch_sizes:
        room = per_row_budget(budget, b)
        plan[int(b)] = list(asked) + [m for m in ladder if verify_tokens(m) <= room]
    return plan


def union(plan: dict[int, list[Method]]) -> list[Method]:
    """Every method of a plan once, in the order of the smallest batch size's list (a superset of the others)."""
    out: list[Method] = []
    for b in sorted(plan):
        out += [m for m in plan[b] if m not in out]
    return out


def proposes(proposer: Any, method: Method) -> bool:
    """Whether a family's proposer drafts this method (its `check` refuses what it cannot, e.g. a block drafter's
    trees): a sweep leaves such candidates out instead of failing."""
    try:
        proposer.check(method)
    except EyasError:
        return False
    return True
