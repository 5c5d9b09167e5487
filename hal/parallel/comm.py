"""Collectives that autograd can differentiate, each issued through :mod:`hal.dist`.

Parallel layers move activations between ranks in pairs of conjugate operations: what the forward
gathers, the backward reduce-scatters; what the forward sums over ranks, the backward passes through.
Each function below is one such pair, written once, so a layer states *where* its activations are
split and these functions say *how* they travel (hal's algorithm choice, ``hal.explain``,
:class:`hal.dist.CommError` on a dead or stalled peer).

``group`` is a ``torch.distributed`` process group (``mesh.get_group(dim)`` of a ``DeviceMesh``) or
None for the default group. ``dim`` is the tensor dimension that is split across the group's ranks,
in group-rank order.

Each function checks first, with one small collective, that every rank passes a tensor of the same
dtype and shape (:mod:`hal.parallel.checks`; ``check=False`` when the caller has checked already),
so that a mismatch is an error on every rank instead of a crashed or wrong collective. The backward
moves tensors of the forward's shapes and is not checked again.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import hal.dist as hd
from hal.errors import InvalidArgumentError
from hal.parallel import checks
from hal.parallel.checks import group_rank, group_size, member  # noqa: F401  (also hal.parallel.comm's, as docs/parallel.md names them)


def axis_of(x: torch.Tensor, dim: Any) -> Optional[int]:
    """``dim`` as an index into ``x``'s dimensions (``-1`` -> ``x.dim() - 1``), or None where it is
    none of them (out of range, or not an int)."""
    n = x.dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or not -n <= dim < n:
        return None
    return dim % n


def axis(x: torch.Tensor, dim: Any, op: str, arg: str = "dim", of: str = "x") -> int:
    """:func:`axis_of`, or :class:`hal.InvalidArgumentError` naming ``op`` and ``arg`` where ``dim``
    is no dimension of ``x`` (``of`` says what ``x`` is to the caller). torch's ``movedim`` raised a
    bare IndexError there, and an index wrapped around split another dimension than the one asked for."""
    found = axis_of(x, dim)
    if found is None:
        n = x.dim()
        raise InvalidArgumentError(op, arg, f"a dimension of {of}, an int in [{-n}, {n}) for its shape {tuple(x.shape)}", repr(dim))
    return found


def _agree(call: str, x: torch.Tensor, group: Any, check: bool, dim: Optional[int] = None) -> None:
    """The cross-rank check of a function below: x's dtype and shape (and the split dimension, None
    where it is no dimension of x: every rank then raises that error after the check)."""
    if check:
        fields: list[checks.Field] = [("x", x)]
        if dim is not None:
            fields.append(("dim", axis_of(x, dim)))
        checks.agree(call, group, x.device, fields)


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (equal shapes on every rank)."""
    n = group_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = hd.all_gather(moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks; this rank keeps its slice of ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise InvalidArgumentError(
            "reduce_scatter_to_parallel", "x", f"of a size along dim {dim} divisible by the group's {n} ranks "
            "(pad the sequence or hidden size to a multiple of the parallel degree)", f"size {x.shape[dim]}")
    moved = x.movedim(dim, 0).contiguous()
    out = hd.reduce_scatter(moved, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's slice of ``dim`` (a copy; no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise InvalidArgumentError(
            "scatter_to_parallel", "x", f"of a size along dim {dim} divisible by the group's {n} ranks "
            "(choose a size that is a multiple of the parallel degree)", f"size {x.shape[dim]}")
    return x.chunk(n, dim)[group_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    hd.all_reduce(out, op=op, group=group)
    return out


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, grad_reduce: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.grad_reduce = dim, group, grad_reduce
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        if ctx.grad_reduce:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, send: Optional[list[int]], receive: Optional[list[int]]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        if group_size(group) == 1:
            return x.clone()
        return hd.all_to_all(x.contiguous(), group=group, input_split_sizes=send, output_split_sizes=receive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        if group_size(ctx.group) == 1:
            return grad.clone(), None, None, None
        out = hd.all_to_all(grad.contiguous(), group=ctx.group, input_split_sizes=ctx.receive, output_split_sizes=ctx.send)
        return out, None, None, None


def copy_to_parallel(x: torch.Tensor, group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Forward: ``x`` as is (every rank holds all of it). Backward: the gradients summed over ranks.

    The entry of a column-parallel region: each rank's partial gradient of the replicated input
    becomes the full one."""
    _agree("copy_to_parallel", x, group, check)
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Forward: ``x`` summed over ranks. Backward: the gradient as is.

    The exit of a row-parallel region: each rank holds a partial sum of the output."""
    _agree("reduce_from_parallel", x, group, check)
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, dim: int, group: Any = None, *, grad_reduce: bool = True,
                         check: bool = True) -> torch.Tensor:
    """Forward: every rank's ``x`` concatenated along ``dim``. Backward: the gradient summed over ranks
    and split along ``dim`` (``grad_reduce=True``: the gathered value fed computations on every rank,
    as sequence parallelism's entry to a tensor-parallel region does), or only split
    (``grad_reduce=False``: each rank used the gathered value alike, as gathering a column-parallel
    output does)."""
    _agree("gather_from_parallel", x, group, check, dim)
    return _Gather.apply(x, axis(x, dim, "gather_from_parallel"), group, grad_reduce)


def reduce_scatter_to_parallel(x: torch.Tensor, dim: int, group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Forward: ``x`` summed over ranks, this rank's slice of ``dim`` kept. Backward: the gradient
    gathered along ``dim``. The exit of a row-parallel region under sequence parallelism."""
    _agree("reduce_scatter_to_parallel", x, group, check, dim)
    return _ReduceScatter.apply(x, axis(x, dim, "reduce_scatter_to_parallel"), group)


def scatter_to_parallel(x: torch.Tensor, dim: int, group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Forward: this rank's slice of ``dim`` of a replicated ``x``. Backward: the gradient gathered."""
    _agree("scatter_to_parallel", x, group, check, dim)
    return _Split.apply(x, axis(x, dim, "scatter_to_parallel"), group)


def all_to_all(
    x: torch.Tensor,
    group: Any = None,
    send_sizes: Optional[Sequence[int]] = None,
    receive_sizes: Optional[Sequence[int]] = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Forward: block ``j`` of ``x``'s dim 0 (``send_sizes[j]`` rows) to group rank ``j``; the blocks
    received, in rank order. Backward: the same exchange reversed (the gradient rows go back where
    they came from). Without ``receive_sizes`` the ranks first exchange their counts. The check
    compares x's dtype and dimensions after the first (the rows may differ between ranks)."""
    if check:
        checks.agree("all_to_all", group, x.device, [("x.dtype", x.dtype), ("x.shape[1:]", tuple(x.shape[1:]))])
    if receive_sizes is None and send_sizes is not None and group_size(group) > 1:
        counts = torch.tensor(list(send_sizes), dtype=torch.int64)
        if x.is_cuda:
            counts = counts.to(x.device)
        received = hd.all_to_all(counts, group=group)
        receive_sizes = [int(c) for c in received.tolist()]
    send = None if send_sizes is None else [int(s) for s in send_sizes]
    receive = None if receive_sizes is None else [int(s) for s in receive_sizes]
    return _AllToAll.apply(x, group, send, receive)
