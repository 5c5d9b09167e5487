"""Fixtures of the CPU backend's tests: fresh random data per test."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import hal_nodes  # noqa: F401  (hal's nodes instead of torch's autograd: the kept-state tests)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with a fresh seed per test (printed on failure; HAL_TEST_SEED pins it)."""
    seed = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
