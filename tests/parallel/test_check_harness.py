"""The harness of the gloo checks (tests/parallel/test_tensor.py's run_checks, raise_together,
agree): a check that fails on one rank ends the run on every rank with that one cause, instead of
leaving the ranks out of step (the next check's collectives paired with a peer's pending ones:
"scatter_to_parallel ... got rank 0: float32 (2, 8, 32); rank 1: float64 (1, 17, 32)", then a
closed connection, HAL_TEST_SEED=366844190 of test_plan's dp2xtp2); and the bfloat16 bound's
spread of single-process runs."""

from __future__ import annotations

import pytest
import torch

from hal.dist.launch import launch
from tests.parallel.test_tensor import agree, raise_together, run_checks

pytestmark = pytest.mark.timeout(120)


def _one_rank_fails(rank: int, n: int, mid_check: bool) -> dict[str, str]:
    import torch.distributed as dist

    def first() -> None:
        t = torch.ones(4)
        dist.all_reduce(t)
        if mid_check:  # rank 0 leaves before a collective its peers still make
            if rank == 0:
                raise AssertionError("rank 0's own failure")
            dist.all_reduce(torch.ones(2))
        else:  # a comparison that fails on rank 0 only, agreed before anyone leaves
            raise_together(["rank 0's own failure"] if rank == 0 else [], "compare")

    def second() -> None:  # another shape and dtype: paired with first()'s pending call, a mismatch
        dist.all_reduce(torch.ones(3, dtype=torch.float64))

    return run_checks([("first", first), ("second", second), ("third", lambda: None)], timeout_s=60)


@pytest.mark.parametrize("mid_check", [False, True], ids=["agreed", "mid_check"])
def test_a_check_failing_on_one_rank_ends_the_run_on_every_rank(mid_check: bool) -> None:
    # mid_check: rank 1 waits in first()'s second all-reduce until the process group's timeout (5 s)
    results = launch(_one_rank_fails, 2, (mid_check,), timeout_s=90, pg_timeout_s=5.0)
    assert all(r.ok for r in results), [f"{r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    zero, one = results[0].value, results[1].value
    assert set(zero) == {"first", "(not run)"}, zero
    assert "rank 0's own failure" in zero["first"] and "not run: second, third" in zero["(not run)"], zero
    assert "[0, 1]" in zero["(not run)"] or "[0]" in zero["(not run)"], zero
    # rank 1: never the next check's mismatch; first() failed there too (the agreed failure, or its timeout)
    assert "second" not in one and "third" not in one, one
    if not mid_check:
        assert "failed on another rank" in one["first"], one


def test_bf16_bound_scales_with_the_spread_of_single_process_runs() -> None:
    truth = torch.ones(100, dtype=torch.float64)
    want = truth + 0.01  # one single-process run, 0.01 from the truth
    got = truth + 0.05  # 0.05: more than 3 x 0.01 + 2^-8
    with pytest.raises(AssertionError, match="from float32"):
        agree(got, want, truth, torch.bfloat16, "x")
    # another single-process run (its own truth) lands 0.03 away: 0.05 is within 3 x 0.03 + 2^-8
    other_truth = truth * 2
    agree(got, want, truth, torch.bfloat16, "x", runs=[(other_truth * 1.03, other_truth)])
