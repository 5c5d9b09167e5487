"""Kernel ranking for steps replayed from a CUDA graph: inside ``hal.graphs.device_bound()`` kernels
are ordered by their graph priority, ``explain`` says so, a ``hal.use`` scope opened inside keeps it,
and the backward op of a node made inside it is decided the same way on whichever thread runs the
backward (torch runs CUDA backwards on its own device threads). A test plugin's two kernels record
which one ran; CPU tensors, since the ranking is the dispatcher's and needs no GPU."""

from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import hal
import hal.graphs
from hal.plugin import Plugin

RAN: list[str] = []


def _kernels(name: str) -> tuple[Callable, Callable]:
    """softmax and its backward, recording ``name`` when they run."""

    def softmax(x, dim):  # noqa: ANN001 - exactly the op's parameters
        RAN.append(f"softmax:{name}")
        return F.softmax(x, dim)

    def softmax_backward(grad_out, out, dim):  # noqa: ANN001
        RAN.append(f"softmax_backward:{name}")
        return out * (grad_out - (grad_out * out).sum(dim, keepdim=True))

    return softmax, softmax_backward


def _ranked_plugin() -> Plugin:
    """softmax and its backward twice: ``launch_cheap`` first by priority, ``device_fast`` first by
    graph priority."""
    p = Plugin("ranked", "0.1.0", summary="test: two kernels ranked differently for graph replays")
    p.define_backend(priority=500, device_types=("cpu",))
    for name, priority, graph_priority in (("launch_cheap", 30, 10), ("device_fast", 20, 40)):
        forward, backward = _kernels(name)
        p.kernel("softmax", name=name, priority=priority, graph_priority=graph_priority)(forward)
        p.kernel("softmax_backward", name=name, priority=priority, graph_priority=graph_priority)(backward)
    return p


@pytest.fixture
def ranked(install_plugins) -> None:  # noqa: ANN001
    import hal_backend_cpu_ref

    install_plugins([hal_backend_cpu_ref.plugin, _ranked_plugin()])
    RAN.clear()


def test_device_bound_ranks_kernels_by_their_graph_priority(ranked: None, seed: int) -> None:
    x = torch.randn(4, 7, dtype=torch.float64)
    want = F.softmax(x, -1)
    torch.testing.assert_close(hal.ops.softmax(x, -1), want)
    with hal.graphs.device_bound():
        torch.testing.assert_close(hal.ops.softmax(x, -1), want)
        d = hal.explain("softmax", x, -1)
        with hal.use(strict=True):  # a scope opened inside keeps the ranking
            hal.ops.softmax(x, -1)
    assert RAN == ["softmax:launch_cheap", "softmax:device_fast", "softmax:device_fast"]
    assert d.kernel == "device_fast" and "kernels ranked by their graph priority" in str(d)
    assert "graph priority" not in str(hal.explain("softmax", x, -1))


@pytest.mark.parametrize("graphed_forward", [True, False])
def test_the_backward_op_follows_the_forwards_ranking_on_another_thread(ranked: None, seed: int, graphed_forward: bool) -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    if graphed_forward:
        with hal.graphs.device_bound():
            y = hal.ops.softmax(x, -1)
    else:
        y = hal.ops.softmax(x, -1)
    g = torch.randn_like(y)
    worker = threading.Thread(target=lambda: y.backward(g))  # no scope on this thread
    worker.start()
    worker.join()
    kernel = "device_fast" if graphed_forward else "launch_cheap"
    assert RAN == [f"softmax:{kernel}", f"softmax_backward:{kernel}"]
    xr = x.detach().clone().requires_grad_(True)
    F.softmax(xr, -1).backward(g)
    torch.testing.assert_close(x.grad, xr.grad)


def test_a_scope_of_the_backward_caller_wins_over_the_forwards(ranked: None, seed: int) -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with hal.graphs.device_bound():
        y = hal.ops.softmax(x, -1)
    with hal.use(kernel={"softmax_backward": "launch_cheap"}):
        y.backward(torch.randn_like(y))
    assert RAN == ["softmax:device_fast", "softmax_backward:launch_cheap"]


def test_explain_follows_a_decomposition_with_the_ranking(install_plugins, seed: int) -> None:
    """The steps of a training decomposition are explained as a device-bound call decides them."""
    import hal_backend_cpu_ref

    from hal.plugin import Plugin as _Plugin

    p = _Plugin("ranked_bn", "0.1.0", summary="test: batch norm ranked differently for graph replays")
    p.define_backend(priority=500, device_types=("cpu",))

    def bn(name: str) -> Callable:
        def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):  # noqa: ANN001
            return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)

        return batch_norm

    p.kernel("batch_norm", name="launch_cheap", priority=30, graph_priority=10)(bn("launch_cheap"))
    p.kernel("batch_norm", name="device_fast", priority=20, graph_priority=40)(bn("device_fast"))
    install_plugins([hal_backend_cpu_ref.plugin, p])
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    args = (x, w, None, torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64),
            torch.ones(4, dtype=torch.float64), 1, 1, 1, 1, 1e-5, 0.1, True)
    with hal.graphs.device_bound():
        d = hal.explain("fused_conv_bn_relu", *args)
    steps = {s.op: s for s in d.steps}
    assert d.route == "decomposition" and steps["batch_norm"].kernel == "device_fast", d
    assert hal.explain("fused_conv_bn_relu", *args).steps[1].kernel == "launch_cheap"
