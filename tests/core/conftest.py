"""Fixtures of the core's tests: registries built from plugin objects in the test (no install)."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import pytest

from hal import dispatch
from hal.plugin import Plugin
from hal.runtime import Runtime


@pytest.fixture
def install_plugins() -> Iterator[Callable[[Sequence[Plugin]], Runtime]]:
    """Install a Runtime made of the given plugins; the previous one is restored afterwards."""
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
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No HAL_* variables from the outside; decisions re-made after the test."""
    import os

    for name in list(os.environ):
        if name.startswith("HAL_"):
            monkeypatch.delenv(name)
    dispatch.reset()
    yield monkeypatch
    dispatch.reset()
