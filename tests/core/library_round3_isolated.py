"""Two regression tests of issue 41's sweep that declare ops with hal.library. A declaration lasts
for the process, so tests/core/test_contract_round3.py runs this file in a fresh interpreter (its
name keeps pytest's collection of the suite away from it). Each failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch

import hal
from hal.types import Tensor
from tests.core.test_contract_round3 import _declared_cube, _gen


def test_library_kernel_returning_a_list_for_one_result_is_refused(seed: int) -> None:
    """Before: a kernel returning ``[y]`` for an op with one result passed the first call's check
    (a list was read as results by position) and the caller got a list instead of a tensor."""
    op = _declared_cube("round3_listed")

    @hal.library.register_kernel("round3_listed", backend="cpu", name="listed", priority=20)
    def listed(x: torch.Tensor, factor: float) -> list:
        return [factor * x**3]

    with pytest.raises(hal.library.KernelResultError, match="returned a list of 1 result"):
        op(torch.randn(4, 3, generator=_gen(seed)))


def test_library_op_without_fake_rule_says_so_under_fullgraph_compile(seed: int) -> None:
    """Before: ``torch.compile(fullgraph=True)`` of an op declared without ``@op.fake`` failed with
    Dynamo's "NotImplementedError/UnsupportedFakeTensorException when running FX node", which
    neither names the op nor says what to add; eager calls run (checked here too)."""
    @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)
    def round3_no_fake(x: Tensor) -> Tensor:
        """2 * x"""

    @hal.library.register_kernel("round3_no_fake", backend="cpu", name="doubled", priority=20)
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    x = torch.randn(5, generator=_gen(seed))
    torch.testing.assert_close(round3_no_fake(x), 2 * x)
    with pytest.raises(Exception, match=r"op round3_no_fake declares no fake rule.*@hal\.ops\.round3_no_fake\.fake"):
        torch.compile(lambda t: round3_no_fake(t) + 1, fullgraph=True)(x)
