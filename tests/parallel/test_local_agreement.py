"""A rank whose own arguments are wrong (a tensor on another device, a target of the wrong shape, ids
of another dtype, a bad ``reduction``...) raises together with its peers, after the agreement, and
the group stays in step (issue 41, item 8 follow-up), on 2 real gloo ranks.

Each case: one rank passes a bad argument, both ranks catch what they get, then both make a valid
call of the same layer, which must give one process's result. Before the fix the bad rank raised
alone before the agreement: its valid call's all-gather paired with its peer's pending bad-call
one, the peer's valid call then waited for a partner that never came (``CommError`` after
``WAIT_S``), and every later case was out of step. Every wait is bounded, so a regression fails in
seconds instead of hanging.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from hal.dist.launch import RankResult, launch

from ._agreement_support import V, outcome as _outcome, reference_layers

pytestmark = pytest.mark.timeout(240)

N = 2
WAIT_S = 8.0
META = torch.device("meta")


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    return float((got.detach() - want.detach()).abs().max()) if got.numel() else 0.0


def _cases(rank: int, seed: int) -> dict[str, tuple[Callable[[], Any], Callable[[], float]]]:
    """name -> (the call with one rank's bad argument, a valid call's difference from one process)."""
    import torch.distributed as dist

    from hal.parallel import ColumnParallelLinear, ExpertParallelMoE, ParallelRMSNorm, vocab_parallel_linear_cross_entropy

    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    layers = reference_layers(g)
    col_full, row_full, head_full, table = layers.column_full, layers.row_full, layers.head_full, layers.table
    column, row, emb, head = layers.column, layers.row, layers.emb, layers.head
    x8, x6, x5 = draw(3, 8), draw(3, 6), draw(2, 3, 5)
    ids = torch.randint(0, V, (3, 4), generator=g)
    target = torch.randint(0, V, (2, 3), generator=g)
    flat_target = target.reshape(-1)
    alone = {r: dist.new_group([r]) for r in range(N)}  # every rank makes each group, in the same order

    def bad_on(who: int, bad: Any, good: Any) -> Any:
        return bad if rank == who else good

    def loss(t: torch.Tensor, **options: Any) -> torch.Tensor:
        return vocab_parallel_linear_cross_entropy(x5.reshape(6, 5), head.weight, t, vocab_size=V, bias_shard=head.bias, **options)

    want_loss = F.cross_entropy(head_full(x5.reshape(6, 5)), flat_target)
    valid_loss = (lambda: _diff(loss(flat_target), want_loss))

    def moe(x: torch.Tensor) -> torch.Tensor:
        return ExpertParallelMoE(4, 6, 4, 2, group=dist.group.WORLD, dtype=torch.float64)(x)

    tokens = draw(3, 4)

    def moe_valid() -> float:
        return _diff(moe(tokens), ExpertParallelMoE(4, 6, 4, 2, dtype=torch.float64)(tokens))

    def norm_backward(x: torch.Tensor) -> tuple[int, ...]:
        x = x.detach().requires_grad_(x.device.type != "meta")
        ParallelRMSNorm(8, dtype=torch.float64)(x).sum().backward()
        return tuple(x.shape)

    def norm_valid() -> float:
        x = draw(4, 8).requires_grad_()
        norm_backward(x)
        return _diff(ParallelRMSNorm(8, dtype=torch.float64)(x), F.rms_norm(x, (8,)))

    from hal.parallel.plan import PlanContext, SequenceEntry

    entry = SequenceEntry().apply(torch.nn.Identity(), PlanContext(mesh=None, sequence_parallel=True))
    seq = draw(2, 6, 8)

    return {
        "column_meta_x_rank1": (lambda: column(bad_on(1, x8.to(META), x8)), lambda: _diff(column(x8), col_full(x8))),
        "row_meta_x_rank0": (lambda: row(bad_on(0, x6.to(META), x6)), lambda: _diff(row(x6), row_full(x6))),
        "embedding_meta_ids_rank1": (lambda: emb(bad_on(1, ids.to(META), ids)), lambda: _diff(emb(ids), table(ids))),
        "embedding_float_ids_rank0": (lambda: emb(bad_on(0, ids.double(), ids)), lambda: _diff(emb(ids), table(ids))),
        "head_target_shape_rank1": (lambda: head(x5, bad_on(1, flat_target, target)),
                                    lambda: _diff(head(x5, target), F.cross_entropy(head_full(x5).reshape(6, V), flat_target))),
        "head_meta_x_rank0": (lambda: head(bad_on(0, x5.to(META), x5)),
                              lambda: _diff(head(x5, gather=True), head_full(x5))),
        "loss_meta_target_rank1": (lambda: loss(bad_on(1, flat_target.to(META), flat_target)), valid_loss),
        "loss_reduction_rank0": (lambda: loss(flat_target, reduction=bad_on(0, "avg", "mean")), valid_loss),
        "loss_chunk_rows_rank1": (lambda: loss(flat_target, chunk_rows=bad_on(1, 0, 2)), valid_loss),
        "loss_both_ranks_differ": (lambda: loss(bad_on(0, flat_target.to(META), flat_target), reduction=bad_on(1, "avg", "mean")),
                                   valid_loss),
        "moe_width_rank1": (lambda: moe(bad_on(1, draw(3, 5)[:, :5], tokens)), moe_valid),
        "norm_meta_x_rank0": (lambda: norm_backward(bad_on(0, draw(4, 8).to(META), draw(4, 8))), norm_valid),
        # parallelize's sequence split: rank 1's length 5 is no multiple of 2 (refused by it alone before the agreement)
        "sequence_entry_length_rank1": (lambda: entry(bad_on(1, seq[:, :5], seq[:, :4])),
                                        lambda: _diff(entry(seq[:, :4]), seq[:, :4].chunk(N, 1)[rank])),
        # a group of one rank: no exchange, the rank's own detailed error at once (as before)
        "alone_meta_x": (lambda: ColumnParallelLinear.from_linear(col_full, mesh=alone[rank])(x8.to(META)),
                         lambda: _diff(ColumnParallelLinear.from_linear(col_full, mesh=alone[rank])(x8), col_full(x8))),
    }


def _run(rank: int, n: int, seed: int) -> dict[str, dict[str, Any]]:
    import hal.dist as hd

    hd.set_timeout(WAIT_S)
    out = {}
    for name, (bad, valid) in _cases(rank, seed).items():
        out[name] = {"bad": _outcome(bad), "valid": _outcome(valid)}
    return out


@functools.lru_cache(maxsize=None)
def _launched(seed: int) -> tuple[RankResult, ...]:
    return tuple(launch(_run, N, (seed,), timeout_s=200))


@pytest.fixture(scope="module")
def outcomes(seed: int) -> list[dict[str, dict[str, Any]]]:
    results = _launched(seed)
    bad = [f"rank {r.rank}: {r.message} (exit code {r.exitcode})\n{r.traceback}" for r in results if not r.ok]
    assert not bad, f"HAL_TEST_SEED={seed}\n" + "\n".join(bad)
    return [r.value for r in results]


#: (case, the error's start, what it names of each rank)
CASES = [
    ("column_meta_x_rank1", "ColumnParallelLinear: argument 'x' must be a tensor on the layer's device; got "
     "rank 0: valid; rank 1: a float64 tensor on meta, the layer on cpu"),
    ("row_meta_x_rank0", "RowParallelLinear: argument 'x' must be a tensor on the layer's device; got "
     "rank 0: a float64 tensor on meta, the layer on cpu; rank 1: valid"),
    ("embedding_meta_ids_rank1", "VocabParallelEmbedding: argument 'ids' must be a tensor on the layer's device; got "
     "rank 0: valid; rank 1: a int64 tensor on meta, the layer on cpu"),
    ("embedding_float_ids_rank0", "VocabParallelEmbedding: argument 'ids' must be an int64 or int32 tensor of token ids "
     "(as nn.Embedding); got rank 0: a torch.float64 tensor; rank 1: valid"),
    ("head_target_shape_rank1", "VocabParallelLMHead: argument 'target' must be a tensor of x's leading shape (one class id "
     "per row of x, as F.cross_entropy); got rank 0: valid; rank 1: shape (6,), x (2, 3, 5)"),
    ("head_meta_x_rank0", "VocabParallelLMHead: argument 'x' must be a tensor on the layer's device; got "
     "rank 0: a float64 tensor on meta, the layer on cpu; rank 1: valid"),
    ("loss_meta_target_rank1", "vocab_parallel_linear_cross_entropy: argument 'target' must be a tensor on the layer's device; "
     "got rank 0: valid; rank 1: a int64 tensor on meta, the layer on cpu"),
    ("loss_reduction_rank0", "vocab_parallel_linear_cross_entropy: argument 'reduction' must be one of none, mean, sum; "
     "got rank 0: 'avg'; rank 1: valid"),
    ("loss_chunk_rows_rank1", "vocab_parallel_linear_cross_entropy: argument 'chunk_rows' must be an int of at least 1; "
     "got rank 0: valid; rank 1: 0"),
    ("loss_both_ranks_differ", "vocab_parallel_linear_cross_entropy: argument 'target, reduction' must be target: a tensor on "
     "the layer's device; reduction: one of none, mean, sum; got rank 0: target: a int64 tensor on meta, the layer on cpu; "
     "rank 1: reduction: 'avg'"),
    ("moe_width_rank1", "ExpertParallelMoE: argument 'x' must be a tensor whose last dimension is the layer's dim; got "
     "rank 0: valid; rank 1: shape (3, 5)"),
    ("norm_meta_x_rank0", "ParallelRMSNorm: argument 'x' must be a tensor on the layer's device; got "
     "rank 0: a float64 tensor on meta, the layer on cpu; rank 1: valid"),
    ("sequence_entry_length_rank1", "scatter_to_parallel: argument 'x' must be the same dtype and shape on every rank of the group; "
     "got rank 0: float64 (2, 4, 8); rank 1: float64 (2, 5, 8)"),
]


@pytest.mark.parametrize("case, message", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_on_one_rank_raises_on_every_rank_and_the_group_stays_in_step(outcomes: list, case: str, message: str) -> None:
    """The same InvalidArgumentError on both ranks, naming each rank and what it passed; then a
    valid call on both ranks gives one process's result (the group is in step)."""
    for rank in (0, 1):
        got = outcomes[rank][case]
        assert not got["valid"]["raised"], f"{case}, rank {rank}, the valid call after: {got['valid']['message']}"
        assert got["valid"]["value"] < 1e-12, f"{case}, rank {rank}: the valid call differs from one process by {got['valid']['value']}"
        assert "InvalidArgumentError" in got["bad"]["raised"], f"{case}, rank {rank}: {got['bad']}"
        assert got["bad"]["message"] == f"InvalidArgumentError: {message}", f"{case}, rank {rank}"


def test_a_group_of_one_raises_the_ranks_own_error(outcomes: list) -> None:
    """No peer: nothing exchanged, the rank's own error at once, as before (the layer's device named)."""
    for rank in (0, 1):
        got = outcomes[rank]["alone_meta_x"]
        assert got["bad"]["message"] == ("InvalidArgumentError: ColumnParallelLinear: argument 'x' must be a tensor on the "
                                         "layer's device, cpu; got a torch.float64 tensor on meta"), got
        assert not got["valid"]["raised"] and got["valid"]["value"] < 1e-12, got
