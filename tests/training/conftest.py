"""Fixtures of the training-integration tests: a fresh, printed seed per test; dispatcher statistics
reset around each test; every test runs on the installed backends (cpu_ref on CI)."""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import pytest
import torch

import hal


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh seed per test (printed, recorded; HAL_TEST_SEED pins it); torch is seeded with it."""
    value = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}")
    torch.manual_seed(value)
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _fresh_stats() -> Iterator[None]:
    hal.reset_stats()
    yield
    hal.reset_stats()
