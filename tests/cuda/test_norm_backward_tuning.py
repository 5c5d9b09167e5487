"""The launch candidates of the layer_norm / rms_norm backward and how the autotuner is asked about
them, without a GPU: the first candidate of every table (CUDA, ROCm, the interpreter's) is exactly
the launch the backward used before it was tuned (``rows`` blocks, ``persistent_programs``
programs, no prefetch), so that nothing changes where tuning does not happen; the others prefetch
within the warp limits; a cached choice reads back; small problems are not tuned."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hal_backend_cuda.launch import TABLES as CUDA_TABLES
from hal_backend_rocm.launch import RocmTables
from hal_triton import autotune
from hal_triton.config import NormBwdConfig
from hal_triton.kernels.norm import _backward_bytes

TABLES = {"cuda": CUDA_TABLES, "gfx90a": RocmTables("gfx90a"), "gfx942": RocmTables("gfx942")}
#: (shape, dtype, normalised length) on meta tensors (a GPU's tables without the GPU): the tile kernel, and rows too long for it
CASES = [((32768, 4096), torch.bfloat16, 4096), ((16384, 8192), torch.bfloat16, 8192), ((8192, 2048), torch.bfloat16, 2048),
         ((16384, 4096), torch.float32, 4096), ((7, 3, 1000), torch.float16, 1000), ((64, 32768), torch.float32, 32768)]


def _default(tables, x: torch.Tensor, n: int) -> NormBwdConfig:
    """The backward's launch before it had candidates."""
    return NormBwdConfig(**tables.rows(x, n), programs=tables.persistent_programs(x))


@pytest.mark.parametrize("vendor", list(TABLES))
@pytest.mark.parametrize("shape,dtype,n", CASES)
def test_the_first_candidate_is_the_untuned_launch(vendor, shape, dtype, n) -> None:
    tables = TABLES[vendor]
    x = torch.empty(shape, dtype=dtype, device="meta")
    candidates = tables.norm_backward_candidates(x, n)
    assert candidates[0] == _default(tables, x, n)
    assert len(set(candidates)) == len(candidates)
    if candidates[0].block_n < n:  # the loop kernel: nothing to choose
        assert len(candidates) == 1
        return
    assert len(candidates) > 1
    for c in candidates[1:]:
        assert c.prefetch and c.block_n == candidates[0].block_n and c.num_warps <= 16
        assert c.num_warps * candidates[0].block_m == candidates[0].num_warps * c.block_m, "the same elements a thread"


@pytest.mark.parametrize("n", [20, 32, 37])
def test_cpu_tensors_get_the_interpreters_small_candidates(n) -> None:
    x = torch.empty(5, n)
    for tables in TABLES.values():
        candidates = tables.norm_backward_candidates(x, n)
        assert candidates[0] == _default(tables, x, n)
        assert all(c.block_n <= 32 and c.programs <= 5 for c in candidates)


def test_a_cached_choice_reads_back() -> None:
    best = CUDA_TABLES.norm_backward_candidates(torch.empty(32768, 4096, dtype=torch.bfloat16, device="meta"), 4096)[-1]
    assert best.options, "the NVIDIA prefetching candidates carry a register cap"
    record = json.loads(json.dumps(dataclasses.asdict(best)))
    assert autotune._from_record(NormBwdConfig, record) == best


def test_no_tuning_where_there_is_one_candidate_or_a_small_problem() -> None:
    def never(_):
        raise AssertionError("nothing to time")

    only = NormBwdConfig(1, 4096, 8, 16)
    assert autotune.choose(CUDA_TABLES, torch.device("cuda"), "k", (only,), never, 1e15) is only
    two = (only, dataclasses.replace(only, prefetch=True))
    small = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")  # 1.5 MB moved: about a microsecond
    assert autotune.streaming_work(_backward_bytes(small)) < autotune.MIN_TUNED_FLOPS
    assert autotune.choose(CUDA_TABLES, torch.device("cuda"), "k", two, never, autotune.streaming_work(_backward_bytes(small))) is only
    big = torch.empty(32768, 4096, dtype=torch.bfloat16, device="meta")
    assert autotune.streaming_work(_backward_bytes(big)) > autotune.MIN_TUNED_FLOPS


def test_a_choice_is_remembered_per_device_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The cached choice of a problem is decoded once per process and device: later calls neither
    build the candidates nor read the cache again (the per-call cost of a tuned kernel)."""
    monkeypatch.setenv("HAL_TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(CUDA_TABLES, "slug", lambda device: f"memo-test-{tmp_path.name}")
    monkeypatch.setattr(autotune, "_chosen", {})
    x = torch.empty(32768, 4096, dtype=torch.bfloat16, device="meta")
    candidates = CUDA_TABLES.norm_backward_candidates(x, 4096)
    best = candidates[-1]
    (tmp_path / f"autotune-memo-test-{tmp_path.name}.json").write_text(json.dumps({"choices": {"k": {"config": dataclasses.asdict(best), "ms": 1.0}}}))
    flops = autotune.streaming_work(_backward_bytes(x))
    made = []

    def listed():
        made.append(1)
        return candidates

    def never(_):
        raise AssertionError("a cached problem is not timed")

    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert autotune.choose(CUDA_TABLES, dev0, "k", listed, never, flops) == best
    assert len(made) == 1
    first = autotune.choose(CUDA_TABLES, dev0, "k", listed, never, flops)
    assert first == best and len(made) == 1, "the second call of the problem builds no candidates"
    assert autotune.choose(CUDA_TABLES, dev1, "k", listed, never, flops) == best and len(made) == 2, "another device looks again"
    small = autotune.streaming_work(_backward_bytes(torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")))
    assert autotune.choose(CUDA_TABLES, dev0, "k", listed, never, small) == candidates[0], "a small problem keeps the first"
