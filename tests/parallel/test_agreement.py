"""hal.parallel given bad or mismatched input on 2 real gloo ranks: every rank raises the same clear
error, no rank crashes, and the group still works afterwards (issue 41, item 8).

One launch runs every case in turn on both ranks (a case's error is caught and recorded with its
class's bases and its message); the tests then assert, case by case, what each rank saw. Before the
fix the ids and targets out of range gave numbers, the layer built on a group without the rank
raised "negative dimension -8", and the shape and dtype mismatches killed rank 0 with SIGABRT
(gloo's size enforcement) while rank 1 returned a wrongly shaped gather. The second round's cases
(:func:`_edge_cases`, run first in the same launch) compare views, empty and non-finite input with
torch in one process and refuse bad dimensions, dtypes, devices and sizes. Every input is drawn
from the module's seed.
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
#: a bound on every wait: a rank left waiting by a bug fails in seconds with CommError, not the group's 60 s
WAIT_S = 20.0


def _cases(rank: int, seed: int) -> dict[str, Callable[[], Any]]:
    """name -> the case as this rank runs it (the same order on every rank)."""
    import torch.distributed as dist

    from hal.parallel import (ColumnParallelLinear, ExpertParallelMoE, RowParallelLinear, VocabParallelEmbedding,
                              VocabParallelLMHead, comm, vocab_parallel_linear_cross_entropy)

    g = torch.Generator().manual_seed(seed)  # every rank draws the same numbers in the same order
    emb_full = torch.nn.Embedding(V, 5, padding_idx=2, dtype=torch.float64)
    with torch.no_grad():
        emb_full.weight.copy_(torch.randn(V, 5, generator=g, dtype=torch.float64))
    head_full = torch.nn.Linear(5, V, dtype=torch.float64)
    with torch.no_grad():
        head_full.weight.copy_(torch.randn(V, 5, generator=g, dtype=torch.float64))
        head_full.bias.copy_(torch.randn(V, generator=g, dtype=torch.float64))
    ids = torch.randint(0, V, (3, 4), generator=g)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (6,), generator=g)
    emb = VocabParallelEmbedding.from_embedding(emb_full)
    head = VocabParallelLMHead.from_linear(head_full)
    head_ignore = VocabParallelLMHead.from_linear(head_full, ignore_index=-1)
    w_shard = head.weight.detach()
    outside = {r: dist.new_group([r]) for r in range(N)}  # rank r alone: every rank makes each group, in the same order
    only_rank0 = dist.new_group([0])

    def with_ids(*changes: tuple[tuple[int, int], int], on: tuple[int, ...] = (0, 1)) -> torch.Tensor:
        out = ids.clone()
        if rank in on:
            for where, value in changes:
                out[where] = value
        return out

    def loss(t: torch.Tensor, module: Any = head) -> float:
        return float(module(x, t))

    def reference_loss(t: torch.Tensor, ignore_index: int) -> float:
        return float(F.cross_entropy(head_full(x), t, ignore_index=ignore_index))

    def column(rows: int, **options: Any) -> tuple[int, ...]:
        torch.manual_seed(seed)
        layer = ColumnParallelLinear(8, 6, **options)
        y = layer(torch.randn(rows, 4, 8, generator=torch.Generator().manual_seed(seed + rank)))
        y.sum().backward()
        return tuple(y.shape)

    def row(dtype: torch.dtype) -> tuple[int, ...]:
        torch.manual_seed(seed)
        layer = RowParallelLinear(8, 6, dtype=dtype)
        return tuple(layer(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + rank), dtype=dtype)).shape)

    def working_layers() -> float:
        """Column -> row on matching input after all the errors: equal to one process's result."""
        torch.manual_seed(seed)
        full1, full2 = torch.nn.Linear(8, 6, dtype=torch.float64), torch.nn.Linear(6, 8, dtype=torch.float64)
        inp = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        got = RowParallelLinear.from_linear(full2)(ColumnParallelLinear.from_linear(full1, act="gelu")(inp))
        want = full2(F.gelu(full1(inp)))
        return float((got - want).abs().max())

    return {
        # --- ids and targets outside the vocabulary --------------------------------------------------------
        "id_past_vocab": lambda: emb(with_ids(((1, 2), V + 3))),
        "id_negative": lambda: emb(with_ids(((0, 0), -1))),
        "id_in_padding_row": lambda: emb(with_ids(((2, 3), V))),  # rank 1 holds a row for id V: padding
        "id_bad_on_rank1_only": lambda: emb(with_ids(((0, 1), V), on=(1,))),
        "id_bad_alone": lambda: VocabParallelEmbedding(V, 3, outside[rank])(with_ids(((0, 0), V + rank))),
        "ids_valid_edges": lambda: float((emb(with_ids(((0, 0), 0), ((0, 1), V - 1), ((0, 2), 2))) -
                                          emb_full(with_ids(((0, 0), 0), ((0, 1), V - 1), ((0, 2), 2)))).abs().max()),
        "target_past_vocab": lambda: loss(torch.where(torch.arange(6) == 4, V + 7, target)),
        "target_in_padding_row": lambda: loss(torch.where(torch.arange(6) == 1, V, target)),
        "target_negative": lambda: loss(torch.where(torch.arange(6) == 0, -5, target)),
        "target_ignored_default": lambda: loss(torch.where(torch.arange(6) % 2 == 0, -100, target)) - reference_loss(
            torch.where(torch.arange(6) % 2 == 0, -100, target), -100),
        "target_ignored_custom": lambda: loss(torch.where(torch.arange(6) < 3, -1, target), head_ignore) - reference_loss(
            torch.where(torch.arange(6) < 3, -1, target), -1),
        "target_default_ignore_with_custom": lambda: loss(torch.where(torch.arange(6) == 5, -100, target), head_ignore),
        "target_bad_on_rank0_only_function": lambda: float(vocab_parallel_linear_cross_entropy(
            x, w_shard, torch.where((torch.arange(6) == 2) & (rank == 0), V, target), vocab_size=V)),
        # --- a group without this rank --------------------------------------------------------------------
        "column_outside_group": lambda: repr(ColumnParallelLinear(4, 8, mesh=only_rank0)),
        "row_outside_group": lambda: repr(RowParallelLinear(4, 8, mesh=only_rank0)),
        "embedding_outside_group": lambda: repr(VocabParallelEmbedding(V, 4, only_rank0)),
        "head_outside_group": lambda: repr(VocabParallelLMHead(4, V, only_rank0)),
        # --- shapes, dtypes, values that differ across ranks ----------------------------------------------
        "column_rows_differ_gathered": lambda: column(2 + rank, gather_output=True),
        "column_rows_differ_backward": lambda: column(2 + rank),
        "column_sequence_differs_overlap": lambda: column(2, sequence_parallel=True, sequence_dim=0, overlap=True)
        if rank == 0 else column(3, sequence_parallel=True, sequence_dim=0, overlap=True),
        "column_settings_differ": lambda: column(2, act="gelu" if rank else "none"),
        "row_dtype_differs": lambda: row(torch.float64 if rank else torch.float32),
        "gather_shape_differs": lambda: tuple(comm.gather_from_parallel(torch.ones(2, 3 + rank), 0).shape),
        "reduce_dtype_differs": lambda: tuple(comm.reduce_from_parallel(torch.ones(4, dtype=torch.float32 if rank else torch.float64)).shape),
        "ids_differ": lambda: emb(with_ids(((1, 1), (int(ids[1, 1]) + 1) % V), on=(1,))),
        "ids_shape_differs": lambda: emb(ids[: 2 + rank]),
        "loss_rows_differ": lambda: float(vocab_parallel_linear_cross_entropy(x[: 5 + rank], w_shard, target[: 5 + rank], vocab_size=V)),
        "loss_targets_differ": lambda: loss(torch.where((torch.arange(6) == 3) & (rank == 1), (target + 1) % V, target)),
        "loss_settings_differ": lambda: float(vocab_parallel_linear_cross_entropy(x, w_shard, target, vocab_size=V,
                                                                                  label_smoothing=0.1 * rank)),
        "moe_dtype_differs": lambda: tuple(ExpertParallelMoE(4, 6, 2, 1, group=dist.group.WORLD, dtype=torch.float64 if rank else None)(
            torch.randn(5, 4, dtype=torch.float64 if rank else torch.float32)).shape),
        # --- the group is intact after all of the above ---------------------------------------------------
        "layers_after_errors": working_layers,
    }


