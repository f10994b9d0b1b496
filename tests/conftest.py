"""Shared fixtures: the real SmolLM2 folder (converted once per machine) and a quiet environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("EYAS_NO_PROGRESS", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    from eyas.assets import smollm2_dir

    return smollm2_dir()
