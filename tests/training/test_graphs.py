"""hal.graphs on a machine without a CUDA device (CI): a graphed step runs eagerly every call, says
why, and keeps its argument checks. Capture and replay are tested on the device
(tests/cuda/device/test_graphs.py)."""

from __future__ import annotations

import pytest
import torch

import hal
import hal.graphs

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour (a CUDA device captures)")


def test_without_cuda_every_call_runs_the_step(seed: int) -> None:
    calls = []

    def step(x: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(scale)
        return (x * scale).sum()

    graphed = hal.graphs.graphed(step)
    xs = [torch.randn(5) for _ in range(4)]
    got = [graphed(x, 1.5) for x in xs]
    assert calls == [1.5] * 4  # no warm-up skipped, nothing replayed
    for x, g in zip(xs, got):
        torch.testing.assert_close(g, (x * 1.5).sum())
    text = graphed.explain()
    assert "1 argument signature" in text and "eager: no CUDA device" in text
    assert graphed.captured() == 0


def test_signatures_are_told_apart_by_shape_and_value(seed: int) -> None:
    graphed = hal.graphs.graphed(lambda x, k: x[:k].sum())
    graphed(torch.randn(4), 2)
    graphed(torch.randn(4), 3)
    graphed(torch.randn(6), 2)
    graphed(torch.randn(6), 2)
    assert "3 argument signature" in graphed.explain()


def test_explain_before_any_call_and_bad_warmup() -> None:
    def train_step() -> None:
        pass

    assert "has not been called yet" in hal.graphs.graphed(train_step).explain()
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        hal.graphs.graphed(train_step, warmup=0)


def test_reset_forgets_signatures(seed: int) -> None:
    graphed = hal.graphs.graphed(lambda x: x + 1)
    graphed(torch.randn(3))
    graphed.reset()
    assert "has not been called yet" in graphed.explain()


def test_unhashable_arguments_share_one_signature(seed: int) -> None:
    """An argument that cannot be hashed runs eagerly; calls with new such objects do not each add a
    signature that is never used again."""

    class Config:
        __hash__ = None  # type: ignore[assignment]

    graphed = hal.graphs.graphed(lambda x, cfg: x * 2)
    for _ in range(5):
        x = torch.randn(3)
        torch.testing.assert_close(graphed(x, Config()), x * 2)
    assert "1 argument signature" in graphed.explain()