def _same(got: torch.Tensor, want: torch.Tensor) -> str:
    """"" when ``got`` is ``want`` (shape, dtype, NaN and infinities where torch has them, the finite
    values to float64 rounding), else what differs."""
    try:
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-9, atol=1e-12, equal_nan=True)
    except AssertionError as exc:
        return str(exc)
    return ""


def _edge_cases(rank: int, seed: int) -> dict[str, Callable[[], Any]]:
    """Input a new user passes (the second round of issue 41's attacks): views, empty and non-finite
    tensors compared with one process's torch result ("" when equal); out-of-range dimensions,
    parameters that differ across ranks in a layer without a forward collective, ids and targets of
    the wrong dtype, inputs on another device than the layer, bad sizes. Run before the cases of
    :func:`_cases`, whose last one checks that the group still works."""
    import torch.distributed as dist

    from hal.parallel import (ColumnParallelLinear, ExpertParallelMoE, ParallelLayerNorm, ParallelRMSNorm, RowParallelLinear,
                              VocabParallelEmbedding, VocabParallelLMHead, comm, vocab_parallel_linear_cross_entropy)

    g = torch.Generator().manual_seed(seed + 1)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    layers = reference_layers(g, reduction="none")
    column_full, row_full, head_full, table = layers.column_full, layers.row_full, layers.head_full, layers.table
    column, row, emb, head = layers.column, layers.row, layers.emb, layers.head
    ids = torch.randint(0, V, (4, 3), generator=g)
    x8, x6, x5 = draw(8, 4).t(), draw(6, 4).t(), draw(12, 5)[::2]  # views: transposed, strided
    target = torch.randint(0, V, (6,), generator=g)
    only_rank0 = dist.new_group([0])

    def nonfinite(t: torch.Tensor, *where: tuple[int, ...]) -> torch.Tensor:
        out = t.clone()
        for i, w in enumerate(where):
            out[w] = (float("nan"), float("inf"), -float("inf"))[i % 3]
        return out

    def embedding_nonfinite_rows() -> str:
        """A NaN in rank 0's first row (id 0) and an Inf in rank 1's (id 6): only those ids' rows."""
        bad = torch.nn.Embedding(V, 5, dtype=torch.float64)
        with torch.no_grad():
            bad.weight.copy_(nonfinite(table.weight, (0, 1), (6, 2)))
        lookup = torch.tensor([[0, 3, 6], [9, 10, 1]])
        return _same(VocabParallelEmbedding.from_embedding(bad)(lookup), bad(lookup))

    def column_grad_of_empty() -> str:
        mine, theirs = (torch.empty(0, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        ColumnParallelLinear.from_linear(column_full, gather_output=True, act="gelu")(mine).sum().backward()
        F.gelu(column_full(theirs)).sum().backward()
        return _same(mine.grad, theirs.grad)

    def overlapped(x: torch.Tensor) -> str:
        """Sequence parallelism with the overlapped gather: each rank passes its half of dim 1."""
        layer = ColumnParallelLinear.from_linear(column_full, gather_output=True, sequence_parallel=True, overlap=True)
        return _same(layer(x.chunk(N, 1)[rank]), column_full(x))

    def moe_uneven() -> str:
        """Rank 0 routes 3 tokens, rank 1 none: each gets the one-process layer's output for its own."""
        tokens = draw(3, 4)[: 3 * (1 - rank)]
        return _same(ExpertParallelMoE(4, 6, 4, 2, group=dist.group.WORLD, dtype=torch.float64)(tokens),
                     ExpertParallelMoE(4, 6, 4, 2, dtype=torch.float64)(tokens))

    def loss(x: torch.Tensor, t: torch.Tensor, **options: Any) -> str:
        return _same(vocab_parallel_linear_cross_entropy(x, head.weight, t, vocab_size=V, bias_shard=head.bias, **options),
                     F.cross_entropy(head_full(x), t.long(), **options))

    def norm_backward(make: Callable[[], torch.nn.Module], width: int = 8) -> tuple[int, ...]:
        x = torch.randn(2, width, requires_grad=True)
        make()(x).sum().backward()
        return tuple(x.grad.shape)

    def norm_without_grad() -> tuple[int, ...]:
        """Widths that differ, no backward to come: no check (it would cost inference a collective)."""
        with torch.no_grad():
            return tuple(ParallelRMSNorm(8 + 2 * rank)(torch.randn(2, 8 + 2 * rank)).shape)

    meta = {"device": "meta"}
    return {
        # --- compared with torch in one process ---------------------------------------------------------------
        "same_embedding_nonfinite_rows": embedding_nonfinite_rows,
        "same_column_transposed": lambda: _same(column(x8), column_full(x8)),
        "same_column_expanded": lambda: _same(column(x8[:1].expand(3, 8)), column_full(x8[:1].expand(3, 8))),
        "same_row_transposed": lambda: _same(row(x6), row_full(x6)),
        "same_embedding_transposed": lambda: _same(emb(ids.t()), table(ids.t())),
        "same_loss_strided": lambda: loss(x5, torch.stack([target, target], 1)[:, 0], reduction="none"),
        "same_overlap_transposed": lambda: overlapped(draw(4, 2, 8).transpose(0, 1)),
        "same_column_empty_grad": column_grad_of_empty,
        "same_loss_empty_sum": lambda: loss(x5[:0], target[:0], reduction="sum"),
        "same_loss_empty_mean": lambda: loss(x5[:0], target[:0]),
        "same_embedding_empty": lambda: _same(emb(ids[:, :0]), table(ids[:, :0])),
        "same_overlap_empty": lambda: overlapped(draw(3, 0, 8)),
        "same_moe_uneven": moe_uneven,
        "same_column_nonfinite": lambda: _same(column(nonfinite(x8, (0, 1), (1, 2), (2, 0))), column_full(nonfinite(x8, (0, 1), (1, 2), (2, 0)))),
        "same_row_nonfinite": lambda: _same(row(nonfinite(x6, (0, 1), (0, 4), (1, 3))), row_full(nonfinite(x6, (0, 1), (0, 4), (1, 3)))),
        "same_loss_nonfinite": lambda: loss(nonfinite(x5, (0, 1), (2, 2), (4, 0)), target, reduction="none"),
        "same_reduce_nonfinite": lambda: _same(comm.reduce_from_parallel(nonfinite(x8, (0, 0), (1, 1), (2, 2))),
                                               2 * nonfinite(x8, (0, 0), (1, 1), (2, 2))),
        # --- dimensions that are none of x's ------------------------------------------------------------------
        "dim_gather": lambda: comm.gather_from_parallel(x8, 5),
        "dim_scatter": lambda: comm.scatter_to_parallel(x8, -3),
        "dim_reduce_scatter": lambda: comm.reduce_scatter_to_parallel(x8, 2),
        "dim_bad_on_rank0": lambda: comm.gather_from_parallel(x8, 5 if rank == 0 else 1),
        "dim_column_overlap": lambda: ColumnParallelLinear(8, 6, sequence_parallel=True, sequence_dim=3, overlap=True)(torch.randn(2, 3, 8)),
        "dim_row": lambda: RowParallelLinear(8, 6, sequence_parallel=True, sequence_dim=4)(torch.randn(2, 4, 4)),
        "dim_embedding": lambda: VocabParallelEmbedding(V, 4, sequence_dim=3)(ids),
        # --- norms whose parameters differ across ranks, then backward -----------------------------------------
        "norm_width_differs": lambda: norm_backward(lambda: ParallelRMSNorm(8 + 2 * rank), 8 + 2 * rank),
        "norm_dtype_differs": lambda: norm_backward(lambda: ParallelRMSNorm(8, dtype=torch.float64 if rank else torch.float32)),
        "norm_bias_differs": lambda: norm_backward(lambda: ParallelLayerNorm(8, bias=rank == 0)),
        "norm_width_differs_no_grad": norm_without_grad,
        # --- dtypes and devices ----------------------------------------------------------------------------
        "ids_bool": lambda: emb(ids > 5),
        "ids_uint8": lambda: emb(ids.to(torch.uint8)),
        "target_bool": lambda: loss(x5, target > 5),
        "meta_column": lambda: column(torch.empty(3, 8, dtype=torch.float64, **meta)),
        "meta_column_layer": lambda: ColumnParallelLinear(8, 6, **meta)(torch.randn(3, 8)),
        "meta_row": lambda: row(torch.empty(3, 6, dtype=torch.float64, **meta)),
        "meta_ids": lambda: emb(ids.to("meta")),
        "meta_loss_target": lambda: loss(x5, target.to("meta")),
        "meta_head": lambda: head(torch.empty(3, 5, dtype=torch.float64, **meta)),
        "meta_norm": lambda: ParallelRMSNorm(8)(torch.empty(3, 8, **meta)),
        "meta_moe": lambda: ExpertParallelMoE(4, 6, 2, 1, group=dist.group.WORLD)(torch.empty(3, 4, **meta)),
        # --- sizes --------------------------------------------------------------------------------------------
        "size_negative": lambda: ColumnParallelLinear(-8, 6),
        "size_float": lambda: RowParallelLinear(8, 6.0),
        "size_embedding_float": lambda: VocabParallelEmbedding(V, 4.5),
        "size_head_vocab_zero": lambda: VocabParallelLMHead(4, 0),
        "size_chunk_rows_zero": lambda: loss(x5, target, chunk_rows=0),
        "size_chunks_bool": lambda: ColumnParallelLinear(8, 6, sequence_parallel=True, overlap=True, chunks=True),
        "moe_outside_group": lambda: repr(ExpertParallelMoE(4, 6, 2, 1, group=only_rank0)),
    }


def _switch_cases(rank: int, seed: int) -> dict[str, Callable[[], Any]]:
    """The same checks with hal.parallel.set_checks(False): only the local ones remain."""
    import hal.parallel
    from hal.parallel import VocabParallelEmbedding

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 4), generator=g)
    emb = VocabParallelEmbedding(V, 3)

    def off(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            hal.parallel.set_checks(False)
            try:
                return fn()
            finally:
                hal.parallel.set_checks(None)
        return run

    return {
        # ids that differ (valid) go unnoticed: the sum mixes both ranks' lookups, as without the check
        "off_ids_differ_unchecked": off(lambda: tuple(emb(torch.where(torch.arange(4) == 0, (ids + rank) % V, ids)).shape)),
        # out of range on both ranks: each raises by itself, before any collective
        "off_id_past_vocab": off(lambda: emb(torch.where(ids == ids[0, 0], V, ids))),
        "on_ids_differ": lambda: tuple(emb(torch.where(torch.arange(4) == 0, (ids + rank) % V, ids)).shape),
    }


def _run(rank: int, n: int, seed: int, which: str) -> dict[str, dict[str, Any]]:
    import hal.dist as hd

    hd.set_timeout(WAIT_S)
    cases = {**_edge_cases(rank, seed), **_cases(rank, seed)} if which == "cases" else _switch_cases(rank, seed)
    return {name: _outcome(fn) for name, fn in cases.items()}


@functools.lru_cache(maxsize=None)
def _launched(seed: int, which: str, env: tuple = ()) -> tuple[RankResult, ...]:
    return tuple(launch(_run, N, (seed, which), timeout_s=200, env=dict(env)))


@pytest.fixture(scope="module")
def outcomes(seed: int) -> list[dict[str, dict[str, Any]]]:
    """Every case's outcome on each rank (each rank ran to the end: no crash, no hang)."""
    results = _launched(seed, "cases")
    bad = [f"rank {r.rank}: {r.message} (exit code {r.exitcode})\n{r.traceback}" for r in results if not r.ok]
    assert not bad, f"HAL_TEST_SEED={seed}\n" + "\n".join(bad)
    return [r.value for r in results]


def _raised(outcomes: list[dict[str, dict[str, Any]]], case: str, error: str, *fragments: str, ranks: tuple[int, ...] = (0, 1)) -> None:
    for rank in ranks:
        got = outcomes[rank][case]
        assert error in got["raised"], f"{case}, rank {rank}: expected {error}, got {got}"
        for fragment in fragments:
            assert fragment in got["message"], f"{case}, rank {rank}: {fragment!r} not in {got['message']!r}"


OUT_OF_RANGE = [
    ("id_past_vocab", "ids", f"[0, {V})", f"ranks 0, 1: {V + 3}"),
    ("id_negative", "ids", f"[0, {V})", "ranks 0, 1: -1"),
    ("id_in_padding_row", "ids", f"[0, {V})", f"ranks 0, 1: {V}"),
    ("id_bad_on_rank1_only", "ids", f"[0, {V})", f"rank 0: valid; rank 1: {V}"),
    ("target_past_vocab", "target", f"[0, {V}) or ignore_index=-100", f"ranks 0, 1: {V + 7}"),
    ("target_in_padding_row", "target", f"[0, {V})", f"ranks 0, 1: {V}"),
    ("target_negative", "target", f"[0, {V})", "ranks 0, 1: -5"),
    ("target_default_ignore_with_custom", "target", "ignore_index=-1", "ranks 0, 1: -100"),
    ("target_bad_on_rank0_only_function", "target", f"[0, {V})", f"rank 0: {V}; rank 1: valid"),
]


@pytest.mark.parametrize("case, arg, expected, got", OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE])
def test_out_of_range_raises_index_error_on_every_rank(outcomes: list, case: str, arg: str, expected: str, got: str) -> None:
    """As nn.Embedding / F.cross_entropy: an IndexError (and hal's InvalidArgumentError), on every
    rank of the group, naming the argument, the valid range and what each rank passed."""
    _raised(outcomes, case, "IndexError", f"argument '{arg}'", expected, got)
    _raised(outcomes, case, "InvalidArgumentError")


