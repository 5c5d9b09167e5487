"""kits/cpp's C++ kernels in the ROCm plugin (hal_backend_rocm.cpp_kernels): registered as "cpp" and
"miopen_cpp" for gfx90a and gfx942 below the Triton kernels, rejecting with the runtime's reason
here, and which kernel runs which call per architecture, from the plugin's own capability data.

The calls are checked as the dispatcher checks them, with Inputs built by hand (test_selection.py:
CPU tensors stand in for device tensors, the architecture is the one a ROCm device reports). One
more stand-in, said where it is used: an available runtime (a ROCm device with hiprtc), to show
where the C++ kernels would then run. No kernel runs on an AMD device here; the last test runs the
code of "miopen_cpp" (hal_cpp.register's fused kernels) on CPU threads with 64-lane wavefronts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hal_backend_cpu_ref import plugin as cpu_ref
from test_selection import NOT_TUNED, _inputs, _kernels, _t, chosen

import hal
import hal_cpp
from hal.plugin import Plugin
from hal_torch.table import eager
from hal_backend_rocm.cpp_kernels import RUNTIME
from hal_cpp.host import HostRuntime
from hal_cpp.register import Convolution
from tests.cpp.test_emulated import call, randn
from tests.cuda._support import assert_close, fresh_seed, reference

CPP_OPS = {"batch_norm": "cpp", "batch_norm_backward": "cpp", "layer_norm_backward": "cpp", "rms_norm_backward": "cpp",
           "fused_adamw_": "cpp", "fused_conv_bn_relu": "miopen_cpp", "fused_conv_bn_relu_backward": "miopen_cpp"}
FLOATS = {"float16", "bfloat16", "float32", "float64"}
LAYOUTS_DIFFER = ("params, grads, exp_avgs, exp_avg_sqs, master_params hold tensors with gaps or overlaps, or differing in "
                  "memory layout at one index (the multi-tensor kernel walks each as one run of memory)")


def _cpp(op: str):
    return next(k for k in _kernels(op) if k.name == CPP_OPS[op])


def _vec(c: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(c).to(dtype)


def _calls(dtype: torch.dtype) -> dict[str, tuple[tuple, dict[str, Any]]]:
    """A call of every op with a C++ kernel: channels-last batch norm, norms over rows of 512, a
    3x3 convolution of 8 channels, AdamW over two tensors."""
    x = _t(4, 16, 6, 6, dtype=dtype).contiguous(memory_format=torch.channels_last)
    rows = _t(32, 512, dtype=dtype)
    conv_x, conv_w = _t(2, 8, 10, 10, dtype=dtype), _t(16, 8, 3, 3, dtype=dtype)
    conv_vecs = (_vec(16, dtype), _vec(16, dtype), _vec(16, dtype), _vec(16, dtype), torch.rand(16).to(dtype) + 0.5)
    params = [_t(8, 6, dtype=dtype), _t(33, dtype=dtype)]
    moments = [[torch.randn_like(p) for p in params] for _ in range(3)]
    return {
        "batch_norm": ((x, _vec(16), torch.rand(16) + 0.5, _vec(16), _vec(16), True, 0.1, 1e-5), {}),
        "batch_norm_backward": ((torch.randn_like(x), x, _vec(16), torch.rand(16) + 0.5, _vec(16), True, 1e-5), {}),
        "layer_norm_backward": ((torch.randn_like(rows), rows, (512,), _vec(512, dtype)), {}),
        "rms_norm_backward": ((torch.randn_like(rows), rows, (512,), _vec(512, dtype)), {}),
        "fused_adamw_": ((params, moments[0], moments[1], [m.abs() for m in moments[2]]),
                         dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)),
        "fused_conv_bn_relu": ((conv_x, conv_w, *conv_vecs), dict(padding=1, training=True)),
        "fused_conv_bn_relu_backward": ((_t(2, 16, 10, 10, dtype=dtype), conv_x, conv_w, *conv_vecs), dict(padding=1, training=True)),
    }


#: what runs each call on gfx90a/gfx942 when the runtime cannot run (here), and the kernel after it
TRITON_FIRST = {"batch_norm": "triton", "batch_norm_backward": "triton", "layer_norm_backward": "triton",
                "rms_norm_backward": "triton", "fused_adamw_": "triton", "fused_conv_bn_relu": "miopen_triton",
                "fused_conv_bn_relu_backward": "miopen_triton"}


def _accepting(op: str, arch: str, args: tuple, kwargs: dict) -> list[str]:
    """Every kernel of the plugin that takes the call, highest priority first."""
    inputs = _inputs(op, arch, *args, **kwargs)
    return [k.name for k in _kernels(op) if not k.not_supported_reasons(inputs)]


@pytest.fixture
def device_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for a ROCm device with hiprtc (none exists here): the runtime reports no reason."""
    monkeypatch.setattr(RUNTIME, "unavailable_reason", lambda: None)


