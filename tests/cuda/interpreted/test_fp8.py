"""The Triton FP8 kernels (hal_triton.fp8, as the CUDA plugin registers them) in the Triton
interpreter, against cpu_ref: quantisation (every granularity, current and given scales, the
transposed variant) and dequantisation bit for bit, the scaled GEMM within the op's tolerance.

In the interpreter the kernels encode with float32 and integer arithmetic (``HW=False``): Triton's
interpreter casts to FP8 inexactly (it rounds half up on one bit and loses the carry out of the
mantissa, see hal_triton/fp8.py), so the hardware casts are checked on the GPU
(tests/cuda/device/test_fp8_kernels.py) and in the compiled code (tests/cuda/test_aot.py).
Run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tests.cuda._support import assert_bits, assert_close, finite_codes, fresh_seed, rms

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's "invalid value" inside the interpreter
]

if os.environ.get("TRITON_INTERPRET") == "1":
    from hal_backend_cpu_ref import fp8 as ref
    from hal_backend_cuda import plugin

from hal.ops.fp8 import FORMATS, format_values, scale_shape  # noqa: E402

FORMAT_NAMES = tuple(FORMATS)


def kern(op: str):
    return next(k.fn for k in plugin.kernels if k.op == op and k.name == "triton")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def wide(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values over a wide range of magnitudes (log-normal spread), signs mixed."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp(3.0 * torch.randn(shape, generator=gen, dtype=torch.float64))
    return x.to(dtype)


def given_scale(gen: torch.Generator, shape: tuple, granularity: str, block_size: int) -> torch.Tensor:
    return (torch.rand(scale_shape(shape, granularity, block_size), generator=gen) * 2 + 0.01).float()


def ref_quantize(x: torch.Tensor, fmt: str, granularity: str, scale, block_size: int, transpose: bool = False):
    s = None if scale is None else scale.numpy()
    fn = ref.fp8_quantize_transpose if transpose else ref.fp8_quantize
    with np.errstate(all="ignore"):
        return fn(x.float().numpy(), fmt, granularity, s, block_size)  # float32: exact for every input dtype


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_every_value_every_tie_and_the_edges_encode_exactly(fmt: str) -> None:
    """Each finite value, each midpoint of two neighbours (ties to even, the carry into the
    exponent), values past the largest finite one, infinities, NaN, float32 subnormals, -0."""
    vals = format_values(fmt)
    fin = np.unique(vals[np.isfinite(vals)])
    mids = ((fin[1:] + fin[:-1]) / 2).astype(np.float32)  # exact in float32
    big = FORMATS[fmt].max_finite
    edges = [big * 1.0001, -big * 3, 1e38, math.inf, -math.inf, math.nan, -math.nan, 1e-40, -1e-40, -0.0, 0.0]
    x = torch.tensor(np.concatenate([fin, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)), edges]), dtype=torch.float32)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(fresh_seed()))]
    one = torch.tensor(1.0)
    q, s = kern("fp8_quantize")(x, fmt, "tensor", one, 128)
    want_q, want_s = ref_quantize(x, fmt, "tensor", one, 128)
    assert_bits(q, want_q, f"{fmt} codes")
    assert_bits(s, want_s, f"{fmt} scale")


CASES = [(g, given) for g in ("tensor", "row", "block") for given in (False, True)]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("granularity,given", CASES, ids=[f"{g}-{'given' if v else 'current'}" for g, v in CASES])
def test_quantize_matches_cpu_ref_bit_for_bit(gen: torch.Generator, fmt: str, granularity: str, given: bool) -> None:
    dtype = (torch.float32, torch.bfloat16, torch.float16)[int(torch.randint(0, 3, (), generator=gen))]
    shape, bs = (2, 19, 37), 16
    x = wide(gen, *shape, dtype=dtype)
    x[0, 3, 5] = -0.0
    x[1, 2, :] = 0  # an all-zero row (scale 1 under current row scaling)
    scale = given_scale(gen, shape, granularity, bs) if given else None
    if given:
        x[0, 0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 1e30])
    q, s = kern("fp8_quantize")(x, fmt, granularity, scale, bs)
    want_q, want_s = ref_quantize(x, fmt, granularity, scale, bs)
    assert_bits(q, want_q, "q")
    assert_bits(s, want_s, "scale")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("granularity,given", [c for c in CASES if c != ("row", True)], ids=lambda v: str(v))
def test_quantize_transpose_matches_cpu_ref_bit_for_bit(gen: torch.Generator, fmt: str, granularity: str, given: bool) -> None:
    shape, bs = (2, 21, 34), 16
    x = wide(gen, *shape)
    x[1, :, 4] = 0  # an all-zero column
    scale = given_scale(gen, shape, granularity, bs) if given else None
    got = kern("fp8_quantize_transpose")(x, fmt, granularity, scale, bs)
    want = ref_quantize(x, fmt, granularity, scale, bs, transpose=True)
    assert len(got) == 4
    for g, w, what in zip(got, want, ("q", "scale", "q_t", "scale_t")):
        assert_bits(g, w, what)
    assert got[2].is_contiguous()


def test_power_of_two_tensor_scales(gen: torch.Generator) -> None:
    """A given tensor scale that is a normal power of two divides by multiplying with its exact
    reciprocal: the same codes as the division, at the ends of the exponent range too (2^-126 and
    2^126; 2^127 and the subnormal 2^-149 take the division), with NaN, infinities, -0, float32
    subnormals and overflowing quotients in x."""
    x = wide(gen, 9, 40)
    x.view(-1)[:8] = torch.tensor([math.nan, math.inf, -math.inf, 3e38, -0.0, 1e-40, -1e-39, 1e-30])
    for sv in (2.0**-7, 8.0, 2.0**-126, 2.0**126, 2.0**127, 2.0**-149, 0.75):
        scale = torch.tensor(sv, dtype=torch.float32)
        for fmt in ("e4m3fn", "e5m2fnuz"):
            q, s = kern("fp8_quantize")(x, fmt, "tensor", scale, 128)
            want_q, want_s = ref_quantize(x, fmt, "tensor", scale, 128)
            assert_bits(q, want_q, f"{fmt} scale {sv} q")
            assert_bits(s, want_s, f"{fmt} scale {sv} scale")


def test_row_and_block_sizes_of_other_shapes(gen: torch.Generator) -> None:
    """Rows longer than the row kernel keeps in one tile (16384: its two loops), rows longer than
    the elementwise tile kept whole, a vector, a block size that is not a power of two, ragged
    edge blocks."""
    cases = [((2, 16500), "row", 128), ((3, 150), "row", 128), ((70,), "row", 128), ((2, 30, 41), "block", 12), ((33, 70), "block", 32)]
    for shape, granularity, bs in cases:
        x = wide(gen, *shape)
        q, s = kern("fp8_quantize")(x, "e4m3fn", granularity, None, bs)
        want_q, want_s = ref_quantize(x, "e4m3fn", granularity, None, bs)
        assert_bits(q, want_q, f"{shape} q")
        assert_bits(s, want_s, f"{shape} scale")
        if len(shape) >= 2 and shape[-1] < 16384:  # (the transposed variant has no row kernel)
            got = kern("fp8_quantize_transpose")(x, "e5m2fnuz", granularity, None, bs)
            for g, w in zip(got, ref_quantize(x, "e5m2fnuz", granularity, None, bs, transpose=True)):
                assert_bits(g, w, f"{shape} transposed")


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_nan_and_infinite_amax_propagate(gen: torch.Generator, granularity: str) -> None:
    """A NaN makes its group's scale NaN (every code NaN), an infinity its scale infinite (finite
    values become zeros, the infinity NaN), as cpu_ref."""
    x = wide(gen, 40, 40)
    x[1, 7] = math.nan
    x[37, 33] = -math.inf
    for transpose in (False, True):
        got = kern("fp8_quantize_transpose" if transpose else "fp8_quantize")(x, "e4m3fn", granularity, None, 32)
        want = ref_quantize(x, "e4m3fn", granularity, None, 32, transpose=transpose)
        for g, w in zip(got, want):
            assert_bits(g, w, f"{granularity} transpose={transpose}")
        assert got[1].isnan().any()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("granularity", ["number", "tensor", "row", "block"])
def test_dequantize_every_pattern_matches_cpu_ref(gen: torch.Generator, fmt: str, granularity: str) -> None:
    out_dtype = ("float32", "bfloat16", "float16")[int(torch.randint(0, 3, (), generator=gen))]
    shape, bs = (2, 16, 40), 16
    q = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    q.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scale = 0.37 if granularity == "number" else given_scale(gen, shape, granularity, bs)
    got = kern("fp8_dequantize")(q, scale, fmt, bs, out_dtype)
    with np.errstate(all="ignore"):
        want = ref.fp8_dequantize(q.numpy(), scale if granularity == "number" else scale.numpy(), fmt, bs, out_dtype)
    assert got.dtype == getattr(torch, out_dtype)
    assert_bits(got.float(), np.asarray(want).astype(np.float32), f"{fmt} {granularity}")


GEMMS = [
    ("e4m3fn", "e4m3fn", "tensor", "tensor", "bfloat16"),
    ("e5m2", "e4m3fn", "row", "row", "float32"),
    ("e4m3fn", "e5m2", "block", "block", "float16"),
    ("e4m3fnuz", "e4m3fnuz", "row", "block", "bfloat16"),
    ("e5m2fnuz", "e4m3fnuz", "block", "tensor", "float32"),
]


@pytest.mark.parametrize("a_fmt,b_fmt,a_gran,b_gran,out_dtype", GEMMS)
def test_scaled_mm_matches_cpu_ref(gen: torch.Generator, a_fmt: str, b_fmt: str, a_gran: str, b_gran: str, out_dtype: str) -> None:
    m, n, k, bs = 37, 29, 100, 32
    a, b = finite_codes(gen, a_fmt, m, k), finite_codes(gen, b_fmt, n, k)
    sa = given_scale(gen, (m, k), a_gran, bs) / (rms(a_fmt) * k**0.25)  # products summing to unit scale
    sb = given_scale(gen, (n, k), b_gran, bs) / (rms(b_fmt) * k**0.25)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    args = (a, b, sa, sb, bias, a_fmt, b_fmt, out_dtype, bs)
    got = kern("fp8_scaled_mm")(*args)
    want = ref.fp8_scaled_mm(a.numpy(), b.numpy(), sa.numpy(), sb.numpy(), bias.float().numpy(), a_fmt, b_fmt, "float32", bs)
    assert got.dtype == getattr(torch, out_dtype)
    assert_close("fp8_scaled_mm", got, torch.from_numpy(np.asarray(want, dtype=np.float64)), args)


def test_scaled_mm_propagates_nan_codes_and_reads_strided_rows(gen: torch.Generator) -> None:
    m, n, k = 20, 18, 64
    wide_a = finite_codes(gen, "e4m3fn", m, k + 16)
    a = wide_a[:, :k]  # rows with a stride of k + 16
    b = finite_codes(gen, "e4m3fn", n, k)
    a[3, 10] = 0x7F  # NaN
    sa, sb = torch.tensor(0.01), (torch.rand(n, 1, generator=gen) * 0.02 + 0.001)
    args = (a, b, sa, sb, None, "e4m3fn", "e4m3fn", "float32", 128)
    got = kern("fp8_scaled_mm")(*args)
    want = ref.fp8_scaled_mm(a.numpy(), b.numpy(), sa.numpy(), sb.numpy(), None, "e4m3fn", "e4m3fn", "float32", 128)
    assert got[3].isnan().all() and not got[[0, 1, 2, 4]].isnan().any()
    assert_close("fp8_scaled_mm", got, torch.from_numpy(np.asarray(want, dtype=np.float64)), args)


def test_checks_refuse_what_the_kernels_cannot_tile() -> None:
    """block_size past what one program spans; block scales a GEMM K step cannot lie within."""
    from hal.dispatch import prepare
    from hal.registry import get_op

    def reasons(op: str, *args) -> list[str]:
        spec = next(k for k in plugin.kernels if k.op == op and k.name == "triton")
        return list(spec.check(prepare(get_op(op), list(args)).inputs))  # the kernel's own check (CPU tensors have no arch)

    x = torch.randn(8, 8)
    assert any("above 1024" in r for r in reasons("fp8_quantize", x, "e4m3fn", "block", None, 2048))
    assert any("above 1024" in r for r in reasons("fp8_quantize_transpose", x, "e4m3fn", "block", None, 1500))
    a = torch.zeros(8, 96, dtype=torch.uint8)
    blocks = torch.ones(1, 2)
    assert any("power of two of at least 32" in r for r in reasons("fp8_scaled_mm", a, a, blocks, blocks, None, "e4m3fn", "e4m3fn", "float32", 48))
    assert not any("power of two" in r for r in reasons("fp8_scaled_mm", a, a, torch.tensor(1.0), torch.ones(8, 1), None, "e4m3fn", "e4m3fn", "float32", 48))


def test_device_reasons_name_the_architecture_and_the_formats() -> None:
    """fp8_device's table: NVIDIA from sm_89 with the OCP formats, gfx942 with fnuz, gfx950 with OCP."""
    from hal.plugin_sdk.fp8_hardware import fp8_arch_reasons, fp8_device

    assert fp8_arch_reasons("sm_90", ["e4m3fn", "e5m2"]) == [] and fp8_arch_reasons("sm_89", ["e5m2"]) == []
    assert fp8_arch_reasons("sm_80", ["e4m3fn"]) == ["FP8 needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper); this is sm_80"]
    (why,) = fp8_arch_reasons("sm_90", ["e4m3fn", "e4m3fnuz"])
    assert "fnuz formats are AMD's" in why and "e4m3fnuz" in why
    assert fp8_arch_reasons("gfx942", ["e4m3fnuz", "e5m2fnuz"]) == [] and fp8_arch_reasons("gfx950", ["e4m3fn"]) == []
    assert fp8_arch_reasons("gfx90a", ["e4m3fnuz"]) == ["FP8 needs gfx942 or later (MI300); this is gfx90a"]
    (why,) = fp8_arch_reasons("gfx942", ["e4m3fn"])
    assert "gfx942 has e4m3fnuz and e5m2fnuz, not e4m3fn" in why
    assert "unknown FP8 format" in fp8_arch_reasons("sm_90", ["e3m4"])[0]
    assert fp8_device(torch.device("cpu"), ["e4m3fnuz"]) == []  # CPU tensors: the interpreter emulates every format


