"""Cases of layer_norm, rms_norm and their backward ops, and of rms_norm_amax (rms_norm's cases,
and a NaN/infinite row and a negative peak for its amax).

Besides transformer widths and odd sizes: long rows (reductions of 16k), normalisation over two
dimensions and over a single element, a large common offset (mean 100, unit spread: the variance
as E[x^2] - E[x]^2 cancels catastrophically in the case dtype, while a float32 mean is still exact
enough: at mean 1000 the rounding of a float32 mean alone exceeds the float32 tolerance), and large
values whose squares overflow float16 (a half-precision kernel must accumulate in float32).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from . import Call, Draw, Table, backward_call, case, from_table


def norm_args(
    d: Draw,
    op: str,
    shape: tuple[int, ...],
    dims: int = 1,
    affine: bool = True,
    eps: Optional[float] = 1e-5,
    layout: str = "contiguous",
    offset: float = 0.0,
    values: str = "unit",
) -> Call:
    """Arguments of layer_norm or rms_norm over the last ``dims`` dimensions of ``shape``."""
    normalized = shape[len(shape) - dims :]
    args: dict[str, Any] = {
        "x": d.normal(*shape, std=d.magnitude(values), mean=offset, layout=layout),
        "normalized_shape": normalized,
        "weight": d.uniform(*normalized, low=0.5, high=1.5) if affine else None,
    }
    if op == "layer_norm":
        args["bias"] = d.normal(*normalized, std=0.5) if affine else None
    args["eps"] = eps
    return Call(args)


def _backward(d: Draw, op: str, **kw: Any) -> Call:
    fwd = norm_args(d, op, **kw)
    return backward_call(f"{op}_backward", d, fwd, tuple(fwd.args["x"].shape))


SHAPES: Table = {
    "transformer_768": (dict(shape=(2, 16, 768)), True, True),
    "no_affine": (dict(shape=(4, 10, 33), affine=False), False, True),
    "two_dims": (dict(shape=(3, 6, 10), dims=2), True, True),
    "odd_prime": (dict(shape=(3, 7, 13)), False, True),
    "single_row_batch1": (dict(shape=(1, 1000)), False, False),
    "single_feature": (dict(shape=(4, 5, 1)), False, False),
    "long_row": (dict(shape=(2, 16384)), False, True),
    "noncontig": (dict(shape=(5, 12, 40), layout="noncontig"), False, True),
    "large_offset": (dict(shape=(4, 256), offset=100.0), False, True),
    "large_values": (dict(shape=(4, 256), values="big"), False, False),
    "eps_large": (dict(shape=(6, 20), eps=0.1), False, False),
    # zero-size dimensions: no rows, or rows of no features
    "empty_rows": (dict(shape=(0, 16)), True, True),
    "empty_batch_3d": (dict(shape=(2, 0, 8)), False, True),
    "empty_features": (dict(shape=(3, 0)), False, True),
}


def _cases(op: str, backward: bool) -> list:
    build = _backward if backward else norm_args
    out = from_table(SHAPES, build, backward, op=op)
    if op == "rms_norm":  # eps None resolves to torch's default (float32's epsilon; float64's for float64)
        out.append(case("default_eps", build, quick=True, op=op, shape=(3, 64), eps=None))
    return out


def _amax_call(d: Draw, specials: str = "", **kw: Any) -> Call:
    """rms_norm_amax: rms_norm's arguments; its results are y (the case dtype) and a float32 amax.
    ``specials``: "nan_row" puts a NaN in one row and an infinity in another (their rows of y are
    NaN: amax NaN), "negative_peak" makes the largest |y| a negative value far above the rest."""
    call = norm_args(d, "rms_norm", **kw)
    x = call.args["x"]
    if specials == "nan_row":
        x[1, 3], x[2, 0] = math.nan, -math.inf
    elif specials == "negative_peak":
        x[-1, -1] = -40.0 * float(x.abs().max())
    return dataclasses.replace(call, result_dtypes=(d.float_dtype, "float32"))


def _amax_cases() -> list:
    """rms_norm's cases (forward rows of its table) with the amax result, and its value edges."""
    out = from_table(SHAPES, _amax_call)
    out += [
        case("default_eps", _amax_call, quick=True, shape=(3, 64), eps=None),
        case("nan_row", _amax_call, shape=(4, 40), specials="nan_row"),
        case("negative_peak", _amax_call, shape=(6, 96), specials="negative_peak"),
    ]
    return out


CASES = {
    "layer_norm": _cases("layer_norm", False),
    "layer_norm_backward": _cases("layer_norm", True),
    "rms_norm": _cases("rms_norm", False),
    "rms_norm_backward": _cases("rms_norm", True),
    "rms_norm_amax": _amax_cases(),
}
