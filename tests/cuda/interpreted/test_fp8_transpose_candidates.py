"""The FP8 casts that also write the transpose (hal_triton.fp8) in every launch the plugins' tables
offer the autotuner (``fp8_transpose_candidates``), in the Triton interpreter, and how the kit asks
the autotuner about them.

Each tile of the CUDA and ROCm candidates at Llama-3-8B's shapes gives q, q_t, the scales and the
amax bit for bit those of the launch the casts used before they had candidates (no ``pick``: the
``elementwise`` tile), and cpu_ref's, in every transposed mode (per tensor with current, given and
reduced-amax scales and from a given amax; row-wise current scaling with its amax pass; given block
scales), for bfloat16, float16 and float32 inputs in an OCP and an FNUZ format, on ragged and batched shapes,
with every output the call allocates poisoned first (codes set to the format's NaN, scales to NaN:
the inputs hold neither, so an element a tile leaves unwritten shows). The interpreter ignores
``num_warps``, so each tile shape runs once.

Then the wiring: each transposed op of the CUDA plugin consults :func:`hal_triton.autotune.choose`
once, with a key naming the mode, format, dtype, M and K, the plugin's candidates (today's launch
first) and the bytes the cast moves, and runs the launch it returns; the chooser here runs every
GPU candidate twice on the call's own inputs first, as timing does, so the results also prove a
repeated cast changes nothing (the amax word maxed again, fresh zeroed words for the row amax).
Run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

from hal.conformance.poison import filled_empties
from tests.cuda._support import assert_bits, fresh_seed

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's "invalid value" inside the interpreter
]

if os.environ.get("TRITON_INTERPRET") == "1":
    from hal_backend_cpu_ref import fp8 as ref
    from hal_backend_cuda import plugin
    from hal_backend_cuda.launch import TABLES as CUDA_TABLES
    from hal_backend_rocm.launch import RocmTables
    from hal_triton import autotune
    from hal_triton import fp8 as f8
    from hal_triton.config import Fp8TransposeConfig, next_pow2
    from hal_triton.tables import INTERPRETER

from hal.ops.fp8 import FORMATS, scale_shape  # noqa: E402

#: the (M, K) the tables are asked about: the bf16 arrays of a Llama-3-8B layer's FP8 casts
TABLE_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
#: ragged shapes (neither side a multiple of 16 or of a tile) and batched ones, with their input dtype
SHAPES = (((67, 130), torch.bfloat16), ((2, 45, 70), torch.float16), ((130, 67), torch.float32), ((3, 20, 9), torch.bfloat16))
#: the transposed modes of hal_triton.fp8
MODES = ("tensor current", "tensor given", "tensor amax", "from amax", "rows current", "blocks given")
#: block size of the given block scales: not a power of two, not dividing any tile
BLOCK = 24


def table_candidates() -> list["Fp8TransposeConfig"]:
    """Every candidate of the CUDA and ROCm tables at the table shapes."""
    out: list[Fp8TransposeConfig] = []
    for shape in TABLE_SHAPES:
        x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        for tables in (CUDA_TABLES, RocmTables("gfx90a"), RocmTables("gfx942")):
            out += tables.fp8_transpose_candidates(x, *shape)
    return list(dict.fromkeys(out))


def tiles() -> list[tuple[int, int]]:
    """What of a candidate changes the kernel in the interpreter: (block_r, block_c)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    return sorted({(c.block_r, c.block_c) for c in table_candidates()})


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def wide(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Normal values over a wide range of magnitudes, signs mixed, a -0.0 and a zero row and column."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp(3.0 * torch.randn(shape, generator=gen, dtype=torch.float64))
    x = x.to(dtype)
    x[..., 1, :] = 0
    x[..., :, 2] = 0
    x.view(-1)[5] = -0.0
    return x


def poisoned(fmt: str):
    """torch.empty / torch.empty_like fill what they return while inside: uint8 with the format's
    NaN code, floats with NaN (torch.zeros, for the amax words, stays as it is)."""
    code = 0x80 if FORMATS[fmt].fnuz else 0x7F
    return filled_empties(lambda t: t.fill_(code) if t.dtype == torch.uint8 else t.fill_(float("nan")) if t.is_floating_point() else t)


def given(gen: torch.Generator, shape: tuple[int, ...], granularity: str) -> torch.Tensor:
    return (torch.rand(scale_shape(shape, granularity, BLOCK), generator=gen) * 2 + 0.01).float()


def cast(mode: str, x: torch.Tensor, fmt: str, scales: dict[str, torch.Tensor], pick: Optional[Callable]) -> tuple:
    """The host function of ``mode`` (emulated cast, the interpreter's elementwise tile unless ``pick``)."""
    tile = INTERPRETER.elementwise
    if mode == "tensor amax":
        return f8.quantize_amax(x, fmt, scales["tensor"], True, False, **tile, pick=pick)
    if mode == "from amax":
        return f8.quantize_from_amax(x, fmt, x.float().abs().amax(), True, False, **tile, pick=pick)
    granularity, scale = {"tensor current": ("tensor", None), "tensor given": ("tensor", scales["tensor"]),
                          "rows current": ("row", None), "blocks given": ("block", scales["block"])}[mode]
    return f8.quantize(x, fmt, granularity, scale, BLOCK, True, False, **tile, pick=pick)


def reference(mode: str, x: torch.Tensor, fmt: str, scales: dict[str, torch.Tensor]) -> tuple:
    """cpu_ref's results of ``mode`` (on float32 values: exact for every input dtype)."""
    xs = x.float().numpy()
    with np.errstate(all="ignore"):
        if mode == "tensor amax":
            return ref.fp8_quantize_transpose_amax(xs, scales["tensor"].numpy(), fmt)
        if mode == "from amax":
            return ref.fp8_quantize_transpose_from_amax(xs, np.abs(xs).max(), fmt)
        granularity, scale = {"tensor current": ("tensor", None), "tensor given": ("tensor", scales["tensor"].numpy()),
                              "rows current": ("row", None), "blocks given": ("block", scales["block"].numpy())}[mode]
        return ref.fp8_quantize_transpose(xs, fmt, granularity, scale, BLOCK)


def fixed(tile: "Fp8TransposeConfig") -> Callable[[str, Any, int], "Fp8TransposeConfig"]:
    """A pick that always answers ``tile``."""
    return lambda key, run, nbytes: tile


#: the tiles move codes, whatever their format (tests/cuda/interpreted/test_fp8.py checks every
#: format's encoding): one OCP and one FNUZ format, the two NaN and saturation conventions, and the
#: two exponent widths, at half the interpreter's time of all four (the suite's budget)
TILE_FORMATS = ("e4m3fn", "e5m2fnuz")


@pytest.mark.parametrize("fmt", TILE_FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_every_candidate_tile_writes_todays_codes(gen: torch.Generator, mode: str, fmt: str) -> None:
    for shape, dtype in SHAPES:
        x = wide(gen, shape, dtype)
        scales = {g: given(gen, shape, g) for g in ("tensor", "block")}
        with poisoned(fmt):
            today = cast(mode, x, fmt, scales, None)
        for got, want, what in zip(today, reference(mode, x, fmt, scales), ("q", "scale", "q_t", "scale_t or amax")):
            assert_bits(got, want, f"{mode} {fmt} {shape} {dtype}, today's launch, {what} against cpu_ref")
        for block_r, block_c in tiles():
            with poisoned(fmt):
                got = cast(mode, x, fmt, scales, fixed(Fp8TransposeConfig(block_r, block_c, 4)))
            assert len(got) == len(today)
            for g, t, what in zip(got, today, ("q", "scale", "q_t", "scale_t or amax")):
                assert_bits(g, t.numpy(), f"{mode} {fmt} {shape} {dtype}, tile {block_r}x{block_c}, {what}")


def test_the_tables_offer_larger_tiles_at_the_8b_shapes() -> None:
    """The candidates exercised above: today's 64 x 64 and tiles of 128 rows and of 128 columns."""
    assert {(64, 64), (128, 128), (64, 128), (128, 64), (32, 128)} <= set(tiles())


# --- the kit's wiring: autotune.choose consulted, every candidate run repeatedly --------------------

#: (op, arguments after x, mode name in the key, x read per run), for x of shape s and format f
OPS: list[tuple[str, Callable[[torch.Tensor, dict, str], tuple], Optional[str], int]] = [
    ("fp8_quantize_transpose", lambda x, s, f: (x, f, "tensor", None, BLOCK), "tensor_amax", 1),
    ("fp8_quantize_transpose", lambda x, s, f: (x, f, "tensor", s["tensor"], BLOCK), "tensor", 1),
    ("fp8_quantize_transpose", lambda x, s, f: (x, f, "row", None, BLOCK), "rows_cols", 2),
    ("fp8_quantize_transpose", lambda x, s, f: (x, f, "block", s["block"], BLOCK), "blocks", 1),
    ("fp8_quantize_transpose", lambda x, s, f: (x, f, "block", None, BLOCK), None, 1),  # fp8_blocks_kernel: its one launch
    ("fp8_quantize_transpose_amax", lambda x, s, f: (x, s["tensor"], f), "tensor+amax", 1),
    ("fp8_quantize_transpose_from_amax", lambda x, s, f: (x, x.float().abs().amax(), f), "tensor_amax", 1),
    ("fp8_quantize", lambda x, s, f: (x, f, "tensor", None, BLOCK), None, 1),  # no transpose: nothing to choose
]


def kern(op: str):
    return next(k.fn for k in plugin.kernels if k.op == op and k.name == "triton")


def cpu_ref(op: str, x: torch.Tensor, args: tuple) -> tuple:
    """cpu_ref's results of the op on float32 values of the same arguments."""
    conv = [a.float().numpy() if isinstance(a, torch.Tensor) else a for a in args]
    with np.errstate(all="ignore"):
        return getattr(ref, op)(*conv)


@pytest.mark.parametrize("case", range(len(OPS)), ids=[f"{o[0]}-{o[2] or 'untuned'}" for o in OPS])
def test_the_transposed_casts_ask_the_autotuner(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, case: int) -> None:
    op, args_of, mode, reads = OPS[case]
    fmt = ("e4m3fn", "e5m2")[case % 2]
    shape, dtype = (3, 67, 130), torch.bfloat16
    x = wide(gen, shape, dtype)
    scales = {g: given(gen, shape, g) for g in ("tensor", "block")}
    gpu = CUDA_TABLES.fp8_transpose_candidates(torch.empty(4096, 4096, dtype=dtype, device="meta"), 4096, 4096)
    calls: list[dict[str, Any]] = []
    launched: list[tuple[int, int, int]] = []
    launch = f8.launch

    def recording_launch(kernel, grid, *args, **kw):
        if kernel is f8.fp8_encode_kernel:
            launched.append((kw["BLOCK_R"], kw["BLOCK_C"], kw["num_warps"]))
        return launch(kernel, grid, *args, **kw)

    def choose(tables, device, key, candidates, run, flops):
        listed = candidates() if callable(candidates) else candidates  # the sequence, or a function making it
        calls.append(dict(device=device, key=key, candidates=tuple(listed), flops=flops))
        for cand in gpu:  # as timing does: each candidate, more than once, on the call's own inputs
            run(cand)
            run(cand)
        return gpu[-1]

    monkeypatch.setattr(autotune, "choose", choose)
    monkeypatch.setattr(f8, "launch", recording_launch)
    args = args_of(x, scales, fmt)
    with poisoned(fmt):
        got = kern(op)(*args)
    want = cpu_ref(op, x, args)
    assert len(got) == len(want)
    for g, w, i in zip(got, want, range(len(want))):
        assert_bits(g, w, f"{op} {mode} result {i}")
    if mode is None:
        assert calls == [], f"{op} {args[2:]}: no transposed fp8_encode_kernel launch, nothing to choose"
        return
    (call,) = calls
    assert call["device"] == x.device and call["candidates"] == CUDA_TABLES.fp8_transpose_candidates(x, 67, 130)
    assert call["candidates"][0] == Fp8TransposeConfig(*f8._tile_shape(130, INTERPRETER.elementwise["block_elems"], True),
                                                       INTERPRETER.elementwise["num_warps"]), "today's launch first"
    key = call["key"]
    for part in (f"/{mode}/", f"/{fmt}/", str(dtype), f"/m{next_pow2(67)}/", "/k130", "/b4/", "/sw/"):
        assert part in key, f"{part!r} not in the key {key!r}"
    assert call["flops"] == autotune.streaming_work((reads * x.element_size() + 2) * x.numel())
    assert launched[-1] == (gpu[-1].block_r, gpu[-1].block_c, gpu[-1].num_warps), "the chosen launch runs last"
    assert len(launched) == 2 * len(gpu) + 1


def test_keys_tell_the_modes_formats_and_shapes_apart() -> None:
    x = torch.empty(4, 96, 160, dtype=torch.bfloat16)
    keys = {f8._transpose_key(x, 4, 96, 160, fmt, mode, hw, amax)
            for fmt in ("e4m3fn", "e5m2") for mode in (f8.S_TENSOR, f8.S_TENSOR_AMAX, f8.S_ROW_AMAX, f8.S_BLOCK)
            for hw in (False, True) for amax in (False, True)}
    assert len(keys) == 2 * 4 * 2 * 2
    assert f8._transpose_key(x, 4, 96, 160, "e4m3fn", 0, True) != f8._transpose_key(x, 4, 96, 161, "e4m3fn", 0, True)
    assert f8._transpose_key(x, 4, 96, 160, "e4m3fn", 0, True) != f8._transpose_key(x.float(), 4, 96, 160, "e4m3fn", 0, True)
    assert f8._transpose_key(x, 4, 96, 160, "e4m3fn", 0, True) != f8._transpose_key(x, 4, 300, 160, "e4m3fn", 0, True)
