"""grouped_gemm and its backward (group sizes stay on the device: no synchronisation, capturable).
Launch configuration: the plugin's GEMM tile candidates (its weight-gradient candidates for the
weight's gradient), the fastest measured per device and problem, FMA tiles for float64."""

from __future__ import annotations

from .. import autotune
from .kit import FIRST, Kit, family


def register(kit: Kit) -> None:
    tables = kit.tables

    @kit.kernel("grouped_gemm", "triton", FIRST)
    def grouped_gemm(x, weight, group_sizes):
        """On the GPU the group sizes are not read back: rows past sum(group_sizes) come out as
        zeros and groups past x's rows are cut (the op's contract asks for sum == rows)."""
        gg = family("grouped_gemm")
        flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
        cfg = kit.gemm_config(x, autotune.grouped_key("grouped_gemm", x, weight), tables.gemm_candidates(x),
                              lambda c: gg.grouped_gemm(x, weight, group_sizes, c), flops)
        return gg.grouped_gemm(x, weight, group_sizes, cfg)

    @kit.kernel("grouped_gemm_backward", "triton", FIRST)
    def grouped_gemm_backward(grad_out, x, weight, group_sizes):
        gg = family("grouped_gemm")
        flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
        sg, sk, sn = weight.stride()
        k = int(weight.shape[1])
        cfg_x = kit.gemm_config(x, autotune.grouped_key("grouped_gemm_dx", x, weight), tables.gemm_candidates(x),
                                lambda c: gg.grouped_matmul(grad_out, weight, (sg, sn, sk), k, group_sizes, c), flops)
        cfg_w = kit.gemm_config(x, autotune.grouped_key("grouped_gemm_dw", x, weight), tables.wgrad_candidates(x),
                                lambda c: gg.grouped_gemm_backward(grad_out, x, weight, group_sizes, cfg_x, c), flops)
        return gg.grouped_gemm_backward(grad_out, x, weight, group_sizes, cfg_x, cfg_w)
