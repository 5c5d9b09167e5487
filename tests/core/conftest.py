"""Fixtures of the core's tests: a clean HAL_* environment (plugin registries: tests/conftest.py)."""

from __future__ import annotations

from typing import Iterator

import pytest

from hal import dispatch


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No HAL_* variables from the outside; decisions re-made after the test."""
    import os

    for name in list(os.environ):
        if name.startswith("HAL_") and name not in ("HAL_TUNE", "HAL_TUNE_CACHE"):  # see the root conftest.py
            monkeypatch.delenv(name)
    dispatch.reset()
    yield monkeypatch
    dispatch.reset()
