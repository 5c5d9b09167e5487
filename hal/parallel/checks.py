"""Cross-rank agreement checks of hal.parallel: a mismatch between ranks is an error on every rank.

A collective whose ranks pass tensors of different shapes or dtypes does not fail cleanly: gloo
aborts the process whose buffer is too small (``SIGABRT``, "Received data size doesn't match
expected size") while a peer may return a wrongly shaped result, and NCCL may hang or read past
the data. So before a layer's collectives each rank describes its call in a fixed-size row of
integers (which call, the dtype and shape of its tensors, its settings, whether its input is
valid) and the ranks all-gather those rows through :mod:`hal.dist`: one small collective, after
which every rank holds the same table and raises the same error when the rows differ, naming what
each rank passed. The backward's collectives move tensors of the forward's shapes, so the forward's
check covers them too.

When the checks run (:func:`set_checks`, else ``HAL_PARALLEL_CHECK``, else the default):

* on CPU tensors (gloo) by default: one all-gather of 320 bytes a rank per checked call (18 in a
  step of a 4-block tensor-parallel Llama with vocabulary-parallel embedding and loss), measured at
  0.3 % of that step on 2 loaded CPU cores (``benchmarks/parallel_checks.py``; 3 % for a
  2-block model of width 256, whose step is 1 s: docs/parallel.md, "Agreement checks");
* on GPU tensors only when turned on: reading the table back is a host-device synchronisation per
  call, which stalls the host's run-ahead of the GPU;
* never on a group of one rank.

Ids and targets out of range (:func:`out_of_range`) are found on the host for CPU tensors and,
with the checks on, for GPU tensors (the same synchronisation); with the checks off a GPU tensor
gets a device-side assert instead (``torch._assert_async``: no synchronisation, and what torch's
own ``F.embedding`` and ``F.cross_entropy`` do on CUDA). With the checks on, a rank's bad input is
part of its row, so every rank raises :class:`IndexOutOfRangeError` together; with them off, the
rank that found it raises alone (its peers then wait in their next collective until the timeout:
:class:`hal.dist.CommError`).

The checks of a rank's own arguments (a tensor on another device than the layer's, ids of a dtype
other than int64 or int32, a target not of x's leading shape, a bad ``reduction`` or ``chunk_rows``
...) are part of the agreement too: the rank computes its verdict first (:class:`Local`: valid, or
the first :class:`Check` that failed and a short text of what it was given), puts it in its row,
and after the all-gather every rank raises the same :class:`hal.InvalidArgumentError`, naming each
rank and what it passed (``got rank 0: a float64 tensor on meta, the layer on cpu; rank 1:
valid``); the failing rank's own, more detailed error is its ``__cause__``. No rank raises alone
before the collective, so a rank that catches the error and goes on stays in step with its
peers. Where the rows are not exchanged (checks off, a group of one, a layer on ``meta``), the
rank raises its own error at once, as before: its peers then wait in their next collective. A
call that makes no collective (a norm without sequence parallelism or without grad) checks
locally only: there is no exchange to carry its verdict.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

import hal.dist as hd
from hal.dist.checks import group_by
from hal.errors import InvalidArgumentError


class IndexOutOfRangeError(InvalidArgumentError, IndexError):
    """An id or a target outside the vocabulary: an :class:`IndexError` as torch's ``F.embedding``
    and ``F.cross_entropy`` raise, and a :class:`hal.InvalidArgumentError` naming the ranks that
    passed it (with the agreement checks on, every rank raises it)."""


#: the calls that check, by their index in a row (the first field: ranks in different calls differ there)
CALLS = (
    "copy_to_parallel",
    "reduce_from_parallel",
    "gather_from_parallel",
    "reduce_scatter_to_parallel",
    "scatter_to_parallel",
    "all_to_all",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_linear_cross_entropy",
    "ExpertParallelMoE",
    "ParallelRMSNorm",
    "ParallelLayerNorm",
)
SLOTS = 40  # integers per row: the same for every call, so that the ranks' rows always gather
_TEXT = 7  # integers of a rank's local verdict: what it was given, as up to 56 bytes of UTF-8
_HEAD = 4 + _TEXT  # call, out of range?, the bad value, the failed check's code, its text; then the fields
_DIMS = 4  # leading dims shown in full; the rest are covered by a hash of the whole shape
_NONE = -(1 << 62)  # an absent value (None), a padding slot

Value = Union[torch.Tensor, torch.dtype, tuple, int, float, bool, None]
Field = Union[tuple[str, Value], tuple[str, Value, str]]  # (name, value) or (name, value, what must agree)
#: every dtype torch has, by its code in a row (crc32 of its name: the same in every process)
_DTYPE_OF = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}

_enabled: Optional[bool] = None
_env: Optional[bool] = None


def set_checks(enabled: Optional[bool]) -> None:
    """Turn the cross-rank agreement checks on (True: also on GPU tensors, with a synchronisation
    per checked call) or off (False), or back to the default (None: ``HAL_PARALLEL_CHECK`` if set,
    else on for CPU tensors and off for GPU ones). Every rank of a group must use the same setting:
    a rank that checks waits for its peers' rows."""
    global _enabled
    if enabled is not None and not isinstance(enabled, bool):
        raise InvalidArgumentError("hal.parallel.set_checks", "enabled", "True, False or None", repr(enabled))
    _enabled = enabled


