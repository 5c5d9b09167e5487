"""Tolerances and the comparison of one result against the float64 reference.

Tolerance of a result component: the op's declared ``Tolerance`` for a dtype (see
:func:`tolerance_key`), replaced by a backend's override where one exists, widened by the op's
reduction length (``atol * sqrt(K)`` for ops that accumulate, K from ``decl.reduction`` on the
canonical arguments), and zero for ``exact`` cases. An element passes when
``|out - ref| <= atol + rtol * |ref|``; NaN must meet NaN and an infinity the same infinity.

The declared atol is for results of unit scale, so for float results it is multiplied by a scale:
the larger of the case's data scale (``Call.scale``: 1, or the magnitude of huge or fp16-subnormal
inputs) and the reference component's own magnitude, its root mean square (:func:`magnitude`); it is
kept at least one subnormal step of the dtype. Components that are naturally large thus get a
proportionate atol: a weight gradient summing N*H*W unit products is O(sqrt(N*H*W)), and its float32
rounding error grows with its partial sums, not with one unit term (PyTorch's own float32 CPU
kernels exceed the unscaled bound there). The data scale keeps a floor under components that are
zero by cancellation (a conv bias gradient through training-mode batch norm), whose rounding error
is that of the unit-scale terms that cancel. An op's composite that rounds an intermediate value to
the op's dtype between its steps (``Decomposition.rounds``) is allowed ``rtol * |intermediate|``
more in its first result, elementwise.

Overrides, per backend, merged in this order (a later one wins):

1. a mapping the backend plugin ships as ``plugin.conformance_tolerances``:
   ``{"softmax": {"float16": (atol, rtol), "*": (atol, rtol)}}`` ("*": every dtype);
2. the file ``conformance/tolerances/<backend>.txt`` of this package, if present;
3. a file given with ``hal conformance --tolerances FILE``.

Tolerance files hold one override per line, ``op dtype atol rtol``, then an optional ``# reason``;
the dtype is the one whose declared tolerance it replaces (see :func:`tolerance_key`), or ``*``::

    softmax  float16  4e-4  8e-3   # this backend divides by the row sum in float16
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from hal.arrays import FLOAT_DTYPES, torch_dtype
from hal.ops._tolerances import INTEGER, QUANTIZED
from hal.registry import OpDecl, Tolerance

from .xfail import check_given_file

#: (op, dtype or "*") -> (atol, rtol)
Overrides = dict[tuple[str, str], tuple[float, float]]
TOLERANCE_DIR = Path(__file__).with_name("tolerances")


def is_exact_op(decl: OpDecl) -> bool:
    """Ops specified to be reproducible bit for bit up to rounding ties (integer results and
    quantisation): the suite reports their ULP distance."""
    return dict(decl.tolerances) in (INTEGER, QUANTIZED)


def tolerance_key(decl: OpDecl, case_dtype: str, result_dtype: str) -> str:
    """The dtype whose declared tolerance applies to a result component.

    The case dtype sets the precision of the computation, so float components (float32 running
    stats beside float16 activations included) use it; integer results (quantize) use their own
    dtype, and so do float results of integer cases (dequantize, int8_linear).
    """
    if result_dtype not in FLOAT_DTYPES or case_dtype not in FLOAT_DTYPES:
        if result_dtype in decl.tolerances:
            return result_dtype
    if case_dtype in decl.tolerances:
        return case_dtype
    if result_dtype in decl.tolerances:
        return result_dtype
    raise KeyError(f"op {decl.name} declares no tolerance for {case_dtype} or {result_dtype} (declared: {', '.join(decl.tolerances)})")


def magnitude(ref: torch.Tensor) -> float:
    """Root mean square of the finite elements of a reference component (0 when there are none)."""
    r = ref.to(torch.float64)
    finite = r[torch.isfinite(r)]
    return float(finite.square().mean().sqrt()) if finite.numel() else 0.0


def resolve(
    decl: OpDecl,
    case_dtype: str,
    result_dtype: str,
    k: int,
    scale: float = 1.0,
    exact: bool = False,
    overrides: Optional[Overrides] = None,
) -> tuple[float, float]:
    """(atol, rtol) of one result component of a case; ``scale`` is the component's magnitude
    (float results; 1 for integer results, whose atol counts quantisation steps)."""
    if exact:
        return 0.0, 0.0
    key = tolerance_key(decl, case_dtype, result_dtype)
    declared = decl.tolerances[key]
    over = (overrides or {}).get((decl.name, key)) or (overrides or {}).get((decl.name, "*"))
    tol = Tolerance(over[0], over[1], declared.per_sqrt_k) if over else declared
    atol, rtol = tol.widened(k)
    if result_dtype not in FLOAT_DTYPES:
        return atol, rtol
    return max(atol * scale, _rounding_floor(result_dtype)), rtol


def _rounding_floor(dtype: str) -> float:
    """The spacing of a float dtype's smallest subnormals: no kernel can round a result more
    finely, so a scaled-down atol never drops below it (0 for integer dtypes)."""
    if dtype not in FLOAT_DTYPES:
        return 0.0
    info = torch.finfo(torch_dtype(dtype))
    return float(info.smallest_normal * info.eps)


def parse_overrides(text: str, source: str) -> Overrides:
    """Overrides from the text of a tolerance file (``op dtype atol rtol  # reason`` per line)."""
    out: Overrides = {}
    for n, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        parts = body.split()
        try:
            op, dtype, atol, rtol = parts
            out[(op, dtype)] = (float(atol), float(rtol))
        except ValueError:
            raise ValueError(f"{source}:{n}: expected 'op dtype atol rtol', got {line.strip()!r}") from None
    return out


def load_overrides(backend: str, plugin: Any = None, extra_file: Union[None, str, Path] = None) -> Overrides:
    """A backend's tolerance overrides: its plugin's mapping, this package's file, then ``extra_file``."""
    if extra_file is not None:
        check_given_file(Path(extra_file), "tolerance file", "--tolerances")
    out: Overrides = {}
    shipped: Mapping[str, Mapping[str, Any]] = getattr(plugin, "conformance_tolerances", None) or {}
    for op, per_dtype in shipped.items():
        for dtype, (atol, rtol) in per_dtype.items():
            out[(op, dtype)] = (float(atol), float(rtol))
    for path in (TOLERANCE_DIR / f"{backend}.txt", Path(extra_file) if extra_file else None):
        if path is not None and path.is_file():
            out.update(parse_overrides(path.read_text(), str(path)))
    return out


# --- comparing arrays ---------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """The outcome of comparing one result component with its reference."""

    ok: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    max_ulp: Optional[int] = None
    message: str = ""


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bit patterns mapped to integers that count representable values (adjacent floats
    differ by one; -0 and +0 are equal)."""
    size = t.element_size()
    bits = t.contiguous().view(_BITS[size]).to(torch.int64)
    magnitude = bits & ((1 << (8 * size - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor) -> int:
    """Largest distance in units in the last place of ``got``'s dtype between ``got`` and ``want``
    (float64, rounded to that dtype first) over the elements selected by ``where``."""
    if not bool(where.any()):
        return 0
    if not got.is_floating_point():
        return int((got.to(torch.float64) - want.round())[where].abs().max())
    diff = _ordered(got).to(torch.float64) - _ordered(want.to(got.dtype)).to(torch.float64)
    return int(diff[where].abs().max())


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, ulps: bool = False,
            slack: Optional[torch.Tensor] = None) -> Comparison:
    """Compare ``got`` (a CPU tensor of the result dtype) with ``want`` (a CPU reference, float64
    for float results) elementwise: ``|got - want| <= atol + rtol * |want|`` (``+ slack``, float64
    broadcasting to ``want``, where given), NaN meeting NaN."""
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(False, math.inf, math.inf, None, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    g, w = got.to(torch.float64), want.to(torch.float64)
    both_nan = torch.isnan(g) & torch.isnan(w)
    finite = torch.isfinite(g) & torch.isfinite(w)
    err = torch.where(finite, (g - w).abs(), torch.zeros_like(g))
    bound = atol + rtol * w.abs() + (slack if slack is not None else 0.0)
    close = both_nan | (g == w) | (finite & (err <= bound))
    rel = torch.where(finite & (w != 0), err / w.abs().clamp_min(1e-300), torch.zeros_like(g))
    out = Comparison(
        ok=bool(close.all()),
        max_abs_err=float(err.max()) if err.numel() else 0.0,
        max_rel_err=float(rel.max()) if rel.numel() else 0.0,
    )
    if ulps:
        out.max_ulp = ulp_distance(got, want, finite)
    bad = ~close
    if out.ok:
        return out
    nonfinite_mismatch = int((bad & ~finite).sum())
    if nonfinite_mismatch:
        out.max_abs_err = out.max_rel_err = math.inf
    count = int(bad.sum())
    flat = int(torch.argmax(torch.where(bad, torch.where(finite, err - bound, torch.full_like(g, math.inf)), torch.full_like(g, -math.inf))))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(g.shape))) if g.ndim else ()
    gv, wv = float(g.reshape(-1)[flat]), float(w.reshape(-1)[flat])
    out.message = (
        f"{name}: {count} of {g.numel()} elements beyond tolerance (atol {_fmt(atol)}, rtol {_fmt(rtol)})"
        + (f", {nonfinite_mismatch} of them NaN/inf where the reference differs" if nonfinite_mismatch else "")
        + f"; worst at {index}: got {_fmt(gv)}, expected {_fmt(wv)}"
        + (f" (|err| {_fmt(abs(gv - wv))} > {_fmt(float(bound.reshape(-1)[flat]))})" if math.isfinite(gv) and math.isfinite(wv) else "")
    )
    return out
