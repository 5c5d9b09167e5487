"""On a CUDA device: a training-like sequence of hal.ops calls runs without a host synchronisation,
is captured in a CUDA graph, and its replays compute what eager calls compute on the same inputs.

Skipped without a usable CUDA backend (CI); run on the device machine (benchmarks/h200.sh).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hal
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Model:
    """Static buffers and one step of ops covering every kernel family of the CUDA backend."""

    def __init__(self, gen: torch.Generator) -> None:
        dev = torch.device("cuda")

        def r(*shape: int, dtype: torch.dtype = torch.bfloat16, std: float = 1.0) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device="cpu") * std).to(dtype).to(dev)

        self.x, self.lw, self.lb = r(64, 256), r(256), r(256)
        self.w, self.b = r(512, 256, std=0.06), r(512)
        self.shift = r(512)
        self.img, self.cw = r(8, 16, 12, 12).contiguous(memory_format=torch.channels_last), r(16, 16, 3, 3, std=0.1)
        self.gamma, self.beta = torch.rand(16, device=dev) + 0.5, torch.randn(16, device=dev)
        self.rm, self.rv = torch.zeros(16, device=dev), torch.ones(16, device=dev)
        self.xg, self.wg = r(96, 64), r(4, 64, 32, std=0.1)
        self.sizes = torch.tensor([10, 0, 50, 36], dtype=torch.int32, device=dev)
        self.xq, self.wq = (torch.randint(-128, 128, s, generator=gen).to(torch.int8).to(dev) for s in ((32, 64), (48, 64)))
        self.params = [r(1000), r(37, 3)]
        self.grads = [r(1000), r(37, 3)]
        self.masters = [p.float() for p in self.params]
        self.m = [torch.zeros_like(w) for w in self.masters]
        self.v = [torch.zeros_like(w) for w in self.masters]
        self.inv = torch.tensor([0.5], device=dev)
        self.inputs = [self.x, self.img, self.xg, self.grads[0], self.grads[1]]
        self.state = [self.rm, self.rv, *self.params, *self.grads, *self.masters, *self.m, *self.v]

    def step(self) -> list[torch.Tensor]:
        h = hal.ops.layer_norm(self.x, (256,), self.lw, self.lb)
        h = hal.ops.linear(h, self.w, self.b, "gelu")
        h = hal.ops.rms_norm(h, (512,))
        p = hal.ops.softmax(h, -1)
        a = hal.ops.scale_shift_act(h, 2.0, self.shift, "silu")
        y = hal.ops.fused_conv_bn_relu(self.img, self.cw, None, self.gamma, self.beta, self.rm, self.rv, padding=1, training=True)
        q = hal.ops.quantize(a, 0.05, 0)
        d = hal.ops.dequantize(q, 0.05, 0)
        o = hal.ops.grouped_gemm(self.xg, self.wg, self.sizes)
        i8 = hal.ops.int8_linear(self.xq, self.wq, 0.01, 0.02, None, "bfloat16")
        found = hal.ops.amp_unscale_(self.grads, self.inv)
        hal.ops.fused_adamw_(self.params, self.grads, self.m, self.v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.01, step=1.0, master_params=self.masters, found_inf=found)
        return [p, a, y, d, o, i8, found]


def _refill(tensors: list[torch.Tensor], gen: torch.Generator) -> None:
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def test_step_runs_without_host_synchronisation() -> None:
    model = Model(torch.Generator().manual_seed(fresh_seed()))
    model.step()  # compile, tune and cache outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_step_is_capturable_and_replays_match_eager() -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    model = Model(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = model.step()
    for _ in range(2):
        _refill(model.inputs, gen)
        before = [t.clone() for t in model.state]
        graph.replay()
        torch.cuda.synchronize()
        replayed: list[Any] = [o.clone() for o in outs] + [t.clone() for t in model.state]
        for t, saved in zip(model.state, before):
            t.copy_(saved)
        eager = model.step() + [t.clone() for t in model.state]
        for i, (a, b) in enumerate(zip(replayed, eager)):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, equal_nan=True, msg=lambda m, i=i: f"output/state {i}: {m}")
    stats = hal.stats()
    assert not any(v["fallbacks"] for (op, backend, kernel), v in stats.items() if backend == "cuda"), stats