def refresh() -> None:
    """Re-read ``HAL_PARALLEL_CHECK`` (the environment is read once, on the first checked call)."""
    global _env
    _env = None


def _from_env() -> Optional[bool]:
    global _env
    if _env is None:
        text = os.environ.get("HAL_PARALLEL_CHECK", "").strip().lower()
        if text in ("1", "true", "yes", "on"):
            _env = True
        elif text in ("0", "false", "no", "off"):
            _env = False
        elif text:
            raise InvalidArgumentError("hal.parallel", "HAL_PARALLEL_CHECK", "1 or 0 (or unset: on for CPU tensors)", repr(text))
    return _env


# --- membership: the group a call names must hold this rank ------------------------------------
# (here, not in hal.parallel.comm, which checks its calls with this module: the two imported each
# other while comm held these; comm re-exports them)


def not_member(group: Any, op: str) -> InvalidArgumentError:
    me = dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        got = (f"GroupMember.NON_GROUP_MEMBER, what torch.distributed.new_group returns on the ranks it leaves out "
               f"(global rank {me} is not in that group)")
    else:
        try:
            got = f"a group of global ranks {dist.get_process_group_ranks(group)}, without global rank {me}"
        except Exception:  # a group torch cannot describe on this rank
            got = f"{group!r}, which does not contain global rank {me}"
    return InvalidArgumentError(op, "group", f"a process group that contains this rank (global rank {me}): build the "
                                "layer only on the group's ranks, or pass the group this rank belongs to "
                                "(mesh['tp'] of a DeviceMesh gives every rank its own)", got)


def member(group: Any = None, op: str = "hal.parallel") -> tuple[int, int]:
    """(ranks in ``group``, this rank's index in it); :class:`hal.InvalidArgumentError` naming the
    group and this rank when this rank is not in it (torch answers -1 there)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or rank < 0:
        raise not_member(group, op)
    return size, rank


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (the default group for None); an error if this rank is not in it."""
    return member(group)[0]


def group_rank(group: Any = None) -> int:
    """This rank's index in ``group``; an error if this rank is not in it."""
    return member(group)[1]


def enabled(device: torch.device) -> bool:
    """Whether calls on ``device`` run the agreement check (see :func:`set_checks`)."""
    if _enabled is not None:
        return _enabled
    env = _from_env()
    return device.type == "cpu" if env is None else env


def exchanged(group: Any, device: torch.device) -> bool:
    """Whether :func:`agree` exchanges rows on ``group`` for tensors on ``device`` (the checks are
    on and the group has peers): what values computed only for the check need."""
    return enabled(device) and group_size(group) > 1


@dataclasses.dataclass
class Bounds:
    """What an argument of ids must be, and the first value of this rank's that is not (or None)."""

    arg: str
    expected: str
    bad: Optional[int]


