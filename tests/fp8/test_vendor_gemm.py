"""The cuBLASLt / hipBLASLt fp8_scaled_mm kernels' rules and scale layouts, on the CPU: the pure
functions that decide what each takes (NVIDIA and AMD architecture strings), the refusal of FP8 on
GPUs without it, the scales handed to torch._scaled_mm (block scales as cuBLASLt's 1 x 128 and
128 x 128 layouts), and the call itself where torch's CPU _scaled_mm runs it (tensor and row
scales) against hal's op. The GPU runs are tests/cuda/device/test_fp8_training.py's."""

from __future__ import annotations

import pytest
import torch

import hal
from hal.plugin_sdk.fp8_hardware import gpu_has_fp8
from hal_backend_cuda import fp8 as cuda_fp8
from hal_backend_rocm import fp8 as rocm_fp8


def rules(arch, a="e4m3fn", b="e4m3fn", ga="tensor", gb="tensor", m=256, k=256, n=256, bs=128):
    return cuda_fp8.shape_reasons(arch, a, b, ga, gb, m, k, n, bs)


def test_cuda_rules_accept_what_cublaslt_runs():
    for pair in (("e4m3fn", "e4m3fn"), ("e4m3fn", "e5m2"), ("e5m2", "e4m3fn")):
        assert rules("sm_90", *pair) == []
        assert rules("sm_89", *pair) == []
        assert rules("sm_100", *pair) == []
    assert rules("sm_90", ga="row", gb="row", m=7) == []  # M is free
    assert rules("sm_90", ga="block", gb="block", k=512, n=384) == []
    assert rules("sm_90", ga="block", gb="block", m=200, k=512, n=384) == []  # ran on the H200


@pytest.mark.parametrize("arch,case,needle", [
    ("sm_80", {}, "8.9"),
    ("sm_86", {}, "compute capability"),
    ("sm_90", {"a": "e4m3fnuz", "b": "e4m3fnuz"}, "fnuz"),
    ("sm_90", {"a": "e5m2", "b": "e5m2"}, "e5m2 x e5m2"),
    ("sm_90", {"k": 200}, "K=200"),
    ("sm_90", {"n": 100}, "N=100"),
    ("sm_90", {"ga": "row", "gb": "tensor"}, "row x tensor"),
    ("sm_90", {"ga": "block", "gb": "block", "bs": 64}, "block_size=64"),
    ("sm_89", {"ga": "block", "gb": "block"}, "sm_90 (Hopper) only"),
    ("sm_100", {"ga": "block", "gb": "block"}, "sm_90 (Hopper) only"),
    ("sm_90", {"ga": "block", "gb": "block", "k": 144}, "K=144"),
    ("sm_90", {"ga": "block", "gb": "block", "n": 64}, "N=64"),  # conformance's block128 (130, 64, 256)
    ("sm_90", {"ga": "block", "gb": "block", "m": 130}, "M=130"),
    ("sm_89", {"ga": "row", "gb": "row"}, "sm_90 or newer"),
])
def test_cuda_rules_refuse_with_the_reason(arch, case, needle):
    reasons = rules(arch, **case)
    assert reasons and any(needle in r for r in reasons), reasons


def test_rocm_rules():
    ok = rocm_fp8.shape_reasons
    assert ok("gfx942", "e4m3fnuz", "e4m3fnuz", "tensor", "tensor", 256, 256, "float32") == []
    assert ok("gfx942", "e5m2fnuz", "e4m3fnuz", "tensor", "tensor", 256, 256, "bfloat16") == []
    assert ok("gfx942", "e4m3fnuz", "e4m3fnuz", "row", "row", 256, 256, "bfloat16") == []
    assert ok("gfx950", "e4m3fn", "e5m2", "tensor", "tensor", 256, 256, "bfloat16") == []
    cases = [
        (("gfx942", "e4m3fn", "e4m3fn", "tensor", "tensor", 256, 256, "bfloat16"), "fnuz"),
        (("gfx950", "e4m3fnuz", "e4m3fnuz", "tensor", "tensor", 256, 256, "bfloat16"), "gfx950"),
        (("gfx90a", "e4m3fnuz", "e4m3fnuz", "tensor", "tensor", 256, 256, "bfloat16"), "gfx942 or later"),
        (("gfx942", "e5m2fnuz", "e5m2fnuz", "tensor", "tensor", 256, 256, "bfloat16"), "e5m2 x e5m2"),
        (("gfx942", "e4m3fnuz", "e4m3fnuz", "block", "block", 256, 256, "bfloat16"), "block scales"),
        (("gfx942", "e4m3fnuz", "e5m2fnuz", "row", "row", 256, 256, "bfloat16"), "second operand"),
        (("gfx942", "e4m3fnuz", "e4m3fnuz", "row", "row", 256, 256, "float16"), "bfloat16"),
        (("gfx942", "e4m3fnuz", "e4m3fnuz", "tensor", "tensor", 250, 256, "bfloat16"), "K=250"),
    ]
    for args, needle in cases:
        reasons = ok(*args)
        assert reasons and any(needle in r for r in reasons), (args, reasons)


