"""The cross-rank argument check of debug mode (``hal.dist.set_debug(True)`` or ``HAL_DIST_CHECK=1``).

Before the collective, the ranks all-gather a small integer signature of their call (collective,
algorithm, op, dtype, shape, root, split sizes). Every rank then sees the same table, so when the
calls disagree every rank raises the same :class:`hal.InvalidArgumentError`, naming what each rank
passed, instead of one rank hanging or the data going wrong. ``send``/``recv`` pairs swap their
signatures with the peer instead. The check runs as the first step of the call, in call order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from hal.dist import engine
from hal.dist.algorithms import COLLECTIVES, REDUCE_OPS, REGISTRY, Call
from hal.dist.engine import Steps
from hal.errors import InvalidArgumentError

#: the dtypes every engine moves (gloo's set); the index is the dtype's code in signatures.
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)
_DIMS = 6  # leading dims carried in full; the rest are covered by a hash of the whole shape
_HEAD = 7 + _DIMS  # collective, algorithm, op, dtype, peer, ndim, shape hash, dims


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else f"dtype #{code}"


def _shape_hash(shape: torch.Size) -> int:
    value = 1469598103934665603  # FNV-1a over the dims: the same on every rank (unlike hash())
    for d in shape:
        value = ((value ^ int(d)) * 1099511628211) % (1 << 61)
    return value


def signature(call: Call, algorithm: str) -> list[int]:
    """The integers that must agree across ranks (with split sizes: -1 except for all_to_all)."""
    t = call.tensor
    dims = list(t.shape[:_DIMS]) + [-1] * (_DIMS - min(t.dim(), _DIMS))
    row = [
        COLLECTIVES.index(call.collective),
        list(REGISTRY[call.collective]).index(algorithm),
        REDUCE_OPS.index(call.op) if call.op else -1,
        DTYPES.index(t.dtype),
        -1 if call.peer is None else call.peer,
        t.dim(),
        _shape_hash(t.shape[1:] if call.collective == "all_to_all" else t.shape),
        *dims,
    ]
    n = call.gi.size  # split fields on every call: the rows of any two collectives have one length
    send, recv = [-1] * n, [-1] * n
    if call.collective == "all_to_all":
        send = call.input_splits if call.input_splits is not None else [t.shape[0] // n] * n
        recv = call.output_splits if call.output_splits is not None else recv
    row += [*send, *recv]
    return row


def _describe(row: list[int], collective: str) -> str:
    ndim = row[5]
    dims = [str(d) for d in row[7 : 7 + min(ndim, _DIMS)]] + (["..."] if ndim > _DIMS else [])
    if collective == "all_to_all" and dims:
        dims[0] = "*"  # rows may differ between ranks
    return f"{_dtype_name(row[3])} ({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def group_by(values: list[str]) -> str:
    """'ranks 0-2: a; rank 3: b' for a per-rank list of descriptions."""
    parts: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        parts.setdefault(v, []).append(rank)
    out = []
    for v, ranks in parts.items():
        run = len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1))
        label = f"{ranks[0]}-{ranks[-1]}" if run else ", ".join(map(str, ranks))
        out.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {label}: {v}")
    return "; ".join(out)


def compare(call: Call, rows: list[list[int]]) -> Optional[InvalidArgumentError]:
    """The error to raise when the ranks' signatures disagree, else None (the same on every rank)."""
    name = call.collective
    fields = [
        (0, "collective", "the same collective on every rank of the group", lambda r: COLLECTIVES[r[0]]),
        (1, "algorithm", "the same algorithm on every rank (same hal.dist settings, HAL_KERNEL_*)",
         lambda r: list(REGISTRY[name])[r[1]]),
        (2, "op", "the same reduction on every rank", lambda r: REDUCE_OPS[r[2]] if r[2] >= 0 else "-"),
        (4, "src", "the same root rank on every rank", lambda r: str(r[4])),
    ]
    for index, arg, expected, show in fields:
        if len({r[index] for r in rows}) > 1:
            return InvalidArgumentError(name, arg, expected, group_by([show(r) for r in rows]))
    same_shape = [r[3:_HEAD] for r in rows]
    if name == "all_to_all":
        same_shape = [[r[3], r[5], r[6], *r[8:_HEAD]] for r in rows]  # dim 0 may differ
    if any(s != same_shape[0] for s in same_shape):
        what = "the same dtype and trailing dims" if name == "all_to_all" else "the same dtype and shape"
        return InvalidArgumentError(
            name, "t", f"{what} on every rank of the group", group_by([_describe(r, name) for r in rows])
        )
    if name == "all_to_all":
        return _compare_splits(rows, call.gi.size)
    return None


def _compare_splits(rows: list[list[int]], n: int) -> Optional[InvalidArgumentError]:
    send = [r[_HEAD : _HEAD + n] for r in rows]
    recv = [r[_HEAD + n : _HEAD + 2 * n] for r in rows]
    for dst in range(n):
        for src in range(n):
            expect = recv[dst][src]
            if expect >= 0 and expect != send[src][dst]:
                return InvalidArgumentError(
                    "all_to_all",
                    "output_split_sizes",
                    f"on rank {dst}, entry {src} equal to input_split_sizes[{dst}] of rank {src} ({send[src][dst]})",
                    str(expect),
                )
    return None


def verify(call: Call, algorithm: str) -> Steps:
    """Steps exchanging the call's signature and raising on a mismatch (run before the algorithm)."""
    if call.collective in ("send", "recv"):
        return (yield from _verify_pair(call))
    mine = torch.tensor(signature(call, algorithm), dtype=torch.int64, device=call.tensor.device)
    table = torch.empty(call.gi.size * mine.numel(), dtype=torch.int64, device=mine.device)
    yield engine.all_gather_into(table, mine, call.gi.group)
    error = compare(call, table.view(call.gi.size, -1).tolist())
    if error is not None:
        raise error
    return None


def _verify_pair(call: Call) -> Steps:
    t = call.tensor
    mine = torch.tensor([DTYPES.index(t.dtype), t.dim(), _shape_hash(t.shape), t.numel()], dtype=torch.int64, device=t.device)
    theirs = torch.empty_like(mine)
    ops: list[Any] = [
        dist.P2POp(dist.isend, mine, call.peer, call.gi.group, engine.P2P_TAG + 1),
        dist.P2POp(dist.irecv, theirs, call.peer, call.gi.group, engine.P2P_TAG + 1),
    ]
    yield dist.batch_isend_irecv(ops)
    if mine.tolist() != theirs.tolist():
        other = "recv" if call.collective == "send" else "send"
        code, _, _, numel = theirs.tolist()
        raise InvalidArgumentError(
            call.collective,
            "t",
            f"the dtype and shape of the matching {other} on rank {call.peer} ({_dtype_name(code)}, {numel} elements)",
            f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}",
        )
    return None
