"""Argument checks shared by the op checkers.

Each helper raises :class:`hal.InvalidArgumentError` naming the op, the argument, what was expected
and what was given, and returns the value in canonical form where there is one.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from hal.arrays import FLOAT_DTYPES, describe, dtype_name, is_array, short_repr
from hal.errors import InvalidArgumentError

INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64")

#: the largest int a kernel can take (sizes, strides and options are int64 in torch and C++).
INT64_MAX = 2**63 - 1
#: the largest array hal creates, in bytes: torch sizes its storage in int64 bytes.
MAX_RESULT_BYTES = INT64_MAX


def fail(op: str, name: str, expected: str, got: Any) -> InvalidArgumentError:
    """The error for argument ``name`` of ``op`` (``got`` is described unless already a string)."""
    return InvalidArgumentError(op, name, expected, got if isinstance(got, str) else describe(got))


def shown(v: Any) -> str:
    """``repr(v)`` for error messages, short for huge ints."""
    return short_repr(int(v) if is_int(v) else v)


def shape_of(a: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in a.shape)


def itemsize(a: Any) -> int:
    """Bytes per element of an array."""
    return int(a.element_size()) if isinstance(a, torch.Tensor) else int(a.itemsize)


def numel(a: Any) -> int:
    n = 1
    for s in a.shape:
        n *= int(s)
    return n


def rank(op: str, name: str, a: Any, ranks: Iterable[int], what: str = "") -> int:
    """The rank of ``a``, which must be one of ``ranks``."""
    allowed = tuple(ranks)
    if a.ndim not in allowed:
        want = " or ".join(f"{r}-D" for r in allowed)
        raise fail(op, name, f"a {want} array{(' ' + what) if what else ''}", a)
    return a.ndim


def min_rank(op: str, name: str, a: Any, low: int, what: str = "") -> int:
    if a.ndim < low:
        raise fail(op, name, f"an array of at least {low} dimensions{(' ' + what) if what else ''}", a)
    return a.ndim


def writable(op: str, name: str, a: Any) -> None:
    """An array an op writes in place must not have elements sharing memory (an expanded view,
    stride 0 along a dimension of size > 1), as torch's in-place ops require."""
    if numel(a) <= 1:  # nothing, or one element: nothing can overlap (empty arrays may have 0 strides)
        return
    strides = a.stride() if isinstance(a, torch.Tensor) else a.strides
    if any(int(st) == 0 and int(n) > 1 for st, n in zip(strides, a.shape)):
        raise fail(op, name, "an array whose elements do not share memory (an expanded view cannot be written in place: clone() it first)", a)


def float_dtype(op: str, name: str, a: Any, allowed: Sequence[str] = FLOAT_DTYPES) -> str:
    t = dtype_name(a)
    if t not in allowed:
        raise fail(op, name, f"of a floating dtype ({', '.join(allowed)})", a)
    return t


def int_dtype(op: str, name: str, a: Any, allowed: Sequence[str] = INT_DTYPES) -> str:
    t = dtype_name(a)
    if t not in allowed:
        raise fail(op, name, f"of an integer dtype ({', '.join(allowed)})", a)
    return t


def same_dtype(op: str, name: str, a: Any, ref_name: str, ref: Any) -> None:
    if dtype_name(a) != dtype_name(ref):
        raise fail(op, name, f"of the same dtype as '{ref_name}' ({dtype_name(ref)})", a)


def dtype_in(op: str, name: str, a: Any, allowed: Iterable[str], why: str) -> None:
    allowed = tuple(allowed)
    if dtype_name(a) not in allowed:
        raise fail(op, name, f"of dtype {' or '.join(allowed)} ({why})", a)


def shape_is(op: str, name: str, a: Any, shape: Sequence[int], what: str = "") -> None:
    if shape_of(a) != tuple(shape):
        raise fail(op, name, f"of shape {tuple(shape)}{(' ' + what) if what else ''}", a)


def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def integer(op: str, name: str, v: Any, low: Optional[int] = None, high: Optional[int] = None) -> int:
    if not is_int(v):
        raise fail(op, name, "an int", v)
    v = int(v)
    if (low is not None and v < low) or (high is not None and v > high):
        bounds = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise fail(op, name, f"an int {bounds}", shown(v))
    return in_int64(op, name, v)


def in_int64(op: str, name: str, v: int) -> int:
    """``v``, which kernels take as an int64, must fit in one."""
    if not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise fail(op, name, "an int that fits in 64 bits (|value| < 2**63)", shown(v))
    return v


