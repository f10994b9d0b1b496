from __future__ import annotations

from eyas.utils.io import EyasError


def not_built(stage: str) -> None:
    """Stages that do not exist yet say so and exit non-zero instead of printing fake output."""
    raise EyasError(f"'eyas {stage}' is not built yet in this version of eyas.", exit_code=3)
