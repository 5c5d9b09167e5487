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

from tests.cuda._support import assert_bits, assert_close, finite_codes, fresh_seed, rms, tie_cases

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


# --- the v2 casts (issue 40): every path of hal_triton.fp8's v2 kernels and the v1 baseline they
# replace, on odd shapes, specials and values built to land next to the format's rounding ties ---


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch):
    """torch.empty fills what it hands out (0x7E bytes: a large finite code; 0x5A5A5A5A words;
    float32 -1234.5), so an output element a kernel fails to write shows up as a wrong value."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.dtype == torch.uint8:
            t.fill_(0x7E)
        elif t.dtype == torch.int32:
            t.fill_(0x5A5A5A5A)
        elif t.is_floating_point():
            t.fill_(-1234.5)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _f8():
    from hal_triton import fp8

    return fp8


def _quantize(version: str, x, fmt, granularity, scale, bs, transpose, programs=None):
    """hal_triton.fp8.quantize as the interpreter tables launch it, in cast ``version``."""
    f8 = _f8()
    old = f8.set_cast_version(version)
    try:
        return f8.quantize(x, fmt, granularity, scale, bs, transpose, False, 64, 4, programs)
    finally:
        f8.set_cast_version(old)


def _specials(gen: torch.Generator, x: torch.Tensor, granularity: str) -> torch.Tensor:
    """x (2-D or more) with a zero row, an all-equal row, -0, and (not per tensor: it would make the
    whole tensor NaN) a NaN, an infinity and a huge value scattered in."""
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    if rows.shape[0] >= 3:
        rows[1] = 0
        rows[2] = -3.25
    rows.view(-1)[0] = -0.0
    if granularity != "tensor" and rows.numel() >= 8:
        idx = torch.randperm(rows.numel(), generator=gen)[:3]
        rows.view(-1)[idx] = torch.tensor([math.nan, -math.inf, 3e38]).to(x.dtype)
    return x


V2_SHAPES = [(1, 1), (1, 70), (3, 1), (37, 53), (2, 19, 33), (5, 300), (70, 17)]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_v2_casts_match_cpu_ref_and_v1_on_odd_shapes(poisoned, gen: torch.Generator, fmt: str, granularity: str, transpose: bool) -> None:
    """Every v2 kernel (and its v1 twin) against cpu_ref bit for bit, outputs poisoned: one row,
    one column, odd sizes, a batch, rows longer than the interpreter's tiles, blocks cut by the
    edges, current and given scales, each shape with a different dtype and number of persistent
    programs (1 to 5, fewer or more than the tiles); v1 on every other shape."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for i, shape in enumerate(V2_SHAPES):
        if (transpose or granularity == "block") and len(shape) < 2:
            continue
        bs = (16, 32, 12)[i % 3]
        x = _specials(gen, wide(gen, *shape, dtype=dtypes[i % 3]), granularity)
        for given in (False, True):
            if given and transpose and granularity == "row":
                continue
            scale = given_scale(gen, shape, granularity, bs) if given else None
            want = ref_quantize(x, fmt, granularity, scale, bs, transpose)
            for version in ("v2", "v1") if i % 2 == 0 else ("v2",):  # v1 (the A/B baseline) on every other shape
                got = _quantize(version, x, fmt, granularity, scale, bs, transpose, programs=1 + i % 5)
                assert len(got) == len(want)
                for g, w, what in zip(got, want, ("q", "scale", "q_t", "scale_t")):
                    assert_bits(g, w, f"{version} {fmt} {granularity} {shape} {x.dtype} given={given} {what}")


