"""torch's float64 (and, without AVX512-FP16, float16) CPU convolutions unfold the whole batch into
an im2col buffer of batch x C/groups*kh*kw x out_h*out_w elements; with a huge padding and a dilated
kernel that is gigabytes for a few hundred input elements (the reliability suite's property test
drew one at seed 1165711134: 2.3 GB, and the capped process ran out of memory with a raw
RuntimeError). The CPU backend's torch-based convolutions decline such calls; cpu_ref computes them
in proportion to their arrays."""

from __future__ import annotations

import torch

import hal


def test_a_dilated_convolution_with_huge_padding_is_declined_by_the_torch_kernels() -> None:
    x, w = torch.randn(1, 3, 6, 3, dtype=torch.float64), torch.randn(4, 3, 6, 4, dtype=torch.float64)
    g = torch.randn(1, 4, 1996, 1997, dtype=torch.float64)
    d = hal.explain("conv2d_backward", g, x, w, 1, 1000, 2)
    onednn = [c for c in d.candidates if c.backend == "cpu" and c.kernel == "onednn"]
    assert onednn and any("unfold the input" in r for r in onednn[0].reasons), d
    assert d.backend == "cpu_ref", d


def test_ordinary_convolutions_keep_the_torch_kernel() -> None:
    """A ResNet 3x3 convolution in float64 unfolds to 9x its input: within the bound."""
    x, w = torch.randn(8, 64, 28, 28, dtype=torch.float64), torch.randn(64, 64, 3, 3, dtype=torch.float64)
    assert hal.explain("conv2d", x, w, None, 1, 1).kernel == "onednn"
    g = torch.randn(8, 64, 28, 28, dtype=torch.float64)
    assert hal.explain("conv2d_backward", g, x, w, 1, 1).kernel == "onednn"
