"""hal.dist on real gloo process groups: 4 ranks, and 8 ranks as 2 nodes x 4 for hierarchical.

The ranks of one launch run several checks (tests/dist/workers.py) and report each one, so every
check is its own test here while the processes start only once per group size.
"""

from __future__ import annotations

from typing import Any

import pytest

from hal.dist.launch import launch
from tests.dist import workers

pytestmark = pytest.mark.timeout(240)


Outcomes = dict[str, list[tuple[str, float]]]  # check -> (error or '', seconds) per rank


def _launch_checks(world_size: int, names: list[str], seed: int, env: dict[str, str]) -> Outcomes:
    results = launch(workers.run_checks, world_size, (seed, names), env=env, timeout_s=200)
    failed = workers.describe_failures(results)
    assert not failed, f"a rank failed outside the checks (HAL_TEST_SEED={seed}):\n{failed}"
    return {name: [r.value[name] for r in results] for name in names}


@pytest.fixture(scope="module")
def four_ranks(seed: int) -> Outcomes:
    return _launch_checks(4, list(workers.FOUR_RANK_CHECKS), seed, env={})


@pytest.fixture(scope="module")
def eight_ranks(seed: int) -> Outcomes:
    return _launch_checks(8, list(workers.EIGHT_RANK_CHECKS), seed, env={"LOCAL_WORLD_SIZE": "4"})


def _passed(outcomes: Outcomes, name: str, seed: int) -> None:
    print(f"{name}: {max(s for _, s in outcomes[name]):.2f} s on the slowest rank")
    errors = [f"rank {r}:\n{e}" for r, (e, _) in enumerate(outcomes[name]) if e]
    assert not errors, f"check {name} failed (HAL_TEST_SEED={seed}):\n" + "\n".join(errors)


@pytest.mark.parametrize("name", list(workers.FOUR_RANK_CHECKS))
def test_four_ranks(four_ranks: Outcomes, name: str, seed: int) -> None:
    _passed(four_ranks, name, seed)


@pytest.mark.parametrize("name", list(workers.EIGHT_RANK_CHECKS))
def test_eight_ranks_as_two_nodes(eight_ranks: Outcomes, name: str, seed: int) -> None:
    _passed(eight_ranks, name, seed)


def test_conformance_cases_pass_on_four_ranks(seed: int) -> None:
    """Every collective x algorithm x dtype against the NumPy reference (hal conformance --world-size 4)."""
    from hal.conformance import collectives

    records = collectives.run(4, "cpu", seed=seed, quick=True)
    bad = [r for r in records if r["status"] not in ("pass", "skip")]
    assert not bad, f"HAL_TEST_SEED={seed}: " + "\n".join(f"{r['op']}/{r['kernel']}/{r['dtype']}/{r['case']}: {r['status']} {r['reason']}" for r in bad[:20])
    ran = {(r["op"], r["kernel"]) for r in records if r["status"] == "pass"}
    for alg in ("native", "hierarchical", "compressed_fp16", "compressed_bf16"):
        assert ("all_reduce", alg) in ran, f"all_reduce/{alg} never ran"
    for op in ("reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv"):
        assert (op, "native") in ran
    skipped = [r for r in records if r["status"] == "skip"]
    assert all(r["kernel"].startswith("compressed") for r in skipped), skipped[:3]  # only max/min and integers


def _fault(fn: Any, timeout_s: float) -> list[dict[str, Any]]:
    results = launch(fn, 4, (timeout_s,), timeout_s=90, pg_timeout_s=60, wait_ranks=[0, 1, 2], final_barrier=False)
    survivors = results[:3]
    assert all(r.ok for r in survivors), workers.describe_failures(survivors)
    return [r.value for r in survivors]


def test_a_rank_that_dies_raises_hal_errors_on_the_others() -> None:
    for value in _fault(workers.rank_dies, timeout_s=5.0):
        assert value["error"] == "CommError", value
        assert value["seconds"] < 5.0 + 3.0, value
        assert "died, stalled" in value["message"] and "destroy it" in value["message"], value["message"]


def test_a_rank_that_stalls_raises_hal_errors_within_the_timeout() -> None:
    for value in _fault(workers.rank_stalls, timeout_s=2.0):
        assert value["error"] == "CommError", value
        assert 1.5 < value["seconds"] < 2.0 + 3.0, value
