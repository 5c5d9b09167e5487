"""hal.dist pieces that need no process group: settings, the cost model, the scale, the checks' logic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hal
import hal.dist as hd
from hal.dist import bench, checks, compressed, settings
from hal.dist.algorithms import REGISTRY, Call
from hal.dist.groups import GroupInfo


def _group(n: int, per_node: int = 0) -> GroupInfo:
    nodes = tuple(tuple(range(i, i + per_node)) for i in range(0, n, per_node)) if per_node else (tuple(range(n)),)
    return GroupInfo(None, 0, n, tuple(range(n)), "gloo", nodes, topology_known=bool(per_node))


def test_explain_without_a_process_group_says_how_to_start_one() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    with pytest.raises(hal.BackendUnavailableError, match="init_process_group"):
        hal.explain("all_reduce", torch.ones(3))
    with pytest.raises(hal.BackendUnavailableError, match="init_process_group"):
        hd.all_gather(torch.ones(3))


def test_cost_model_ranks_algorithms_by_the_links() -> None:
    t = torch.empty(16 << 20)  # 64 MiB of fp32
    call = Call("all_reduce", t, _group(8, per_node=4), op="sum")
    cost = {name: alg.cost for name, alg in REGISTRY["all_reduce"].items()}
    try:
        hd.set_cost_model("gloo", gbps_inter=0.1, gbps_intra=10.0)  # slow network between nodes
        model = hd.cost_model("gloo")
        assert cost["hierarchical"](call, model) < cost["native"](call, model)
        hd.set_cost_model("gloo", gbps_inter=10.0)  # a node's network as fast as one rank's link: no gain
        model = hd.cost_model("gloo")
        assert cost["native"](call, model) < cost["hierarchical"](call, model)
        hd.set_cost_model("gloo", gbps_inter=0.1, topology_aware_native=True)  # NCCL-like native
        model = hd.cost_model("gloo")
        assert cost["native"](call, model) < cost["hierarchical"](call, model)
        hd.set_cost_model("gloo", gbps_inter=0.1, compress_gbps=1000.0, topology_aware_native=False)  # slow wire, free compression
        model = hd.cost_model("gloo")
        assert cost["compressed_bf16"](call, model) < 0.6 * cost["native"](call, model)
        half = Call("all_reduce", torch.empty(16 << 20, dtype=torch.float16), _group(8, per_node=4), op="sum")
        assert cost["compressed_bf16"](half, model) > cost["native"](half, model)  # 16-bit input: nothing saved
    finally:
        hd.reset_cost_model()
    assert hd.cost_model("gloo") == hd.cost.DEFAULTS["gloo"]


def test_capability_reasons_are_sentences() -> None:
    ints = Call("all_reduce", torch.empty(4, dtype=torch.int32), _group(4), op="max")
    reasons = REGISTRY["all_reduce"]["compressed_fp16"].reasons(ints)
    assert any("only sum and avg" in r for r in reasons) and any("floating-point" in r for r in reasons)
    for layout, words in [(_group(4), "node layout is unknown"), (_group(4, per_node=4), "one node"), (_group(4, per_node=1), "one rank per node")]:
        why = REGISTRY["all_reduce"]["hierarchical"].reasons(Call("all_reduce", torch.empty(4), layout, op="sum"))
        assert len(why) == 1 and words in why[0], why
    uneven = GroupInfo(None, 0, 5, tuple(range(5)), "gloo", ((0, 1, 2), (3, 4)), True)
    assert "different numbers" in REGISTRY["all_reduce"]["hierarchical"].reasons(Call("all_reduce", torch.empty(4), uneven, op="sum"))[0]


def test_settings_validate_and_read_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (lambda: hd.set_timeout(-1), lambda: hd.set_topology(0), lambda: hd.set_cost_model(gbps_intra=0)):
        with pytest.raises(hal.InvalidArgumentError):
            bad()
    with pytest.raises(hal.InvalidArgumentError, match="one of"):
        hd.comm_hook("ring")
    monkeypatch.setenv("HAL_DIST_TIMEOUT", "7.5")
    monkeypatch.setenv("HAL_DIST_CHECK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    settings.refresh()
    try:
        assert settings.timeout() == 7.5 and settings.debug() and settings.ranks_per_node() == 4
        monkeypatch.setenv("HAL_DIST_TIMEOUT", "2")
        assert settings.timeout() == 7.5  # cached until refresh()
        hd.set_timeout(1.0)
        hd.set_topology(8)
        assert settings.timeout() == 1.0 and settings.ranks_per_node() == 8  # code beats the environment
    finally:
        hd.set_timeout(None)
        hd.set_topology(None)
        monkeypatch.delenv("HAL_DIST_TIMEOUT")
        monkeypatch.delenv("HAL_DIST_CHECK")
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        settings.refresh()
    assert settings.timeout() is None and not settings.debug()


def test_fp16_prescale_is_the_largest_safe_power_of_two() -> None:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(1, 1025))
        amax = float(rng.uniform(0.5, 1.0) * 2.0 ** int(rng.integers(-60, 60)))
        k = int(compressed.fp16_scale_exponent(torch.tensor([amax], dtype=torch.float32), n))
        scaled = n * float(np.float32(amax)) * 2.0**k
        assert 2.0**14 <= scaled < 2.0**15, (seed, n, amax, k)  # fits, and not more than 2x below the limit
    for bad in (math.inf, math.nan):
        assert int(compressed.fp16_scale_exponent(torch.tensor([bad]), 4)) == 0
    assert int(compressed.fp16_scale_exponent(torch.tensor([1e-40]), 4)) == 126  # clamped: stays finite


def _row(call: Call, algorithm: str = "native") -> list[int]:
    return checks.signature(call, algorithm)


def test_cross_rank_check_names_what_each_rank_passed() -> None:
    gi = _group(4)
    rows = [_row(Call("all_reduce", torch.empty(4, 8), gi, op="sum")) for _ in range(3)]
    rows.append(_row(Call("all_reduce", torch.empty(4, 9), gi, op="sum")))
    err = checks.compare(Call("all_reduce", torch.empty(4, 8), gi, op="sum"), rows)
    assert err is not None and "ranks 0-2: float32 (4, 8); rank 3: float32 (4, 9)" in str(err), err
    same = [_row(Call("all_reduce", torch.empty(4, 8), gi, op="sum")) for _ in range(4)]
    assert checks.compare(Call("all_reduce", torch.empty(4, 8), gi, op="sum"), same) is None
    algs = [_row(Call("all_reduce", torch.empty(4), gi, op="sum"), a) for a in ("native", "native", "hierarchical", "native")]
    assert "'algorithm'" in str(checks.compare(Call("all_reduce", torch.empty(4), gi, op="sum"), algs))
    # all_to_all: rows may differ, split sizes must match between sender and receiver
    send = [[1, 2, 0, 1], [0, 0, 3, 1], [2, 2, 2, 2], [1, 1, 1, 1]]
    recv = [[send[src][dst] for src in range(4)] for dst in range(4)]
    calls = [Call("all_to_all", torch.empty(sum(send[r]), 3), gi, input_splits=send[r], output_splits=recv[r]) for r in range(4)]
    assert checks.compare(calls[0], [_row(c) for c in calls]) is None
    recv[2][1] = 5
    calls[2] = Call("all_to_all", torch.empty(sum(send[2]), 3), gi, input_splits=send[2], output_splits=recv[2])
    err = checks.compare(calls[0], [_row(c) for c in calls])
    assert err is not None and "on rank 2, entry 1" in str(err), err


@pytest.mark.parametrize("argv, expected", [
    (["--world-size", "0"], "--world-size 0: give 1 or more"),
    (["--step-factor", "1"], "--step-factor 1.0: give a factor above 1"),
    (["--dtype", "float7"], "--dtype float7: give a torch dtype name such as float32 or bfloat16"),
    (["--collective-ops", "all_reduce,al_gather"], "unknown collective op 'al_gather' (did you mean 'all_gather'?)"),
])
def test_bench_module_refuses_bad_options_before_any_rank_starts(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    """``python -m hal.dist.bench`` checked none of its options (``hal bench --collectives`` did):
    --world-size 0 ended in an IndexError, --step-factor 1 never ended, --dtype float7 failed in
    every rank. Now the same check: one line, exit status 2, nothing run."""
    assert bench.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("python -m hal.dist.bench: ") and expected in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1, out.err


def test_bench_sizes_and_factors() -> None:
    assert bench.parse_bytes("8") == 8 and bench.parse_bytes("64K") == 65536 and bench.parse_bytes("256M") == 256 << 20
    assert bench.sizes(8, 256 << 20, 4)[-1] == 256 << 20 and bench.sizes(8, 32, 2) == [8, 16, 32]
    assert bench.busbw_factor("all_reduce", 4) == 1.5 and bench.busbw_factor("all_gather", 4) == 0.75
