"""Collective algorithms as registered implementations, with capability reasons and a cost.

An algorithm is a generator function taking a :class:`Call`: it starts c10d transfers with
``async_op=True``, yields their work handles, and returns the result (see :mod:`hal.dist.engine`).
It is an :class:`Algorithm`: which collective it implements, whether it is lossy, a
``reasons(call)`` function (sentences saying why it cannot run this call; empty when it can) and a
``cost(call, model)`` estimate in seconds that ``auto`` compares. This module holds the ``native``
algorithm of every collective (the engine's own operation), registered in its own table with
:func:`register`; ``hierarchical`` and the compressed algorithms live in their own modules, each
listing them in ``ALGORITHMS``, which :func:`hal.wiring.wire` installs (:func:`install`) after the
native ones: hierarchical, then compressed_fp16 and compressed_bf16. Importing a module fills no
table of another.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from hal.dist import engine
from hal.dist.cost import CostModel
from hal.dist.engine import Steps
from hal.dist.groups import GroupInfo

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")
REDUCE_OPS = ("sum", "avg", "max", "min")

#: c10d reduction per hal op (avg is summed, then divided: gloo has no average of its own)
C10D_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclasses.dataclass(slots=True)
class Call:
    """One collective call after validation: what every algorithm and the cost model look at."""

    collective: str
    tensor: torch.Tensor
    gi: GroupInfo
    op: str = ""  # reduction for all_reduce / reduce_scatter
    peer: Optional[int] = None  # broadcast src, send dst, recv src (global ranks)
    input_splits: Optional[list[int]] = None  # all_to_all
    output_splits: Optional[list[int]] = None
    #: a synchronous call on a GPU engine: a one-transfer algorithm may call c10d synchronously
    #: (stream-ordered either way; the synchronous call is the cheaper one on the host)
    blocking: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def reduce_op(self) -> Any:
        """The c10d ReduceOp; ``avg`` is a sum divided afterwards (:meth:`finish_avg`) except on NCCL/RCCL."""
        if self.op == "avg" and self.gi.engine in engine.GPU_ENGINES:
            return dist.ReduceOp.AVG
        return C10D_OP[self.op]

    def finish_avg(self, t: torch.Tensor) -> None:
        """Divide a summed ``avg`` by the group size where the engine could not average itself."""
        if self.op == "avg" and self.gi.engine not in engine.GPU_ENGINES:
            t.div_(self.gi.size)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered implementation of one collective."""

    name: str
    collective: str
    steps: Callable[[Call], Steps]
    reasons: Callable[[Call], list[str]]
    cost: Callable[[Call, CostModel], float]
    lossy: bool = False
    #: True when the algorithm is one engine operation (async calls need no lane; see engine.execute).
    single_step: bool = False


#: collective -> algorithm name -> Algorithm, in registration order: this module's native ones,
#: then those :func:`hal.wiring.wire` installs (the order of ``hal.explain`` and of auto's ties).
REGISTRY: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}


def install(algorithms: Iterable[Algorithm]) -> None:
    """Add ``algorithms`` to :data:`REGISTRY`, in order; a name taken already is an error."""
    for alg in algorithms:
        if alg.name in REGISTRY[alg.collective]:
            raise ValueError(f"hal.dist: {alg.collective} already has an algorithm named {alg.name!r}")
        REGISTRY[alg.collective][alg.name] = alg


def _no_reasons(call: Call) -> list[str]:
    return []


def register(
    collective: str,
    name: str,
    *,
    cost: Callable[[Call, CostModel], float],
    reasons: Callable[[Call], list[str]] = _no_reasons,
    lossy: bool = False,
    single_step: bool = False,
) -> Callable[[Callable[[Call], Steps]], Callable[[Call], Steps]]:
    """Register the decorated generator function as algorithm ``name`` of ``collective`` (this
    module's native algorithms; another module lists its own in ``ALGORITHMS`` instead)."""

    def deco(fn: Callable[[Call], Steps]) -> Callable[[Call], Steps]:
        install([Algorithm(name, collective, fn, reasons, cost, lossy, single_step)])
        return fn

    return deco


