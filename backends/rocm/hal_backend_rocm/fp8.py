"""fp8_scaled_mm through hipBLASLt (``torch._scaled_mm`` on a ROCm build of torch): per-tensor and
row-wise scales in the formats of the GPU's matrix cores, the fnuz formats on gfx942 (MI300) and
the OCP formats on gfx950 (MI355). The FP8 casts are Triton's, registered by hal_triton.kernels.

ROCm's torch._scaled_mm takes what CUDA's does (``a`` (M, K) row-major, ``mat2`` (K, N)
column-major: hal's ``b`` (N, K) as ``b.t()``; K and N multiples of 16; float32 scales () x () or
(M, 1) x (1, N)) with its own limits: row-wise only with an e4m3 second operand and a bfloat16
result, and no block scales (the 1 x 128 / 128 x 128 pairs are CUDA-only), so hal's block scales
go to Triton. e5m2 x e5m2 is declined too (hal never asks for it; it is untested here). Pairings
beyond per-tensor scales are tried once per device on a 128^3 problem and the answer cached, so a
build lacking them declines with torch's message. Devices without FP8 are declined with
hal.plugin_sdk.fp8_hardware.fp8_device's reasons; the bias rides the epilogue for half-precision
results and is added after the GEMM for float32 ones.

The eager emulation is left to :mod:`.fallbacks`, which registers it with the same refusal.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hal.ops.fp8 import TORCH_DTYPE_NAMES, scale_shape
from hal.plugin import Inputs
from hal.plugin_sdk.fp8_hardware import fp8_arch_reasons, fp8_device

from ._common import kernel
from ._device import ANY_GFX

SETTLED = {("tensor", "tensor")}


def granularity(scale: Any, shape: tuple[int, ...], block_size: int) -> str:
    """"tensor", "row" or "block": what a scale's shape means for an operand of ``shape``."""
    got = tuple(scale.shape)
    if got == ():
        return "tensor"
    return "row" if got == scale_shape(shape, "row", block_size) else "block"


def shape_reasons(arch: str, a_format: str, b_format: str, a_granularity: str, b_granularity: str,
                  k: int, n: int, out_dtype: str) -> list[str]:
    """Why hipBLASLt cannot run this scaled GEMM on an AMD GPU of ``arch`` (pure: the rules that
    need no device; empty when it may)."""
    reasons = list(fp8_arch_reasons(arch, (a_format, b_format)))
    if a_format.startswith("e5m2") and b_format.startswith("e5m2"):
        reasons.append("e5m2 x e5m2: not offered through hipBLASLt here (hal's recipes never pair two gradients)")
    if k % 16 or n % 16:
        reasons.append(f"K={k}, N={n}: torch._scaled_mm needs both multiples of 16")
    pair = (a_granularity, b_granularity)
    if "block" in pair:
        reasons.append("block scales: torch's ROCm _scaled_mm has no 128 x 128 block scaling (Triton runs them)")
    elif pair == ("row", "row"):
        if not b_format.startswith("e4m3"):
            reasons.append(f"row-wise scales with a {b_format} second operand: hipBLASLt's row-wise GEMM takes e4m3 there")
        if out_dtype != "bfloat16":
            reasons.append(f"row-wise scales with a {out_dtype} result: hipBLASLt's row-wise GEMM writes bfloat16")
    elif pair != ("tensor", "tensor"):
        reasons.append(f"{a_granularity} x {b_granularity} scales: hipBLASLt takes tensor x tensor or row x row")
    return reasons


