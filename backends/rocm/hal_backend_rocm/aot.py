"""Ahead-of-time compilation of every Triton kernel this plugin launches, for gfx90a or gfx942, on a
machine without an AMD GPU (or before the first run on one: it fills Triton's cache).

The plugin's Triton kernel functions run on ``meta`` tensors with launch tables pinned to the
architecture (``RocmTables("gfx942")``), while a stand-in Triton driver reports that architecture
as the current target. Each launch then goes through Triton's own JIT path (argument
specialisation, option parsing: an option name the HIP backend does not know is dropped there, as
at run time) up to the point of compiling; :data:`triton.knobs.runtime.jit_cache_hook` records the
kernel, signature, constants and options and skips the launch. :meth:`Launch.compile` then
compiles exactly that with ``triton.compile`` for the architecture. No kernel runs.

``representative_calls()`` names one or more calls per Triton kernel of the plugin, chosen to reach
every entry kernel of hal_triton (tile and loop variants, NCHW and channels_last, every GEMM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any, Callable, Iterator, Optional

import torch

from hal.plugin import Plugin
from hal.plugin_sdk.calls import canonical_args
from hal.plugin_sdk.declarations import get_op
from hal_triton.kernels import int32_dequant, register

from . import VENDOR, __version__
from ._device import TRITON_ARCHS
from .launch import RocmTables

#: HIP options a launch may set (the others are derived by Triton from the target)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack", "enable_fp_fusion")


@dataclasses.dataclass
class Launch:
    """One kernel launch as Triton's JIT would compile it."""

    kernel: Any  # the triton JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict  # LAUNCH_OPTIONS as Triton's HIP backend parsed them

    @property
    def name(self) -> str:
        """"family.kernel", as hal_triton.aot names kernels."""
        return f"{self.kernel.fn.__module__.rsplit('.', 1)[-1]}.{self.kernel.fn.__name__}"

    @property
    def constants(self) -> dict[str, Any]:
        """The compile-time constants by parameter name."""
        names = self.kernel.arg_names
        return {names[path[0]]: value for path, value in self.constexprs.items() if len(path) == 1}

    @property
    def key(self) -> str:
        """What makes two launches one compilation."""
        return repr((self.name, sorted(self.signature.items()), sorted(self.constexprs.items(), key=repr),
                     sorted(self.attrs.items(), key=repr), sorted(self.options.items())))

    def compile(self, arch: str) -> Any:
        """The compiled kernel for ``arch`` (its ``asm`` holds amdgcn and hsaco, ``metadata.shared``
        the LDS bytes it allocates)."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        source = ASTSource(fn=self.kernel, signature=self.signature, constexprs=self.constexprs, attrs=self.attrs)
        return triton.compile(source, target=GPUTarget("hip", arch, 64), options=dict(self.options))


class _StandIn:
    """The active Triton driver while launches are captured: a device of ``arch`` with nothing to run on."""

    def __init__(self, arch: str) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("hip", arch, 64)
        self.device = f"hal-aot-{arch}"  # Triton keeps one binder per device: one per architecture

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device: Optional[str] = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


@contextlib.contextmanager
def capturing(arch: str) -> Iterator[list[Launch]]:
    """Within the block, Triton launches are recorded (into the yielded list) and not run."""
    from triton import knobs
    from triton.runtime.driver import driver

    found: list[Launch] = []

    def hook(*, fn: Any, compile: dict, **_: Any) -> bool:
        options = json.loads(compile["specialization_data"])["options"]
        found.append(Launch(fn.jit_function, dict(compile["signature"]), dict(compile["constants"]), dict(compile["configs"][0]),
                            {k: options[k] for k in LAUNCH_OPTIONS if k in options}))
        return True  # skip compiling and launching here

    saved_hook, saved_driver = knobs.runtime.jit_cache_hook, driver._active
    driver.set_active(_StandIn(arch))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        driver._active = saved_driver


def distinct(launches: list[Launch]) -> list[Launch]:
    """The launches that compile to different kernels, first occurrence kept."""
    unique: dict[str, Launch] = {}
    for launch in launches:
        unique.setdefault(launch.key, launch)
    return list(unique.values())


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _f32(*shape: int) -> torch.Tensor:
    return _meta(*shape, dtype=torch.float32)


def _canonical(op: str, *args: Any, **kwargs: Any) -> tuple:
    """The canonical arguments a kernel of ``op`` receives for this call (validated by the op)."""
    decl = get_op(op)
    full = [kwargs[p.name] if p.name in kwargs else args[i] if i < len(args) else p.default for i, p in enumerate(decl.params)]
    return canonical_args(decl, full)


def _norm_calls(op: str, rms: bool) -> list[tuple]:
    short, long = _meta(256, 4096), _f32(16, 32768)
    calls = []
    for x in (short, long):
        n = x.shape[-1]
        w = _meta(n, dtype=x.dtype)
        affine = (w,) if rms else (w, _meta(n, dtype=x.dtype))
        if op.endswith("_backward"):
            calls.append(_canonical(op, torch.empty_like(x), x, (n,), w, 1e-5))
        else:
            calls.append(_canonical(op, x, (n,), *affine, 1e-5))
    return calls


def _softmax_calls(backward: bool) -> list[tuple]:
    cases = ((_meta(256, 4096), 1), (_meta(8, 65536, dtype=torch.float16), 1), (_f32(64, 512, 32), 1))
    op = "softmax_backward" if backward else "softmax"
    return [_canonical(op, torch.empty_like(x), x, d) if backward else _canonical(op, x, d) for x, d in cases]


def _bn_calls(backward: bool) -> list[tuple]:
    nchw, nhwc = _meta(8, 64, 14, 14), _meta(8, 64, 14, 14, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    stats = (_f32(64), _f32(64))
    calls = []
    for x, training in ((nchw, True), (nchw, False), (nhwc, True)):
        params = (_meta(64, dtype=x.dtype), _meta(64, dtype=x.dtype))
        if backward:
            calls.append(_canonical("batch_norm_backward", torch.empty_like(x), x, *stats, params[0], training, 1e-5))
        else:
            calls.append(_canonical("batch_norm", x, *stats, *params, training, 0.1, 1e-5))
    return calls


def _fused_conv_calls(backward: bool) -> list[tuple]:
    x, w = _meta(8, 32, 14, 14), _meta(64, 32, 3, 3)
    vectors = (_meta(64), _meta(64), _meta(64), _f32(64), _f32(64))
    if backward:
        return [_canonical("fused_conv_bn_relu_backward", _meta(8, 64, 14, 14), x, w, *vectors, 1, 1, 1, 1, 1e-5, True)]
    return [_canonical("fused_conv_bn_relu", x, w, *vectors, 1, 1, 1, 1, 1e-5, 0.1, training) for training in (True, False)]


def _linear_calls(backward: bool) -> list[tuple]:
    calls = []
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        x, w, b = _meta(512, 1024, dtype=dtype), _meta(2048, 1024, dtype=dtype), _meta(2048, dtype=dtype)
        if backward:
            calls.append(_canonical("linear_backward", _meta(512, 2048, dtype=dtype), x, w, b, "gelu"))
        else:
            calls.append(_canonical("linear", x, w, b, "gelu"))
    return calls


def _grouped_calls(backward: bool) -> list[tuple]:
    x, w, sizes = _meta(4096, 512), _meta(8, 512, 1024), _meta(8, dtype=torch.int64)
    if backward:
        return [_canonical("grouped_gemm_backward", _meta(4096, 1024), x, w, sizes)]
    return [_canonical("grouped_gemm", x, w, sizes)]


def _affine_calls(backward: bool) -> list[tuple]:
    x = _meta(4096, 1024)
    calls = []
    for scale, shift in ((_f32(1024), _meta(1024)), (2.0, 0.5)):
        if backward:
            calls.append(_canonical("scale_shift_act_backward", torch.empty_like(x), x, scale, shift, "gelu"))
        else:
            calls.append(_canonical("scale_shift_act", x, scale, shift, "gelu"))
    return calls


def _optim_calls(adamw: bool) -> list[tuple]:
    params = [_meta(4096, 1024), _meta(1024)]
    if not adamw:
        return [_canonical("amp_unscale_", [_meta(*p.shape, dtype=torch.float16) for p in params], _f32())]
    states = [[_f32(*p.shape) for p in params] for _ in range(3)]
    return [_canonical("fused_adamw_", params, [torch.empty_like(p) for p in params], states[0], states[1], lr=1e-3, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=0.01, step=3, master_params=states[2], inv_scale=_f32(),
                       found_inf=_f32())]


def _quant_calls(op: str) -> list[tuple]:
    x = _meta(256, 1024)
    per_row = (_f32(256), _meta(256, dtype=torch.int32), 0)
    if op == "quantize":
        return [_canonical(op, x, *per_row, "int8"), _canonical(op, x, 0.05, 3, None, "uint8")]
    if op == "dequantize":
        return [_canonical(op, _meta(256, 1024, dtype=torch.uint8), _f32(256), _meta(256, dtype=torch.uint8), 0)]
    if op == "fake_quantize":
        return [_canonical(op, _meta(256, 1024, dtype=torch.float16), 0.05, 0.0, -128, 127, None)]
    if op == "fake_quantize_backward":
        return [_canonical(op, _f32(256, 1024), _f32(256, 1024), _f32(256), _meta(256, dtype=torch.int64), -128, 127, 0)]
    return [_canonical(op, _meta(512, 1024, dtype=torch.int8), _meta(2048, 1024, dtype=torch.int8), _f32(), _f32(2048), _f32(2048), "float16")]


def _fp8_calls(op: str) -> list[tuple]:
    """fnuz calls (gfx942's formats) reaching every FP8 kernel: current scaling per tensor, row and
    128 x 128 block, a given scale, the transposed rows, dequantisation, the GEMM."""
    x, fmt = _meta(256, 1024), "e4m3fnuz"
    if op == "fp8_quantize":
        return [_canonical(op, x, fmt, g) for g in ("tensor", "row", "block")] + [_canonical(op, x, fmt, "tensor", _f32())]
    if op == "fp8_quantize_transpose":
        return [_canonical(op, x, fmt, "row")]
    if op in ("fp8_quantize_amax", "fp8_quantize_transpose_amax", "fp8_quantize_from_amax", "fp8_quantize_transpose_from_amax"):
        return [_canonical(op, x, _f32(), fmt)]
    if op == "fp8_dequantize":
        return [_canonical(op, _meta(256, 1024, dtype=torch.uint8), _f32(2, 8), fmt, 128, "bfloat16")]
    a, b = _meta(512, 1024, dtype=torch.uint8), _meta(2048, 1024, dtype=torch.uint8)
    return [_canonical(op, a, b, _f32(4, 8), _f32(16, 8), _meta(2048), "e5m2fnuz", fmt, "bfloat16")]


def _transformer_calls(op: str) -> list[tuple]:
    x, tables = _meta(2, 4, 64, 128), (_f32(64, 64), _f32(64, 64))
    if op.startswith("rotary_embedding"):
        return [_canonical(op, x, *tables, interleaved) for interleaved in (False, True)]
    gate, up = _meta(512, 2048), _meta(512, 2048)
    return [_canonical(op, torch.empty_like(gate), gate, up)] if op.endswith("_backward") else [_canonical(op, gate, up)]


def _loss_calls(op: str) -> list[tuple]:
    target = _meta(256, dtype=torch.int64)
    if op.startswith("cross_entropy"):
        logits = _meta(256, 32000)
        head = (logits, target)
    else:
        head = (_meta(256, 512), _meta(4096, 512), target, _meta(4096))
    calls = []
    for reduction in ("mean", "none"):
        grad = _f32(256) if reduction == "none" else _f32()
        args = (*head, -100, 0.0, reduction)
        calls.append(_canonical(op, grad, *args) if op.endswith("_backward") else _canonical(op, *args))
    return calls


def representative_calls() -> dict[str, list[tuple]]:
    """Canonical argument tuples (meta tensors) per op with Triton kernels in this plugin."""
    calls: dict[str, Callable[[], list[tuple]]] = {
        "batch_norm": lambda: _bn_calls(False),
        "batch_norm_backward": lambda: _bn_calls(True),
        "fused_conv_bn_relu": lambda: _fused_conv_calls(False),
        "fused_conv_bn_relu_backward": lambda: _fused_conv_calls(True),
        "scale_shift_act": lambda: _affine_calls(False),
        "scale_shift_act_backward": lambda: _affine_calls(True),
        "linear": lambda: _linear_calls(False),
        "linear_backward": lambda: _linear_calls(True),
        "grouped_gemm": lambda: _grouped_calls(False),
        "grouped_gemm_backward": lambda: _grouped_calls(True),
        "layer_norm": lambda: _norm_calls("layer_norm", False),
        "layer_norm_backward": lambda: _norm_calls("layer_norm_backward", False),
        "rms_norm": lambda: _norm_calls("rms_norm", True),
        "rms_norm_backward": lambda: _norm_calls("rms_norm_backward", True),
        "rms_norm_amax": lambda: _norm_calls("rms_norm_amax", True),
        "softmax": lambda: _softmax_calls(False),
        "softmax_backward": lambda: _softmax_calls(True),
        "amp_unscale_": lambda: _optim_calls(False),
        "fused_adamw_": lambda: _optim_calls(True),
        **{op: (lambda op=op: _quant_calls(op)) for op in ("quantize", "dequantize", "fake_quantize", "fake_quantize_backward", "int8_linear")},
        **{op: (lambda op=op: _fp8_calls(op)) for op in ("fp8_quantize", "fp8_quantize_transpose", "fp8_quantize_amax",
                                                                   "fp8_quantize_transpose_amax", "fp8_quantize_from_amax",
                                                                   "fp8_quantize_transpose_from_amax", "fp8_dequantize", "fp8_scaled_mm")},
        **{op: (lambda op=op: _transformer_calls(op)) for op in ("rotary_embedding", "rotary_embedding_backward", "swiglu", "swiglu_backward",
                                                                        "swiglu_amax")},
        **{op: (lambda op=op: _loss_calls(op)) for op in ("cross_entropy", "cross_entropy_backward", "linear_cross_entropy",
                                                          "linear_cross_entropy_backward")},
    }
    return {op: make() for op, make in calls.items()}


def capture(arch: str, tables: Optional[RocmTables] = None) -> list[Launch]:
    """Every launch the plugin's Triton kernels make on the representative calls, with ``tables``
    (default: the tables pinned to ``arch``), plus the int8 epilogue of the hipBLASLt int8_linear."""
    tables = tables or RocmTables(arch)
    kernels = register(Plugin("rocm-aot", __version__), tables, archs=TRITON_ARCHS, vendor=VENDOR)
    calls = representative_calls()
    with capturing(arch) as found:
        for (op, _), fn in kernels.items():
            for args in calls[op]:
                fn(*args)
        int32_dequant(tables, _meta(512, 2048, dtype=torch.int32), _f32(), _f32(2048), _f32(2048), "float16")
    return found