def test_registered_for_cdna_below_the_triton_kernels() -> None:
    for op, name in CPP_OPS.items():
        k = _cpp(op)
        triton = [t for t in _kernels(op) if "triton" in t.name]
        assert triton and all(k.priority < t.priority for t in triton), f"{op}: {name} should rank below Triton until measured"
        assert k.archs.accepts("gfx90a") and k.archs.accepts("gfx942"), op
        assert not k.archs.accepts("gfx1100") and not k.archs.accepts("sm_90"), op
        assert k.dtypes == FLOATS, op


@pytest.mark.skipif(getattr(torch.version, "hip", None) is not None, reason="torch here is a ROCm build")
@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_here_the_cpp_kernels_give_the_runtimes_reason_and_triton_runs(arch: str) -> None:
    reason = RUNTIME.unavailable_reason()
    assert reason.startswith("torch is not a ROCm build: install torch from the ROCm wheel index")
    for op, (args, kwargs) in _calls(torch.bfloat16).items():
        name, passed = chosen(op, arch, *args, **kwargs)
        assert name == TRITON_FIRST[op], op
        assert _cpp(op).not_supported_reasons(_inputs(op, arch, *args, **kwargs)) == [reason], op
    args, kwargs = _calls(torch.float64)["fused_adamw_"]  # the Triton AdamW takes no float64
    name, passed = chosen("fused_adamw_", arch, *args, **kwargs)
    assert name == "torch" and passed["cpp"] == [reason]


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_with_a_device_the_cpp_kernels_come_next_after_triton(device_stand_in: None, arch: str) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for op, (args, kwargs) in _calls(dtype).items():
            accepting = _accepting(op, arch, args, kwargs)
            assert accepting[:2] == [TRITON_FIRST[op], CPP_OPS[op]], (op, dtype, accepting)
    args, kwargs = _calls(torch.float64)["fused_adamw_"]
    assert chosen("fused_adamw_", arch, *args, **kwargs)[0] == "cpp"  # the one call the C++ kernels win


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_with_a_device_the_cpp_kernels_turn_down_what_they_cannot_address(device_stand_in: None, arch: str) -> None:
    _, kwargs = _calls(torch.float64)["fused_adamw_"]
    params = [_t(6, 8, dtype=torch.float64).t(), _t(33, dtype=torch.float64)]
    grads, m, v = ([torch.randn(p.shape, dtype=p.dtype) for p in params] for _ in range(3))  # contiguous: not params' layout
    name, passed = chosen("fused_adamw_", arch, params, grads, m, [t.abs() for t in v], **kwargs)
    assert name == "torch" and passed["cpp"] == [LAYOUTS_DIFFER]
    wide = _t(4, 8192)
    inputs = _inputs("layer_norm_backward", arch, torch.randn_like(wide), wide, (8192,), _vec(8192, torch.bfloat16))
    assert _cpp("layer_norm_backward").not_supported_reasons(inputs) == [
        "rows of 8192 values (the C++ kernel holds rows of up to 4096 in registers)"]
    x, _, rv, w, b, *rest = _calls(torch.float32)["batch_norm"][0]
    inputs = _inputs("batch_norm", arch, x, torch.randn(32)[::2], rv, w, b, *rest)
    assert _cpp("batch_norm").not_supported_reasons(inputs) == ["running_mean must have unit stride (the kernels index them in place)"]


