"""The out-of-tree backend template (examples/backend_template), loaded in-process from the checkout
without installing it: its three ops' kernels (swiglu, softmax, rms_norm and its backward op)
against torch and against hal's reference on fresh random inputs, its gradients through hal's
autograd, and its imports limited to hal's public plugin surface. scripts/check_install.sh builds
its wheel, installs it into a clean venv and runs ``hal conformance --backend template`` there."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal
import hal_backend_cpu_ref
from hal.plugin import Plugin
from hal.runtime import Runtime

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "backend_template"
PACKAGE = TEMPLATE / "hal_backend_template"

#: what a backend may import from hal: the plugin SDK and the op vocabulary (issue 42)
PUBLIC_SURFACE = {"hal.plugin", "hal.ops", "hal.types", "hal.errors"}

#: (dtype, atol, rtol) of the comparisons with torch: float32 and bfloat16 results are rounded once
#: from float32 arithmetic, as torch's own kernels compute them
DTYPES = [(torch.float64, 1e-12, 1e-10), (torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]


@pytest.fixture
def template(monkeypatch: pytest.MonkeyPatch, install_plugins: Callable[[Sequence[Plugin]], Runtime]) -> Iterator[ModuleType]:
    """The template's plugin module imported from the checkout, installed beside cpu_ref."""
    monkeypatch.syspath_prepend(str(TEMPLATE))
    module = importlib.import_module("hal_backend_template")
    assert Path(module.__file__).resolve().parent == PACKAGE, f"imported {module.__file__}, not the checkout's template"
    install_plugins([hal_backend_cpu_ref.plugin, module.plugin])
    yield module


def _draw(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)


def _on_template(op: str, *args, **kwargs) -> torch.Tensor:
    """``hal.ops.<op>`` forced onto the template backend, having checked that its kernel is chosen."""
    with hal.use(backend="template"):
        decision = hal.explain(op, *args, **kwargs)
        assert (decision.backend, decision.kernel) == ("template", "torch_math"), str(decision)
        return getattr(hal.ops, op)(*args, **kwargs)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_kernels_match_torch_on_random_inputs(template: ModuleType, seed: int, dtype: torch.dtype, atol: float, rtol: float) -> None:
    gate, up = _draw((3, 5, 8), dtype), _draw((5, 1), dtype)  # up broadcast along the last dim
    want = (F.silu(gate.float()) * up.float()).to(dtype) if dtype != torch.float64 else F.silu(gate) * up
    _close(_on_template("swiglu", gate, up), want, atol, rtol)

    x = _draw((4, 7, 6), dtype, scale=4.0)
    for dim in (0, 1, -1):
        _close(_on_template("softmax", x, dim), F.softmax(x, dim, dtype=x.dtype if dtype == torch.float64 else torch.float32).to(dtype), atol, rtol)

    weight = _draw((7, 6), dtype, scale=1.0)
    want = F.rms_norm(x.double(), (7, 6), weight.double(), 1e-6).to(dtype)
    _close(_on_template("rms_norm", x, (7, 6), weight, 1e-6), want, atol, 2 * rtol)


def test_numpy_inputs_give_numpy_results(template: ModuleType, seed: int) -> None:
    x = _draw((6, 9), torch.float32)
    out = _on_template("softmax", x.numpy(), 1)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32, (type(out), getattr(out, "dtype", None))
    _close(torch.from_numpy(out), F.softmax(x, 1), 1e-6, 1e-6)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_gradients_run_the_templates_backward_op(template: ModuleType, seed: int, with_weight: bool) -> None:
    x = _draw((3, 4, 10), torch.float64).requires_grad_(True)
    weight = _draw((10,), torch.float64).requires_grad_(True) if with_weight else None
    grad_out = _draw((3, 4, 10), torch.float64)
    hal.reset_stats()
    with hal.use(backend="template"):
        hal.ops.rms_norm(x, 10, weight).backward(grad_out)
    assert ("rms_norm_backward", "template", "torch_math") in hal.stats(), hal.stats()

    xr = x.detach().clone().requires_grad_(True)
    wr = weight.detach().clone().requires_grad_(True) if with_weight else None
    F.rms_norm(xr, (10,), wr, torch.finfo(torch.float64).eps).backward(grad_out)
    _close(x.grad, xr.grad, 1e-10, 1e-9)
    if with_weight:
        _close(weight.grad, wr.grad, 1e-10, 1e-9)


def test_backward_op_returns_the_weight_gradient_without_a_weight(template: ModuleType, seed: int) -> None:
    """rms_norm_backward returns grad_weight of shape normalized_shape also for a forward without a
    weight (the op's declaration): the gradient a weight of ones would get."""
    x, grad_out = _draw((2, 3, 5, 4), torch.float32), _draw((2, 3, 5, 4), torch.float32)
    grad_x, grad_weight = _on_template("rms_norm_backward", grad_out, x, (5, 4), None, 1e-5)
    ones = torch.ones(5, 4, requires_grad=True)
    xr = x.clone().requires_grad_(True)
    F.rms_norm(xr, (5, 4), ones, 1e-5).backward(grad_out)
    _close(grad_x, xr.grad, 1e-5, 1e-5)
    _close(grad_weight, ones.grad, 1e-4, 1e-5)


def test_swiglu_and_softmax_gradients_by_torchs_autograd(template: ModuleType, seed: int) -> None:
    """The two kernels marked differentiable: torch records them, no backward op of the template is
    needed, and the gradients are torch's."""
    gate, up = _draw((4, 6), torch.float64).requires_grad_(True), _draw((4, 6), torch.float64).requires_grad_(True)
    x = _draw((4, 6), torch.float64).requires_grad_(True)
    grad_out = _draw((4, 6), torch.float64)
    with hal.use(backend="template"):
        torch.autograd.backward([hal.ops.swiglu(gate, up), hal.ops.softmax(x, 0)], [grad_out, grad_out])
    want = torch.autograd.grad([F.silu(gate) * up, F.softmax(x, 0)], [gate, up, x], [grad_out, grad_out])
    for got, expected in zip((gate.grad, up.grad, x.grad), want):
        _close(got, expected, 1e-12, 1e-10)


def test_the_templates_kernels_pass_the_conformance_cases(template: ModuleType) -> None:
    """A few cases per kernel and dtype (``--quick``), against cpu_ref in float64; the full run is
    check_install.sh's ``hal conformance --backend template`` in a clean venv."""
    from hal.conformance.runner import Suite

    suite = Suite(backend="template", ops=["swiglu", "softmax", "rms_norm", "rms_norm_backward"], quick=True)
    results = suite.run(suite.plan())
    kernels = {(r.op, r.kernel) for r in results}
    assert kernels == {(op, "torch_math") for op in ("swiglu", "softmax", "rms_norm", "rms_norm_backward")}, kernels
    failed = [f"{r.id}: {r.status} {r.reason}" for r in results if r.status != "pass"]
    assert not failed, "\n".join(failed)


def test_the_template_imports_only_hals_public_plugin_surface() -> None:
    imported = set()
    for source in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module)
    from_hal = {name for name in imported if name == "hal" or name.startswith("hal.")}
    assert from_hal and from_hal <= PUBLIC_SURFACE, sorted(from_hal - PUBLIC_SURFACE)
    assert not {name for name in imported if name.startswith("hal_")}, "the template imports another backend or a kit"
