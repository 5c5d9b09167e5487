"""hal.parallel given bad or mismatched input on 2 real gloo ranks: every rank raises the same clear
error, no rank crashes, and the group still works afterwards (issue 41, item 8).

One launch runs every case in turn on both ranks (a case's error is caught and recorded with its
class's bases and its message); the tests then assert, case by case, what each rank saw. Before the
fix the ids and targets out of range gave numbers, the layer built on a group without the rank
raised "negative dimension -8", and the shape and dtype mismatches killed rank 0 with SIGABRT
(gloo's size enforcement) while rank 1 returned a wrongly shaped gather. Every input is drawn from
the module's seed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from hal.dist.launch import RankResult, launch

pytestmark = pytest.mark.timeout(240)

N = 2
V = 11  # vocabulary: 6 ids per rank, the last row of rank 1's slice is padding
#: a bound on every wait: a rank left waiting by a bug fails in seconds with CommError, not the group's 60 s
WAIT_S = 20.0


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        value = fn()
    except Exception as exc:  # recorded for the test to judge
        return {"raised": [c.__name__ for c in type(exc).__mro__], "message": f"{type(exc).__name__}: {exc}", "value": None}
    return {"raised": [], "message": "", "value": value}


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
    cases = _cases(rank, seed) if which == "cases" else _switch_cases(rank, seed)
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