@pytest.mark.parametrize("stand_in", [False, True])
def test_other_architectures_never_get_the_cpp_kernels(request: pytest.FixtureRequest, stand_in: bool) -> None:
    """gfx1100 (RDNA 3, wavefront 32): the architecture is the reason, with a device or without."""
    if stand_in:
        request.getfixturevalue("device_stand_in")
    for op, (args, kwargs) in _calls(torch.float16).items():
        assert _cpp(op).not_supported_reasons(_inputs(op, "gfx1100", *args, **kwargs)) == [NOT_TUNED], op
        assert CPP_OPS[op] not in _accepting(op, "gfx1100", args, kwargs)
    args, kwargs = _calls(torch.float64)["fused_adamw_"]
    assert chosen("fused_adamw_", "gfx1100", *args, **kwargs)[0] == "torch"



#: float64: the reference's precision, so no ReLU mask can flip near zero (conformance's kink band does that for the others)
FUSED_DTYPE = torch.float64


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kit's code-object cache of the CPU-thread modules, shared by the cases (one compile)."""
    return tmp_path_factory.mktemp("cpp-host")


@pytest.mark.parametrize("training", [True, False])
def test_the_fused_kernels_code_on_cpu_threads(install_plugins, host_cache: Path, monkeypatch: pytest.MonkeyPatch, training: bool) -> None:
    """What "miopen_cpp" runs (the fused kernels of hal_cpp.register, shared with CUDA's "cudnn_cpp"):
    the convolution without its bias, the C++ batch norm + ReLU with the bias folded in, the
    backward's exact zero convolution-bias gradient in training. Run by the dispatcher on CPU threads
    with 64-lane wavefronts (hal_cpp.host), torch's CPU convolution standing in for MIOpen's, against
    cpu_ref in float64, outputs poisoned first."""
    monkeypatch.setenv("HAL_CPP_CACHE_DIR", str(host_cache))
    host = Plugin(name="cpp_fused_w64", version="0", summary="kits/cpp's fused kernels on CPU threads (test)")
    host.define_backend(priority=cpu_ref.backend.priority + 10, device_types=("cpu",))
    hal_cpp.register(host, HostRuntime(warp_size=64, multiprocessors=4), convolution=Convolution("torch", eager("conv2d"), eager("conv2d_backward")))
    install_plugins([cpu_ref, host])
    gen = torch.Generator().manual_seed(fresh_seed())
    x = randn(gen, 2, 8, 6, 7, dtype=FUSED_DTYPE).contiguous(memory_format=torch.channels_last)
    w = randn(gen, 16, 8, 3, 3, dtype=FUSED_DTYPE, scale=0.2).contiguous(memory_format=torch.channels_last)
    cb, bw, bb, rm = (randn(gen, 16, dtype=FUSED_DTYPE) for _ in range(4))
    rv = (torch.rand(16, generator=gen) + 0.5).to(FUSED_DTYPE)
    tail = (1, 1, 1, 1, 1e-4)  # stride, padding, dilation, groups, eps
    args = (x, w, cb, bw, bb, rm, rv, *tail, 0.2, training)
    assert hal.explain("fused_conv_bn_relu", *args).kernel == "torch_cpp"
    want, copies = reference("fused_conv_bn_relu", *args)
    y = call("fused_conv_bn_relu", hal.ops.fused_conv_bn_relu, args)
    assert_close("fused_conv_bn_relu", y, want, args)
    for name, got, ref in (("running_mean", rm, copies[5]), ("running_var", rv, copies[6])):
        assert_close("fused_conv_bn_relu", got, ref, args, what=name)
    g = randn(gen, *y.shape, dtype=FUSED_DTYPE).contiguous(memory_format=torch.channels_last)
    bargs = (g, x, w, cb, bw, bb, rm, rv, *tail, training)
    grads = call("fused_conv_bn_relu_backward", hal.ops.fused_conv_bn_relu_backward, bargs)
    wants, _ = reference("fused_conv_bn_relu_backward", *bargs)
    for what, got, ref in zip(("grad_x", "grad_conv_weight", "grad_conv_bias", "grad_bn_weight", "grad_bn_bias"), grads, wants):
        assert_close("fused_conv_bn_relu_backward", got, ref, bargs, what=what)
    if training:
        assert torch.equal(grads[2], torch.zeros_like(grads[2]))
