"""Fixtures of the training-integration tests: dispatcher statistics reset around each test (seeds:
tests/conftest.py); every test runs on the installed backends (cpu_ref on CI)."""

from __future__ import annotations

from typing import Iterator

import pytest

import hal


@pytest.fixture(autouse=True)
def _fresh_stats() -> Iterator[None]:
    hal.reset_stats()
    yield
    hal.reset_stats()
