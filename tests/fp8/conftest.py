"""Fixtures of the FP8 tests: test-only backends installed beside the real cpu_ref (their reference)."""

from __future__ import annotations

from typing import Callable, Sequence

import pytest

from hal.plugin import Plugin
from hal.runtime import Runtime


@pytest.fixture
def install(install_plugins: Callable[[Sequence[Plugin]], Runtime]) -> Callable[..., Runtime]:
    """Install a Runtime of the real cpu_ref plugin plus the given test plugins; restored afterwards."""
    import hal_backend_cpu_ref

    return lambda *plugins: install_plugins([hal_backend_cpu_ref.plugin, *plugins])
