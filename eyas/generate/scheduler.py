"""When each conversation's next turn is generated: in rounds across a chunk, or streamed.

A run rewrites chunks `todo` of `chunk` conversations each and calls `on_chunk(b, conversations, counts)`
as each chunk is done (a conversation is None when not even its first reply fits in --max-length).
In rounds, every conversation of a chunk waits for the round's longest reply before its next turn; its
sampling is seeded per chunk, so a resumed run writes the same file. Streamed, a conversation's next turn
is queued as soon as its last reply ends, with many conversations in flight across chunk boundaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from eyas.generate.turns import Conversation, Turns, turn_counts

Decode = Callable[[list[list[int]], int], list[list[int]]]  # (prompt ids, seed) -> reply ids, in order
OnChunk = Callable[[int, list[Any], dict], None]


class Requests(Protocol):
    """A streaming generator: prompts go in one by one, replies come back as they finish."""

    def submit(self, key: str, prompt: list[int], rank: int | None = None) -> None: ...

    def poll(self) -> list[tuple[str, list[int]]]: ...


def run_in_rounds(turns: Turns, decode: Decode, convs: list[list[dict]], chunk: int, todo: list[int], seed: int,
                  on_chunk: OnChunk) -> None:
    """Rewrite chunks `todo`, each one round of turns at a time through `decode`."""
    for b in todo:
        on_chunk(b, *_rewrite_in_rounds(turns, decode, convs[b * chunk:(b + 1) * chunk], seed * 1_000_003 + b))


def _rewrite_in_rounds(turns: Turns, decode: Decode, convs: list[list[dict]],
                       seed: int) -> tuple[list[list[dict] | None], dict]:
    """Every assistant turn of `convs`, turn by turn across them: the new conversations and their counts."""
    work = [Conversation(c) for c in convs]
    stats = turn_counts()
    live = list(range(len(work)))
    while live:
        jobs = [(b, opened) for b in live if (opened := turns.open(work[b], stats)) is not None]
        live = [b for b, _ in jobs]
        if not jobs:
            break
        replies = decode([ids for _, (_, ids) in jobs], seed)
        seed += 1
        for toks, (b, (j, _)) in zip(replies, jobs, strict=True):
            turns.close(work[b], j, toks, stats)
    return [turns.finish(c, stats) for c in work], stats


def run_streamed(turns: Turns, requests: Requests, convs: list[list[dict]], chunk: int, todo: list[int],
                 window: int, on_chunk: OnChunk) -> None:
    """Rewrite chunks `todo` with up to `window` conversations in flight, one turn of each at a time in
    `requests`; `on_chunk` runs as soon as chunk b and all before it are done, so the saved file keeps the
    input order. A turn is ranked by its conversation's place in the input, so earlier conversations finish
    (and are saved) first."""
    order = iter([i for b in todo for i in range(b * chunk, min((b + 1) * chunk, len(convs)))])
    work: dict[int, Conversation] = {}
    stats = {b: turn_counts() for b in todo}
    left = {b: min((b + 1) * chunk, len(convs)) - b * chunk for b in todo}
    results: dict[int, list[dict] | None] = {}
    flying: dict[str, tuple[int, int]] = {}  # request key -> (conversation, turn)
    emit = list(todo)  # chunks in order, written as soon as complete

    def advance(i: int) -> None:
        """Queue conversation i's next turn, or finish it."""
        b = i // chunk
        opened = turns.open(work[i], stats[b])
        if opened is not None:
            key = f"c{i}t{opened[0]}"
            requests.submit(key, opened[1], rank=i)
            flying[key] = (i, opened[0])
            return
        results[i] = turns.finish(work.pop(i), stats[b])
        left[b] -= 1
        while emit and left[emit[0]] == 0:
            e = emit.pop(0)
            lo, hi = e * chunk, min((e + 1) * chunk, len(convs))
            on_chunk(e, [results.pop(k) for k in range(lo, hi)], stats.pop(e))

    while True:
        while len(work) < window and (i := next(order, None)) is not None:
            work[i] = Conversation(convs[i])
            advance(i)
        if not flying:
            break
        for key, toks in requests.poll():
            if key in flying:
                i, j = flying.pop(key)
                turns.close(work[i], j, toks, stats[i // chunk])
                advance(i)