def number(
    op: str,
    name: str,
    v: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite Python number within bounds, as a float."""
    if not is_number(v):
        raise fail(op, name, "a Python number", v)
    try:
        f = float(v)
    except OverflowError:  # an int beyond float64's range (10**400)
        raise fail(op, name, "a finite number (within float64's range, below 1.8e308)", shown(v)) from None
    if not math.isfinite(f):
        raise fail(op, name, "a finite number", repr(v))
    too_low = low is not None and (f < low or (low_open and f == low))
    too_high = high is not None and (f > high or (high_open and f == high))
    if too_low or too_high:
        if low is not None and high is not None:
            bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            bounds = f"{'>' if low_open else '>='} {low:g}"
        else:
            bounds = f"{'<' if high_open else '<='} {high:g}"
        raise fail(op, name, f"a number {bounds}", shown(v))
    return f


def number_in(low: Optional[float] = None, high: Optional[float] = None, high_open: bool = False) -> Callable[[str, str, Any], float]:
    """A validator of a volatile number parameter (``OpDecl.volatile``): checked on every call."""
    return lambda op, name, v: number(op, name, v, low=low, high=high, high_open=high_open)


def one_value(op: str, name: str, v: Any) -> Any:
    """A Python number (as a float) or a one-element float array (kept: read on the device)."""
    if is_array(v):
        scalar_or_array(op, name, v, numel=(1,))
        return v
    return number(op, name, v)


def one_value_in(low: Optional[float] = None) -> Callable[[str, str, Any], Any]:
    """A validator of a volatile number-or-array parameter: a number >= low (as a float) or a
    one-element float array (kept as it is: its value is read on the device, never on the host)."""

    def check(op: str, name: str, v: Any) -> Any:
        if is_array(v):
            scalar_or_array(op, name, v, numel=(1,))
            return v
        return number(op, name, v, low=low)

    return check


def optional_one_value(op: str, name: str, v: Any) -> Any:
    return None if v is None else one_value(op, name, v)


def boolean(op: str, name: str, v: Any) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise fail(op, name, "a bool", v)
    return bool(v)


def bool_tuple(op: str, name: str, v: Any, n: int) -> tuple[bool, ...]:
    """A sequence of ``n`` bools (an output mask), as a tuple of Python bools."""
    if not isinstance(v, (tuple, list)) or len(v) != n or not all(isinstance(b, (bool, np.bool_)) for b in v):
        raise fail(op, name, f"a tuple of {n} bools", v)
    return tuple(bool(b) for b in v)


def choice(op: str, name: str, v: Any, options: Sequence[str]) -> str:
    if not isinstance(v, str) or v not in options:
        raise fail(op, name, f"one of {', '.join(repr(o) for o in options)}", v)
    return v


def int_pair(op: str, name: str, v: Any, low: int = 1) -> tuple[int, int]:
    """An int or a pair of ints, each >= low, as a pair."""
    if is_int(v):
        v = (v, v)
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(is_int(x) for x in v):
        raise fail(op, name, "an int or a pair of ints", v)
    if any(int(x) < low for x in v):
        raise fail(op, name, f"ints >= {low}", ", ".join(map(shown, v)))
    return in_int64(op, name, int(v[0])), in_int64(op, name, int(v[1]))


def int_tuple(op: str, name: str, v: Any, low: int = 1) -> tuple[int, ...]:
    """An int or a sequence of ints, each >= low, as a tuple (a shape)."""
    if is_int(v):
        v = (v,)
    if isinstance(v, torch.Size):
        v = tuple(v)
    if not isinstance(v, (tuple, list)) or not all(is_int(x) for x in v):
        raise fail(op, name, "an int or a sequence of ints", v)
    if any(int(x) < low for x in v):
        raise fail(op, name, f"ints >= {low}", ", ".join(map(shown, v)))
    return tuple(in_int64(op, name, int(x)) for x in v)


def result_fits(op: str, name: str, shape: Sequence[int], itemsize: int, what: str = "result") -> None:
    """A result of ``shape`` must be creatable: at most :data:`MAX_RESULT_BYTES` bytes. ``name`` is
    the argument that makes it this large (padding, a broadcast operand)."""
    n = 1
    for s in shape:
        n *= int(s)
    if n * itemsize > MAX_RESULT_BYTES:
        raise fail(
            op,
            name,
            f"small enough for a {what} of at most 2**63 - 1 bytes",
            f"a {what} of shape {tuple(int(s) for s in shape)} ({n} elements, {n * itemsize} bytes)",
        )


def broadcast_shapes(a: Sequence[int], b: Sequence[int]) -> Optional[tuple[int, ...]]:
    """The broadcast of two shapes (NumPy's and torch's rules: a size-1 dimension takes the other's
    size, 0 included), or None when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = int(a[-i]) if i <= len(a) else 1
        y = int(b[-i]) if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def broadcasts_to(op: str, name: str, a: Any, target: Sequence[int], target_name: str) -> None:
    """``a``'s shape must broadcast to ``target`` without growing it."""
    s = shape_of(a)
    ok = len(s) <= len(target) and all(x in (1, y) for x, y in zip(reversed(s), reversed(tuple(target))))
    if not ok:
        raise fail(op, name, f"broadcastable to the shape of '{target_name}' {tuple(target)}", a)


def scalar_or_array(
    op: str, name: str, v: Any, numel: Optional[Iterable[int]] = None, floating: bool = True
) -> None:
    """A Python number, or an array with one of the allowed element counts and a suitable dtype."""
    if not is_array(v):
        if not is_number(v):
            raise fail(op, name, "a Python number or an array", v)
        return
    if numel is not None:
        allowed = tuple(sorted(set(numel)))
        if int(np.prod(v.shape)) not in allowed or v.ndim > 1:
            raise fail(op, name, f"a number or a 0-d/1-d array of {' or '.join(map(str, allowed))} elements", v)
    if floating:
        float_dtype(op, name, v)
