"""fp8_scaled_mm through cuBLASLt: ``torch._scaled_mm`` with per-tensor, row-wise and (on Hopper)
128 x 128 block scales; ``tuned`` times it against the Triton FP8 GEMM of hal_triton once per
device and shape bucket and keeps the faster. The FP8 casts (fp8_quantize, fp8_dequantize) are
Triton's alone, registered by hal_triton.kernels.

What torch._scaled_mm takes (ATen's ScaledBlas.cpp / Blas.cpp; torch's meta function says the same):
``a`` (M, K) row-major and ``mat2`` (K, N) column-major, so hal's ``b`` (N, K) goes in as ``b.t()``;
K and N multiples of 16, M any (block scales: N a multiple of 128, M of 4, see shape_reasons); OCP formats only, and not e5m2 x e5m2 (cuBLASLt has no such
kernel); float32 scales of shape () x () (tensor-wise), (M, 1) x (1, N) (row-wise: hal's (N, 1) b
scales reshaped), or the DeepSeek-V3 pairs of 1 x 128 and 128 x 128 blocks on sm_90 with cuBLASLt
12.9 or newer. hal's "block" scales are 128 x 128 for both operands, a pair cuBLASLt lacks: a's
block scales repeated over the 128 rows of each block are the same numbers as 1 x 128 scales, so
the call is (1 x 128, 128 x 128), with a's scales outer-dimension-major as cuBLASLt wants. The bias
rides the epilogue only for a half-precision result (rounded to that dtype first, as the epilogue
takes it); a float32 result gets the bias added after the GEMM.

Row-wise and block-wise support depends on the CUDA and cuBLASLt versions torch was built with;
each (device, formats, granularities, result dtype) pairing not settled by the rules above is tried
once on a 128 x 128 x 128 problem and the answer cached (:func:`probe_reason`), so a build without
them declines with torch's own message and the dispatcher goes on to Triton or the emulation.
Devices without FP8 are declined with hal.plugin_sdk.fp8_hardware.fp8_device's reasons.

The eager emulation (hal_torch.fp8) is registered here under its own function object with
the same refusal on devices without FP8, so the backend's generic twins (:mod:`.eager_kernels`)
do not add an unchecked copy.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hal.plugin import Inputs
from hal.ops.fp8 import TORCH_DTYPE_NAMES, scale_shape
from hal.plugin_sdk.fp8_hardware import FP8_CHECKS as EAGER_CHECKS, fp8_arch_reasons, fp8_device
from hal_torch.table import eager
from hal_triton import autotune

from . import TRITON_KERNELS, plugin
from ._common import kernel
from .launch import TABLES

#: the granularity pairs cuBLASLt is known to take with e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3 on
#: every FP8 GPU (sm_89 and newer): per-tensor scales, any result dtype. Everything else is probed.
SETTLED = {("tensor", "tensor")}
BLOCK = 128


def granularity(scale: Any, shape: tuple[int, ...], block_size: int) -> str:
    """"tensor", "row" or "block": what a scale's shape means for an operand of ``shape``."""
    got = tuple(scale.shape)
    if got == ():
        return "tensor"
    if got == scale_shape(shape, "row", block_size):
        return "row"
    return "block"


def shape_reasons(arch: str, a_format: str, b_format: str, a_granularity: str, b_granularity: str,
                  m: int, k: int, n: int, block_size: int) -> list[str]:
    """Why cuBLASLt cannot run this scaled GEMM on an NVIDIA GPU of ``arch`` (pure: the rules that
    need no device; empty when it may). ``m`` is unconstrained but for block scales."""
    reasons = list(fp8_arch_reasons(arch, (a_format, b_format)))
    if (a_format, b_format) == ("e5m2", "e5m2"):
        reasons.append("e5m2 x e5m2: cuBLASLt has no FP8 GEMM with two e5m2 operands")
    if k % 16 or n % 16:
        reasons.append(f"K={k}, N={n}: torch._scaled_mm needs both multiples of 16")
    pair = (a_granularity, b_granularity)
    if pair not in (("tensor", "tensor"), ("row", "row"), ("block", "block")):
        reasons.append(f"{a_granularity} x {b_granularity} scales: cuBLASLt takes tensor x tensor, row x row or block x block")
    if "block" in pair:
        if block_size != BLOCK:
            reasons.append(f"block_size={block_size}: cuBLASLt's block scales are 128 x 128")
        if not arch.startswith("sm_9"):
            reasons.append(f"block scales: cuBLASLt has them on sm_90 (Hopper) only; this is {arch}")
        if k % BLOCK:
            reasons.append(f"K={k}: block scales through cuBLASLt need K a multiple of 128")
        # b's 128 x 128 blocks must tile N, and a's 1 x 128 scales go in M-major columns that
        # cuBLASLt reads in 16-byte units (M a multiple of 4). On the H200 (torch 2.11, commit
        # 2fba452) (M, N, K) = (8192, 8192, 8192), (200, 384, 512) and (128, 128, 128) ran, while
        # (130, 64, 256) made cublasLtMatmulAlgoGetHeuristic answer CUBLAS_STATUS_NOT_SUPPORTED;
        # both rules cover it (which of the two cuBLASLt needs is not yet told apart).
        if n % BLOCK:
            reasons.append(f"N={n}: cuBLASLt's 128 x 128 block scales of b need N a multiple of 128 (its heuristic finds no kernel otherwise)")
        if m % 4:
            reasons.append(f"M={m}: cuBLASLt's 1 x 128 scales of a need M a multiple of 4 (16-byte aligned scale columns)")
    if "row" in pair:
        digits = arch[3:] if arch.startswith("sm_") else ""
        if not digits.isdigit() or int(digits) < 90:
            reasons.append(f"row-wise scales: torch's row-wise FP8 GEMM needs sm_90 or newer; this is {arch}")
    return reasons