def test_out_of_range_on_a_group_of_one(outcomes: list) -> None:
    """No peer to tell: the rank raises at once (each rank alone in its group, its own bad id)."""
    for rank in (0, 1):
        _raised(outcomes, "id_bad_alone", "IndexError", f"got {V + rank} (group rank 0)", ranks=(rank,))


def test_valid_ids_and_ignored_targets_still_work(outcomes: list) -> None:
    """The edges of the range, padding_idx and ignore_index (the default and a custom one) give
    torch's results; a default -100 is out of range once ignore_index is -1, as in torch."""
    for rank in (0, 1):
        for case in ("ids_valid_edges", "target_ignored_default", "target_ignored_custom"):
            got = outcomes[rank][case]
            assert not got["raised"], f"{case}, rank {rank}: {got['message']}"
            assert abs(got["value"]) < 1e-12, f"{case}, rank {rank}: differs from torch by {got['value']}"


@pytest.mark.parametrize("case, cls", [("column_outside_group", "ColumnParallelLinear"), ("row_outside_group", "RowParallelLinear"),
                                       ("embedding_outside_group", "VocabParallelEmbedding"), ("head_outside_group", "VocabParallelLMHead")])
def test_layer_on_a_group_without_this_rank(outcomes: list, case: str, cls: str) -> None:
    """At construction, naming the layer, the group and the rank (not "negative dimension -8");
    the group's own rank builds the layer."""
    _raised(outcomes, case, "InvalidArgumentError", f"{cls}: argument 'group' must be a process group that contains this rank "
            "(global rank 1)", "NON_GROUP_MEMBER", ranks=(1,))
    assert not outcomes[0][case]["raised"] and cls in outcomes[0][case]["value"], outcomes[0][case]


