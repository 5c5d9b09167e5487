"""Fixtures of the reference backend's tests: fresh random data per test (helpers are in refcheck.py)."""

from __future__ import annotations

import os

from typing import Iterator

import numpy as np
import pytest

import hal


@pytest.fixture(autouse=True)
def _reference_backend() -> Iterator[None]:
    """Every call of these tests runs on cpu_ref, whatever faster CPU backend is installed."""
    with hal.use(backend="cpu_ref"):
        yield


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with a fresh seed per test (printed on failure; HAL_TEST_SEED pins it)."""
    seed = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
