"""Fixtures of the hal.parallel tests: a fresh seed per module (HAL_TEST_SEED pins it)."""

from __future__ import annotations

import pytest

from hal.dist import launch
from tests.conftest import draw_seed

launch.PRELOAD.append("hal.parallel")


@pytest.fixture(scope="module")
def seed() -> int:
    """A fresh seed per test module, printed so a failure can be rerun with HAL_TEST_SEED."""
    value = draw_seed()
    print(f"HAL_TEST_SEED={value}")
    return value
