"""swiglu's gate and up as the two halves of one tensor (``h.chunk(2, -1)``, a packed gate-and-up
projection): hal's autograd node differentiates ``h`` itself, and a backward kernel that writes both
gradients into one buffer hands that buffer to ``h`` with no concatenation. A test plugin's kernels
(CPU tensors: the node is the dispatcher's and needs no GPU) record the buffer they wrote; torch's
autograd of ``F.silu(gate) * up`` is the reference."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import hal
from hal.arrays import halves_of
from hal.plugin import Plugin
from hal.registry import declare

WRITTEN: list[torch.Tensor] = []


def _swiglu(gate, up):  # noqa: ANN001 - exactly the op's parameters
    return F.silu(gate) * up


def _backward(packs: bool) -> Callable:
    def swiglu_backward(grad_out, gate, up):  # noqa: ANN001
        s = torch.sigmoid(gate)
        whole = halves_of(gate, up) if packs else None
        if whole is None:
            dg, du = torch.empty_like(gate), torch.empty_like(up)
        else:
            dg, du = torch.empty(whole.shape, dtype=whole.dtype).chunk(2, dim=-1)
            WRITTEN.append(dg._base)
        torch.mul(grad_out * up, s * (1 + gate * (1 - s)), out=dg)
        torch.mul(grad_out, gate * s, out=du)
        return dg, du

    return swiglu_backward


def _plugin(packs: bool) -> Plugin:
    p = Plugin("halves", "0.1.0", summary="test: swiglu whose backward writes packed gradients" if packs else "test: swiglu")
    p.define_backend(priority=500, device_types=("cpu",))
    p.kernel("swiglu", name="plain", priority=30)(_swiglu)
    p.kernel("swiglu_backward", name="packs" if packs else "plain", priority=30)(_backward(packs))
    return p


@pytest.fixture(params=[True, False], ids=["packing kernel", "plain kernel"])
def packs(request: pytest.FixtureRequest, install_plugins) -> bool:  # noqa: ANN001
    import hal_backend_cpu_ref

    install_plugins([hal_backend_cpu_ref.plugin, _plugin(request.param)])
    WRITTEN.clear()
    return request.param


def _reference(h: torch.Tensor, w: torch.Tensor, g: torch.Tensor, swap: bool = False) -> torch.Tensor:
    h = h.detach().requires_grad_(True)
    gate, up = (h @ w).chunk(2, dim=-1)
    if swap:
        gate, up = up, gate
    (F.silu(gate) * up).backward(g)
    return h.grad


def test_the_halves_gradient_reaches_the_packed_tensor_whole(packs: bool, seed: int) -> None:
    x, w = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True), torch.randn(16, 24, dtype=torch.float64)
    h = x @ w  # the packed projection (3, 5, 24): gate and up are its halves
    seen: list[torch.Tensor] = []
    h.register_hook(seen.append)
    gate, up = h.chunk(2, dim=-1)
    y = hal.ops.swiglu(gate, up)
    assert type(y.grad_fn).__name__ == "HalSwigluHalvesBackward"
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, _reference(x, w, g))
    assert seen[0].shape == h.shape
    if packs:  # the kernel's buffer itself, not a concatenation of its halves
        assert len(WRITTEN) == 1 and seen[0].data_ptr() == WRITTEN[0].data_ptr()
    else:
        assert not WRITTEN


def test_halves_watched_or_swapped_take_the_plain_node(packs: bool, seed: int) -> None:
    x, w = torch.randn(4, 16, dtype=torch.float64, requires_grad=True), torch.randn(16, 20, dtype=torch.float64)
    g = torch.randn(4, 10, dtype=torch.float64)
    gate, up = (x @ w).chunk(2, dim=-1)
    hooked: list[torch.Tensor] = []
    gate.register_hook(hooked.append)  # a hook on a half must see its gradient
    y = hal.ops.swiglu(gate, up)
    assert type(y.grad_fn).__name__ == "HalSwigluBackward"
    y.backward(g)
    torch.testing.assert_close(x.grad, _reference(x, w, g))
    assert len(hooked) == 1 and hooked[0].shape == gate.shape
    x.grad = None
    WRITTEN.clear()
    up, gate = (x @ w).chunk(2, dim=-1)  # the first half as up: not the declared order
    y = hal.ops.swiglu(gate, up)
    assert type(y.grad_fn).__name__ == "HalSwigluBackward"
    y.backward(g)
    torch.testing.assert_close(x.grad, _reference(x, w, g, swap=True))
    assert not WRITTEN  # the swapped halves are no packed pair for the kernel either


def test_halves_must_name_two_tensor_gradients() -> None:
    def op(a: torch.Tensor, b: torch.Tensor, k: float) -> torch.Tensor:
        """A test declaration that is never registered."""

    for halves in (("a", "a"), ("a", "k"), ("a", "c")):
        with pytest.raises(ValueError, match="halves|unknown parameter"):
            declare(dtypes=("float64",), tolerances={}, backward="op_backward", gradients=("a", "b"), halves=halves)(op)
