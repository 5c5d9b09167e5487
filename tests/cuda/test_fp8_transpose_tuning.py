"""The launch candidates of the FP8 casts that also write the transpose and how the autotuner is asked
about them, without a GPU: the first candidate of every table (CUDA, ROCm, the interpreter's, the
protocol's default) is exactly the launch those casts used before they had candidates (the
``elementwise`` tile of ``_tile_shape(k, block_elems, transpose=True)`` over its warps), so that
nothing changes where tuning does not happen; the others are few, larger, and fit the array; every
one the tables offer is compiled ahead of time (hal_triton.aot); a cached choice reads back; small
casts are not tuned, Llama-3-8B's are. Each candidate's codes are checked in the interpreter
(tests/cuda/interpreted/test_fp8_transpose_candidates.py, with the kit's call of the autotuner)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from hal_backend_cuda.launch import TABLES as CUDA_TABLES
from hal_backend_rocm.launch import RocmTables
from hal_triton import aot, autotune
from hal_triton.config import Fp8TransposeConfig, next_pow2
from hal_triton.fp8 import _cast_bytes, _tile_shape
from hal_triton.tables import INTERPRETER, LaunchTables

TABLES = {"cuda": CUDA_TABLES, "gfx90a": RocmTables("gfx90a"), "gfx942": RocmTables("gfx942")}
#: Llama-3-8B's FP8 casts (bf16 activations and weights), a float32 one, and small, ragged and batched arrays
BIG = [((4096, 4096), torch.bfloat16), ((4096, 14336), torch.bfloat16), ((14336, 4096), torch.bfloat16)]
CASES = [*BIG, ((4096, 4096), torch.float32), ((8, 512, 4096), torch.bfloat16), ((67, 130), torch.bfloat16), ((3, 20, 9), torch.float16),
         ((2048, 16), torch.float32), ((1, 4096), torch.bfloat16)]
#: at most this many candidates (each costs a compilation on a device's first call of a problem)
MOST = 8


def _default(tables, x: torch.Tensor) -> Fp8TransposeConfig:
    """The transposed casts' launch before they had candidates."""
    e = tables.elementwise(x)
    return Fp8TransposeConfig(*_tile_shape(int(x.shape[-1]), e["block_elems"], transpose=True), e["num_warps"])


def _mk(x: torch.Tensor) -> tuple[int, int]:
    return int(x.shape[-2]), int(x.shape[-1])


@pytest.mark.parametrize("vendor", list(TABLES))
@pytest.mark.parametrize("shape,dtype", CASES)
def test_the_first_candidate_is_the_untuned_launch(vendor, shape, dtype) -> None:
    tables = TABLES[vendor]
    x = torch.empty(shape, dtype=dtype, device="meta")
    m, k = _mk(x)
    candidates = tables.fp8_transpose_candidates(x, m, k)
    assert candidates[0] == _default(tables, x)
    assert len(set(candidates)) == len(candidates) <= MOST
    for c in candidates:
        assert all(v >= 16 and v == next_pow2(v) for v in (c.block_r, c.block_c)), c
        assert c.num_warps in (4, 8, 16), c
    for c in candidates[1:]:
        assert c.block_r <= next_pow2(m) and c.block_c <= next_pow2(k), f"{c} is mostly masked off on {shape}"


@pytest.mark.parametrize("vendor", list(TABLES))
@pytest.mark.parametrize("shape,dtype", BIG)
def test_larger_tiles_are_offered_for_llama_8b(vendor, shape, dtype) -> None:
    x = torch.empty(shape, dtype=dtype, device="meta")
    candidates = TABLES[vendor].fp8_transpose_candidates(x, *_mk(x))
    assert candidates[0] == Fp8TransposeConfig(64, 64, 8 if vendor == "cuda" else 4), "today's 64 x 64 tile (4096 elements)"
    assert len(candidates) >= 4
    assert any(c.block_c == 128 for c in candidates) and any(c.block_r == 128 for c in candidates)
    assert Fp8TransposeConfig(128, 128, 8) in candidates


@pytest.mark.parametrize("shape", [(5, 40), (3, 67, 130), (4096, 4096)])
def test_cpu_tensors_and_the_protocols_default_get_todays_launch_only(shape) -> None:
    x = torch.empty(shape)
    for tables in TABLES.values():
        assert tables.fp8_transpose_candidates(x, *_mk(x)) == (_default(tables, x),)
        assert _default(tables, x) == Fp8TransposeConfig(*_tile_shape(shape[-1], INTERPRETER.elementwise["block_elems"], True), 4)
    big = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    for tables in TABLES.values():  # a plugin that declares no tiles: today's launch alone
        bare = copy.copy(tables)
        bare.fp8_transpose_tiles = LaunchTables.fp8_transpose_tiles
        assert bare.fp8_transpose_candidates(big, *_mk(big)) == (_default(tables, big),)


def test_every_candidate_is_compiled_ahead_of_time() -> None:
    """Each tile the tables offer at any of the cases (and warps) is an AOT spec of the transposed
    encode, and of the amax pass before the row-wise cast, for each vendor's targets."""
    encode, amax = set(), set()
    for spec in aot.specs():
        p, warps = dict(spec.params), dict(spec.options).get("num_warps", 4)
        if spec.kernel == "fp8_encode_kernel" and p["TRANSPOSE"]:
            encode.add((p["BLOCK_R"], p["BLOCK_C"], warps, spec.fp8))
        if spec.kernel == "fp8_amax_kernel" and p["MODE"] == 1:
            amax.add((p["BLOCK_R"], p["BLOCK_C"], warps))
    for vendor, tables in TABLES.items():
        hw = "ocp" if vendor == "cuda" else ("fnuz" if vendor == "gfx942" else "")
        for shape, dtype in CASES:
            x = torch.empty(shape, dtype=dtype, device="meta")
            for c in tables.fp8_transpose_candidates(x, *_mk(x))[1:]:
                assert (c.block_r, c.block_c, c.num_warps) in amax, f"{vendor} {c}: no AOT spec of fp8_amax_kernel"
                if hw:
                    assert (c.block_r, c.block_c, c.num_warps, hw) in encode, f"{vendor} {c}: no AOT spec of the hardware cast"


def test_a_cached_choice_reads_back() -> None:
    best = CUDA_TABLES.fp8_transpose_candidates(torch.empty(4096, 14336, dtype=torch.bfloat16, device="meta"), 4096, 14336)[-1]
    record = json.loads(json.dumps(dataclasses.asdict(best)))
    assert autotune._from_record(Fp8TransposeConfig, record) == best


def test_no_tuning_where_there_is_one_candidate_or_a_small_cast() -> None:
    def never(_):
        raise AssertionError("nothing to time")

    only = Fp8TransposeConfig(64, 64, 8)
    assert autotune.choose(CUDA_TABLES, torch.device("cuda", 0), "k", (only,), never, 1e15) is only
    two = (only, Fp8TransposeConfig(128, 128, 8))
    small = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta")  # 4 MB moved: about a microsecond
    assert autotune.streaming_work(_cast_bytes(small)) < autotune.MIN_TUNED_FLOPS
    assert autotune.choose(CUDA_TABLES, torch.device("cuda", 0), "k", two, never, autotune.streaming_work(_cast_bytes(small))) is only
    assert autotune.choose(CUDA_TABLES, torch.device("cpu"), "k", two, never, 1e15) is only
    for shape, dtype in BIG:
        assert autotune.streaming_work(_cast_bytes(torch.empty(shape, dtype=dtype, device="meta"))) > autotune.MIN_TUNED_FLOPS
