"""Progress bars for long work: rate in tokens/s (not just items/s) and an ETA."""

from __future__ import annotations

import os
import sys

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


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


def progress_bar(disable: bool | None = None) -> Progress:
    """A rich Progress with count, tok/s, elapsed and ETA. Quiet when EYAS_NO_PROGRESS is set."""
    if disable is None:
        disable = bool(os.environ.get("EYAS_NO_PROGRESS")) or not sys.stderr.isatty() and bool(
            os.environ.get("CI")
        )
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _TokenRate(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        disable=disable,
        transient=False,
    )