def algorithms(collective: str = "all_reduce") -> list[str]:
    """Names of the algorithms registered for ``collective``."""
    return list(REGISTRY[collective])


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy (engines need dense buffers)."""
    return t if t.is_contiguous() else t.contiguous()


def _ring(call: Call, m: CostModel, nbytes: float, phases: int) -> float:
    return m.ring(nbytes, call.gi.size, call.gi.node_count, phases)


def _native_all_reduce_cost(call: Call, m: CostModel) -> float:
    gi = call.gi
    if m.topology_aware_native and gi.node_count > 1 and gi.per_node:
        return m.two_level(call.nbytes, gi.per_node, gi.node_count, extra_launches=0)
    return _ring(call, m, call.nbytes, 2)


# --- all_reduce ------------------------------------------------------------------------------


@register(
    "all_reduce",
    "native",
    single_step=True,
    cost=_native_all_reduce_cost,
)
def native_all_reduce(call: Call) -> Steps:
    """The engine's own all-reduce (NCCL/RCCL rings and trees, gloo's ring)."""
    t = call.tensor
    buf = contiguous(t)
    yield dist.all_reduce(buf, op=call.reduce_op(), group=call.gi.group, async_op=not call.blocking)
    call.finish_avg(buf)
    if buf is not t:
        t.copy_(buf)
    return t


# --- all_gather, reduce_scatter, all_to_all ------------------------------------------------------


@register(
    "all_gather",
    "native",
    single_step=True,
    cost=lambda call, m: _ring(call, m, call.nbytes * call.gi.size, 1),
)
def native_all_gather(call: Call) -> Steps:
    """The engine's own all-gather; the shards are concatenated along dim 0."""
    t = contiguous(call.tensor)
    if t.dim() == 0:  # 0-d tensors are stacked: one element per rank
        t = t.reshape(1)
    out = t.new_empty((call.gi.size * t.shape[0], *t.shape[1:]))
    yield engine.all_gather_into(out, t, call.gi.group, async_op=not call.blocking)
    return out


@register(
    "reduce_scatter",
    "native",
    single_step=True,
    cost=lambda call, m: _ring(call, m, call.nbytes, 1),
)
def native_reduce_scatter(call: Call) -> Steps:
    """The engine's own reduce-scatter; this rank receives its block of dim 0."""
    t = contiguous(call.tensor)
    out = t.new_empty((t.shape[0] // call.gi.size, *t.shape[1:]))
    yield engine.reduce_scatter_into(out, t, call.reduce_op(), call.gi.group, async_op=not call.blocking)
    call.finish_avg(out)
    return out


@register(
    "all_to_all",
    "native",
    cost=lambda call, m: _ring(call, m, call.nbytes, 1),
)
def native_all_to_all(call: Call) -> Steps:
    """The engine's own all-to-all; without output split sizes they are exchanged first (MoE dispatch)."""
    t = contiguous(call.tensor)
    in_splits, out_splits = call.input_splits, call.output_splits
    if in_splits is not None and out_splits is None:
        counts = torch.tensor(in_splits, dtype=torch.int64, device=t.device)
        received = torch.empty_like(counts)
        yield dist.all_to_all_single(received, counts, group=call.gi.group, async_op=True)
        out_splits = [int(c) for c in received.tolist()]
    rows = sum(out_splits) if out_splits is not None else t.shape[0]  # equal blocks: as many rows return
    out = t.new_empty((rows, *t.shape[1:]))
    yield dist.all_to_all_single(out, t, out_splits, in_splits, group=call.gi.group, async_op=True)
    return out


# --- broadcast, send, recv -------------------------------------------------------------------------


@register(
    "broadcast",
    "native",
    single_step=True,
    cost=lambda call, m: _ring(call, m, call.nbytes, 2),  # as a scatter then an all-gather
)
def native_broadcast(call: Call) -> Steps:
    """The engine's own broadcast from global rank ``src``."""
    t = call.tensor
    buf = contiguous(t)
    yield dist.broadcast(buf, call.peer, group=call.gi.group, async_op=not call.blocking)
    if buf is not t:
        t.copy_(buf)
    return t


def _one_step(call: Call, m: CostModel) -> float:
    return m.ring(call.nbytes * 2, 2, call.gi.node_count, 1)  # one step carrying the whole tensor


@register("send", "native", single_step=True, cost=_one_step)
def native_send(call: Call) -> Steps:
    """The engine's own point-to-point send to global rank ``dst``."""
    yield dist.isend(contiguous(call.tensor), call.peer, group=call.gi.group)
    return None


@register("recv", "native", single_step=True, cost=_one_step)
def native_recv(call: Call) -> Steps:
    """The engine's own point-to-point receive from global rank ``src``, into ``t``."""
    t = call.tensor
    buf = contiguous(t)
    yield dist.irecv(buf, call.peer, group=call.gi.group)
    if buf is not t:
        t.copy_(buf)
    return t
