"""Fixtures shared by every test folder under tests/: fresh seeds and test-only plugin registries."""

from __future__ import annotations

import os
from typing import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch

from hal import dispatch
from hal.plugin import Plugin
from hal.runtime import Runtime


def draw_seed() -> int:
    """A fresh seed, or HAL_TEST_SEED when set (to replay a failure)."""
    return int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh seed per test, printed and recorded so a failure can be rerun; torch is seeded too."""
    value = draw_seed()
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}  (rerun with HAL_TEST_SEED={value})")
    torch.manual_seed(value)
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def install_plugins() -> Iterator[Callable[[Sequence[Plugin]], Runtime]]:
    """Install a Runtime made of the given plugin objects (no pip install: DESIGN habit 6); the
    previous runtime and fresh statistics are restored afterwards."""
    previous = dispatch.DISPATCHER._runtime
    dispatch.reset_stats()

    def install(plugins: Sequence[Plugin]) -> Runtime:
        rt = Runtime.from_plugins(plugins)
        dispatch.install(rt)
        return rt

    yield install
    dispatch.install(previous)
    dispatch.reset_stats()


@pytest.fixture
def hal_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Calls with autograd run hal's node and backward op, also for kernels torch's autograd would
    record (HAL_TORCH_AUTOGRAD=0): for tests of what hal's backward path does."""
    monkeypatch.setenv("HAL_TORCH_AUTOGRAD", "0")
    dispatch.reset()
    yield
    monkeypatch.delenv("HAL_TORCH_AUTOGRAD")
    dispatch.reset()
