"""Where a training run's seconds before its first optimizer step go, for the loop's first-step line.

Start-up work happens in places that do not see each other (the target starts before the trainer exists,
torch.compile runs inside the first batch's capture and the first step), so each notes its seconds here and
the loop (eyas.train.loop) reads them when the first step is done: one ledger per process, cleared by the
loop for the next session.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

_parts: dict[str, float] = {}

# torch's compile timers: a frame's forward (and AOT autograd's joint graph) and the backward, compiled lazily
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def note(part: str, seconds: float) -> None:
    """Add `seconds` to start-up part `part` (e.g. "target load")."""
    _parts[part] = _parts.get(part, 0.0) + seconds


@contextlib.contextmanager
def timed(part: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        note(part, time.perf_counter() - t)


def take() -> dict[str, float]:
    """The parts noted since the last take, cleared."""
    out = dict(_parts)
    _parts.clear()
    return out


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (every thread: the draft's and the target's)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_TIMERS))


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (forward graphs; a backward rides on its forward)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
