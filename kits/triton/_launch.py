"""Host-side helpers shared by the kernel families: dtype maps, sizes, launches.

Entry kernels declare the integer arguments that Triton must not specialise on (sizes and strides
whose value 1 or divisibility by 16 buys nothing): every specialisation is a separate compilation,
and a conformance run meets hundreds of shapes.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver as _driver

from hal.arrays import float32_value

from .config import Plans, cdiv, next_pow2  # noqa: F401  (re-exported for the kernel families)

#: torch dtype -> Triton element type (for pointers cast from integer addresses, and outputs).
TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


def compute_dtype(dtype: torch.dtype) -> Any:
    """The arithmetic type of a kernel for inputs of ``dtype``: float64 stays float64, every other
    floating type computes in float32 (half-precision inputs are rounded once, at the store)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def torch_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch twin of :func:`compute_dtype` (for partial-sum buffers)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch(kernel: Any, grid: Sequence[int], *args: Any, num_warps: int = 4, num_stages: int = 2, fp_fusion: bool = True,
           options: Sequence[tuple[str, Any]] = (), **constexprs: Any) -> None:
    """Launch ``kernel`` on ``grid`` with its runtime ``args`` and ``constexprs``.

    ``fp_fusion=False`` forbids contracting a multiply and an add into one FMA, for kernels whose
    rounding must match a reference bit for bit (quantisation). ``options`` are vendor launch
    options given to Triton as they are (AMD's ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``).

    The first launch of a specialisation goes through Triton (``kernel[grid](...)``: binding,
    specialisation, compilation); later ones with the same :func:`_spec_key` call the compiled
    kernel's launcher directly (see :class:`_Launched`), which saves most of Triton's per-launch
    host time. ``HAL_TRITON_FAST_LAUNCH=0`` turns that off. A call site that launches the same
    geometry over and over does better still with a :class:`LaunchPlan`.
    """
    if _FAST_LAUNCH[0]:
        try:
            key = (kernel, num_warps, num_stages, fp_fusion, tuple(options), *constexprs.items(), *map(_spec_key, args))
            hit = _LAUNCHED.get(key)
        except TypeError:  # an unhashable constexpr: Triton's path only
            key = hit = None
        if hit is not None:
            hit(grid, args)
            return
    else:
        key = None
    launched = _through_triton(kernel, grid, args, num_warps, num_stages, fp_fusion, options, constexprs)
    if key is not None and launched is not None:
        if len(_LAUNCHED) > 8192:
            _LAUNCHED.clear()
        _LAUNCHED[key] = launched


def _through_triton(kernel: Any, grid: Sequence[int], args: tuple, num_warps: int, num_stages: int, fp_fusion: bool,
                    options: Sequence[tuple[str, Any]], constexprs: dict[str, Any]) -> "Optional[_Launched]":
    """Launch through Triton itself (binding, specialisation, compilation on a miss of its cache);
    the compiled specialisation as a :class:`_Launched` for the fast path, or None where there is
    none (the fast path off, the interpreter, a Triton whose compiled kernels look otherwise)."""
    compiled = kernel[tuple(grid)](*args, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fp_fusion, **dict(options), **constexprs)
    if not _FAST_LAUNCH[0] or compiled is None:
        return None
    launched = _Launched.build(kernel, compiled, len(args), constexprs)
    if launched is None:
        _FAST_LAUNCH[0] = False  # this Triton's compiled kernels do not look as expected
    return launched


