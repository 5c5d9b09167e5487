"""``Inputs.traced`` as a real torch.compile sees it. A kernel check that accepts only traced calls
(the CUDA plugin's graph-only convolution kernels, its SwiGLU size rule) must be asked on the
tensors AOTAutograd traces the graph with (functional tensors wrapping fake ones), not only on
Dynamo's fake tensors: a check that answered False there kept the opaque kernel in ResNet-50's
compiled inference graph. A test plugin's two softmax kernels record which one ran and what the
check saw; CPU tensors, since the decision is the dispatcher's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hal
from hal.plugin import Inputs, Plugin, traced

SEEN: list[str] = []


def _opaque(x, dim):  # noqa: ANN001 - exactly the op's parameters
    SEEN.append("ran opaque")
    return F.softmax(x, dim)


def _graph_ops(x, dim):  # noqa: ANN001
    SEEN.append("traced graph_ops")
    return F.softmax(x, dim)


def _only_in_graphs(inputs: Inputs) -> list[str]:
    SEEN.append(f"asked with {type(inputs['x']).__name__}: traced={inputs.traced}")
    return [] if inputs.traced else ["only inside torch.compile graphs"]


@pytest.fixture
def graph_only(install_plugins) -> None:  # noqa: ANN001
    import hal_backend_cpu_ref

    p = Plugin("graphonly", "0.1.0", summary="test: an opaque kernel, and one of torch's ops for compiled graphs only")
    p.define_backend(priority=500, device_types=("cpu",))
    p.kernel("softmax", name="opaque", priority=30)(_opaque)
    p.kernel("softmax", name="graph_ops", priority=2, check=_only_in_graphs, differentiable=True)(_graph_ops)
    install_plugins([hal_backend_cpu_ref.plugin, p])
    SEEN.clear()


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_compiled_graphs_take_the_kernel_only_traced_calls_accept(graph_only: None, grad: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 33, generator=gen).requires_grad_(grad)

    def model(t: torch.Tensor) -> torch.Tensor:
        return hal.ops.softmax(t * 2.0, -1) + 1.0

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert "traced graph_ops" in SEEN and "ran opaque" not in SEEN, SEEN
    assert any(s.startswith("asked with FunctionalTensor: traced=True") for s in SEEN), SEEN  # AOTAutograd's tensors
    torch.testing.assert_close(got, F.softmax(x.detach() * 2.0, -1) + 1.0)

    SEEN.clear()
    assert hal.explain("softmax", x, -1).kernel == "opaque"
    hal.ops.softmax(x, -1)
    assert "ran opaque" in SEEN and "traced graph_ops" not in SEEN, SEEN


def test_eager_functionalize_is_not_traced(seed: int) -> None:
    """torch.func.functionalize computes on real tensors eagerly: not a trace."""
    x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
    answers: list[bool] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        answers.append(traced([t]))
        return t.relu()

    torch.func.functionalize(f)(x)
    assert answers == [False]
    assert not traced([x, None, 3])
