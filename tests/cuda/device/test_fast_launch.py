"""On a CUDA device: launches of compiled Triton specialisations that bypass Triton's Python launch
path (hal.triton._launch) compute what the first, Triton-launched call computes, reuse one entry
per specialisation, and take a new one when the specialisation changes (a misaligned view).

Skipped without a CUDA device (CI); run on the device machine (benchmarks/h200.sh).
"""

from __future__ import annotations

import pytest
import torch

from hal.triton import _launch, elementwise
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fast_launches_match_and_reuse_their_specialisation():
    if not _launch._FAST_LAUNCH[0]:
        pytest.skip("fast launches are off (HAL_TRITON_FAST_LAUNCH=0)")
    gen = torch.Generator().manual_seed(fresh_seed())
    _launch._LAUNCHED.clear()
    cfg = {"block_elems": 1024, "num_warps": 4}
    for i in range(4):  # fresh data each time: the first call compiles, the others launch directly
        x = torch.randn(300, 257, generator=gen).cuda()
        b = torch.randn(257, generator=gen).cuda()
        out = torch.full_like(x, float("nan"))
        elementwise.affine_act(x, 0.5, b, "gelu", out=out, **cfg)
        want = torch.nn.functional.gelu(x.double() * 0.5 + b.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        assert len(_launch._LAUNCHED) == 1, f"call {i}: {len(_launch._LAUNCHED)} entries"
    base = torch.randn(300 * 257 + 1, generator=gen).cuda()
    x = base[1:].view(300, 257)  # 4-byte aligned only: another specialisation of the pointer
    out = torch.full_like(x, float("nan"))
    elementwise.affine_act(x, 0.5, b, "gelu", out=out, **cfg)
    torch.testing.assert_close(out.double(), torch.nn.functional.gelu(x.double() * 0.5 + b.double()), rtol=1e-5, atol=1e-6)
    assert len(_launch._LAUNCHED) == 2