MISMATCHES = [
    ("column_rows_differ_gathered", "ColumnParallelLinear: argument 'x'", "rank 0: float32 (2, 4, 8); rank 1: float32 (3, 4, 8)"),
    ("column_rows_differ_backward", "ColumnParallelLinear: argument 'x'", "rank 0: float32 (2, 4, 8); rank 1: float32 (3, 4, 8)"),
    ("column_sequence_differs_overlap", "ColumnParallelLinear: argument 'x'", "rank 0: float32 (2, 4, 8); rank 1: float32 (3, 4, 8)"),
    ("column_settings_differ", "ColumnParallelLinear: argument 'layers' must be the same layer settings", "act"),
    ("row_dtype_differs", "RowParallelLinear: argument 'x'", "rank 0: float32 (3, 4); rank 1: float64 (3, 4)"),
    ("gather_shape_differs", "gather_from_parallel: argument 'x'", "rank 0: float32 (2, 3); rank 1: float32 (2, 4)"),
    ("reduce_dtype_differs", "reduce_from_parallel: argument 'x'", "rank 0: float64 (4,); rank 1: float32 (4,)"),
    ("ids_differ", "VocabParallelEmbedding: argument 'ids' must be the same token ids on every rank", "feed the tensor-parallel"),
    ("ids_shape_differs", "VocabParallelEmbedding: argument 'ids' must be the same dtype and shape", "rank 0: int64 (2, 4); rank 1: int64 (3, 4)"),
    ("loss_rows_differ", "vocab_parallel_linear_cross_entropy: argument 'x'", "rank 0: float64 (5, 5); rank 1: float64 (6, 5)"),
    ("loss_targets_differ", "argument 'target' must be the same targets on every rank", "feed the tensor-parallel"),
    ("loss_settings_differ", "argument 'settings' must be the same vocab_size, ignore_index, label_smoothing", "rank 0"),
    ("moe_dtype_differs", "ExpertParallelMoE: argument 'x.dtype'", "rank 0: float32; rank 1: float64"),
]