def out_of_range(values: torch.Tensor, size: int, ignore: Optional[int] = None) -> Optional[int]:
    """The first of ``values`` outside ``[0, size)`` (``ignore`` allowed too), or None.

    On the host for CPU tensors and when the checks are on; otherwise a device-side assert that
    fails the next synchronising call as torch's CUDA kernels do, and None."""
    bad = (values < 0) | (values >= size)
    if ignore is not None:
        bad &= values != ignore
    if values.device.type != "cpu" and not enabled(values.device):
        torch._assert_async(~bad.any(), f"hal.parallel: an id or target outside [0, {size}) (index out of range in self)")
        return None
    if not bool(bad.any()):
        return None
    return int(values[bad][0])


def count(call: str, arg: str, value: Any, low: int) -> int:
    """``value`` where it is an int (no bool) of at least ``low``, else :class:`hal.InvalidArgumentError`
    (a size given to a layer: torch.empty raised "negative dimension" or a TypeError for a float)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(call, arg, f"an int of at least {low}", repr(value))
    return value


def on_device(call: str, arg: str, t: Optional[torch.Tensor], device: torch.device) -> None:
    """Raise :class:`hal.InvalidArgumentError` where tensor ``t`` (argument ``arg`` of ``call``) is not
    on ``device``, the layer's (torch's own errors there named neither: "unknown device type for
    autocast" for a meta input, "unsupported scalarType" in the loss). A local check, for calls that
    make no collective: the layers that do carry it in their row (:meth:`Local.device`)."""
    if t is not None and t.device != device:
        raise InvalidArgumentError(call, arg, f"a tensor on the layer's device, {device}", f"a {t.dtype} tensor on {t.device}")


@dataclasses.dataclass(frozen=True)
class Check:
    """One local check of an argument, the same on every process: the op, the argument and what it
    must be (the text every rank's error shows). Made by :func:`check`, once per check, at import."""

    op: str
    arg: str
    expected: str

    @property
    def code(self) -> int:
        """Its number in a row (crc32 of its texts: the same in every process, never 0)."""
        return zlib.crc32(f"{self.op}\0{self.arg}\0{self.expected}".encode()) | 1


_CHECKS: dict[int, Check] = {}


def check(op: str, arg: str, expected: str) -> Check:
    """A :class:`Check`, registered so that a peer's row can name it."""
    made = Check(op, arg, expected)
    _CHECKS[made.code] = made
    return made


class Local:
    """This rank's verdict on its arguments of one call, before the agreement: valid, or the first
    :class:`Check` that failed with a short text of what it was given (shown to every rank) and the
    error this rank raises where the rows are not exchanged. :func:`agree` carries it in the row."""

    __slots__ = ("failed", "got", "error")

    def __init__(self) -> None:
        self.failed: Optional[Check] = None
        self.got = ""
        self.error: Optional[InvalidArgumentError] = None

    @property
    def ok(self) -> bool:
        return self.failed is None

    def fail(self, check: Check, got: str, expected: Optional[str] = None, got_here: Optional[str] = None) -> None:
        """Record ``check`` as failed (the first failure is kept): ``got`` what this rank passed (as
        every rank shows it); ``expected`` and ``got_here``, more precise texts than those for this
        rank's own error (raised where the rows are not exchanged)."""
        if self.failed is None:
            self.failed, self.got = check, got
            self.error = InvalidArgumentError(check.op, check.arg, expected or check.expected, got_here or got)

    def device(self, check: Check, t: Optional[torch.Tensor], device: torch.device) -> None:
        """:func:`on_device` as a verdict: ``t`` must be on ``device`` (the layer's)."""
        if self.ok and t is not None and t.device != device:
            self.fail(check, f"a {str(t.dtype).removeprefix('torch.')} tensor on {t.device}, the layer on {device}",
                      f"a tensor on the layer's device, {device}", f"a {t.dtype} tensor on {t.device}")

    def count(self, check: Check, value: Any, low: int) -> None:
        """:func:`count` as a verdict (``check.expected``: "an int of at least ``low``")."""
        if self.ok and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            self.fail(check, repr(value)[:40])

    def raise_now(self) -> None:
        """Raise this rank's error, if any (where no agreement carries it: no collective follows)."""
        if self.error is not None:
            raise self.error


def device_check(op: str, arg: str) -> Check:
    """The check that ``arg`` of ``op`` is on the layer's device (:meth:`Local.device`)."""
    return check(op, arg, "a tensor on the layer's device")


def row_device(layer: torch.device, given: torch.device) -> torch.device:
    """Where a call's row travels: the layer's device (a tensor on another one is refused by every
    rank through the row); the given tensor's where the layer's is ``meta``, which has no collectives."""
    return given if layer.type == "meta" else layer


def content_code(values: torch.Tensor) -> int:
    """A checksum of an integer tensor's values (crc32 of its bytes): equal ids give equal codes."""
    return zlib.crc32(values.detach().to("cpu").contiguous().numpy().tobytes())


def config_code(*items: Any) -> int:
    """A checksum of settings (ints, strings, bools, tuples): the same on every process, unlike hash()."""
    return zlib.crc32(repr(items).encode())


def _shape_hash(shape: Sequence[int]) -> int:
    return zlib.crc32(struct.pack(f"<{len(shape)}q", *shape))


def _encode(value: Value) -> list[int]:
    """A field's integers: a tensor is (dtype, ndim, shape hash, leading dims), a shape (ndim, shape
    hash, leading dims), a dtype its code, a float its bits, an int or bool itself, None a marker."""
    if isinstance(value, torch.Tensor):
        return [*_encode(value.dtype), *_encode(tuple(value.shape))]
    if isinstance(value, tuple):
        dims = [int(d) for d in value]
        return [len(dims), _shape_hash(dims), *dims[:_DIMS], *[_NONE] * (_DIMS - min(len(dims), _DIMS))]
    if isinstance(value, torch.dtype):
        return [zlib.crc32(str(value).encode())]
    if isinstance(value, float):
        return list(struct.unpack("<q", struct.pack("<d", value)))
    return [_NONE if value is None else int(value)]


def _dtype_name(code: int) -> str:
    found = _DTYPE_OF.get(code)
    return "an unknown dtype" if found is None else str(found).removeprefix("torch.")


def _show(value: Value, ints: list[int]) -> str:
    """A field as a rank passed it, from its integers (``value``: this rank's, for the kind)."""
    if isinstance(value, (torch.Tensor, tuple)):
        shape = ints[1:] if isinstance(value, torch.Tensor) else ints
        ndim = shape[0]
        dims = [str(d) for d in shape[2 : 2 + min(ndim, _DIMS)]] + (["..."] if ndim > _DIMS else [])
        text = f"({', '.join(dims)}{',' if ndim == 1 else ''})"
        return f"{_dtype_name(ints[0])} {text}" if isinstance(value, torch.Tensor) else text
    if isinstance(value, torch.dtype):
        return _dtype_name(ints[0])
    if isinstance(value, float):
        return f"{struct.unpack('<d', struct.pack('<q', ints[0]))[0]:g}"
    return "None" if ints[0] == _NONE else str(ints[0])


def _text(text: str) -> list[int]:
    """A local verdict's text as _TEXT integers (UTF-8, cut with "..." where longer)."""
    data = text.encode()
    room = 8 * _TEXT
    if len(data) > room:
        data = data[: room - 3].decode(errors="ignore").encode() + b"..."
    return list(struct.unpack(f"<{_TEXT}q", data.ljust(room, b"\0")))


def _untext(ints: list[int]) -> str:
    return struct.pack(f"<{_TEXT}q", *ints).rstrip(b"\0").decode(errors="replace")


def agree(call: str, group: Any, device: torch.device, fields: Sequence[Field], bounds: Optional[Bounds] = None,
          local: Optional[Local] = None) -> None:
    """Check that every rank of ``group`` makes the same ``call`` with the same ``fields`` (name,
    value, and optionally what the error says must agree) and valid input; raise the same error on
    every rank when not (see the module doc).

    ``bounds``: an argument of ids checked by :func:`out_of_range`; a bad value on any rank raises
    :class:`IndexOutOfRangeError` on every rank (on this rank alone when the check does not run).
    ``local``: this rank's verdict on its own arguments; one that failed on any rank raises
    :class:`hal.InvalidArgumentError` on every rank (its own error at once when the check does not
    run). Where it failed, ``fields`` are not read (the caller may pass none). ``device``: where the
    row travels, the layer's device (:func:`row_device`). Costs one small all-gather when it runs."""
    failed = local is not None and not local.ok
    bad = None if bounds is None or failed else bounds.bad
    if not exchanged(group, device):
        if failed:
            local.raise_now()
        if bounds is not None and bad is not None:
            raise IndexOutOfRangeError(call, bounds.arg, bounds.expected, f"{bad} (group rank {group_rank(group)})")
        return
    ranks = group_size(group)
    encoded = [] if failed else [_encode(f[1]) for f in fields]
    verdict = [local.failed.code, *_text(local.got)] if failed else [0] * (1 + _TEXT)
    row = [CALLS.index(call), 0 if bad is None else 1, 0 if bad is None else bad, *verdict, *(i for e in encoded for i in e)]
    if len(row) > SLOTS:
        raise AssertionError(f"hal.parallel.checks: {call}'s row has {len(row)} integers, more than SLOTS={SLOTS}")
    mine = torch.tensor(row + [_NONE] * (SLOTS - len(row)), dtype=torch.int64, device=device)
    rows = hd.all_gather(mine, group=group).view(ranks, SLOTS).tolist()
    error = _compare(call, rows, fields, encoded, bounds)
    if error is not None:
        if failed:
            raise error from local.error
        raise error


def _refused(rows: list[list[int]]) -> InvalidArgumentError:
    """The error of a table where some rank's own arguments failed their check (the same on every rank)."""
    found = [_CHECKS.get(code, Check("hal.parallel", "?", f"valid (check {code} is unknown to this process)"))
             for code in dict.fromkeys(r[3] for r in rows if r[3])]
    several = len(found) > 1

    def shown(r: list[int]) -> str:
        if not r[3]:
            return "valid"
        text = _untext(r[4:_HEAD])
        return f"{_CHECKS[r[3]].arg}: {text}" if several and r[3] in _CHECKS else text

    expected = "; ".join(f"{c.arg}: {c.expected}" for c in found) if several else found[0].expected
    return InvalidArgumentError(found[0].op, ", ".join(dict.fromkeys(c.arg for c in found)), expected,
                                group_by([shown(r) for r in rows]))


def _compare(call: str, rows: list[list[int]], fields: Sequence[Field], encoded: list[list[int]],
             bounds: Optional[Bounds]) -> Optional[InvalidArgumentError]:
    """The error every rank raises for this table (the same on every rank), or None."""
    if len({r[0] for r in rows}) > 1:
        return InvalidArgumentError(
            "hal.parallel", "call", "the same call on every rank of the group, in the same order (each rank's model "
            "must run the same parallel layers on the same inputs)", group_by([CALLS[r[0]] for r in rows]))
    if any(r[3] for r in rows):  # a rank's own arguments failed: before anything read from its fields
        return _refused(rows)
    if any(r[1] for r in rows) and bounds is not None:
        return IndexOutOfRangeError(call, bounds.arg, bounds.expected, group_by([str(r[2]) if r[1] else "valid" for r in rows]))
    start = _HEAD
    for field, ints in zip(fields, encoded):
        name, value = field[0], field[1]
        got = [r[start : start + len(ints)] for r in rows]
        if any(g != got[0] for g in got):
            what = "dtype and shape" if isinstance(value, torch.Tensor) else "shape" if isinstance(value, tuple) else "value"
            expected = field[2] if len(field) > 2 else f"the same {what} on every rank of the group"
            return InvalidArgumentError(call, name, expected, group_by([_show(value, g) for g in got]))
        start += len(ints)
    return None


__all__ = ["IndexOutOfRangeError", "Bounds", "Check", "Local", "set_checks", "refresh", "enabled", "exchanged", "agree",
           "out_of_range", "check", "device_check", "row_device", "count", "on_device", "content_code", "config_code"]
