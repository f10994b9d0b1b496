"""Shared fixtures: the real SmolLM2 folder (converted once per machine) and a quiet environment."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("EYAS_NO_PROGRESS", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    from eyas.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def one_thread():
    """The CPU is shared (2 cores): spinning OpenMP threads slow tiny matmuls 25-50x under load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