@pytest.mark.parametrize("case, head, detail", MISMATCHES, ids=[c[0] for c in MISMATCHES])
def test_mismatch_across_ranks_is_an_error_on_every_rank(outcomes: list, case: str, head: str, detail: str) -> None:
    """InvalidArgumentError on both ranks, the same message, naming what each rank passed (before:
    SIGABRT on rank 0 and a wrongly shaped result on rank 1, or a silently mixed result)."""
    _raised(outcomes, case, "InvalidArgumentError", head, detail)
    assert outcomes[0][case]["message"] == outcomes[1][case]["message"]


def test_group_still_works_after_the_errors(outcomes: list) -> None:
    """Every error was raised before any payload moved: the next layers compute one process's result."""
    for rank in (0, 1):
        got = outcomes[rank]["layers_after_errors"]
        assert not got["raised"], got["message"]
        assert got["value"] < 1e-12, f"rank {rank}: differs from one process by {got['value']}"


SAME_AS_TORCH = [
    "same_embedding_nonfinite_rows", "same_column_transposed", "same_column_expanded", "same_row_transposed",
    "same_embedding_transposed", "same_loss_strided", "same_overlap_transposed", "same_column_empty_grad", "same_loss_empty_sum",
    "same_loss_empty_mean", "same_embedding_empty", "same_overlap_empty", "same_moe_uneven", "same_column_nonfinite",
    "same_row_nonfinite", "same_loss_nonfinite", "same_reduce_nonfinite",
]


