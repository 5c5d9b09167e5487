"""hal.parallel.comm on real gloo groups: each conjugate pair's forward and backward against one process.

Every rank draws every rank's float64 input from the seed, computes the whole-group result with
plain tensor operations, and compares its own share of the values and gradients with it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hal.dist.launch import launch
from hal.parallel import comm

pytestmark = pytest.mark.timeout(240)


def _inputs(seed: int, n: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        out.append(torch.randn(shape, generator=g, dtype=torch.float64) + 0.5)
    return out


def _check_all(rank: int, n: int, seed: int) -> dict[str, str]:
    import traceback

    failures = {}
    xs = _inputs(seed, n, (4 * n, 3, 2))

    def case(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception:
            failures[name] = traceback.format_exc()

    def grads(op: Any, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = mine.clone().requires_grad_(True)
        y = op(x)
        (y * weight_of(rank, y.shape)).sum().backward()
        return y.detach(), x.grad

    def weight_of(r: int, shape: torch.Size) -> torch.Tensor:
        """Rank r's weighting of an output of this shape: the loss is sum(y * w), w differing per rank."""
        g = torch.Generator().manual_seed(seed * 7919 + 31 * r + torch.Size(shape).numel())
        return torch.randn(tuple(shape), generator=g, dtype=torch.float64) + 0.5

    def copy_to() -> None:
        y, g = grads(lambda x: comm.copy_to_parallel(x), xs[0])
        torch.testing.assert_close(y, xs[0], rtol=0, atol=0)
        want = sum(weight_of(r, xs[0].shape) for r in range(n))
        torch.testing.assert_close(g, want)

    def reduce_from() -> None:
        y, g = grads(lambda x: comm.reduce_from_parallel(x), xs[rank])
        torch.testing.assert_close(y, sum(xs))
        torch.testing.assert_close(g, weight_of(rank, y.shape))

    def gather_reduce() -> None:
        y, g = grads(lambda x: comm.gather_from_parallel(x, 1, grad_reduce=True), xs[rank][:, :, :1])
        full = torch.cat([x[:, :, :1] for x in xs], dim=1)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        summed = sum(weight_of(r, full.shape) for r in range(n))
        torch.testing.assert_close(g, summed.chunk(n, 1)[rank])

    def gather_split() -> None:
        y, g = grads(lambda x: comm.gather_from_parallel(x, 0, grad_reduce=False), xs[rank])
        torch.testing.assert_close(y, torch.cat(xs), rtol=0, atol=0)
        torch.testing.assert_close(g, weight_of(rank, y.shape).chunk(n, 0)[rank])

    def reduce_scatter() -> None:
        y, g = grads(lambda x: comm.reduce_scatter_to_parallel(x, 0), xs[rank])
        torch.testing.assert_close(y, sum(xs).chunk(n, 0)[rank])
        torch.testing.assert_close(g, torch.cat([weight_of(r, y.shape) for r in range(n)]))

    def scatter() -> None:
        y, g = grads(lambda x: comm.scatter_to_parallel(x, 0), xs[0])
        torch.testing.assert_close(y, xs[0].chunk(n, 0)[rank], rtol=0, atol=0)
        torch.testing.assert_close(g, torch.cat([weight_of(r, y.shape) for r in range(n)]))

    def all_to_all_uneven() -> None:
        # rank r sends (r + j) % 3 + 1 rows to rank j; the counts are exchanged by the call.
        sizes = [[(r + j) % 3 + 1 for j in range(n)] for r in range(n)]
        rows = [x.reshape(-1, 6)[: sum(sizes[r])] for r, x in enumerate(xs)]
        y, g = grads(lambda x: comm.all_to_all(x, send_sizes=sizes[rank]), rows[rank])
        want = torch.cat([rows[r].split(sizes[r])[rank] for r in range(n)])
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        # the gradient of row i of rank r's input is the weight rank j put on it after the exchange
        back = []
        for j in range(n):
            wj = weight_of(j, torch.Size((sum(sizes[r][j] for r in range(n)), 6)))
            back.append(wj.split([sizes[r][j] for r in range(n)])[rank])
        torch.testing.assert_close(g, torch.cat(back))

    def indivisible() -> None:
        import hal

        odd = torch.ones(2 * n + 1, 3, dtype=torch.float64)
        for op in (lambda: comm.scatter_to_parallel(odd, 0), lambda: comm.reduce_scatter_to_parallel(odd, 0)):
            try:
                op()
            except hal.InvalidArgumentError as exc:
                assert "divisible" in str(exc) and f"size {2 * n + 1}" in str(exc), exc
            else:
                raise AssertionError("an indivisible split was accepted")

    for name, fn in [("indivisible", indivisible), ("copy_to", copy_to), ("reduce_from", reduce_from), ("gather_reduce", gather_reduce),
                     ("gather_split", gather_split), ("reduce_scatter", reduce_scatter), ("scatter", scatter),
                     ("all_to_all_uneven", all_to_all_uneven)]:
        case(name, fn)
    return failures


@pytest.mark.parametrize("n", [2, 4])
def test_conjugate_collectives_match_one_process(n: int, seed: int) -> None:
    results = launch(_check_all, n, (seed,), timeout_s=200)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    failures = {f"rank {r.rank} {k}": v for r in results for k, v in r.value.items()}
    assert not failures, f"HAL_TEST_SEED={seed}\n" + "\n".join(f"{k}:\n{v}" for k, v in failures.items())
