"""Which kernel of the ROCm plugin runs which call, per gfx architecture and dtype, from the plugin's
own capability data: each call is checked as the dispatcher checks it (Inputs with the device's
architecture; the highest-priority kernel with no reason wins).

No ROCm device or ROCm build of torch exists here, so the Inputs are built by hand with the
architecture a ROCm device would report and CPU tensors standing in for device tensors (the checks
read shapes, dtypes, strides and flags only; no kernel runs). That is the only stand-in; the tests
keep to the plugin's decisions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hal.dispatch import prepare
from hal.plugin import Inputs, KernelSpec
from hal.registry import get_op
from hal_backend_rocm import plugin

ROCM = torch.device("cuda", 0)  # how torch names a ROCm device


def _inputs(op: str, arch: str, *args: Any, **kwargs: Any) -> Inputs:
    decl = get_op(op)
    full = [kwargs[p.name] if p.name in kwargs else args[i] if i < len(args) else p.default for i, p in enumerate(decl.params)]
    canonical = prepare(decl, full).inputs
    return Inputs(decl, canonical.args, "rocm", ROCM, canonical.dtype, "torch", arch)


def _kernels(op: str) -> list[KernelSpec]:
    return sorted((k for k in plugin.kernels if k.op == op and k.backend == "rocm"), key=lambda k: -k.priority)


def chosen(op: str, arch: str, *args: Any, **kwargs: Any) -> tuple[str, dict[str, list[str]]]:
    """(the kernel that runs, the reasons of every kernel above it)."""
    inputs = _inputs(op, arch, *args, **kwargs)
    passed: dict[str, list[str]] = {}
    for k in _kernels(op):
        reasons = k.not_supported_reasons(inputs)
        if not reasons:
            return k.name, passed
        passed[k.name] = reasons
    raise AssertionError(f"no kernel of rocm runs {op}: {passed}")


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


NOT_TUNED = "device architecture gfx1100 not supported (this kernel needs gfx90a or gfx942)"


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_linear_epilogues_on_cdna(arch: str) -> None:
    x, w, b = _t(64, 128), _t(256, 128), _t(256)
    assert chosen("linear", arch, x, w, b, "gelu_tanh")[0] == "hipblaslt"
    name, passed = chosen("linear", arch, x, w, b, "silu")
    assert name == "hipblas_triton"
    assert passed == {"hipblaslt": ["act 'silu' has no hipBLASLt epilogue (none, relu, gelu_tanh)"]}
    # float64: no hipBLASLt kernel (it takes float16, bfloat16, float32), the library GEMM + Triton pass
    assert chosen("linear", arch, x.double(), w.double(), b.double(), "relu")[0] == "hipblas_triton"


def test_unlisted_architecture_runs_torch_kernels_and_says_why() -> None:
    x, w, b = _t(64, 128), _t(256, 128), _t(256)
    name, passed = chosen("linear", "gfx1100", x, w, b, "silu")
    assert name == "torch"
    assert passed["hipblas_triton"] == [NOT_TUNED] and passed["triton"] == [NOT_TUNED]
    assert chosen("linear", "gfx1100", x, w, b, "relu")[0] == "hipblaslt"  # through torch: any AMD GPU
    assert chosen("layer_norm", "gfx1100", x, (128,))[0] == "torch"
    assert chosen("layer_norm", "gfx942", x, (128,))[0] == "triton"
    assert chosen("conv2d", "gfx1100", _t(2, 3, 8, 8), _t(4, 3, 3, 3))[0] == "miopen"


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_fused_conv_bn_relu_paths(arch: str) -> None:
    def call(x: torch.Tensor, training: bool, padding: Any = 1) -> tuple[str, dict]:
        c = x.shape[1]
        vec = lambda: torch.randn(16).to(x.dtype)  # noqa: E731
        return chosen("fused_conv_bn_relu", arch, x, _t(16, c, 3, 3, dtype=x.dtype), vec(), vec(), vec(), vec(), torch.rand(16).to(x.dtype) + 0.5,
                      padding=padding, training=training)

    f32 = _t(2, 8, 10, 10, dtype=torch.float32)
    assert call(f32, training=False)[0] == "miopen_fused"
    name, passed = call(f32, training=True)
    assert name == "miopen_triton" and passed["miopen_fused"] == ["training mode (batch statistics cannot be folded into the weights)"]
    name, passed = call(f32.contiguous(memory_format=torch.channels_last), training=False)
    assert name == "miopen_triton"
    assert passed["miopen_fused"] == ["input not NCHW-contiguous (torch.miopen_convolution_relu fuses NCHW inputs only)"]
    name, passed = call(_t(2, 8, 10, 10), training=False)  # bfloat16: torch would not build a fusion plan
    assert name == "miopen_triton" and passed["miopen_fused"][0].startswith("dtype bfloat16 not supported (supports float32)")
    name, passed = call(f32, training=False, padding="same")  # odd kernel: symmetric, still fused
    assert name == "miopen_fused"


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942", "gfx1100"])
def test_fused_conv_bn_add_relu_paths(arch: str) -> None:
    """Eval with symmetric padding: torch.miopen_convolution_add_relu on folded weights, any layout
    and half or single precision, any AMD GPU; training, asymmetric padding and float64: torch's ops."""

    def call(x: torch.Tensor, training: bool, padding: Any = 1) -> tuple[str, dict]:
        vec = lambda: torch.randn(16).to(x.dtype)  # noqa: E731
        out = 10 if padding == 1 else 9
        return chosen("fused_conv_bn_add_relu", arch, x, _t(16, x.shape[1], 3, 3, dtype=x.dtype), vec(), vec(), vec(), vec(),
                      torch.rand(16).to(x.dtype) + 0.5, _t(2, 16, out, out, dtype=x.dtype), padding=padding, training=training)

    x = _t(2, 8, 10, 10)
    assert call(x, training=False) == ("miopen_fused", {})
    assert call(x.contiguous(memory_format=torch.channels_last), training=False)[0] == "miopen_fused"
    assert call(x.float(), training=False)[0] == "miopen_fused"
    name, passed = call(x, training=True)
    assert name == "torch" and passed["miopen_fused"] == ["training mode (batch statistics cannot be folded into the weights)"]
    name, passed = call(x, training=False, padding=(1, 0, 1, 0))
    assert name == "torch" and passed["miopen_fused"] == ["asymmetric padding (torch.miopen_convolution_add_relu takes one padding per side pair)"]
    assert call(x.double(), training=False)[0] == "torch"


