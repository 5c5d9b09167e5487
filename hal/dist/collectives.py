"""The public collectives of hal.dist: arguments checked here, then the chosen algorithm runs.

Each function takes a torch tensor (or a CPU NumPy array, shared without copying), validates its
arguments on this rank (bad input raises :class:`hal.InvalidArgumentError` before anything is
sent), picks the algorithm (:mod:`hal.dist.select`), and runs it (:mod:`hal.dist.engine`). With
``async_op=True`` it returns a :class:`hal.dist.Work`. ``hal.explain("<collective>", ...)`` takes
the same arguments (without ``async_op``) and shows the choice.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hal import arrays
from hal.arrays import describe
from hal.dispatch.decision import Decision
from hal.dist import checks, engine, groups, select, settings
from hal.dist.algorithms import REDUCE_OPS, Call
from hal.errors import InvalidArgumentError

_REDUCE_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
_DTYPES = frozenset(checks.DTYPES)
Back = Callable[[Any], Any]  # turns the algorithm's torch result into what the caller gets
Built = tuple[Call, str, Back]


def _tensor(collective: str, t: Any, in_place: bool) -> tuple[torch.Tensor, Back]:
    """The torch tensor to work on (detached: collectives are not differentiated) and the result mapping."""
    if isinstance(t, torch.Tensor):
        work = t.detach()
        if in_place:
            return work, lambda _: t
        return work, lambda r: r
    if isinstance(t, np.ndarray):
        if in_place and (not t.flags.writeable or any(s < 0 for s in t.strides)):
            raise InvalidArgumentError(
                collective, "t", "a writeable NumPy array without negative strides (it is updated in place)", describe(t)
            )
        work = arrays.from_numpy(t)
        if in_place:
            return work, lambda _: t
        return work, lambda r: arrays.to_numpy(r) if isinstance(r, torch.Tensor) else r
    raise InvalidArgumentError(collective, "t", "a torch.Tensor or a numpy.ndarray", describe(t))


def _common(collective: str, t: Any, group: Any, algorithm: Any, in_place: bool) -> tuple[torch.Tensor, Back, groups.GroupInfo]:
    work, back = _tensor(collective, t, in_place)
    if work.dtype not in _DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in checks.DTYPES)
        raise InvalidArgumentError(collective, "t", f"a tensor of one of {names}", describe(t))
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InvalidArgumentError(collective, "group", "a torch.distributed ProcessGroup or None", describe(group))
    if not isinstance(algorithm, str):
        raise InvalidArgumentError(collective, "algorithm", "an algorithm name or 'auto'", describe(algorithm))
    return work, back, groups.info(collective, group, work.device)


def _op(collective: str, op: Any, t: torch.Tensor) -> str:
    if op == "sum":
        return "sum"
    name = op.lower() if isinstance(op, str) else _REDUCE_NAMES.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else None
    if name not in REDUCE_OPS:
        raise InvalidArgumentError(collective, "op", "one of 'sum', 'avg', 'max', 'min'", repr(op))
    if name == "avg" and not t.is_floating_point():
        raise InvalidArgumentError(
            collective, "op", "'sum', 'max' or 'min' for an integer tensor (avg needs floating point)", f"'avg' with {describe(t)}"
        )
    return name


def _rank(collective: str, arg: str, value: Any, gi: groups.GroupInfo, p2p: bool) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in gi.global_ranks:
        raise InvalidArgumentError(collective, arg, f"a global rank of the group ({list(gi.global_ranks)})", repr(value))
    if p2p and value == gi.global_ranks[gi.rank]:
        raise InvalidArgumentError(collective, arg, "another rank than this one", repr(value))
    return value


def _splits(name: str, value: Any, gi: groups.GroupInfo) -> Optional[list[int]]:
    if value is None:
        return None
    items = list(value.tolist() if isinstance(value, torch.Tensor) else value)
    if len(items) != gi.size or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in items):
        raise InvalidArgumentError("all_to_all", name, f"{gi.size} non-negative ints (one per rank)", repr(value))
    return items


# --- building a call per collective (shared by the functions and their explainers) -----------------


def _build_all_reduce(t: Any, op: Any = "sum", group: Any = None, algorithm: Any = "auto") -> Built:
    work, back, gi = _common("all_reduce", t, group, algorithm, in_place=True)
    return Call("all_reduce", work, gi, op=_op("all_reduce", op, work)), algorithm, back


def _build_all_gather(t: Any, group: Any = None, algorithm: Any = "auto") -> Built:
    work, back, gi = _common("all_gather", t, group, algorithm, in_place=False)
    return Call("all_gather", work, gi), algorithm, back


def _build_reduce_scatter(t: Any, op: Any = "sum", group: Any = None, algorithm: Any = "auto") -> Built:
    work, back, gi = _common("reduce_scatter", t, group, algorithm, in_place=False)
    if work.dim() == 0 or work.shape[0] % gi.size:
        raise InvalidArgumentError(
            "reduce_scatter", "t", f"a tensor whose dim 0 is a multiple of the group size {gi.size}", describe(t)
        )
    return Call("reduce_scatter", work, gi, op=_op("reduce_scatter", op, work)), algorithm, back


def _build_all_to_all(
    t: Any,
    group: Any = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    output_split_sizes: Optional[Sequence[int]] = None,
    algorithm: Any = "auto",
) -> Built:
    work, back, gi = _common("all_to_all", t, group, algorithm, in_place=False)
    if work.dim() == 0:
        raise InvalidArgumentError("all_to_all", "t", "a tensor of at least one dimension", describe(t))
    send = _splits("input_split_sizes", input_split_sizes, gi)
    recv = _splits("output_split_sizes", output_split_sizes, gi)
    if send is None and work.shape[0] % gi.size:
        raise InvalidArgumentError(
            "all_to_all", "t", f"dim 0 a multiple of the group size {gi.size} when input_split_sizes is None", describe(t)
        )
    if send is not None and sum(send) != work.shape[0]:
        raise InvalidArgumentError("all_to_all", "input_split_sizes", f"sizes summing to dim 0 of t ({work.shape[0]})", repr(send))
    return Call("all_to_all", work, gi, input_splits=send, output_splits=recv), algorithm, back


def _build_broadcast(t: Any, src: Any, group: Any = None, algorithm: Any = "auto") -> Built:
    work, back, gi = _common("broadcast", t, group, algorithm, in_place=True)
    return Call("broadcast", work, gi, peer=_rank("broadcast", "src", src, gi, p2p=False)), algorithm, back


def _build_send(t: Any, dst: Any, group: Any = None, algorithm: Any = "auto") -> Built:
    work, back, gi = _common("send", t, group, algorithm, in_place=False)
    return Call("send", work, gi, peer=_rank("send", "dst", dst, gi, p2p=True)), algorithm, back


def _build_recv(t: Any, src: Any, group: Any = None, algorithm: Any = "auto") -> Built:
    work, back, gi = _common("recv", t, group, algorithm, in_place=True)
    return Call("recv", work, gi, peer=_rank("recv", "src", src, gi, p2p=True)), algorithm, back


def _run(built: Built, async_op: bool) -> Any:
    call, requested, back = built
    if async_op is not False and async_op is not True:
        raise InvalidArgumentError(call.collective, "async_op", "True or False", repr(async_op))
    alg = select.choose(call, requested)
    call.blocking = not async_op and call.gi.engine in engine.GPU_ENGINES
    steps = alg.steps(call)
    single = alg.single_step
    if settings.debug():  # the cross-rank check runs first, in call order
        steps = _checked(call, alg.name, steps)
        single = False
    run = engine.Run(steps, f"hal.dist.{call.collective} ({alg.name})", call.gi, back)
    return engine.execute(run, async_op, single, call.tensor.device)


def _checked(call: Call, algorithm: str, steps: engine.Steps) -> engine.Steps:
    yield from checks.verify(call, algorithm)
    return (yield from steps)


# --- the public functions --------------------------------------------------------------------------


def all_reduce(t: Any, op: Any = "sum", group: Any = None, algorithm: str = "auto", *, async_op: bool = False) -> Any:
    """Reduce ``t`` over the group in place (op: sum, avg, max, min) and return it.

    ``algorithm``: ``auto`` (the cost model's choice), ``native``, ``hierarchical``,
    ``compressed_fp16`` or ``compressed_bf16`` (see :func:`hal.dist.algorithms`).
    """
    return _run(_build_all_reduce(t, op, group, algorithm), async_op)


def all_gather(t: Any, group: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Every rank's ``t`` (same shape everywhere) concatenated along dim 0, in group-rank order."""
    return _run(_build_all_gather(t, group, algorithm), async_op)


def reduce_scatter(t: Any, op: Any = "sum", group: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """``t`` reduced over the group, split along dim 0 into group-size blocks: this rank's block."""
    return _run(_build_reduce_scatter(t, op, group, algorithm), async_op)


def all_to_all(
    t: Any,
    group: Any = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    output_split_sizes: Optional[Sequence[int]] = None,
    *,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Any:
    """Send block ``j`` of ``t``'s dim 0 to group rank ``j``; return the blocks received, in rank order.

    Blocks are equal without split sizes. With ``input_split_sizes`` alone the ranks first exchange
    how many rows each sends (as MoE token dispatch needs); ``output_split_sizes`` skips that.
    """
    return _run(_build_all_to_all(t, group, input_split_sizes, output_split_sizes, algorithm), async_op)


def broadcast(t: Any, src: int, group: Any = None, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Overwrite ``t`` on every rank with its value on global rank ``src``; return it."""
    return _run(_build_broadcast(t, src, group, algorithm), async_op)


def send(t: Any, dst: int, group: Any = None, *, async_op: bool = False) -> Any:
    """Send ``t`` to global rank ``dst`` (which calls :func:`recv`)."""
    return _run(_build_send(t, dst, group), async_op)


def recv(t: Any, src: int, group: Any = None, *, async_op: bool = False) -> Any:
    """Receive into ``t`` from global rank ``src`` (which calls :func:`send`); return ``t``."""
    return _run(_build_recv(t, src, group), async_op)


def _explainer(build: Callable[..., Built]) -> Callable[..., Decision]:
    def explain(*args: Any, **kwargs: Any) -> Decision:
        call, requested, _ = build(*args, **kwargs)
        return select.decision(call, requested)

    return explain


EXPLAINERS: dict[str, Callable[..., Decision]] = {
    "all_reduce": _explainer(_build_all_reduce),
    "all_gather": _explainer(_build_all_gather),
    "reduce_scatter": _explainer(_build_reduce_scatter),
    "all_to_all": _explainer(_build_all_to_all),
    "broadcast": _explainer(_build_broadcast),
    "send": _explainer(_build_send),
    "recv": _explainer(_build_recv),
}