@pytest.mark.parametrize("case", SAME_AS_TORCH)
def test_views_empty_and_nonfinite_input_give_torchs_result(outcomes: list, case: str) -> None:
    """Transposed, strided and expanded views, empty tensors, NaN and infinities: torch's result in
    one process, NaN and Inf where it has them, on both ranks. Before: a NaN or Inf in the first row
    of a rank's slice of the embedding table (the row it looks up in place of ids its peers hold,
    then multiplied by a zero mask) made NaN of every such id's embedding."""
    for rank in (0, 1):
        got = outcomes[rank][case]
        assert not got["raised"], f"{case}, rank {rank}: {got['message']}"
        assert got["value"] == "", f"{case}, rank {rank}: {got['value']}"


#: (case, the error's start, a detail); every one an InvalidArgumentError on both ranks
BAD_EDGES = [
    ("dim_gather", "gather_from_parallel: argument 'dim' must be a dimension of x, an int in [-2, 2)", "got 5"),
    ("dim_scatter", "scatter_to_parallel: argument 'dim' must be a dimension of x", "got -3"),
    ("dim_reduce_scatter", "reduce_scatter_to_parallel: argument 'dim' must be a dimension of x", "got 2"),
    ("dim_bad_on_rank0", "gather_from_parallel: argument 'dim' must be the same value on every rank", "rank 0: None; rank 1: 1"),
    ("dim_column_overlap", "ColumnParallelLinear: argument 'sequence_dim' must be a dimension of x, an int in [-3, 3)", "got 3"),
    ("dim_row", "RowParallelLinear: argument 'sequence_dim' must be a dimension of x", "got 4"),
    ("dim_embedding", "VocabParallelEmbedding: argument 'sequence_dim' must be a dimension of the output", "got 3"),
    ("norm_width_differs", "ParallelRMSNorm: argument 'weight' must be the same dtype and shape", "rank 0: float32 (8,); rank 1: float32 (10,)"),
    ("norm_dtype_differs", "ParallelRMSNorm: argument 'weight' must be the same dtype and shape", "rank 0: float32 (8,); rank 1: float64 (8,)"),
    ("norm_bias_differs", "ParallelLayerNorm: argument 'bias' must be a bias on every rank of the group, or on none", "rank 0: 1; rank 1: 0"),
    ("ids_bool", "VocabParallelEmbedding: argument 'ids' must be an int64 or int32 tensor", "torch.bool"),
    ("ids_uint8", "VocabParallelEmbedding: argument 'ids' must be an int64 or int32 tensor", "torch.uint8"),
    ("target_bool", "vocab_parallel_linear_cross_entropy: argument 'target' must be an integer tensor", "torch.bool"),
    ("meta_column", "ColumnParallelLinear: argument 'x' must be a tensor on the layer's device; got ranks 0, 1:", "tensor on meta, the layer on cpu"),
    ("meta_column_layer", "ColumnParallelLinear: argument 'x' must be a tensor on the layer's device; got ranks 0, 1:", "a float32 tensor on cpu, the layer on meta"),
    ("meta_row", "RowParallelLinear: argument 'x' must be a tensor on the layer's device; got ranks 0, 1:", "tensor on meta, the layer on cpu"),
    ("meta_ids", "VocabParallelEmbedding: argument 'ids' must be a tensor on the layer's device; got ranks 0, 1:", "tensor on meta, the layer on cpu"),
    ("meta_loss_target", "vocab_parallel_linear_cross_entropy: argument 'target' must be a tensor on the layer's device", "tensor on meta"),
    ("meta_head", "VocabParallelLMHead: argument 'x' must be a tensor on the layer's device; got ranks 0, 1:", "tensor on meta, the layer on cpu"),
    ("meta_norm", "ParallelRMSNorm: argument 'x' must be a tensor on the layer's device; got ranks 0, 1:", "tensor on meta, the layer on cpu"),
    ("meta_moe", "ExpertParallelMoE: argument 'x' must be a tensor on the layer's device; got ranks 0, 1:", "tensor on meta, the layer on cpu"),
    ("size_negative", "ColumnParallelLinear: argument 'in_features' must be an int of at least 0", "got -8"),
    ("size_float", "RowParallelLinear: argument 'out_features' must be an int of at least 0", "got 6.0"),
    ("size_embedding_float", "VocabParallelEmbedding: argument 'embedding_dim' must be an int of at least 1", "got 4.5"),
    ("size_head_vocab_zero", "VocabParallelLMHead: argument 'vocab_size' must be an int of at least 1", "got 0"),
    ("size_chunk_rows_zero", "vocab_parallel_linear_cross_entropy: argument 'chunk_rows' must be an int of at least 1", "got ranks 0, 1: 0"),
    ("size_chunks_bool", "ColumnParallelLinear: argument 'chunks' must be an int of at least 1", "got True"),
]


