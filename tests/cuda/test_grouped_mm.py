"""grouped_gemm through torch._grouped_mm (hal_backend_cuda.grouped): the shared bodies against one
matrix product per group, run here by torch's CPU implementation of the same op (the CUTLASS kernel
itself runs on the H200: tests/cuda/device and the conformance suite), and what the CUDA kernels
refuse, as sentences: whatever would make torch read the offsets on the host or pad the result."""

from __future__ import annotations

import pytest
import torch
from hal_backend_cuda import plugin

from hal.plugin import Inputs
from hal.registry import get_op
from hal_torch.gemm import grouped_mm, grouped_mm_backward, grouped_mm_layout
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no torch._grouped_mm")


def _loop(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.cat([rows @ w[g] for g, rows in enumerate(x.split(sizes))])


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_bodies_match_one_product_per_group_with_empty_groups(transposed_weight: bool) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    sizes = [5, 0, 11, 0, 8]
    k, n = 16, 24
    x = torch.randn(sum(sizes), k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen).transpose(1, 2) if transposed_weight else torch.randn(len(sizes), k, n, generator=gen)
    g = torch.randn(sum(sizes), n, generator=gen)
    group_sizes = torch.tensor(sizes, dtype=torch.int64)

    torch.testing.assert_close(grouped_mm(x, w, group_sizes), _loop(x, w, sizes))
    dx, dw = grouped_mm_backward(g, x, w, group_sizes)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    _loop(xr, wr, sizes).backward(g)
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(dw, wr.grad)
    assert dw[1].abs().max() == 0 and dw[3].abs().max() == 0  # an empty group's weight gradient is zero


def test_layout_rules_are_torchs() -> None:
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    assert grouped_mm_layout("x", x) == [] and grouped_mm_layout("x", x.t()) == []
    odd = torch.randn(32, 12, dtype=torch.bfloat16)  # rows of 24 bytes
    assert grouped_mm_layout("x", odd) == [
        "x (32, 12) with strides (12, 1): torch._grouped_mm needs its last two dimensions row- or column-major "
        "with the leading stride a multiple of 16 bytes"]
    shifted = torch.randn(32, 17, dtype=torch.bfloat16)[:, 1:]
    assert "16-byte boundary" in " ".join(grouped_mm_layout("x", shifted))
    # a valid call of torch's own op is valid by these rules too
    torch._grouped_mm(x, torch.randn(2, 16, 8, dtype=torch.bfloat16), offs=torch.tensor([10, 32], dtype=torch.int32))


def _reasons(op: str, name: str, args: tuple, arch: str = "sm_90", dtype: str = "bfloat16") -> list[str]:
    kernel = next(k for k in plugin.kernels if k.op == op and k.name == name)
    return kernel.not_supported_reasons(Inputs(get_op(op), args, "cuda", torch.device("cuda", 0), dtype, "torch", arch))


@pytest.mark.parametrize("name", ["grouped_mm", "tuned"])
def test_kernels_refuse_what_would_synchronise_or_pad(name: str) -> None:
    sizes = torch.tensor([3, 0, 5], dtype=torch.int32)
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(3, 16, 24, dtype=torch.bfloat16)
    fwd = (x, w, sizes)
    assert _reasons("grouped_gemm", "grouped_mm", fwd) == []
    assert _reasons("grouped_gemm", name, fwd, arch="sm_80") == [
        "device architecture sm_80 not supported (this kernel needs sm_90 (H100/H200: torch's CUTLASS grouped GEMM))"]
    assert _reasons("grouped_gemm", name, fwd, dtype="float16") == ["dtype float16 not supported (supports bfloat16)"]
    narrow = (torch.randn(8, 13, dtype=torch.bfloat16), torch.randn(3, 13, 24, dtype=torch.bfloat16), sizes)
    assert _reasons("grouped_gemm", name, narrow) == ["K=13, N=24: torch._grouped_mm needs both multiples of 8"]
    shifted = torch.randn(8, 17, dtype=torch.bfloat16)[:, 1:]
    assert any("16-byte boundary" in r for r in _reasons("grouped_gemm", name, (shifted, w, sizes)))

    g = torch.randn(8, 24, dtype=torch.bfloat16)
    assert _reasons("grouped_gemm_backward", name, (g, x, w, sizes)) == []
    skewed = torch.randn(300, dtype=torch.bfloat16).as_strided((8, 24), (1, 9))  # column-major, 18-byte columns
    assert _reasons("grouped_gemm_backward", name, (skewed, x, w, sizes)) == [
        "grad_out (8, 24) with strides (1, 9): torch._grouped_mm needs its last two dimensions row- or column-major "
        "with the leading stride a multiple of 16 bytes"]
