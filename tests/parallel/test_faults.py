"""A rank killed or stalled in the middle of a parallel layer's step: the others raise hal.dist.CommError
within the hal.dist timeout (the process group's own timeout is 60 s), never hang.

Four groups of 4 gloo ranks: the expert-parallel MoE layer (the last rank dies between forward and
backward; the last rank stalls there, with the chunked overlap on), and a 4-stage 1F1B pipeline (the
last stage's rank dies, or stalls, inside its second microbatch's forward of the second step).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest
import torch

from hal.dist.launch import launch

#: numba's parallel kernels (hal's CPU backend) in every rank would oversubscribe the cores: one thread each
ONE_THREAD = {"NUMBA_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(240)

SLACK_S = 5.0  # start-up of the failing call, the cascade to the ranks that wait on the waiters, a loaded CI machine


def _outcome(started: float, fn: Callable[[], Any]) -> dict[str, Any]:
    import hal

    try:
        fn()
    except hal.HalError as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - started, "message": str(exc)}
    return {"error": None, "seconds": time.monotonic() - started, "message": ""}


def _fail(how: str) -> None:
    if how == "dies":
        os._exit(3)
    time.sleep(120)


def moe_fault(rank: int, n: int, timeout_s: float, how: str, chunks: int) -> dict[str, Any]:
    """One good step of the MoE layer, then the last rank dies or stalls between forward and backward."""
    import torch.distributed as dist

    import hal.dist as hd
    from hal.parallel.expert import ExpertParallelMoE

    hd.set_timeout(timeout_s)
    layer = ExpertParallelMoE(8, 12, 2 * n, group=dist.group.WORLD, overlap_chunks=chunks, seed=1)
    x = torch.randn(10 + rank, 8, generator=torch.Generator().manual_seed(rank))
    (layer(x).sum() + layer.aux_loss).backward()
    y = layer(x)
    if rank == n - 1:
        _fail(how)
    started = time.monotonic()
    return _outcome(started, lambda: (y.sum() + layer.aux_loss).backward())


class _Trap(torch.nn.Module):
    """The identity, until armed: then its second call dies or stalls."""

    def __init__(self) -> None:
        super().__init__()
        self.how, self.calls = "", 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how:
            self.calls += 1
            if self.calls == 2:
                _fail(self.how)
        return x


def pipeline_fault(rank: int, n: int, timeout_s: float, how: str) -> dict[str, Any]:
    """A 4-stage 1F1B pipeline: one good step, then the last stage fails inside the second step."""
    import torch.nn.functional as F

    import hal
    import hal.dist as hd
    from hal.parallel.pipeline import PipelineParallel

    hd.set_timeout(timeout_s)
    torch.manual_seed(0)
    trap = _Trap()
    last = torch.nn.Sequential(hal.nn.Linear(6, 3), trap)  # one child per stage: the trap inside the last one
    model = torch.nn.Sequential(*[hal.nn.Linear(6, 6, act="relu") for _ in range(n - 1)], last)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pp = PipelineParallel(model, microbatch=x[:2], n_microbatches=4, schedule="1f1b", loss_fn=lambda o, t: F.mse_loss(o, t))
    pp.step(x, target=y)
    if rank == n - 1:
        trap.how = how
    started = time.monotonic()
    return _outcome(started, lambda: pp.step(x, target=y))


def _survivors(fn: Any, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    results = launch(fn, 4, args, timeout_s=90, pg_timeout_s=60, wait_ranks=[0, 1, 2], final_barrier=False, env=ONE_THREAD)
    survivors = results[:3]
    failed = "\n".join(f"rank {r.rank}: {r.message}\n{r.traceback}" for r in survivors if not r.ok)
    assert not failed, failed
    return [r.value for r in survivors]


def _assert_comm_errors(values: list[dict[str, Any]], timeout_s: float, stalled: bool) -> None:
    print("seconds to CommError per surviving rank:", [round(v["seconds"], 2) for v in values])
    for rank, value in enumerate(values):
        assert value["error"] == "CommError", f"rank {rank}: {value}"
        assert value["seconds"] < timeout_s + SLACK_S, f"rank {rank}: {value}"
        assert "died, stalled" in value["message"] or "peer rank died" in value["message"], value["message"]
        if stalled:  # nothing may give up before the bound
            assert value["seconds"] > 0.5 * timeout_s, f"rank {rank}: {value}"


def test_moe_rank_killed_mid_step() -> None:
    _assert_comm_errors(_survivors(moe_fault, (5.0, "dies", 1)), 5.0, stalled=False)


def test_moe_rank_stalled_mid_step_with_overlap() -> None:
    _assert_comm_errors(_survivors(moe_fault, (2.0, "stalls", 2)), 2.0, stalled=True)


def test_pipeline_rank_killed_mid_step() -> None:
    _assert_comm_errors(_survivors(pipeline_fault, (5.0, "dies")), 5.0, stalled=False)


def test_pipeline_rank_stalled_mid_step() -> None:
    _assert_comm_errors(_survivors(pipeline_fault, (2.0, "stalls")), 2.0, stalled=True)