@pytest.mark.parametrize("case, head, detail", BAD_EDGES, ids=[c[0] for c in BAD_EDGES])
def test_bad_edges_are_invalid_argument_errors_on_every_rank(outcomes: list, case: str, head: str, detail: str) -> None:
    """Before: a bare IndexError from movedim for a dimension out of range, and with the overlapped
    gather a sequence_dim one past the last wrapped to dim 0 and gathered the batch (a wrong result);
    norms whose weights differ in width or dtype (or a bias on one rank) aborted both ranks in the
    backward's gradient all-reduce (SIGABRT); bool and uint8 ids or bool targets raised torch's
    "Subtraction ... with a bool tensor"; a meta input raised "unknown device type for autocast"
    or "unsupported scalarType"; negative or float sizes raised torch.empty's RuntimeError or
    TypeError, and chunk_rows=0, chunks=True and an LM head of vocab_size 0 were taken."""
    _raised(outcomes, case, "InvalidArgumentError", head, detail)
    if case.startswith(("dim_bad", "norm_", "meta_", "ids_", "target_", "size_chunk")):  # the same error, from the shared table
        assert outcomes[0][case]["message"] == outcomes[1][case]["message"]


def test_norms_check_only_where_a_backward_will_sum_gradients(outcomes: list) -> None:
    """Without grad there is no collective to protect, and no check to pay: each rank its own width."""
    for rank in (0, 1):
        got = outcomes[rank]["norm_width_differs_no_grad"]
        assert not got["raised"] and got["value"] == (2, 8 + 2 * rank), got