def fp8_view(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 bit patterns as torch's FP8 dtype (no copy)."""
    return q.view(getattr(torch, TORCH_DTYPE_NAMES[fmt]))


def torch_scales(a_scale: torch.Tensor, b_scale: torch.Tensor, a_shape: tuple[int, ...], n: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hal's scales as torch._scaled_mm takes them: 0-d pairs as they are; row-wise (M, 1) and
    (1, N) contiguous; 128 x 128 blocks as (1 x 128 for a: (M, K/128) with strides (1, M);
    128 x 128 for b: (K/128, N/128), the transpose of hal's contiguous (N/128, K/128))."""
    ga = granularity(a_scale, a_shape, block_size)
    if ga == "tensor":
        return a_scale.float(), b_scale.float()
    if ga == "row":
        return a_scale.float().contiguous(), b_scale.float().reshape(1, n).contiguous()
    rows = a_scale.float().repeat_interleave(block_size, 0)[: a_shape[0]]  # each block's scale on each of its rows
    return rows.t().contiguous().t(), b_scale.float().contiguous().t()


def scaled_mm_call(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                   bias: Optional[torch.Tensor], a_format: str, b_format: str, out_dtype: torch.dtype,
                   block_size: int) -> torch.Tensor:
    """``torch._scaled_mm`` on hal's operands: b (N, K) as the column-major (K, N) it takes, the
    scales of each granularity in the shape and layout it wants, the bias in the epilogue where it
    can be."""
    sa, sb = torch_scales(a_scale, b_scale, tuple(a.shape), int(b.shape[0]), block_size)
    epilogue_bias = bias is not None and out_dtype != torch.float32
    out = torch._scaled_mm(fp8_view(a.contiguous(), a_format), fp8_view(b.contiguous(), b_format).t(), sa, sb,
                           bias=bias.to(out_dtype) if epilogue_bias else None, out_dtype=out_dtype)
    if bias is not None and not epilogue_bias:
        out = out + bias.float()
    return out


def _probe(index: int, a_format: str, b_format: str, ga: str, gb: str, out_dtype: torch.dtype, with_bias: bool) -> Optional[str]:
    """Run the pairing once on a 128^3 problem of random values: None, or torch's reason."""
    device = torch.device("cuda", index)
    s = BLOCK
    g = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.rand(s, s, generator=g) - 0.5).to(device).to(getattr(torch, TORCH_DTYPE_NAMES[a_format])).view(torch.uint8)
    b = (torch.rand(s, s, generator=g) - 0.5).to(device).to(getattr(torch, TORCH_DTYPE_NAMES[b_format])).view(torch.uint8)
    shapes = {"tensor": (), "row": (s, 1), "block": (1, 1)}
    sa = torch.ones(shapes[ga], device=device)
    sb = torch.ones(shapes[gb], device=device)
    bias = torch.zeros(s, device=device, dtype=out_dtype) if with_bias else None
    try:
        scaled_mm_call(a, b, sa, sb, bias, a_format, b_format, out_dtype, BLOCK)
        torch.cuda.synchronize(device)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return f"torch {torch.__version__}'s _scaled_mm declines {ga} x {gb} scales for {a_format} x {b_format} -> {out_dtype} here: {first}"
    return None


def _probing_unsafe() -> bool:
    """Inside CUDA graph capture, a torch.compile trace or a fake-tensor mode a probe cannot run
    real kernels (or would be answered by fake ones)."""
    if torch.compiler.is_compiling() or _fake_mode_active():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fake_mode_active() -> bool:
    get = getattr(torch._C, "_get_dispatch_mode", None)
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    return bool(get is not None and key is not None and get(key) is not None)


#: probe answers per (device index, formats, granularities, result dtype, bias in the epilogue)
_PROBED: dict[tuple[Any, ...], Optional[str]] = {}


def probe_reason(device: torch.device, a_format: str, b_format: str, ga: str, gb: str, out_dtype: torch.dtype,
                 with_bias: bool, traced: bool = False) -> Optional[str]:
    """Whether this torch build's _scaled_mm runs the pairing on ``device`` (None) or why not: tried
    once per process, cached. Not tried inside a graph capture or a trace: declined there until an
    eager call has tried it, so such a call falls to the next kernel."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, a_format, b_format, ga, gb, out_dtype, with_bias)
    if key not in _PROBED:
        if traced or _probing_unsafe():
            return "not yet tried on this device (tried on the first eager call, not inside a graph capture or trace)"
        _PROBED[key] = _probe(*key)
    return _PROBED[key]


def cublaslt_check(inputs: Inputs) -> list[str]:
    """What cuBLASLt cannot run (:func:`shape_reasons`), then, for pairings not settled, the probe."""
    a, b = inputs["a"], inputs["b"]
    a_scale, b_scale, bs = inputs["a_scale"], inputs["b_scale"], inputs["block_size"]
    a_format, b_format = inputs["a_format"], inputs["b_format"]
    ga = granularity(a_scale, tuple(a.shape), bs)
    gb = granularity(b_scale, tuple(b.shape), bs)
    device = inputs.device
    if not isinstance(device, torch.device) or device.type != "cuda":
        return ["cuBLASLt runs on CUDA tensors only"]
    arch = inputs.arch
    if arch is None:
        reasons = fp8_device(device, (a_format, b_format))
        if reasons:
            return reasons
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    m, k, n = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
    reasons = shape_reasons(arch, a_format, b_format, ga, gb, m, k, n, int(bs))
    if reasons or (ga, gb) in SETTLED:
        return reasons
    out_dtype = getattr(torch, inputs["out_dtype"])
    why = probe_reason(device, a_format, b_format, ga, gb, out_dtype, inputs["bias"] is not None and out_dtype != torch.float32,
                       inputs.traced)
    return [why] if why else []


@kernel("fp8_scaled_mm", name="cublaslt", priority=30, checks=[cublaslt_check])
def fp8_scaled_mm_cublaslt(a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size):
    return scaled_mm_call(a, b, a_scale, b_scale, bias, a_format, b_format, getattr(torch, out_dtype), block_size)


def triton_takes(inputs: Inputs) -> list[str]:
    """The Triton FP8 GEMM is registered here and its own checks take the call (``tuned`` may run it)."""
    spec = next((k for k in plugin.kernels if k.op == "fp8_scaled_mm" and k.name == "triton" and k.backend == plugin.name), None)
    if spec is None or ("fp8_scaled_mm", "triton") not in TRITON_KERNELS:
        return ["no Triton FP8 GEMM registered to choose from (cublaslt runs alone)"]
    reasons = [r for r in [spec.archs.reason(inputs.arch)] if r] if spec.archs is not None else []
    return reasons + list((spec.check(inputs) or []) if spec.check is not None else [])


@kernel("fp8_scaled_mm", name="tuned", priority=40, checks=[cublaslt_check, triton_takes])
def fp8_scaled_mm_tuned(a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size):
    """cuBLASLt or the Triton FP8 GEMM, whichever ran this device's shape bucket faster (timed once,
    cached per device model; cuBLASLt where nothing is timed: graph capture, small problems)."""
    args = (a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size)
    triton = TRITON_KERNELS[("fp8_scaled_mm", "triton")]
    runs = {"cublaslt": lambda: fp8_scaled_mm_cublaslt(*args), "triton": lambda: triton(*args)}
    m, k, n = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
    ga = granularity(a_scale, tuple(a.shape), block_size)
    key = f"fp8_scaled_mm_path/m{autotune.bucket(m)}/k{k}/n{n}/{a_format}x{b_format}/{ga}/{out_dtype}/bias{int(bias is not None)}"
    return runs[autotune.fastest(TABLES, a.device, key, runs, 2.0 * m * n * k)]()


# the eager emulation, refused on GPUs without FP8 (see the module docs)
for _op, _check in EAGER_CHECKS.items():
    kernel(_op, name="eager", priority=0, checks=[_check])(eager(_op))