class LaunchPlan:
    """One launch of a call site for one geometry: the kernel, its grid, the trailing runtime
    arguments (sizes, strides) and the constexprs fixed once; each call passes only the leading
    ``live`` arguments (the tensors, and numbers that change from call to call).

    A kernel family builds one per geometry it keys on (shapes, strides, dtypes, options) and keeps
    it, so a repeated call costs the live arguments' specialisation key, one dict lookup and the
    launcher, instead of the family's planning and a key over every argument. The key still covers
    every live tensor's dtype, 16-byte alignment and device, so a call never reaches a compiled
    specialisation that assumed otherwise.
    """

    __slots__ = ("kernel", "grid", "fixed", "_opts", "_constexprs", "_by_spec")

    def __init__(self, kernel: Any, grid: Sequence[int], fixed: Sequence[Any] = (), *, num_warps: int = 4, num_stages: int = 2,
                 fp_fusion: bool = True, options: Sequence[tuple[str, Any]] = (), **constexprs: Any) -> None:
        self.kernel, self.grid, self.fixed = kernel, tuple(grid), tuple(fixed)
        self._opts = (num_warps, num_stages, fp_fusion, tuple(options))
        self._constexprs = constexprs
        self._by_spec: dict[tuple, _Launched] = {}

    def __call__(self, *live: Any) -> None:
        spec = live_key(live)
        hit = self._by_spec.get(spec)
        if hit is not None:
            hit(self.grid, live + self.fixed)
            return
        launched = _through_triton(self.kernel, self.grid, live + self.fixed, *self._opts, self._constexprs)
        if launched is not None:
            if len(self._by_spec) > 64:
                self._by_spec.clear()
            self._by_spec[spec] = launched


#: whether launches of compiled specialisations bypass Triton's Python launch path
_FAST_LAUNCH = [os.environ.get("HAL_TRITON_FAST_LAUNCH", "1") != "0" and not triton.knobs.runtime.interpret]
_LAUNCHED: dict[tuple, "_Launched"] = {}


def _spec_key(a: Any) -> Any:
    """What of a runtime argument Triton specialises a kernel on, or finer: a tensor's dtype and its
    address modulo 16; an integer's 32-bit range, whether it is 1 and whether 16 divides it; the
    value of a bool or None; the type of a float (never specialised)."""
    t = type(a)
    if t is _Tensor:  # the most common argument first
        return (a.dtype, a.data_ptr() & 15, a.get_device())
    if t is int:
        return (int, a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF)
    if t is float:
        return float
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15, a.get_device())
    return (t, a)


_Tensor = torch.Tensor


def live_key(args: Sequence[Any]) -> tuple:
    """``tuple(map(_spec_key, args))``, with the tensor case inlined (a plan's live arguments are
    mostly tensors, and this runs on every launch)."""
    return tuple([(a.dtype, a.data_ptr() & 15, a.get_device()) if type(a) is _Tensor else _spec_key(a) for a in args])


class _Launched:
    """A compiled specialisation and how to call its launcher: the arguments Triton's binder would
    pass (the runtime ones, then the constexprs in signature order, which the launcher skips)."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled: Any, tail: tuple) -> None:
        self.compiled, self.tail = compiled, tail

    @classmethod
    def build(cls, kernel: Any, compiled: Any, n_args: int, constexprs: dict[str, Any]) -> "Optional[_Launched]":
        try:
            names = list(kernel.arg_names)
            params = kernel.signature.parameters
            tail = []
            for name in names[n_args:]:
                if name in constexprs:
                    tail.append(constexprs[name])
                elif params[name].default is not params[name].empty:
                    tail.append(params[name].default)
                else:
                    return None
            for attr in ("run", "function", "packed_metadata", "launch_metadata"):
                getattr(compiled, attr)
        except (AttributeError, KeyError, TypeError):
            return None
        return cls(compiled, tuple(tail))

    def __call__(self, grid: Sequence[int], args: tuple) -> None:
        c = self.compiled
        full = args + self.tail
        active = _driver.active
        stream = active.get_current_stream(active.get_current_device())
        n = len(grid)
        hooks = triton.knobs.runtime
        enter = hooks.launch_enter_hook
        # the launch metadata only feeds the enter hook (Triton builds it for none otherwise)
        metadata = None if enter is None else c.launch_metadata(grid, stream, *full)
        c.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, c.function, c.packed_metadata,
              metadata, enter, hooks.launch_exit_hook, *full)


def split_f64(v: float) -> tuple[float, float]:
    """v as two float32 numbers whose sum, in float64, is v to about 48 bits (kernels get Python
    floats as float32, too coarse for float64 statistics and epsilons)."""
    hi = float32_value(v)
    return (hi, v - hi) if math.isfinite(hi) else (v, 0.0)  # beyond float32's range: as Triton passes it


def bf16_dot_workaround(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of ``dtype`` must be upcast to float32 first: the Triton interpreter
    (3.9) multiplies bfloat16 tiles wrongly. The upcast products are exact, so results agree with a
    compiled bfloat16 dot with float32 accumulation; compiled kernels never take this path."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)
