"""On a CUDA device (sm_90): grouped_gemm's ``tuned`` kernel (torch._grouped_mm or the Triton kernel,
whichever this device's timing chose) and the ``grouped_mm`` kernel forced, forward and backward,
against float64 references at an MoE shape with an empty expert; no host synchronisation once the
choice is made; an empty group's weight gradient is zero through CUTLASS too.

Skipped without a CUDA device of compute capability 9.0 (CI); run on the device machine.
"""

from __future__ import annotations

import pytest
import torch

import hal
from tests.cuda._support import assert_close, fresh_seed, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a CUDA device of compute capability 9.0")


def _moe(gen: torch.Generator, rows: int = 4096, k: int = 1024, n: int = 2048, groups: int = 8):
    sizes = torch.multinomial(torch.ones(groups - 1), rows, replacement=True, generator=gen).bincount(minlength=groups - 1)
    sizes = torch.cat([sizes[:3], torch.zeros(1, dtype=sizes.dtype), sizes[3:]])  # expert 3 gets no token
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(groups, k, n, generator=gen) * k**-0.5).to("cuda", torch.bfloat16)
    g = torch.randn(rows, n, generator=gen).to("cuda", torch.bfloat16)
    return x, w, sizes.to("cuda"), g


@pytest.mark.parametrize("kernel", ["tuned", "grouped_mm"])
def test_matches_float64_forward_and_backward(kernel: str) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    x, w, sizes, g = _moe(gen)
    with hal.use(kernel={"grouped_gemm": kernel, "grouped_gemm_backward": kernel}):
        assert hal.explain("grouped_gemm", x, w, sizes).kernel == kernel
        y = hal.ops.grouped_gemm(x, w, sizes)
        dx, dw = hal.ops.grouped_gemm_backward(g, x, w, sizes)
        torch.cuda.synchronize()
        with torch.cuda.device(x.device):
            torch.cuda.set_sync_debug_mode("error")  # the choice is cached: later calls never wait for the device
            try:
                hal.ops.grouped_gemm(x, w, sizes)
                hal.ops.grouped_gemm_backward(g, x, w, sizes)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    x, w, sizes, g = (t.cpu() for t in (x, w, sizes, g))  # the float64 reference runs on the CPU
    want, _ = reference("grouped_gemm", x, w, sizes)
    assert_close("grouped_gemm", y.cpu(), want, (x, w, sizes))
    (want_dx, want_dw), _ = reference("grouped_gemm_backward", g, x, w, sizes)
    assert_close("grouped_gemm_backward", dx.cpu(), want_dx, (g, x, w, sizes), what="grad_x")
    assert_close("grouped_gemm_backward", dw.cpu(), want_dw, (g, x, w, sizes), what="grad_weight")
    assert dw[3].abs().max().item() == 0.0