def test_fused_conv_bn_relu_on_an_untuned_architecture() -> None:
    x = _t(2, 8, 10, 10)
    vec = lambda: torch.randn(16).to(x.dtype)  # noqa: E731
    name, passed = chosen("fused_conv_bn_relu", "gfx1100", x, _t(16, 8, 3, 3), vec(), vec(), vec(), vec(), torch.rand(16).to(x.dtype) + 0.5)
    assert name == "torch" and passed["miopen_triton"] == [NOT_TUNED]


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_attention_backends(arch: str) -> None:
    q, k, v = _t(2, 4, 64, 64, dtype=torch.float16), _t(2, 4, 80, 64, dtype=torch.float16), _t(2, 4, 80, 64, dtype=torch.float16)
    assert chosen("scaled_dot_product_attention", arch, q, k, v)[0] == "flash"
    f32 = [t.float() for t in (q, k, v)]
    name, passed = chosen("scaled_dot_product_attention", arch, *f32)
    assert name == "efficient" and passed["flash"][0].startswith("dtype float32 not supported")
    mask = torch.rand(64, 80) > 0.5
    name, passed = chosen("scaled_dot_product_attention", arch, q, k, v, mask)
    assert name == "math"
    assert "attn_mask given (the math kernel gives fully masked query rows zeros)" in passed["flash"]
    name, passed = chosen("scaled_dot_product_attention", arch, q, k, v, is_causal=True)  # L=64 != S=80
    assert name == "math" and "causal with L != S (torch's top-left alignment is kept by the math kernel)" in passed["efficient"]
    wide = [_t(1, 2, 16, 320, dtype=torch.float16) for _ in range(3)]
    name, passed = chosen("scaled_dot_product_attention", arch, *wide)
    assert name == "math" and "head sizes E=320, Ev=320: needs E == Ev <= 256, a multiple of 8" in passed["flash"]
    odd = [_t(1, 2, 16, 36, dtype=torch.float32) for _ in range(3)]  # float32 head size 36: a multiple of 4
    assert chosen("scaled_dot_product_attention", arch, *odd)[0] == "efficient"
    assert chosen("scaled_dot_product_attention_backward", arch, _t(2, 4, 64, 64, dtype=torch.float16), q, k, v)[0] == "flash"


def test_attention_on_an_untuned_architecture() -> None:
    q = _t(2, 4, 64, 64, dtype=torch.float16)
    name, passed = chosen("scaled_dot_product_attention", "gfx1100", q, q, q)
    assert name == "math" and passed["flash"] == [NOT_TUNED]


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_int8_linear_routes(arch: str) -> None:
    def call(m: int, k: int, n: int) -> tuple[str, dict]:
        xq = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        wq = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        return chosen("int8_linear", arch, xq, wq, 0.02, torch.rand(n) + 0.01, None, "bfloat16")

    assert call(64, 128, 256)[0] == "tuned"
    name, passed = call(8, 30, 16)
    assert name == "triton"
    assert passed["tuned"] == passed["hipblaslt"] == ["8 rows; torch._int_mm needs more than 16", "K=30, N=16; torch._int_mm needs both multiples of 8"]


def test_optimizer_inputs_the_triton_kernel_turns_down() -> None:
    def adamw(arch: str, dtype: torch.dtype, layout: str = "contiguous") -> tuple[str, dict]:
        p = [torch.randn(8, 12).to(dtype)]
        if layout == "transposed":  # dense, like channels_last weights: walked as one run of memory
            p = [p[0].t()]
        elif layout == "strided":  # every other column: gaps the kernel cannot walk
            p = [p[0][:, ::2]]
        g, m, v = ([torch.randn_like(t) for t in p] for _ in range(3))
        return chosen("fused_adamw_", arch, p, g, m, [t.abs() for t in v], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.01, step=1)

    assert adamw("gfx942", torch.bfloat16)[0] == "triton"
    name, passed = adamw("gfx942", torch.float64)
    assert name == "torch" and passed["triton"][0].startswith("dtype float64 not supported")
    assert adamw("gfx90a", torch.float32, "transposed")[0] == "triton"
    name, passed = adamw("gfx90a", torch.float32, "strided")
    assert name == "torch"
    assert passed["triton"] == ["params, grads, exp_avgs, exp_avg_sqs, master_params hold tensors with gaps or overlaps, or differing "
                                "in memory layout at one index (the multi-tensor kernel walks each as one run of memory)"]


def test_an_unknown_architecture_is_a_reason_for_every_kernel() -> None:
    inputs = _inputs("softmax", None, _t(32, 64), -1)  # type: ignore[arg-type]
    assert {k.name: k.not_supported_reasons(inputs) for k in _kernels("softmax")} == {
        "triton": ["device architecture unknown (this kernel needs gfx90a or gfx942)"],
        "torch": ["device architecture unknown (this kernel needs an AMD GPU (gfx...) that torch's ROCm build supports)"],
    }
