"""Fixtures of the device tests: the FP8 formats this GPU has, a freshly seeded generator."""

from __future__ import annotations

import pytest
import torch

from tests.cuda._support import fresh_seed


@pytest.fixture(scope="module")
def fmts() -> list[str]:
    """The FP8 formats this GPU has; without any, the test is skipped with the reason."""
    from hal.ops.fp8 import FORMATS
    from hal.plugin_sdk.fp8_hardware import fp8_device

    from ._fp8 import DEV, formats

    have = formats()
    if not have:
        pytest.skip("; ".join(fp8_device(DEV, list(FORMATS))))
    return have


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())
