"""rms_norm_amax and swiglu_amax (issue 40, FP8: the amax of a linear layer's input reduced by the op
that writes it): their y is the plain op's and their gradients are the plain op's, on every route a
call can take (torch's recorded ops on the cpu backend, hal's autograd node on cpu_ref and eager,
the node for the two halves of a packed projection, the opaque ``torch.ops.hal`` node and the traced
torch ops under torch.compile); the amax is ``max |float32(y)|`` of the y returned, carries no
gradient, propagates NaN and is 0 for an empty y. Also the declaration rule they rely on
(``nondifferentiable_results``). Random inputs from a fresh seed (``seed`` fixture)."""

from __future__ import annotations

import math

import pytest
import torch

import hal
from hal.registry import declare, get_op

BACKENDS = ("cpu", "cpu_ref", "eager")


def _amax_of(y: torch.Tensor) -> torch.Tensor:
    y32 = y.detach().float()
    return y32.abs().amax() if y32.numel() else torch.zeros(())


def _assert_amax(amax: torch.Tensor, y: torch.Tensor) -> None:
    want = _amax_of(y)
    assert amax.dtype == torch.float32 and amax.shape == () and not amax.requires_grad and amax.grad_fn is None
    if bool(want.isnan()):
        assert bool(amax.isnan())
    else:
        assert amax.view(torch.int32) == want.view(torch.int32), (float(amax), float(want))


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_amax_is_rms_norm_with_its_amax_and_its_gradients(backend: str, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 5, 48, generator=gen, dtype=torch.float64) * 3).to(dtype)
    x[1, 2, 7] = -40.0  # the largest |y| negative
    w = (torch.rand(48, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    g = torch.randn(3, 5, 48, generator=gen, dtype=torch.float64).to(dtype)
    with hal.use(backend=backend):
        xa, wa = _leaves(x, w)
        y, amax = hal.ops.rms_norm_amax(xa, (48,), wa, 1e-6)
        xb, wb = _leaves(x, w)
        y0 = hal.ops.rms_norm(xb, (48,), wb, 1e-6)
        assert y.grad_fn is not None and y.requires_grad
        grads = torch.autograd.grad(y, (xa, wa), g)
        want = torch.autograd.grad(y0, (xb, wb), g)
    assert torch.equal(y.detach(), y0.detach())
    _assert_amax(amax, y)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("halves", [False, True], ids=["apart", "halves"])
def test_swiglu_amax_is_swiglu_with_its_amax_and_its_gradients(backend: str, halves: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(4, 6, 2 * 40, generator=gen) * 4
    g = torch.randn(4, 6, 40, generator=gen)
    with hal.use(backend=backend):
        runs = []
        for op in (hal.ops.swiglu_amax, hal.ops.swiglu):
            if halves:  # the two halves of one projection: hal's node differentiates the whole tensor
                (base,) = _leaves(h)
                gate, up = base.chunk(2, dim=-1)
                leaves = [base]
            else:
                gate, up = _leaves(*h.chunk(2, dim=-1))
                leaves = [gate, up]
            out = op(gate, up)
            y = out[0] if isinstance(out, tuple) else out
            runs.append((out, y, torch.autograd.grad(y, leaves, g)))
    (out, y, grads), (_, y0, want) = runs
    assert torch.equal(y.detach(), y0.detach())
    _assert_amax(out[1], y)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_amax_propagates_nan_and_infinity_and_is_zero_for_empty(backend: str) -> None:
    with hal.use(backend=backend):
        x = torch.randn(4, 16)
        x[2, 3] = math.nan
        y, amax = hal.ops.rms_norm_amax(x, (16,), None, 1e-6)
        assert bool(amax.isnan()) and bool(y[2].isnan().all())
        gate, up = torch.randn(3, 8), torch.randn(3, 8) + 5
        gate[1, 1] = math.inf
        y, amax = hal.ops.swiglu_amax(gate, up)
        assert float(amax) == math.inf
        y, amax = hal.ops.rms_norm_amax(torch.empty(0, 16), (16,), None, None)
        assert y.shape == (0, 16) and float(amax) == 0.0 and amax.dtype == torch.float32
        y, amax = hal.ops.swiglu_amax(torch.empty(2, 0), torch.empty(2, 0))
        assert y.shape == (2, 0) and float(amax) == 0.0


def test_numpy_callers_get_numpy_results() -> None:
    import numpy as np

    x = np.random.default_rng(0).standard_normal((5, 12)).astype(np.float32)
    y, amax = hal.ops.rms_norm_amax(x, (12,), None, 1e-6)
    assert isinstance(y, np.ndarray) and isinstance(amax, np.ndarray) and amax.dtype == np.float32 and amax.shape == ()
    assert amax == np.abs(y).max()


@pytest.mark.parametrize("backend", [None, "cpu_ref"], ids=["traced_ops", "opaque_node"])
def test_under_torch_compile_the_ops_trace_and_train_as_eager(backend: str, seed: int) -> None:
    """fullgraph torch.compile: the decision's torch ops join the graph (cpu), or inside a hal.use
    scope the opaque torch.ops.hal node runs with its registered autograd (cpu_ref); y, amax and the
    gradients equal the eager call's."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(6, 32, generator=gen), torch.rand(32, generator=gen) + 0.5
    up = torch.randn(6, 32, generator=gen)

    def f(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor) -> tuple:
        y, a = hal.ops.rms_norm_amax(x, (32,), w, 1e-6)
        h, b = hal.ops.swiglu_amax(y, up)
        return h, a, b

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    g = torch.randn(6, 32, generator=gen)
    results = []
    for fn in (f, compiled):
        leaves = _leaves(x, w, up)
        if backend is None:
            h, a, b = fn(*leaves)
            grads = torch.autograd.grad(h, leaves, g)
        else:
            with hal.use(backend=backend):
                h, a, b = fn(*leaves)
                grads = torch.autograd.grad(h, leaves, g)
        assert not a.requires_grad and not b.requires_grad
        results.append((h.detach(), a, b, grads))
    torch._dynamo.reset()
    (h0, a0, b0, g0), (h1, a1, b1, g1) = results
    torch.testing.assert_close(h1, h0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a1, a0, rtol=1e-6, atol=0)
    torch.testing.assert_close(b1, b0, rtol=1e-6, atol=0)
    for u, v in zip(g1, g0):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_the_ops_share_the_plain_ops_backward_op() -> None:
    for op, plain in (("rms_norm_amax", "rms_norm"), ("swiglu_amax", "swiglu")):
        decl, base = get_op(op), get_op(plain)
        assert decl.backward == base.backward and decl.gradients == base.gradients and decl.nondifferentiable_results == 1
        assert decl.halves == base.halves and decl.autocast == base.autocast
        assert get_op(decl.backward).forward == plain


def test_nondifferentiable_results_are_declared_for_trainable_ops_only() -> None:
    with pytest.raises(ValueError, match="nondifferentiable_results"):

        @declare(dtypes=("float32",), tolerances=get_op("swiglu").tolerances, nondifferentiable_results=1)
        def not_trainable_with_extra(x: hal.types.Tensor) -> tuple[hal.types.Tensor, hal.types.Tensor]:
            """never declared"""
