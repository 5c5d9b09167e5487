"""What benchmarks/attacks41.py's parallel class found on 2 real gloo ranks (issue 41, item 8's
re-run): each case failed before its fix. Inputs drawn from the module's seed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hal.dist.launch import launch

pytestmark = pytest.mark.timeout(240)
V = 11


def _outcome(fn: Any) -> dict:
    try:
        value = fn()
    except Exception as exc:  # recorded for the test to judge
        return {"raised": [c.__name__ for c in type(exc).__mro__], "message": f"{type(exc).__name__}: {exc}"}
    return {"raised": [], "value": value}


def _run(rank: int, n: int, seed: int) -> dict:
    import hal.dist as hd
    from hal.parallel import VocabParallelLMHead, vocab_parallel_linear_cross_entropy

    hd.set_timeout(15.0)
    g = torch.Generator().manual_seed(seed)
    full = torch.nn.Linear(5, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        full.weight.copy_(torch.randn(V, 5, generator=g, dtype=torch.float64))
    head = VocabParallelLMHead.from_linear(full)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (6,), generator=g)
    want = float(F.cross_entropy(full(x), target))
    return {
        # rank 1 passes float32 rows: before, rank 1 alone raised "weight_shard must be x's dtype" before the agreement
        # check, rank 0 went into it, and every later checked call paired with the peer's next one (out of step)
        "x_dtype_differs": _outcome(lambda: float(head(x.float() if rank else x, target))),
        "loss_after": _outcome(lambda: abs(float(head(x, target)) - want)),
        "function_after": _outcome(lambda: abs(float(vocab_parallel_linear_cross_entropy(x, head.weight, target, vocab_size=V)) - want)),
        # before: a (1, 6) target for (6, 5) rows was flattened and taken; F.cross_entropy raises
        "target_shape": _outcome(lambda: float(head(x, target[None]))),
        "target_shape_none": _outcome(lambda: tuple(VocabParallelLMHead.from_linear(full, reduction="none")(x[None], target).shape)),
        "last": _outcome(lambda: abs(float(head(x, target)) - want)),
    }


@pytest.fixture(scope="module")
def outcomes(seed: int) -> list[dict]:
    results = launch(_run, 2, (seed,), timeout_s=200)
    assert all(r.ok for r in results), [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results]
    return [r.value for r in results]


def test_x_dtype_differing_across_ranks_is_one_error_on_every_rank_and_the_group_stays_in_step(outcomes: list) -> None:
    for rank in (0, 1):
        got = outcomes[rank]["x_dtype_differs"]
        assert "InvalidArgumentError" in got["raised"], got
        assert "argument 'x' must be the same dtype and shape on every rank" in got["message"], got["message"]
        assert "rank 0: float64 (6, 5); rank 1: float32 (6, 5)" in got["message"], got["message"]
        for case in ("loss_after", "function_after", "last"):
            assert not outcomes[rank][case]["raised"], outcomes[rank][case]
            assert outcomes[rank][case]["value"] < 1e-12, (case, outcomes[rank][case])
    assert outcomes[0]["x_dtype_differs"]["message"] == outcomes[1]["x_dtype_differs"]["message"]


def test_lm_head_refuses_a_target_not_of_xs_leading_shape(outcomes: list) -> None:
    with pytest.raises(ValueError):  # torch's own behaviour for the same shapes
        F.cross_entropy(torch.randn(6, 5), torch.zeros(1, 6, dtype=torch.long))
    for rank in (0, 1):
        for case, shape in (("target_shape", "(1, 6)"), ("target_shape_none", "(6,)")):
            got = outcomes[rank][case]
            assert "InvalidArgumentError" in got["raised"] and "ValueError" in got["raised"], got
            assert "VocabParallelLMHead: argument 'target' must be a tensor of x's leading shape" in got["message"], got
            assert f"got ranks 0, 1: shape {shape}" in got["message"], got  # every rank, naming what each passed
