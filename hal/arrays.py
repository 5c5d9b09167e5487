"""Array interop: what an argument is, where it lives, and moving it between NumPy and torch.

hal accepts ``torch.Tensor`` (any device) and ``numpy.ndarray`` (CPU). NumPy has no bfloat16, so
bfloat16 travels as ``ml_dtypes.bfloat16`` arrays, viewed without copying.
"""

from __future__ import annotations

import math
import operator
import struct
from typing import Any, Callable, Optional, Sequence

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: dtype names hal uses everywhere (declarations, reports, CLI flags).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_TORCH_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def is_array(x: Any) -> bool:
    """True for a torch.Tensor or a NumPy array."""
    return isinstance(x, (torch.Tensor, np.ndarray))


def float32_value(v: float) -> float:
    """``v`` rounded to the nearest float32 (out of its range: an infinity), as a Python float.

    For numbers an op takes as float32 (a loss scaler's inv_scale), and for kernels that pass
    floats to device code in float32. ``struct``, not a tensor: this runs on launch paths.
    """
    try:
        return _F32.unpack(_F32.pack(v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


_F32 = struct.Struct("f")


def dense_alike(*tensors: torch.Tensor) -> bool:
    """Same shape and strides, and dense (no gaps, no overlap): one flat walk of memory visits the
    same elements of each in the same order, whatever the memory format (channels_last included)."""
    t0 = tensors[0]
    if any(t.shape != t0.shape or t.stride() != t0.stride() for t in tensors[1:]):
        return False
    return t0.is_contiguous() or bool(torch.ops.aten.is_non_overlapping_and_dense(t0))


_IS_CONTIGUOUS = operator.methodcaller("is_contiguous")
_IS_CHANNELS_LAST = operator.methodcaller("is_contiguous", memory_format=torch.channels_last)
_STRIDES = operator.methodcaller("stride")
_SHAPE = operator.attrgetter("shape")


def flat_runs(*lists: Sequence[torch.Tensor]) -> bool:
    """Whether a multi-tensor kernel, which walks each tensor as one run of memory from its data
    pointer, may take these lists: the i-th tensors of all lists dense and alike. Every pass is a
    C-level map (hundreds of tensors in microseconds): contiguous lists answer at once; otherwise
    the lists' shapes and strides are compared, then the first list's tensors checked dense
    (contiguous or channels_last without asking torch, other layouts one by one)."""
    if all(all(map(_IS_CONTIGUOUS, ts)) for ts in lists):
        return True
    first = lists[0]
    strides, shapes = list(map(_STRIDES, first)), list(map(_SHAPE, first))
    if any(list(map(_STRIDES, ts)) != strides or list(map(_SHAPE, ts)) != shapes for ts in lists[1:]):
        return False
    odd = [t for t, c, cl in zip(first, map(_IS_CONTIGUOUS, first), map(_IS_CHANNELS_LAST, first)) if not (c or cl)]
    return all(bool(torch.ops.aten.is_non_overlapping_and_dense(t)) for t in odd)


def halves_of(a: torch.Tensor, b: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor whose last dimension ``a`` and ``b`` split in two, when they are exactly its first
    and second halves (``gate, up = t.chunk(2, -1)``: views of one base ``t``), else None. A kernel
    given such a pair writes gradients into one buffer of ``t``'s shape, and hal's autograd node
    passes that buffer on whole: no concatenation in the backward (:mod:`hal.integration.autograd`)."""
    base = a._base
    if base is None or b._base is not base:
        return None
    half = a.shape[-1]
    shape, stride = base.shape, base.stride()
    if (a.shape != b.shape or base.dim() != a.dim() or shape[:-1] != a.shape[:-1] or shape[-1] != 2 * half
            or a.stride() != stride or b.stride() != stride):
        return None
    start = base.storage_offset()
    if a.storage_offset() != start or b.storage_offset() != start + half * stride[-1]:
        return None
    return base


def row_geometry(t: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """``(rows, columns, row stride)`` of ``t`` seen as rows of its last dimension, when that
    dimension is unit-stride and the leading ones merge into one row stride (a contiguous tensor,
    one half of ``t.chunk(2, -1)``, a slice of rows), else None."""
    if t.dim() == 0:
        return 1, 1, 1
    shape, strides = t.shape, t.stride()
    cols = shape[-1]
    if cols > 1 and strides[-1] != 1:
        return None
    if t.dim() == 1:
        return 1, cols, cols
    for i in range(t.dim() - 2):
        if shape[i] > 1 and strides[i] != strides[i + 1] * shape[i + 1]:
            return None
    return math.prod(shape[:-1]), cols, strides[-2]


def note_writes(tensors: Sequence[torch.Tensor]) -> None:
    """Count a write into each of ``tensors`` that bumps no version counter (running statistics,
    which torch's batch norm also writes without one): see :func:`writes_of`."""
    for t in tensors:
        t._hal_writes = getattr(t, "_hal_writes", 0) + 1


def writes_of(t: torch.Tensor) -> int:
    """How many times hal wrote ``t`` without bumping its version counter (:func:`note_writes`):
    with ``t._version``, what a cache derived from a tensor keys on to notice every update."""
    return getattr(t, "_hal_writes", 0)


def grouped(tensors: Sequence[torch.Tensor], key: Callable[[torch.Tensor], Any]) -> dict[Any, Sequence[torch.Tensor]]:
    """``tensors`` by ``key`` (their dtype, their (device, dtype) ...), in order: one C-level pass
    over the keys in the common case of a single group, which is ``tensors`` itself."""
    keys = list(map(key, tensors))
    if len(set(keys)) <= 1:
        return {keys[0]: tensors} if keys else {}
    groups: dict[Any, list[torch.Tensor]] = {}
    for k, t in zip(keys, tensors):
        groups.setdefault(k, []).append(t)
    return groups


_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel


def address_columns(lists: Sequence[Sequence[torch.Tensor] | None]) -> tuple[tuple[int, ...], ...]:
    """The columns of a multi-tensor kernel's table: for each list the data addresses of its
    tensors (zeros for a list that is None), then the element counts of the first list. C-level
    passes: a model's hundreds of tensors in tens of microseconds, where a Python loop building
    one row per tensor took about 0.1 ms per list on the H200's host. Hashable, so it is also the
    key under which a table built from it is cached."""
    count = len(lists[0])  # type: ignore[arg-type]
    zeros = (0,) * count
    columns = tuple(zeros if ts is None else tuple(map(_DATA_PTR, ts)) for ts in lists)
    return columns + (tuple(map(_NUMEL, lists[0])),)  # type: ignore[arg-type]


def table_rows(columns: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """``columns`` (see address_columns) as an int64 (tensors, fields) host tensor, a row per tensor."""
    return torch.tensor(columns, dtype=torch.int64).t().contiguous()


def dtype_name(a: torch.Tensor | np.ndarray) -> str:
    """The hal name of an array's dtype ("float32", "bfloat16", "int8" ...)."""
    if isinstance(a, torch.Tensor):
        return _TORCH_NAMES.get(a.dtype) or str(a.dtype).removeprefix("torch.")
    return a.dtype.name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a hal dtype name."""
    return _TORCH_DTYPES[name]


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a hal dtype name (bfloat16 through ml_dtypes)."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def device_kind(a: torch.Tensor | np.ndarray) -> str:
    """Which family of backends serves this array: "cpu", "cuda", "rocm" (or torch's device type)."""
    if isinstance(a, np.ndarray):
        return "cpu"
    kind = a.device.type
    if kind == "cuda" and torch.version.hip:
        return "rocm"
    return kind


def device_label(a: torch.Tensor | np.ndarray) -> str:
    """A readable device: "cpu (numpy)", "cpu", "cuda:0"."""
    if isinstance(a, np.ndarray):
        return "cpu (numpy)"
    return str(a.device)


def describe(a: Any) -> str:
    """A short description of a value for error messages."""
    if isinstance(a, (torch.Tensor, np.ndarray)):
        what = "tensor" if isinstance(a, torch.Tensor) else "array"
        return f"a {dtype_name(a)} {what} of shape {tuple(a.shape)} on {device_label(a)}"
    if isinstance(a, (list, tuple)):
        return f"a {type(a).__name__} of {len(a)} items"
    return f"{short_repr(a)} ({type(a).__name__})"


def short_repr(v: Any) -> str:
    """``repr(v)``, short for huge ints, whose repr runs to thousands of digits (and raises beyond
    Python's 4300-digit limit)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an int of {v.bit_length()} bits ({'-' if v < 0 else ''}~2**{v.bit_length() - 1})"
    return repr(v)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy; bfloat16 becomes ml_dtypes.bfloat16)."""
    if not (t.requires_grad or t.dtype == torch.bfloat16):
        try:  # the common case in one call: torch refuses the lazy views (conjugate, negative) handled below
            return t.numpy()
        except (RuntimeError, TypeError):
            pass
    # a tensor requiring grad or of bfloat16, which torch refuses only after building its error
    # message (10-16 us a call on the CI CPU, against about 1 us for the detach and view here)
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.resolve_conj().resolve_neg().numpy()


def from_numpy(a: np.ndarray | np.generic) -> torch.Tensor:
    """A CPU tensor sharing memory with ``a`` where torch can (bfloat16 included); a read-only
    array, one with negative strides or one in the other byte order (``dtype('>f4')`` on a
    little-endian machine), which torch cannot view, is copied (in native byte order: results come
    back native, as NumPy's own functions give them; an op's writes to a copy are copied back)."""
    if type(a) is not np.ndarray:
        a = np.asarray(a)
    if a.dtype == BFLOAT16:
        return torch.from_numpy(np.require(a, requirements="C").view(np.int16)).view(torch.bfloat16)  # keeps 0-d
    if a.flags.writeable:
        try:
            return torch.from_numpy(a)
        except ValueError:
            if a.dtype.isnative and not any(s < 0 for s in a.strides):  # torch's other refusals stay the caller's error
                raise
    return torch.from_numpy(a.astype(a.dtype.newbyteorder("="), order="C"))  # a copy: positive strides, native order


#: element counts up to which :func:`overlaps` lists every element's offset to decide (int64
#: offsets: 32 MiB), where the cheaper tests cannot
_OFFSETS_LIMIT = 1 << 22


def overlaps(a: torch.Tensor | np.ndarray) -> bool:
    """Whether two elements of ``a`` share memory (an expanded or ``as_strided`` view): what an op
    writing ``a`` in place must refuse, since the result would depend on the order of the writes.

    torch's own test (``torch._debug_has_internal_overlap``) answers "too hard" for views such as
    ``as_strided((4, 4), (2, 1))``, and torch's in-place ops then write them. Here such views are
    decided: by counting (more elements than the memory they span holds: they overlap), by the
    sufficient condition of a non-overlapping layout (sorted by stride, each stride beyond the
    extent of the smaller ones), and otherwise, up to :data:`_OFFSETS_LIMIT` elements, by listing
    the offsets; beyond that a view that passes the counting test is taken as not overlapping."""
    if isinstance(a, np.ndarray):
        item = a.itemsize
        if any(s % item for s in a.strides):
            return False  # a byte-strided view of a record: not something an op writes
        shape, strides = tuple(a.shape), tuple(s // item for s in a.strides)
    else:
        known = torch._debug_has_internal_overlap(a)
        if known != 2:  # 0: no overlap, 1: overlap, 2: too hard for torch
            return known == 1
        shape, strides = tuple(a.shape), tuple(a.stride())
    if 0 in shape:
        return False  # no element at all
    dims = sorted((abs(st), n) for n, st in zip(shape, strides) if n > 1)
    if not dims:
        return False
    numel = math.prod(n for _, n in dims)
    span = 1 + sum(st * (n - 1) for st, n in dims)
    if numel > span or any(st == 0 for st, _ in dims):
        return True
    extent = 1
    for st, n in dims:
        if st < extent:
            break
        extent += st * (n - 1)
    else:
        return False
    if numel > _OFFSETS_LIMIT:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return int(torch.unique(offsets).numel()) < numel
