"""rms_norm_amax and swiglu_amax, and fp8_quantize_from_amax (the cast their amax feeds), the Triton
kernels (as the CUDA plugin registers them) in the Triton interpreter: y bit for bit the plain kernel's (rms_norm's, swiglu's: the same kernel without
the epilogue), y within the op's tolerance of cpu_ref, and the amax exactly ``max |float32(y)|`` of
the y the kernel wrote (torch's own amax of it), reduced across programs by the int32 atomic max:
NaN anywhere wins, an infinity without NaN gives inf, -0.0 gives +0.0. The cast given an amax: bit
for bit fp8_quantize's current scaling where the amax is x's, cpu_ref's for any other amax.

Random data from a fresh seed (printed; HAL_TEST_SEED replays), odd shapes, several programs (the
peak in any of them), the tile and the loop kernel of the norm, every float dtype, outputs allocated
over memory filled with junk first. Run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tests.cuda._support import assert_close, fresh_seed, reference

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's "invalid value" inside the interpreter
]

if os.environ.get("TRITON_INTERPRET") == "1":
    from hal_backend_cuda import plugin
    from hal_triton import norm as triton_norm

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def kern(op: str):
    return next(k.fn for k in plugin.kernels if k.op == op and k.name == "triton")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def poison() -> None:
    """Fill memory the CPU allocator will hand out next with junk (NaN-free bytes): a y the kernel
    failed to write would show it."""
    junk = torch.full((1 << 22,), 0x7E, dtype=torch.uint8)
    del junk


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def torch_amax(y: torch.Tensor) -> torch.Tensor:
    """max |float32(y)| by torch (NaN propagates), 0 for an empty y."""
    y32 = y.float()
    return y32.abs().amax() if y32.numel() else torch.zeros(())


def assert_amax(got: torch.Tensor, y: torch.Tensor, what: str) -> None:
    """The kernel's amax: a 0-d float32, the same bits as torch's amax of the y it wrote (NaN: any NaN)."""
    assert got.dtype == torch.float32 and got.shape == (), f"{what}: amax {got.dtype} {tuple(got.shape)}"
    want = torch_amax(y)
    if bool(want.isnan()):
        assert bool(got.isnan()), f"{what}: amax {float(got)}, want NaN"
        return
    assert got.view(torch.int32) == want.view(torch.int32), f"{what}: amax {float(got)!r}, want {float(want)!r}"


def plant_peak(gen: torch.Generator, x: torch.Tensor, factor: float) -> None:
    """Make one random element (in any program's tile) far larger in magnitude, of a random sign."""
    where = tuple(int(torch.randint(0, s, (), generator=gen)) for s in x.shape)
    sign = 1.0 if bool(torch.rand((), generator=gen) < 0.5) else -1.0
    x[where] = sign * factor * float(x.abs().max())


# --- rms_norm_amax -----------------------------------------------------------------------------


NORM_SHAPES = [((7, 33), True), ((3, 5, 64), True), ((40, 24), False), ((1, 1), True), ((2, 3, 300), True)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rms_norm_amax_tile_kernel(gen: torch.Generator, dtype: torch.dtype) -> None:
    """As the dispatcher calls it: y equal to rms_norm's kernel bit for bit and within tolerance of
    cpu_ref (its amax too), the amax exact against the y written, the peak planted in a random row."""
    for shape, affine in NORM_SHAPES:
        n = shape[-1]
        x = randn(gen, *shape, dtype=dtype, scale=3.0)
        plant_peak(gen, x, 5.0)
        w = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if affine else None
        args = (x, (n,), w, 1e-6)
        poison()
        y, amax = kern("rms_norm_amax")(*args)
        assert torch.equal(y, kern("rms_norm")(*args)), f"{shape} {dtype}: y differs from rms_norm's"
        assert_amax(amax, y, f"{shape} {dtype}")
        want, _ = reference("rms_norm_amax", *args)
        assert_close("rms_norm_amax", y, want[0], args, what="y")
        assert_close("rms_norm_amax", amax, want[1], args, dtype=str(dtype).removeprefix("torch."), what="amax")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("block_m,block_n", [(1, 16), (4, 64), (2, 128)])
def test_rms_norm_amax_loop_and_multi_row_tiles(gen: torch.Generator, dtype: torch.dtype, block_m: int, block_n: int) -> None:
    """The loop kernel (rows longer than block_n, read in chunks) and tiles of several rows, with
    the masked tail of a chunk and of the last tile: the amax of every row, from every program."""
    for m, n in ((9, 100), (5, 37), (3, 129)):
        x = randn(gen, m, n, dtype=dtype)
        plant_peak(gen, x, 7.0)
        w = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
        poison()
        y, amax = triton_norm.norm_forward(x, n, w, None, 1e-6, True, amax=True, block_m=block_m, block_n=block_n, num_warps=1)
        y0 = triton_norm.norm_forward(x, n, w, None, 1e-6, True, block_m=block_m, block_n=block_n, num_warps=1)
        assert torch.equal(y, y0)
        assert_amax(amax, y, f"({m}, {n}) block {block_m}x{block_n}")
        want, _ = reference("rms_norm", x, (n,), w, 1e-6)
        assert_close("rms_norm", y, want, (x, (n,), w, 1e-6))


@pytest.mark.parametrize("block_n", [16, 64])
def test_rms_norm_amax_specials(gen: torch.Generator, block_n: int) -> None:
    """NaN (either sign) in any row makes the amax NaN, -inf makes its row NaN too (inf / inf), an
    all-zero x gives +0.0 (its y is 0, no sign bit), and huge finite rows stay finite."""
    n = 40
    for case in ("nan", "neg_nan", "neg_inf", "zeros", "huge"):
        x = randn(gen, 6, n, dtype=torch.float32)
        if case == "zeros":
            x = torch.zeros_like(x)
        elif case == "huge":
            x[3] = 1e30
        else:
            x.view(-1)[int(torch.randint(0, x.numel(), (), generator=gen))] = {"nan": math.nan, "neg_nan": -math.nan,
                                                                            "neg_inf": -math.inf}[case]
        y, amax = triton_norm.norm_forward(x, n, None, None, 1e-6, True, amax=True, block_m=2, block_n=block_n, num_warps=1)
        assert_amax(amax, y, case)
        if case in ("nan", "neg_nan", "neg_inf"):
            assert bool(amax.isnan())
        elif case == "zeros":
            assert float(amax) == 0.0 and int(amax.view(torch.int32)) == 0
        else:
            assert math.isfinite(float(amax))


def test_rms_norm_amax_of_a_row_of_negative_zeros_is_positive_zero() -> None:
    """-0.0 times the weight is -0.0 in y; its amax is +0.0 (the sign bit masked off)."""
    x = torch.full((3, 8), -0.0)
    y, amax = kern("rms_norm_amax")(x, (8,), torch.ones(8), 1e-6)
    assert bool(torch.signbit(y).all()) and int(amax.view(torch.int32)) == 0


# --- swiglu_amax -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_swiglu_amax_layouts(gen: torch.Generator, dtype: torch.dtype) -> None:
    """Flat dense inputs (contiguous and channels_last, walked as one run), the two halves of a
    packed gate-and-up projection (rows with their own stride), odd sizes: y equal to swiglu's
    kernel, within tolerance of cpu_ref, the amax exact against the y written."""
    cases = []
    g, u = randn(gen, 9, 70, dtype=dtype, scale=4.0), randn(gen, 9, 70, dtype=dtype)
    cases.append((g, u))
    g4, u4 = randn(gen, 2, 5, 3, 7, dtype=dtype), randn(gen, 2, 5, 3, 7, dtype=dtype)
    cases.append((g4.to(memory_format=torch.channels_last), u4.to(memory_format=torch.channels_last)))
    packed = randn(gen, 3, 11, 2 * 48, dtype=dtype, scale=3.0)
    cases.append(packed.chunk(2, dim=-1))
    cases.append((randn(gen, 1001, dtype=dtype), randn(gen, 1001, dtype=dtype)))
    for gate, up in cases:
        plant_peak(gen, gate, 4.0)
        poison()
        y, amax = kern("swiglu_amax")(gate, up)
        assert torch.equal(y, kern("swiglu")(gate, up)), f"{tuple(gate.shape)} {dtype}: y differs from swiglu's"
        assert y.stride() == kern("swiglu")(gate, up).stride()
        assert_amax(amax, y, f"{tuple(gate.shape)} {dtype}")
        want, _ = reference("swiglu_amax", gate, up)
        assert_close("swiglu_amax", y, want[0], (gate, up), what="y")
        assert_close("swiglu_amax", amax, want[1], (gate, up), dtype=str(dtype).removeprefix("torch."), what="amax")


def test_swiglu_amax_specials(gen: torch.Generator) -> None:
    """+inf gate: y = inf * up, amax inf; a -inf gate gives NaN (-inf * sigmoid(-inf) = -inf * 0);
    a NaN gate or up: NaN; all -0.0 gates: y of -0.0 and +0.0, amax +0.0."""
    for case in ("inf", "neg_inf", "nan_gate", "nan_up", "neg_zero"):
        gate, up = randn(gen, 5, 300, dtype=torch.float32), randn(gen, 5, 300, dtype=torch.float32) + 3.0
        i = int(torch.randint(0, gate.numel(), (), generator=gen))
        if case == "inf":
            gate.view(-1)[i] = math.inf
        elif case == "neg_inf":
            gate.view(-1)[i] = -math.inf
        elif case == "nan_gate":
            gate.view(-1)[i] = math.nan
        elif case == "nan_up":
            up.view(-1)[i] = -math.nan
        else:
            gate = torch.full_like(gate, -0.0)
        y, amax = kern("swiglu_amax")(gate, up)
        assert_amax(amax, y, case)
        if case == "inf":
            assert float(amax) == math.inf
        elif case == "neg_zero":
            assert int(amax.view(torch.int32)) == 0
        else:
            assert bool(amax.isnan())


def test_empty_inputs_give_amax_zero() -> None:
    """No program runs: the zeroed word is the amax (the dispatcher answers such calls itself, but the
    kernels do not rely on it)."""
    y, amax = kern("rms_norm_amax")(torch.empty(0, 16), (16,), None, 1e-6)
    assert y.shape == (0, 16) and float(amax) == 0.0
    y, amax = kern("swiglu_amax")(torch.empty(0, 8), torch.empty(0, 8))
    assert y.shape == (0, 8) and float(amax) == 0.0


# --- fp8_quantize_from_amax: the cast given the amax -------------------------------------------


def assert_same_bits(got: torch.Tensor, want, what: str) -> None:
    want = torch.as_tensor(want)
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    if got.dtype == torch.float32:
        got, want = got.view(torch.int32), want.view(torch.int32)
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {got.numel()} differ"


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_quantize_from_amax_is_current_scaling_given_the_amax(gen: torch.Generator, fmt: str, transpose: bool) -> None:
    """With x's own amax: fp8_quantize's current-scaling codes and scale bit for bit (and the
    transposed codes); with any other amax: cpu_ref's codes and scale bit for bit (above, below:
    saturation, 0: scale 1, NaN, inf), over poisoned memory."""
    op = "fp8_quantize_transpose_from_amax" if transpose else "fp8_quantize_from_amax"
    from hal_backend_cpu_ref import fp8 as ref

    for shape in ((19, 37), (2, 21, 34), (3, 1, 5), (70,), ()):
        if transpose and len(shape) < 2:
            continue
        dtype = (torch.float32, torch.bfloat16, torch.float16)[int(torch.randint(0, 3, (), generator=gen))]
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp(2 * torch.randn(shape, generator=gen, dtype=torch.float64))).to(dtype)
        own = torch_amax(x)
        poison()
        got = kern(op)(x, own, fmt)
        plain = kern("fp8_quantize_transpose" if transpose else "fp8_quantize")(x, fmt, "tensor", None, 128)
        names = ("q", "scale", "q_t") if transpose else ("q", "scale")
        assert len(got) == len(names)
        for g, w, what in zip(got, plain, names):
            assert_same_bits(g, w, f"{fmt} {shape} {dtype} {what} against fp8_quantize")
        for given in (3.0 * float(own), 0.25 * float(own), 0.0, math.nan, math.inf):
            amax = torch.tensor(given, dtype=torch.float32)
            got = kern(op)(x, amax, fmt)
            with np.errstate(all="ignore"):
                fn = ref.fp8_quantize_transpose_from_amax if transpose else ref.fp8_quantize_from_amax
                want = fn(x.float().numpy(), amax.numpy(), fmt)
            for g, w, what in zip(got, want, names):
                assert_same_bits(g, torch.from_numpy(np.asarray(w)), f"{fmt} {shape} amax {given} {what}")


def test_norm_then_cast_given_its_amax_equals_the_cast_reducing_it(gen: torch.Generator) -> None:
    """The fused chain of an FP8 linear's input: rms_norm_amax, then the cast given its amax, gives
    the codes, scale and transposed codes of fp8_quantize_transpose (current scaling) of that y;
    the same for swiglu_amax."""
    x = randn(gen, 2, 9, 48, dtype=torch.bfloat16, scale=4.0)
    w = (torch.rand(48, generator=gen, dtype=torch.float64) + 0.5).to(torch.bfloat16)
    y, amax = kern("rms_norm_amax")(x, (48,), w, 1e-6)
    g, u = randn(gen, 2, 9, 48, dtype=torch.bfloat16, scale=3.0), randn(gen, 2, 9, 48, dtype=torch.bfloat16)
    h, h_amax = kern("swiglu_amax")(g, u)
    for t, a in ((y.reshape(-1, 48), amax), (h.reshape(-1, 48), h_amax)):
        got = kern("fp8_quantize_transpose_from_amax")(t, a, "e4m3fn")
        want = kern("fp8_quantize_transpose")(t, "e4m3fn", "tensor", None, 128)
        for gg, ww, what in zip(got, want, ("q", "scale", "q_t")):
            assert_same_bits(gg, ww, what)
