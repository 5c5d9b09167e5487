"""Running statistics are written as torch's batch norm writes them: in place, without a bump of
autograd's version counter. A batch norm applied twice before one backward (a module shared by two
branches) and one recomputed by activation checkpointing train under torch; they must under hal
too, on every route (torch's autograd recording the kernel, hal's own nodes, the NumPy reference).
Caches derived from the statistics (eval-mode folded weights) still see every write: hal counts
them itself (``hal.arrays.writes_of``)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hal
from hal.arrays import writes_of

ROUTES = ["default", "hal_nodes", "cpu_ref"]


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    """The route hal's calls take: the default kernels, hal's own autograd nodes (the ``hal_nodes``
    fixture: HAL_TORCH_AUTOGRAD=0), or the cpu_ref backend."""
    if request.param == "hal_nodes":
        request.getfixturevalue("hal_nodes")
    if request.param == "cpu_ref":
        with hal.use(backend="cpu_ref"):
            yield request.param
    else:
        yield request.param


def _leaves(gen: torch.Generator, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def _stats(gen: torch.Generator, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(c, generator=gen, dtype=torch.float64), torch.rand(c, generator=gen, dtype=torch.float64) + 0.5


def _compare(run: Callable[[Any, tuple], torch.Tensor], leaves: list[torch.Tensor], stats: tuple[torch.Tensor, ...],
             gen: torch.Generator) -> None:
    """``run(impl, stats)`` with hal's ops and with torch's on copies of the same leaves and
    statistics: outputs, gradients and the statistics after the step agree."""
    results: dict[str, Any] = {}
    grad: Any = None
    for impl in ("torch", "hal"):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        st = tuple(s.clone() for s in stats)
        out = run(impl, xs, st)
        if grad is None:  # drawn once: both sides get the same upstream gradient
            grad = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        out.backward(grad)
        results[impl] = (out.detach(), [t.grad for t in xs], st)
    (want, want_grads, want_stats), (got, got_grads, got_stats) = results["torch"], results["hal"]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    for g, w in zip(got_stats, want_stats):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _bn(impl: str) -> Callable[..., torch.Tensor]:
    return hal.ops.batch_norm if impl == "hal" else F.batch_norm


def test_batch_norm_applied_twice_before_one_backward(route: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    leaves = _leaves(gen, (3, 4, 5, 5), (4,), (4,))

    def run(impl: str, xs: list[torch.Tensor], st: tuple) -> torch.Tensor:
        x, w, b = xs
        y = _bn(impl)(x, *st, w, b, True, 0.1, 1e-5)
        return _bn(impl)(torch.tanh(y), *st, w, b, True, 0.1, 1e-5)  # the same module, a second time

    _compare(run, leaves, _stats(gen, 4), gen)


def test_fused_conv_bn_relu_applied_twice_before_one_backward(route: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    leaves = _leaves(gen, (2, 4, 6, 6), (4, 4, 3, 3), (4,), (4,))

    def run(impl: str, xs: list[torch.Tensor], st: tuple) -> torch.Tensor:
        x, cw, w, b = xs

        def layer(t: torch.Tensor) -> torch.Tensor:
            if impl == "hal":
                return hal.ops.fused_conv_bn_relu(t, cw, None, w, b, *st, padding=1, training=True)
            return F.relu(F.batch_norm(F.conv2d(t, cw, None, 1, 1), *st, w, b, True, 0.1, 1e-5))

        return layer(layer(x))

    _compare(run, leaves, _stats(gen, 4), gen)


def test_batch_norm_under_activation_checkpointing(route: str, seed: int) -> None:
    """checkpoint recomputes the forward inside the backward: the statistics are written again
    (as torch's are) while the outer graph's nodes still hold them."""
    gen = torch.Generator().manual_seed(seed)
    leaves = _leaves(gen, (3, 4, 5, 5), (4,), (4,))

    def run(impl: str, xs: list[torch.Tensor], st: tuple) -> torch.Tensor:
        x, w, b = xs
        first = _bn(impl)(x, *st, w, b, True, 0.1, 1e-5)
        inner = lambda t: torch.sin(_bn(impl)(t, *st, w, b, True, 0.1, 1e-5))  # noqa: E731
        return checkpoint(inner, first, use_reentrant=False)

    _compare(run, leaves, _stats(gen, 4), gen)


def test_statistics_writes_are_counted_not_versioned(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 4, 4, generator=gen)
    rm, rv = torch.randn(3, generator=gen), torch.rand(3, generator=gen) + 0.5
    versions, writes = (rm._version, rv._version), (writes_of(rm), writes_of(rv))
    hal.ops.batch_norm(x, rm, rv, training=True)
    assert (rm._version, rv._version) == versions, "torch's batch norm does not bump them; neither may hal"
    assert (writes_of(rm), writes_of(rv)) == (writes[0] + 1, writes[1] + 1)
    hal.ops.batch_norm(x, rm, rv, training=False)  # eval reads them only
    assert (writes_of(rm), writes_of(rv)) == (writes[0] + 1, writes[1] + 1)


def test_eval_fold_sees_the_statistics_a_training_step_wrote(seed: int) -> None:
    """The folded weights of eval conv + BN are cached per parameter set: a training forward in
    between (statistics written without a version bump) must rebuild them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 6, 6, generator=gen)
    cw, w, b = torch.randn(5, 3, 3, 3, generator=gen), torch.rand(5, generator=gen) + 0.5, torch.randn(5, generator=gen)
    rm, rv = torch.randn(5, generator=gen), torch.rand(5, generator=gen) + 0.5

    def eval_both() -> tuple[torch.Tensor, torch.Tensor]:
        got = hal.ops.fused_conv_bn_relu(x, cw, None, w, b, rm, rv, padding=1)
        return got, F.relu(F.batch_norm(F.conv2d(x, cw, None, 1, 1), rm, rv, w, b, False, 0.1, 1e-5))

    torch.testing.assert_close(*eval_both(), rtol=1e-5, atol=1e-5)
    before = rm.clone()
    hal.ops.fused_conv_bn_relu(x * 3.0 + 1.0, cw, None, w, b, rm, rv, padding=1, training=True)
    assert not torch.equal(rm, before)
    torch.testing.assert_close(*eval_both(), rtol=1e-5, atol=1e-5, msg="the fold was not rebuilt after the training step")
