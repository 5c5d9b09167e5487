"""Shared fixtures of the reference backend's tests: fresh random data, float64 torch peers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with a fresh seed per test (printed on failure; HAL_TEST_SEED pins it)."""
    seed = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def randn(rng: np.random.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard-normal CPU tensor (never zeros)."""
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def assert_close64(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    """Float64 comparison of a reference kernel against torch, with the error in the message."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
