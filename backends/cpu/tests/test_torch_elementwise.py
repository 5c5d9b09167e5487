"""The torch kernel of scale_shift_act on the CPU backend writes the activation over the affine's
result, a buffer it made (on glibc a second fresh buffer of x's size costs the first touch of all its
pages, about as much as the pass that fills it). These tests check what the conformance suite's
small cases cannot reach: the +inf of GELU on both paths, the backward against autograd, and that the
kernels' in-place writes never reach their inputs or autograd's saved tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hal_backend_cpu import elementwise as ew

import hal


def _randn(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "relu", "none"])
@pytest.mark.parametrize("scale_kind", ["tensor", "number"])
def test_backward_matches_autograd_and_leaves_its_inputs(act, scale_kind, rng) -> None:
    x, g = _randn(rng, 257, 33), _randn(rng, 257, 33)
    scale = (torch.rand(33, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))) + 0.5) if scale_kind == "tensor" else 1.7
    shift = _randn(rng, 33)
    before = [t.clone() for t in (g, x, shift)]
    got = hal.use(backend="cpu", kernel={"scale_shift_act_backward": "torch"})
    with got:
        gx, gs, gb = hal.ops.scale_shift_act_backward(g, x, scale, shift, act)
    leaves = [x.clone().requires_grad_(), scale.clone().requires_grad_() if scale_kind == "tensor" else torch.tensor(1.7, requires_grad=True),
              shift.clone().requires_grad_()]
    from hal_torch.elementwise import ACTIVATION_FNS

    want = torch.autograd.grad(ACTIVATION_FNS[act](leaves[0] * leaves[1] + leaves[2]), leaves, g)
    for name, a, w in zip(("grad_x", "grad_scale", "grad_shift"), (gx, gs, gb), want):
        torch.testing.assert_close(a, w.reshape(a.shape), rtol=2e-5, atol=2e-4, msg=name)
    for t, b in zip((g, x, shift), before):
        assert torch.equal(t, b)  # the in-place writes went to the kernel's own buffers
    if act == "none":
        assert gx.data_ptr() != g.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_of_infinities_and_nan_on_both_paths(dtype) -> None:
    values = torch.tensor([math.inf, -math.inf, math.nan, 1.0, -2.0, 30.0] * 11, dtype=dtype)
    want = [math.inf, math.nan, math.nan, 0.8413447, -0.0455003, 30.0]  # the float64 reference's values
    plain = ew.activate_(values.clone(), "gelu")
    graph = values.clone().requires_grad_()
    recorded = ew.activate_(graph * 1.0, "gelu")  # recorded by autograd: torch's out-of-place GELU
    for out in (plain, recorded):
        np.testing.assert_allclose(out[:6].detach().double().numpy(), want, rtol=1e-2)
    finite = values.clone()[3:6]
    assert ew.activate_(finite, "gelu").data_ptr() == finite.data_ptr()  # overwritten, no second buffer
    no_nan = torch.tensor([1.0, math.inf, -2.0, 30.0] * 11, dtype=dtype)  # +inf the maximum itself, no NaN to flag it
    for z in (no_nan.clone(), no_nan.clone().requires_grad_() * 1.0):
        np.testing.assert_allclose(ew.activate_(z, "gelu")[:4].detach().double().numpy(), [0.8413447, math.inf, -0.0455003, 30.0], rtol=1e-2)


def test_the_forward_of_a_training_call_is_recorded_without_in_place_writes(rng) -> None:
    """With autograd recording the torch kernel, the activation is out of place: an in-place GELU
    would have autograd save a copy of the pre-activation, or fail its version check."""
    x = _randn(rng, 64, 48).requires_grad_()
    scale, shift = torch.rand(48) + 0.5, _randn(rng, 48)
    with hal.use(backend="cpu", kernel={"scale_shift_act": "torch"}):
        y = hal.ops.scale_shift_act(x, scale, shift, "gelu")
    y.backward(torch.ones_like(y))
    ref = x.detach().clone().requires_grad_()
    F.gelu(ref * scale + shift).backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, ref.grad)
