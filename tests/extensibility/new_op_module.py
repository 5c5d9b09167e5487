"""A module outside hal that declares an op of its own (with its backward op), gives it a kernel on a
backend of its own and a reference kernel on cpu_ref (what the conformance suite compares with),
and registers its conformance cases: everything a third party writes to add an op, and nothing in
hal/. Imported by test_new_op.py in a fresh interpreter (its ops must not leak into the registry
of other tests)."""

from __future__ import annotations

import numpy as np
from hal.conformance.cases import Call, register_cases
from hal.conformance.cases import case as conformance_case

import hal  # noqa: F401  (the dispatcher and the torch integration)
from hal.arrays import FLOAT_DTYPES
from hal.ops._fake import like
from hal.ops._tolerances import ELEMENTWISE
from hal.plugin import Plugin
from hal.registry import declare
from hal.types import Tensor


@declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE, backward="cube_scale_backward", gradients="x")
def cube_scale(x: Tensor, factor: float = 2.0) -> Tensor:
    """``factor * x**3``: an op hal has never heard of."""


@cube_scale.fake
def _fake(a):
    return like(a["x"])


@declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE, forward="cube_scale")
def cube_scale_backward(grad_out: Tensor, x: Tensor, factor: float = 2.0) -> Tensor:
    """``grad_out * 3 * factor * x**2``."""


@cube_scale_backward.fake
def _fake_backward(a):
    return like(a["x"])


plugin = Plugin("cubes", "1.0")
plugin.define_backend(priority=1000, device_types=("cpu",), array_api="numpy")


@plugin.kernel("cube_scale", name="torch", array_api="torch")
def cube_scale_torch(x, factor):
    return factor * x * x * x


@plugin.kernel("cube_scale_backward", name="torch", array_api="torch")
def cube_scale_backward_torch(grad_out, x, factor):
    return grad_out * (3.0 * factor) * x * x


@plugin.kernel("cube_scale", name="numpy", backend="cpu_ref")
def cube_scale_reference(x, factor):
    return (factor * np.asarray(x, dtype=np.float64) ** 3).astype(x.dtype)


@plugin.kernel("cube_scale_backward", name="numpy", backend="cpu_ref")
def cube_scale_backward_reference(grad_out, x, factor):
    x64 = np.asarray(x, dtype=np.float64)
    return (np.asarray(grad_out, dtype=np.float64) * 3.0 * factor * x64 * x64).astype(x.dtype)


def _draw(d, shape):
    return Call({"x": d.normal(*shape), "factor": d.scalar(0.5, 3.0)})


def _draw_backward(d, shape):
    fwd = _draw(d, shape)
    return Call({"grad_out": d.normal(*shape), **fwd.args})


register_cases("cube_scale", [conformance_case("small", _draw, quick=True, shape=(3, 5)), conformance_case("odd", _draw, shape=(7, 13, 2))])
register_cases("cube_scale_backward", [conformance_case("small", _draw_backward, quick=True, shape=(4, 6))])