def scaled_mm_call(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                   bias: Optional[torch.Tensor], a_format: str, b_format: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` on hal's operands (b (N, K) as column-major (K, N); (N, 1) b scales as (1, N))."""
    n = b.shape[0]
    if a_scale.dim() == 0:
        sa, sb = a_scale, b_scale
    else:
        sa, sb = a_scale.contiguous(), b_scale.reshape(1, n).contiguous()
    epilogue_bias = bias is not None and out_dtype != torch.float32
    view = lambda q, f: q.contiguous().view(getattr(torch, TORCH_DTYPE_NAMES[f]))  # noqa: E731
    out = torch._scaled_mm(view(a, a_format), view(b, b_format).t(), sa.float(), sb.float(),
                           bias=bias.to(out_dtype) if epilogue_bias else None, out_dtype=out_dtype)
    if bias is not None and not epilogue_bias:
        out = out + bias.float()
    return out


_PROBED: dict[tuple[Any, ...], Optional[str]] = {}


def _probing_unsafe() -> bool:
    """Inside graph capture, a torch.compile trace or a fake-tensor mode no real probe can run."""
    get = getattr(torch._C, "_get_dispatch_mode", None)
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    fake = get is not None and key is not None and get(key) is not None
    return fake or torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def probe_reason(device: torch.device, a_format: str, b_format: str, ga: str, gb: str, out_dtype: torch.dtype,
                 with_bias: bool, traced: bool = False) -> Optional[str]:
    """Whether this build's _scaled_mm runs the pairing on ``device`` (None) or why not: tried once per
    process on a 128^3 problem, cached; declined, untried, inside a graph capture or a trace."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, a_format, b_format, ga, gb, out_dtype, with_bias)
    if key not in _PROBED:
        if traced or _probing_unsafe():
            return "not yet tried on this device (tried on the first eager call, not inside a graph capture or trace)"
        dev = torch.device("cuda", index)
        g = torch.Generator(device="cpu").manual_seed(0)
        q = lambda f: (torch.rand(128, 128, generator=g) - 0.5).to(dev).to(getattr(torch, TORCH_DTYPE_NAMES[f])).view(torch.uint8)  # noqa: E731
        scale = {"tensor": (), "row": (128, 1)}
        bias = torch.zeros(128, device=dev, dtype=out_dtype) if with_bias else None
        try:
            scaled_mm_call(q(a_format), q(b_format), torch.ones(scale[ga], device=dev), torch.ones(scale[gb], device=dev),
                           bias, a_format, b_format, out_dtype)
            torch.cuda.synchronize(dev)
            _PROBED[key] = None
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            text = str(exc).strip()
            _PROBED[key] = (f"torch {torch.__version__}'s _scaled_mm declines {ga} x {gb} scales for {a_format} x {b_format} "
                            f"-> {out_dtype} here: {text.splitlines()[0] if text else type(exc).__name__}")
    return _PROBED[key]


def hipblaslt_check(inputs: Inputs) -> list[str]:
    """What hipBLASLt cannot run (:func:`shape_reasons`), then, beyond per-tensor scales, the probe."""
    a, b, bs = inputs["a"], inputs["b"], inputs["block_size"]
    a_format, b_format, out_dtype = inputs["a_format"], inputs["b_format"], inputs["out_dtype"]
    device = inputs.device
    if not isinstance(device, torch.device) or device.type != "cuda":
        return ["hipBLASLt runs on ROCm GPU tensors only"]
    if inputs.arch is None:
        return fp8_device(device, (a_format, b_format)) or ["device architecture unknown"]
    ga, gb = granularity(inputs["a_scale"], tuple(a.shape), bs), granularity(inputs["b_scale"], tuple(b.shape), bs)
    reasons = shape_reasons(inputs.arch, a_format, b_format, ga, gb, int(a.shape[1]), int(b.shape[0]), out_dtype)
    if reasons or (ga, gb) in SETTLED:
        return reasons
    dt = getattr(torch, out_dtype)
    why = probe_reason(device, a_format, b_format, ga, gb, dt, inputs["bias"] is not None and dt != torch.float32, inputs.traced)
    return [why] if why else []


@kernel("fp8_scaled_mm", name="hipblaslt", priority=30, checks=[hipblaslt_check], archs=ANY_GFX)
def fp8_scaled_mm_hipblaslt(a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size):
    return scaled_mm_call(a, b, a_scale, b_scale, bias, a_format, b_format, getattr(torch, out_dtype))
