"""Progress bars for long work: rate in tokens/s (not just items/s) and an ETA."""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from eyas.utils.io import EyasError


class _TokenRate(ProgressColumn):
    """Shows `fields['tokens'] / elapsed` so every long stage reports tok/s."""

    def render(self, task: Task) -> Text:
        tokens = task.fields.get("tokens", 0)
        elapsed = task.elapsed or 0.0
        if not tokens or elapsed <= 0:
            return Text("", style="progress.data.speed")
        rate = tokens / elapsed
        unit = f"{rate / 1000:.1f}k tok/s" if rate >= 1000 else f"{rate:.0f} tok/s"
        return Text(unit, style="progress.data.speed")


class LineProgress(Progress):
    """For output that is not a terminal (a log file, a pipe, a batch job): no redrawn bar, but a
    plain status line at most every `every` seconds and once at the end, with the same count,
    tok/s, info, elapsed time and ETA a bar would show."""

    prints_lines = True

    def __init__(self, *columns: ProgressColumn, every: float, **kwargs: Any) -> None:
        super().__init__(*columns, disable=True, **kwargs)
        self.every = every
        self._printed: dict[int, float] = {}

    def update(self, task_id: TaskID, **kwargs: Any) -> None:  # type: ignore[override]
        super().update(task_id, **kwargs)
        now = self.get_time()
        if now - self._printed.get(task_id, -float("inf")) >= self.every:
            self._print(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def stop(self) -> None:
        for task in self.tasks:  # the final state
            self._print(task.id)
        super().stop()

    def _print(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        self._printed[task_id] = self.get_time()
        count = f"{task.completed:,.0f}/{task.total:,.0f}" if task.total else f"{task.completed:,.0f}"
        parts = [f"{task.description} {count}", _TokenRate().render(task).plain, str(task.fields.get("info", "")),
                 f"elapsed {_clock(task.elapsed)}"]
        if task.time_remaining is not None and not task.finished:
            parts.append(f"eta {_clock(task.time_remaining)}")
        print("  ".join(p for p in parts if p), file=sys.stderr, flush=True)


def _seconds_between_lines() -> float:
    raw = os.environ.get("EYAS_PROGRESS_EVERY", "30")
    try:
        every = float(raw)
    except ValueError:
        every = -1.0
    if not every >= 0:
        raise EyasError(f"EYAS_PROGRESS_EVERY={raw!r}: set it to the seconds between progress lines (e.g. 30), "
                        "or unset it")
    return every


def _clock(seconds: float | None) -> str:
    s = int(seconds or 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_bar(disable: bool | None = None) -> Progress:
    """A rich Progress with count, tok/s, elapsed and ETA: a live bar on a terminal, a status line
    every EYAS_PROGRESS_EVERY seconds (default 30) otherwise; silent with EYAS_NO_PROGRESS set."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _TokenRate(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    if disable is None:
        if os.environ.get("EYAS_NO_PROGRESS"):
            disable = True
        elif not sys.stderr.isatty():
            return LineProgress(*columns, every=_seconds_between_lines())
    return Progress(*columns, disable=bool(disable), transient=False)