def test_moe_on_a_group_without_this_rank(outcomes: list) -> None:
    """Before: "argument 'group' must be a torch.distributed ProcessGroup ...; got -100"."""
    _raised(outcomes, "moe_outside_group", "InvalidArgumentError", "ExpertParallelMoE: argument 'group' must be a process group "
            "that contains this rank (global rank 1)", "NON_GROUP_MEMBER", ranks=(1,))
    assert "ExpertParallelMoE(" in outcomes[0]["moe_outside_group"]["value"]


@pytest.mark.parametrize("env", [(), (("HAL_PARALLEL_CHECK", "0"),)], ids=["set_checks", "HAL_PARALLEL_CHECK=0"])
def test_checks_switch_off(env: tuple, seed: int) -> None:
    """set_checks(False) leaves only the local checks: ids that differ between ranks go unnoticed,
    out-of-range ids still raise (on each rank by itself); set_checks(None) restores the default
    (HAL_PARALLEL_CHECK=0 turns the default off too)."""
    results = _launched(seed, "switch", env)
    assert all(r.ok for r in results), [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results]
    for r in results:
        got = r.value
        assert not got["off_ids_differ_unchecked"]["raised"], got["off_ids_differ_unchecked"]
        assert "IndexError" in got["off_id_past_vocab"]["raised"] and f"got {V} (group rank {r.rank})" in got["off_id_past_vocab"]["message"]
        if env:
            assert not got["on_ids_differ"]["raised"], got["on_ids_differ"]
        else:
            assert "InvalidArgumentError" in got["on_ids_differ"]["raised"], got["on_ids_differ"]


def test_set_checks_refuses_other_values() -> None:
    import hal.parallel
    from hal.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="True, False or None"):
        hal.parallel.set_checks("yes")  # type: ignore[arg-type]


_CUDA_PROBE = """
import sys, torch
from hal.parallel import checks
ids = torch.tensor([[1, 4], [{bad}, 2]], device="cuda")
checks.set_checks({setting})
found = checks.out_of_range(ids, 8)
print("found", found, flush=True)
torch.cuda.synchronize()
print("synchronized", flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("setting, bad", [("None", 9), ("True", 9), ("None", 3)], ids=["default-bad", "checks-on-bad", "default-valid"])
def test_out_of_range_on_cuda(setting: str, bad: int) -> None:
    """On a GPU the default finds a bad id with a device-side assert (no synchronisation: torch's
    own behaviour on CUDA, the process's CUDA context is lost at the next synchronisation); with the
    checks on it is found on the host and raised as on the CPU. A subprocess, for the lost context."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CUDA_PROBE.format(bad=bad, setting=setting)], capture_output=True, text=True, timeout=120)
    if bad < 8 or setting == "True":
        assert run.returncode == 0, run.stderr
        assert f"found {bad if bad >= 8 else None}" in run.stdout and "synchronized" in run.stdout, run.stdout
    else:
        assert "found None" in run.stdout and "synchronized" not in run.stdout, run.stdout
        assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr[-2000:]
