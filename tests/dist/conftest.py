"""Fixtures of the hal.dist tests: a fresh seed per session (HAL_TEST_SEED pins it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hal.dist import launch
from tests.conftest import draw_seed

# DDP imports torch._dynamo on first use (about 5 s per rank here): import it once in the fork server.
launch.PRELOAD.append("torch._dynamo")


@pytest.fixture(scope="module")
def seed() -> int:
    """A fresh seed per test module, printed so a failure can be rerun with HAL_TEST_SEED."""
    value = draw_seed()
    print(f"HAL_TEST_SEED={value}")
    return value
