"""linear (the vendor's GEMM + a Triton activation pass, ``<blas>_triton``; or one Triton GEMM with
the bias + activation epilogue, ``triton``, ranked below it) and int8_linear. Launch configuration:
the plugin's GEMM tile candidates, the fastest measured per device and problem (cached by
:mod:`hal_triton.autotune`), FMA tiles for float64; ``elementwise`` blocks for the activation pass."""

from __future__ import annotations

import torch

from hal.plugin_sdk.linear import grads_of_rows

from .. import autotune
from .kit import FIRST, SECOND, Kit, OUT_DTYPES, family


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def register(kit: Kit) -> None:
    tables, blas_linear = kit.tables, kit.vendor.linear

    @kit.kernel("linear", f"{kit.vendor.blas_name}_triton", FIRST)
    def linear_blas_triton(x, weight, bias, act):
        y = blas_linear(_rows(x), weight, bias)
        if act != "none":
            family("elementwise").affine_act(y, 1.0, 0.0, act, out=y, **tables.elementwise(y))
        return y.view(*x.shape[:-1], weight.shape[0])

    @kit.kernel("linear", "triton", SECOND)
    def linear_triton(x, weight, bias, act):
        gemm = family("gemm")
        x2 = _rows(x)
        m, k = x2.shape
        n = weight.shape[0]
        key = f"linear/{x.dtype}/m{autotune.bucket(m)}/k{k}/n{n}"
        cfg = kit.gemm_config(x, key, tables.gemm_candidates(x), lambda c: gemm.linear(x2, weight, bias, act, c), 2.0 * m * n * k)
        return gemm.linear(x2, weight, bias, act, cfg).view(*x.shape[:-1], n)

    @kit.kernel("linear_backward", f"{kit.vendor.blas_name}_triton", FIRST)
    def linear_backward(grad_out, x, weight, bias, act, output_mask):
        """The pre-activation is recomputed by the library GEMM; one Triton pass turns grad_out
        into its gradient; then the GEMMs (and the bias sum) output_mask asks for."""
        x2 = _rows(x)
        g2 = _rows(grad_out)
        if act == "none":
            gz = g2
        else:
            z = blas_linear(x2, weight, bias)
            gz = family("elementwise").affine_act_backward(g2, z, 1.0, 0.0, act, (True, False, False), **tables.elementwise(z))[0]
        return grads_of_rows(gz, x2, x, weight, output_mask)

    @kit.kernel("int8_linear", "triton", FIRST, dtypes=None)
    def int8_linear(x_q, w_q, x_scale, w_scale, bias, out_dtype):
        gemm = family("gemm")
        x2 = x_q.reshape(-1, x_q.shape[-1])
        m, k = x2.shape
        n = w_q.shape[0]
        out = OUT_DTYPES[out_dtype]
        cfg = kit.int8_config(x_q, f"int8_linear/m{autotune.bucket(m)}/k{k}/n{n}",
                              lambda c: gemm.int8_linear(x2, w_q, x_scale, w_scale, bias, out, c), 2.0 * m * n * k)
        return gemm.int8_linear(x2, w_q, x_scale, w_scale, bias, out, cfg).view(*x_q.shape[:-1], n)