def test_eager_emulation_takes_cpu_tensors():
    a = torch.randint(0, 120, (4, 32), dtype=torch.uint8)
    inputs = hal.plugin.Inputs(op=hal.registry.get_op("fp8_scaled_mm"),
                               args=(a, a, torch.tensor(1.0), torch.tensor(1.0), None, "e4m3fn", "e4m3fn", "bfloat16", 128),
                               device_kind="cpu", device=torch.device("cpu"), dtype="uint8", array_type="torch")
    assert gpu_has_fp8(inputs) == []


def test_block_scales_in_cublaslt_layouts():
    g = torch.Generator().manual_seed(3)
    m, k, n = 300, 384, 200
    a_scale = torch.rand(3, 3, generator=g) + 0.5  # ceil(300/128) x 384/128
    b_scale = torch.rand(2, 3, generator=g) + 0.5  # ceil(200/128) x 3
    sa, sb = cuda_fp8.torch_scales(a_scale, b_scale, (m, k), n, 128)
    assert sa.shape == (m, 3) and sa.stride() == (1, m)  # 1 x 128, outer-dimension-major
    for i in (0, 127, 128, 255, 256, 299):
        assert torch.equal(sa[i], a_scale[i // 128])
    assert sb.shape == (3, 2) and sb.t().stride() == (3, 1) and torch.equal(sb.t(), b_scale)  # 128 x 128 of b.t()
    ra, rb = cuda_fp8.torch_scales(torch.rand(m, 1, generator=g), torch.rand(n, 1, generator=g), (m, k), n, 128)
    assert ra.shape == (m, 1) and rb.shape == (1, n) and rb.is_contiguous()


def _operands(seed, m, k, n, fa, fb):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, k, generator=g) / 2
    qa, sa = hal.ops.fp8_quantize(a, fa, "row")
    qb, sb = hal.ops.fp8_quantize(b, fb, "row")
    return qa, qb, sa, sb, torch.randn(n, generator=g)


@pytest.mark.parametrize("gran", ["tensor", "row"])
@pytest.mark.parametrize("fa,fb", [("e4m3fn", "e4m3fn"), ("e4m3fn", "e5m2"), ("e5m2", "e4m3fn")])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_the_call_matches_the_op(gran, fa, fb, out_dtype):
    """torch's CPU _scaled_mm runs tensor and row scales: the call's layouts and bias handling give
    hal's result within the op's tolerance (the bias rounded to a half-precision result's dtype)."""
    qa, qb, sa, sb, bias = _operands(7, 48, 64, 80, fa, fb)
    if gran == "tensor":
        sa, sb = sa.max(), sb.max()
    dt = getattr(torch, out_dtype)
    out = cuda_fp8.scaled_mm_call(qa, qb, sa, sb, bias, fa, fb, dt, 128)
    assert out.dtype == dt and out.shape == (48, 80)
    ref = hal.ops.fp8_scaled_mm(qa, qb, sa, sb, bias, fa, fb, "float32", 128)
    tol = 2.0**-7 if out_dtype == "bfloat16" else 1e-5
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    rocm = rocm_fp8.scaled_mm_call(qa, qb, sa, sb, bias, fa, fb, dt)
    assert torch.equal(rocm, out)



def test_no_probe_runs_on_fake_tensors():
    """Inside a fake-tensor mode (torch.compile's tracing) the probes must not run: fake kernels
    would answer 'supported' for any pairing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not cuda_fp8._probing_unsafe() and not rocm_fp8._probing_unsafe()
    with FakeTensorMode():
        assert cuda_fp8._probing_unsafe() and rocm_fp8._probing_unsafe()
    reason = cuda_fp8.probe_reason(torch.device("cuda", 0), "e4m3fn", "e4m3fn", "row", "row", torch.bfloat16, False, traced=True)
    assert reason and "not yet tried" in reason
