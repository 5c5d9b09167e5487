"""FP8: quantisation (amax fused, optionally transposed; given scales with the amax reduced by the
cast for delayed scaling), dequantisation and the scaled GEMM, where
the device has hardware FP8 in the formats asked for (:mod:`hal.plugin_sdk.fp8_hardware`). Launch
configuration: the plugin's ``elementwise`` blocks for the casts; for the casts that also write the
transpose, the fastest of its ``fp8_transpose_candidates`` measured on this device per problem
(cached by :mod:`hal_triton.autotune`), the first (the ``elementwise`` tile) wherever tuning does
not happen; its int8 GEMM tile candidates, the fastest measured per device and problem, for the
GEMM."""

from __future__ import annotations

from typing import Any, Callable

import torch

from hal.plugin_sdk.fp8_hardware import fp8_device

from .. import autotune
from ..checks import Check, fp8_block_reason, fp8_gemm_block_reason
from ..config import Fp8TransposeConfig, GemmConfig
from ..tables import interpreted
from .kit import FIRST, Kit, OUT_DTYPES, family


def _granularity(scale: torch.Tensor, operand: torch.Tensor) -> str:
    """A GEMM scale's granularity as one letter: t(ensor), r(ow), b(lock) (told apart by shape)."""
    if scale.dim() == 0:
        return "t"
    return "r" if tuple(scale.shape) == (int(operand.shape[0]), 1) else "b"


def _block_scale(scale: Any, operand: torch.Tensor) -> bool:
    """Whether a GEMM scale is block-wise (neither 0-d nor one per row)."""
    return isinstance(scale, torch.Tensor) and _granularity(scale, operand) == "b"


def _formats(*names: str) -> Check:
    """The device has hardware FP8 in the named format arguments."""

    def check(inputs: Any) -> list[str]:
        return fp8_device(inputs.device, [inputs[n] for n in names]) if isinstance(inputs.device, torch.device) else []

    return check


def _blocks(inputs: Any) -> list[str]:
    if inputs["granularity"] != "block":
        return []
    why = fp8_block_reason(inputs["block_size"])
    return [why] if why else []


def _gemm_blocks(inputs: Any) -> list[str]:
    blocks = any(_block_scale(inputs[s], inputs[o]) for s, o in (("a_scale", "a"), ("b_scale", "b")))
    why = fp8_gemm_block_reason(inputs["block_size"]) if blocks else None
    return [why] if why else []


def register(kit: Kit) -> None:
    tables = kit.tables

    def pick(x: torch.Tensor) -> Callable[[str, Callable[[Fp8TransposeConfig], Any], int], Fp8TransposeConfig]:
        """The transposed casts' launch for x (at least 2-D): the autotuner's choice among the
        plugin's candidates for its (..., M, K) matrices (hal_triton.fp8.Pick)."""
        m, k = int(x.shape[-2]), int(x.shape[-1])

        def choose(key: str, run: Callable[[Fp8TransposeConfig], Any], nbytes: int) -> Fp8TransposeConfig:
            return autotune.choose(tables, x.device, key, lambda: tables.fp8_transpose_candidates(x, m, k), run, autotune.streaming_work(nbytes))

        return choose

    @kit.kernel("fp8_quantize", "triton", FIRST, checks=(_formats("format"), _blocks))
    def fp8_quantize(x, format, granularity, scale, block_size):
        return family("fp8").quantize(x, format, granularity, scale, block_size, False, not interpreted(x), **tables.elementwise(x))

    @kit.kernel("fp8_quantize_transpose", "triton", FIRST, checks=(_formats("format"), _blocks))
    def fp8_quantize_transpose(x, format, granularity, scale, block_size):
        return family("fp8").quantize(x, format, granularity, scale, block_size, True, not interpreted(x), **tables.elementwise(x),
                                      pick=pick(x))

    @kit.kernel("fp8_quantize_amax", "triton", FIRST, checks=(_formats("format"),))
    def fp8_quantize_amax(x, scale, format):
        return family("fp8").quantize_amax(x, format, scale, False, not interpreted(x), **tables.elementwise(x))

    @kit.kernel("fp8_quantize_transpose_amax", "triton", FIRST, checks=(_formats("format"),))
    def fp8_quantize_transpose_amax(x, scale, format):
        return family("fp8").quantize_amax(x, format, scale, True, not interpreted(x), **tables.elementwise(x), pick=pick(x))

    @kit.kernel("fp8_quantize_from_amax", "triton", FIRST, checks=(_formats("format"),))
    def fp8_quantize_from_amax(x, amax, format):
        return family("fp8").quantize_from_amax(x, format, amax, False, not interpreted(x), **tables.elementwise(x))

    @kit.kernel("fp8_quantize_transpose_from_amax", "triton", FIRST, checks=(_formats("format"),))
    def fp8_quantize_transpose_from_amax(x, amax, format):
        return family("fp8").quantize_from_amax(x, format, amax, True, not interpreted(x), **tables.elementwise(x), pick=pick(x))

    @kit.kernel("fp8_dequantize", "triton", FIRST, dtypes=("uint8",), checks=(_formats("format"),))
    def fp8_dequantize(q, scale, format, block_size, out_dtype):
        return family("fp8").dequantize(q, scale, format, block_size, OUT_DTYPES[out_dtype], **tables.elementwise(q))

    @kit.kernel("fp8_scaled_mm", "triton", FIRST, dtypes=("uint8",), checks=(_formats("a_format", "b_format"), _gemm_blocks))
    def fp8_scaled_mm(a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size):
        f8 = family("fp8")
        m, k = a.shape
        n = b.shape[0]
        out = OUT_DTYPES[out_dtype]

        def run(cfg: GemmConfig) -> torch.Tensor:
            return f8.scaled_mm(a, b, a_scale, b_scale, bias, a_format, b_format, out, block_size, cfg, interpreted(a))

        grans = "".join(_granularity(s, o) for s, o in ((a_scale, a), (b_scale, b)))
        key = f"fp8_scaled_mm/m{autotune.bucket(m)}/k{k}/n{n}/{grans}/{a_format}/{b_format}"
        return run(kit.int8_config(a, key, run, 2.0 * m * n * k))
