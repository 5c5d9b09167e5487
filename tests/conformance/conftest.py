"""Fixtures of the conformance suite's own tests: a fresh seed per test, and test-only backends
(plugins built here) installed beside the real cpu_ref, which serves as their reference."""

from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np
import pytest

from hal import dispatch
from hal.plugin import Plugin
from hal.runtime import Runtime


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The suite's data seed: fresh per test (printed, recorded); HAL_TEST_SEED pins it."""
    value = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}")
    return value


@pytest.fixture
def install() -> Iterator[Callable[..., Runtime]]:
    """Install a Runtime of the real cpu_ref plugin plus the given test plugins; restore afterwards."""
    import hal_backend_cpu_ref

    previous = dispatch.DISPATCHER._runtime

    def _install(*plugins: Plugin) -> Runtime:
        rt = Runtime.from_plugins([hal_backend_cpu_ref.plugin, *plugins])
        dispatch.install(rt)
        return rt

    yield _install
    dispatch.install(previous)