def test_v2_long_rows_and_large_blocks(poisoned, gen: torch.Generator) -> None:
    """Rows past the one-tile limit (16384: the row kernel's two loops), a 2-D per-tensor cast over
    many tiles of the persistent loops, and blocks larger than the interpreter keeps whole."""
    for shape, granularity, bs, transpose in [((2, 16500), "row", 128, False), ((3, 150, 40), "tensor", 128, True),
                                              ((70, 90), "block", 64, True), ((70, 90), "block", 64, False)]:
        x = _specials(gen, wide(gen, *shape, dtype=torch.bfloat16), granularity)
        for given in (False, True):
            if given and (granularity == "row" or transpose):
                continue
            scale = given_scale(gen, shape, granularity, bs) if given else None
            got = _quantize("v2", x, "e4m3fn", granularity, scale, bs, transpose, programs=4)
            for g, w, what in zip(got, ref_quantize(x, "e4m3fn", granularity, scale, bs, transpose), ("q", "scale", "q_t", "scale_t")):
                assert_bits(g, w, f"{shape} {granularity} given={given} {what}")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_v2_quotients_next_to_every_tie(poisoned, gen: torch.Generator, fmt: str) -> None:
    """x / scale on, or one or two float32 ulps beside, the format's values and the midpoints of
    neighbouring values, for random current scales per row, per block and per tensor (each group
    holds its own amax): where a quotient other than the IEEE division's would change a code."""
    for granularity, x, bs, transpose in tie_cases(gen, fmt):
        got = _quantize("v2", x, fmt, granularity, None, bs, transpose, programs=3)
        for g, w, what in zip(got, ref_quantize(x, fmt, granularity, None, bs, transpose), ("q", "scale", "q_t", "scale_t")):
            assert_bits(g, w, f"{fmt} {granularity} transpose={transpose} {what}")


def test_v2_quotient_is_the_ieee_division() -> None:
    """The v2 kernels' division sequence (hal_triton.fp8._recips and _quot: r_dn + r_lo, one
    Newton remainder, Markstein's correction) in NumPy with an exact float32 FMA, against the IEEE
    quotient bit for bit: 2 million pairs of random scales over [2^-64, 2^64] (mantissas anywhere,
    near 1 and near 2) and numerators chosen to make quotients next to float32 midpoints, over the
    quotient range of every format, and +-0; then quotients below 2^-19 (x down to float32
    subnormals), where no format's code depends on more than the sign: those keep the sign and
    stay below 2^-18."""
    from triton._C.libtriton import interpreter as native

    fma = native.fma_fp32
    f32 = np.float32
    rng = np.random.default_rng(fresh_seed())
    n = 500_000
    bad = 0
    for trial in range(5):
        mant = (rng.integers(0, 2**23, n), rng.integers(0, 2**10, n), 2**23 - 1 - rng.integers(0, 2**10, n), rng.integers(0, 2**23, n),
                rng.integers(0, 2**23, n))[trial]
        s = ((1 + mant / 2**23) * 2.0 ** rng.integers(-64, 64, n)).astype(f32)
        mid = (rng.integers(2**24, 2**25, n) | 1) / 2**24 * 2.0 ** rng.integers(-20, 17, n)  # odd 25-bit: float32 midpoints
        q = mid if trial < 3 else rng.uniform(0, 2**17, n) if trial == 3 else 2.0 ** rng.uniform(-200, -19, n)
        x = (q * s.astype(np.float64)).astype(f32) * np.where(rng.random(n) < 0.5, f32(-1), f32(1))
        x[:100], x[100:200] = f32(0.0), f32(-0.0)
        one = np.ones_like(s)
        with np.errstate(all="ignore"):
            r = (one / s).astype(f32)
            r_dn = np.where(fma(-s, r, one) < 0, (r.view(np.int32) - 1).view(f32), r)
            r_lo = (fma(-s, r_dn, one) * r_dn).astype(f32)
            q0 = fma(x, r_dn, (x * r_lo).astype(f32))
            got = fma(-fma(q0, s, -x), r, q0)
            want = (x / s).astype(f32)
        if trial < 4:
            bad += int((got.view(np.int32) != want.view(np.int32)).sum())
        else:
            bad += int(((np.signbit(got) != np.signbit(want)) | (np.abs(got) >= 2.0**-18)).sum())
    assert bad == 0, f"{bad} quotients differ from the IEEE division"


def test_cast_version_switch() -> None:
    f8 = _f8()
    assert f8.cast_version() in f8.CAST_VERSIONS
    old = f8.set_cast_version("v1")
    try:
        assert f8.cast_version() == "v1"
        with pytest.raises(ValueError, match="unknown FP8 cast version"):
            f8.set_cast_version("v3")
    finally:
        f8.set_cast_version(old)
