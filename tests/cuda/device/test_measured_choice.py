"""Measured kernel choice on a CUDA device (hal.dispatch.measure): the contexts, the winner, and no
measurement inside a CUDA-graph capture.

Skipped without a CUDA device (CI); run on the device machine (benchmarks/h200.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hal
from hal import dispatch
from hal.dispatch import measure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = torch.device("cuda")


@pytest.fixture
def tuning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("HAL_TUNE", "on")
    monkeypatch.setenv("HAL_TUNE_CACHE", str(tmp_path))
    dispatch.reset()
    yield
    dispatch.reset()


def _check_winner(d: hal.dispatch.Decision) -> None:
    m = d.measurement
    assert m is not None, str(d)
    times = dict(m.times_us)
    assert len(times) >= 2 and m.winner in times
    first = m.times_us[0][1]
    assert times[m.winner] <= first, f"the winner is never slower than hal's first choice: {m}"
    assert min(times.values()) * (1 + measure.MARGIN) >= times[m.winner] or m.winner == m.times_us[0][0]


def test_an_eager_call_is_measured_among_the_backends_kernels(tuning) -> None:
    x = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(1024, device=DEV, dtype=torch.bfloat16)
    out = hal.ops.linear(x, w, b, "gelu_tanh")
    torch.testing.assert_close(out.float(), torch.nn.functional.gelu(x.float() @ w.float().T + b.float(), approximate="tanh"),
                               atol=0.1, rtol=0.05)
    d = hal.explain("linear", x, w, b, "gelu_tanh")
    assert d.measurement.context == "eager" and any(label.endswith("/eager") for label, _ in d.measurement.times_us)
    _check_winner(d)


def test_training_and_graph_contexts(tuning) -> None:
    x = torch.randn(8192, 2048, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    hal.ops.softmax(x, 1)
    d = hal.explain("softmax", x, 1)
    assert d.measurement.context == "eager/train"
    _check_winner(d)
    with hal.graphs.device_bound():
        y = x.detach()
        hal.ops.softmax(y, 1)
        d = hal.explain("softmax", y, 1)
    assert d.measurement.context == "graph"
    _check_winner(d)


def test_nothing_is_measured_inside_a_capture(tuning, monkeypatch) -> None:
    x = torch.randn(3072, 1536, device=DEV, dtype=torch.float16)
    static = torch.empty_like(x)
    monkeypatch.setenv("HAL_TUNE", "off")  # warm up (compile) the priority choice outside the capture
    hal.ops.softmax(x, 1)
    monkeypatch.setenv("HAL_TUNE", "on")
    dispatch.reset()  # plans go, compiled kernels stay: the capture meets a signature never decided
    before = len(measure.LOG)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        static.copy_(hal.ops.softmax(x, 1))  # a signature never seen: decided by priority, not cached
    torch.cuda.current_stream().wait_stream(stream)
    assert len(measure.LOG) == before, "no measurement during the capture"
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static, torch.softmax(x.float(), 1).half(), atol=2e-3, rtol=2e-3)
    hal.ops.softmax(x, 1)  # the next eager call measures
    assert len(measure.LOG) == before + 1