# --- the given-scale casts that reduce the amax (delayed scaling) ----------------------------------


def ref_quantize_amax(x: torch.Tensor, fmt: str, scale: torch.Tensor, transpose: bool):
    fn = ref.fp8_quantize_transpose_amax if transpose else ref.fp8_quantize_amax
    with np.errstate(all="ignore"):
        return fn(x.float().numpy(), scale.numpy(), fmt)  # float32: exact for every input dtype


def poisoned_call(op: str, *args):
    """The kernel's results, its outputs allocated over memory filled with junk first: torch's CPU
    allocator reuses freed blocks, so a result the kernel failed to write would show the pattern
    (0x7E codes, NaN-free words; the amax word is zeroed by the host function, not the kernel)."""
    junk = torch.full((1 << 20,), 0x7E, dtype=torch.uint8)
    del junk
    return kern(op)(*args)


AMAX_SHAPES = [(19, 37), (2, 21, 34), (3, 1, 5), (1, 70), (33,), (), (64, 300)]


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_quantize_amax_matches_cpu_ref_bit_for_bit(gen: torch.Generator, fmt: str, transpose: bool) -> None:
    """q (and q_t) equal fp8_quantize's codes with the given scale, the scale comes back as given
    and the amax is max |float32(x)|, for fresh random data of a random input dtype in odd shapes,
    with -0.0, zeros, float32 subnormals and values past the format's range (no NaN or infinity:
    see the specials test)."""
    op = "fp8_quantize_transpose_amax" if transpose else "fp8_quantize_amax"
    for shape in AMAX_SHAPES:
        if transpose and len(shape) < 2:
            continue
        dtype = (torch.float32, torch.bfloat16, torch.float16)[int(torch.randint(0, 3, (), generator=gen))]
        x = wide(gen, *shape, dtype=dtype)
        flat = x.view(-1)
        edge = torch.tensor([-0.0, 0.0, 1e-40 if dtype == torch.float32 else 1e-7, -3e4], dtype=dtype)[: flat.numel()]
        flat[torch.randperm(flat.numel(), generator=gen)[: edge.numel()]] = edge
        scale = (torch.rand((), generator=gen) * 2 + 0.01).float()
        got = poisoned_call(op, x, scale, fmt)
        want = ref_quantize_amax(x, fmt, scale, transpose)
        names = ("q", "scale", "q_t", "amax") if transpose else ("q", "scale", "amax")
        assert len(got) == len(want) == len(names)
        for g, w, what in zip(got, want, names):
            assert_bits(g, w, f"{fmt} {shape} {dtype} {what}")
        assert got[-1].dtype == torch.float32 and got[-1].shape == ()
        assert float(got[-1]) == float(x.float().abs().max())  # torch's own amax, as the recipe reduced it before
        if transpose:
            assert got[2].is_contiguous() and tuple(got[2].shape) == shape[:-2] + (shape[-1], shape[-2])
        # the same codes as fp8_quantize_transpose / fp8_quantize with that scale
        plain = kern("fp8_quantize_transpose" if transpose else "fp8_quantize")(x, fmt, "tensor", scale, 128)
        assert_bits(got[0], plain[0].numpy(), "q against fp8_quantize")
        if transpose:
            assert_bits(got[2], plain[2].numpy(), "q_t against fp8_quantize_transpose")


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_quantize_amax_specials(gen: torch.Generator, transpose: bool) -> None:
    """NaN anywhere makes the amax NaN (its bits lie above infinity's: atomic_max keeps it, from any
    tile), an infinity without NaN makes it infinite, -0.0 alone gives +0, and values saturate."""
    op = "fp8_quantize_transpose_amax" if transpose else "fp8_quantize_amax"
    scale = torch.tensor(0.01)
    for fmt in ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"):
        for case in ("nan", "neg_nan", "inf", "neg_inf", "neg_zero", "saturation"):
            x = wide(gen, 2, 45, 70)
            i = int(torch.randint(0, x.numel(), (), generator=gen))
            if case == "neg_zero":
                x = torch.full_like(x, -0.0)
            else:
                x.view(-1)[i] = {"nan": math.nan, "neg_nan": -math.nan, "inf": math.inf, "neg_inf": -math.inf, "saturation": -1e30}[case]
            got = poisoned_call(op, x, scale, fmt)
            want = ref_quantize_amax(x, fmt, scale, transpose)
            for g, w, what in zip(got, want, ("q", "scale", "q_t", "amax") if transpose else ("q", "scale", "amax")):
                assert_bits(g, w, f"{fmt} {case} {what}")
            a = got[-1]
            expect = {"nan": math.nan, "neg_nan": math.nan, "inf": math.inf, "neg_inf": math.inf, "neg_zero": 0.0}.get(case)
            if expect is None:
                assert float(a) == float(np.float32(1e30))
            elif math.isnan(expect):
                assert a.isnan()
            else:
                assert float(a) == expect and not a.view(torch.int32) & (1 << 31)


def test_quantize_amax_empty_and_noncontiguous(gen: torch.Generator) -> None:
    """An empty x: empty codes, amax 0 (no program runs; the zeroed word is the result); a
    non-contiguous x: the codes of its values in row-major order."""
    scale = torch.tensor(0.5)
    q, s, a = kern("fp8_quantize_amax")(torch.empty(0, 7), scale, "e4m3fn")
    assert q.shape == (0, 7) and float(a) == 0.0 and float(s) == 0.5
    q, s, qt, a = kern("fp8_quantize_transpose_amax")(torch.empty(3, 0, 5), scale, "e5m2")
    assert q.shape == (3, 0, 5) and qt.shape == (3, 5, 0) and float(a) == 0.0
    x = wide(gen, 12, 40).mT  # (40, 12), strides (1, 40)
    for transpose in (False, True):
        got = kern("fp8_quantize_transpose_amax" if transpose else "fp8_quantize_amax")(x, scale, "e4m3fn")
        for g, w in zip(got, ref_quantize_amax(x, "e4m3fn", scale, transpose)):
            assert_bits(g, w, f"noncontiguous transpose={transpose}")
