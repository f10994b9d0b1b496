"""(not built yet)"""

from __future__ import annotations

from eyas.recipes._unbuilt import not_built


def cli() -> None:
    not_built("prepare")
