"""The budget of one model-mode check (hal.conformance.model_compare): ``|A - R| <= atol + rtol *
max(|R|, |P|) + |P - R|``. A kernel within its op's tolerance on its own inputs (``|A - P| <= atol
+ rtol * |P|``) passes however far the run drifted (the triangle inequality), also where the drift
moved the exact result P away from a small reference value R (a ReLU output the reference run clips
to 0); a kernel past its tolerance still fails."""

from __future__ import annotations

import torch

from hal.conformance import compare as cmp
from hal.conformance.model_compare import _check
from hal.registry import get_op

DECL = get_op("conv2d")  # a reduction op: atol widened by sqrt(K), scaled by the component's magnitude
K = 4


def _run(got: torch.Tensor, want: torch.Tensor, replayed: torch.Tensor):
    return _check(0, "output", "out", DECL, "float64", K, got, want, replayed, {}, ())


def _tolerance(want: torch.Tensor, replayed: torch.Tensor) -> tuple[float, float]:
    scale = max(cmp.magnitude(want), cmp.magnitude(replayed))
    return cmp.resolve(DECL, "float64", "float64", K, scale)


def test_a_kernel_within_its_tolerance_passes_where_the_drift_moved_its_result_off_a_small_reference() -> None:
    want = torch.tensor([0.0, 0.5, -0.25, 1.0], dtype=torch.float64)  # R: the reference run
    replayed = torch.tensor([0.07, 0.5, -0.25, 1.0], dtype=torch.float64)  # P: the run's inputs drifted at element 0
    atol, rtol = _tolerance(want, replayed)
    got = replayed + 0.9 * (atol + rtol * replayed.abs())  # A: 0.9 of the op's tolerance off P everywhere
    c = _run(got, want, replayed)
    assert c.own is not None and abs(c.own - 0.9) < 1e-6, c
    # |R| alone in the relative term gave atol + |P - R| at element 0, short of 0.9 * rtol * |P| - 0.1 * atol
    assert float((got[0] - want[0]).abs()) > atol + float((replayed[0] - want[0]).abs())
    assert c.ok and c.used <= 1.0, c


def test_a_kernel_past_its_tolerance_still_fails() -> None:
    want = torch.tensor([0.0, 0.5, -0.25, 1.0], dtype=torch.float64)
    replayed = torch.tensor([0.07, 0.5, -0.25, 1.0], dtype=torch.float64)
    atol, rtol = _tolerance(want, replayed)
    for i in range(4):  # 1.1 of the tolerance off P at one element: where P drifted (0) and where it did not
        got = replayed.clone()
        got[i] += 1.1 * (atol + rtol * abs(float(replayed[i])))
        c = _run(got, want, replayed)
        assert not c.ok and c.used > 1.0 and c.own is not None and c.own > 1.0, (i, c)
