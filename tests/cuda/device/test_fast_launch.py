"""On a CUDA device: launches of compiled Triton specialisations that bypass Triton's Python launch
path (hal_triton._launch: ``launch`` and the call sites' ``LaunchPlan``) compute what the first,
Triton-launched call computes, reuse one entry per specialisation, and take a new one when the
specialisation changes (a misaligned view).

Skipped without a CUDA device (CI); run on the device machine (benchmarks/h200.sh).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hal_triton import _launch, elementwise
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _fast_launches_on():
    if not _launch._FAST_LAUNCH[0]:
        pytest.skip("fast launches are off (HAL_TRITON_FAST_LAUNCH=0)")


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


def test_fast_launches_match_and_reuse_their_specialisation():
    gen = torch.Generator().manual_seed(fresh_seed())
    _launch._LAUNCHED.clear()
    n = 300 * 257
    for i in range(4):  # fresh data each time: the first call compiles, the others launch directly
        x = torch.randn(n, generator=gen).cuda()
        out = torch.full_like(x, float("nan"))
        _launch.launch(_scale_kernel, (triton.cdiv(n, 1024),), x, out, n, 0.75, BLOCK=1024)
        torch.testing.assert_close(out, x * 0.75, rtol=0, atol=0)
        assert len(_launch._LAUNCHED) == 1, f"call {i}: {len(_launch._LAUNCHED)} entries"
    base = torch.randn(n + 1, generator=gen).cuda()
    x = base[1:]  # 4-byte aligned only: another specialisation of the pointer
    out = torch.full_like(x, float("nan"))
    _launch.launch(_scale_kernel, (triton.cdiv(n, 1024),), x, out, n, 0.75, BLOCK=1024)
    torch.testing.assert_close(out, x * 0.75, rtol=0, atol=0)
    assert len(_launch._LAUNCHED) == 2


def _plan_entries() -> int:
    return sum(len(site.plan._by_spec) for site in elementwise._SITES.values())


def test_planned_launches_match_and_take_a_new_entry_for_a_misaligned_view():
    gen = torch.Generator().manual_seed(fresh_seed())
    elementwise._SITES.clear()
    cfg = {"block_elems": 1024, "num_warps": 4}
    b = torch.randn(257, generator=gen).cuda()
    for i in range(4):  # one site, one specialisation; the numbers and the data change per call
        x = torch.randn(300, 257, generator=gen).cuda()
        scale = float(torch.rand((), generator=gen)) + 0.25
        out = torch.full_like(x, float("nan"))
        elementwise.affine_act(x, scale, b, "gelu", out=out, **cfg)
        want = torch.nn.functional.gelu(x.double() * scale + b.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        assert (len(elementwise._SITES), _plan_entries()) == (1, 1), f"call {i}"
    base = torch.randn(300 * 257 + 1, generator=gen).cuda()
    x = base[1:].view(300, 257)  # the same geometry, 4-byte aligned only
    out = torch.full_like(x, float("nan"))
    elementwise.affine_act(x, 0.5, b, "gelu", out=out, **cfg)
    torch.testing.assert_close(out.double(), torch.nn.functional.gelu(x.double() * 0.5 + b.double()), rtol=1e-5, atol=1e-6)
    assert (len(elementwise._SITES), _plan_entries()) == (1, 2)
