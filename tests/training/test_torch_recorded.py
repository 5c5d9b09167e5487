"""The autograd route of a kernel registered ``differentiable``: the kernel runs with grad
recording on and torch's autograd records its backward (torch's own nodes, no hal node, no
backward op), ``explain`` says so and ``stats`` counts exactly the forward kernel; a kernel whose
check refuses, or one not registered differentiable, keeps hal's node and its backward op."""

from __future__ import annotations

from collections import Counter

import hal_backend_cpu_ref
import pytest
import torch
import torch.nn.functional as F

import hal
from hal.arrays import writes_of
from hal.plugin import Inputs, Plugin


def _plugin(differentiable) -> Plugin:
    """A backend of torch kernels for softmax (forward and backward) and batch_norm."""
    plugin = Plugin("recorded", "1.0")
    plugin.define_backend(priority=1000, device_types=("cpu",), array_api="torch")
    plugin.kernel("softmax", name="torch", differentiable=differentiable)(lambda x, dim: torch.softmax(x, dim))

    @plugin.kernel("softmax_backward", name="torch")
    def softmax_backward(grad_out, out, dim):
        return torch._softmax_backward_data(grad_out, out, dim, out.dtype)

    @plugin.kernel("batch_norm", name="torch", differentiable=differentiable)
    def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
        return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)

    return plugin


def _counted() -> Counter:
    return Counter({k: v["calls"] for k, v in hal.stats().items() if v["calls"]})


def test_torch_records_a_differentiable_kernel(install_plugins, seed: int) -> None:
    install_plugins([hal_backend_cpu_ref.plugin, _plugin(True)])
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    d = hal.explain("softmax", x, 1)
    assert (d.route, d.autograd_by, d.backend, d.kernel) == ("autograd", "torch", "recorded", "torch"), d
    assert "torch's own" in str(d)
    # a compiled graph takes the kernel's torch ops in (hal counts nothing there); the opaque node
    # of a compiled call inside a hal.use scope runs hal's backward op
    assert d.traceable and d.kernels_run(compiled=True) == []
    assert d.backward is not None and d.backward.op == "softmax_backward"
    hal.reset_stats()
    y = hal.ops.softmax(x, 1)
    assert type(y.grad_fn).__name__ == "SoftmaxBackward0"  # torch's node, not HalSoftmaxBackward
    g = torch.randn_like(y)
    y.backward(g)
    assert _counted() == Counter(d.kernels_run()) == Counter({("softmax", "recorded", "torch"): 1})
    xr = x.detach().clone().requires_grad_(True)
    torch.softmax(xr, 1).backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    with torch.no_grad():
        assert hal.explain("softmax", x, 1).route == "kernel"
        assert hal.explain("softmax", x, 1).autograd_by is None


def test_a_recorded_kernel_that_writes_updates_statistics_as_torch_does(install_plugins, seed: int) -> None:
    """Statistics updated in place, their version counter untouched (as F.batch_norm leaves it) and
    the write counted by hal (hal.arrays.writes_of)."""
    install_plugins([hal_backend_cpu_ref.plugin, _plugin(True)])
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_(True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    mean, var = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    ref_mean, ref_var = mean.clone(), var.clone()
    version, writes = mean._version, writes_of(mean)
    d = hal.explain("batch_norm", x, mean, var, w, b, True, 0.1, 1e-5)
    assert (d.route, d.autograd_by) == ("autograd", "torch"), d
    out = hal.ops.batch_norm(x, mean, var, w, b, True, 0.1, 1e-5)
    assert mean._version == version and writes_of(mean) == writes + 1
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    ref = F.batch_norm(xr, ref_mean, ref_var, wr, br, True, 0.1, 1e-5)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close((mean, var), (ref_mean, ref_var), rtol=0, atol=0)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close((x.grad, w.grad, b.grad), (xr.grad, wr.grad, br.grad), rtol=0, atol=0)


@pytest.mark.parametrize("differentiable", [False, lambda inputs: ["not for these inputs"]], ids=["not_registered", "check_refuses"])
def test_other_kernels_keep_hals_node_and_backward_op(install_plugins, seed: int, differentiable) -> None:
    install_plugins([hal_backend_cpu_ref.plugin, _plugin(differentiable)])
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    d = hal.explain("softmax", x, 1)
    assert (d.route, d.autograd_by) == ("autograd", "hal") and d.backward is not None, d
    hal.reset_stats()
    y = hal.ops.softmax(x, 1)
    assert type(y.grad_fn).__name__.startswith("HalSoftmax")
    y.backward(torch.randn_like(y))
    assert _counted() == Counter(d.kernels_run())
    assert ("softmax_backward", "recorded", "torch") in _counted()


def test_the_check_sees_the_calls_inputs(install_plugins, seed: int) -> None:
    """A check deciding by dtype: float32 recorded by torch, float64 through hal's node."""
    seen: list[str] = []

    def only_float32(inputs: Inputs) -> list[str]:
        seen.append(inputs.dtype)
        return [] if inputs.dtype == "float32" else ["float32 only"]

    install_plugins([hal_backend_cpu_ref.plugin, _plugin(only_float32)])
    for dtype, by in ((torch.float32, "torch"), (torch.float64, "hal")):
        x = torch.randn(4, 9, dtype=dtype, requires_grad=True)
        assert hal.explain("softmax", x, -1).autograd_by == by
        y = hal.ops.softmax(x, -1)
        assert (type(y.grad_fn).__name__ == "SoftmaxBackward0") == (by == "torch")
    assert {"float32", "float64"} <= set(seen)
