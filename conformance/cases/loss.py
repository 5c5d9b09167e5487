"""Cases of cross_entropy, linear_cross_entropy and their backward ops.

Every reduction, ignored rows (the default -100 and a class id used as ignore_index), label
smoothing, int32 targets, a single class, every row ignored (a mean over nothing is NaN), logits of
about +-1000 (exp overflows unless the row maximum is subtracted), vocabularies of 32000, an empty
batch, and for the LM head: a vocabulary large enough that a reference works through several
blocks of rows, no bias, and no features (K = 0). The loss is float32 for half-precision inputs.
"""

from __future__ import annotations

from typing import Any, Optional

from . import Call, Draw, case


def _loss_dtype(d: Draw) -> str:
    return "float64" if d.float_dtype == "float64" else "float32"


def _targets(d: Draw, n: int, classes: int, ignore: float, ignore_index: int, dtype: str) -> Any:
    t = d.rng.integers(0, classes, size=n)
    t[d.rng.random(n) < ignore] = ignore_index
    return d.tensor(t, dtype)


def ce_args(d: Draw, n: int, c: int, ignore: float = 0.0, ignore_index: int = -100, smoothing: float = 0.0,
            reduction: str = "mean", magnitude: float = 1.0, target_dtype: str = "int64") -> Call:
    args = {
        "logits": d.normal(n, c, std=magnitude),
        "target": _targets(d, n, c, ignore, ignore_index, target_dtype),
        "ignore_index": ignore_index,
        "label_smoothing": smoothing,
        "reduction": reduction,
    }
    return Call(args, result_dtypes=(_loss_dtype(d),), scale=magnitude)


def _grad_out(d: Draw, reduction: str, n: int) -> Any:
    return d.normal(*((n,) if reduction == "none" else ()), dtype=_loss_dtype(d))


def _ce_backward(d: Draw, **kw: Any) -> Call:
    fwd = ce_args(d, **kw)
    args = {"grad_out": _grad_out(d, fwd.args["reduction"], kw["n"]), **fwd.args}
    return Call(args, scale=fwd.scale)


def lce_args(d: Draw, n: int, k: int, v: int, bias: bool = True, ignore: float = 0.1, ignore_index: int = -100,
             smoothing: float = 0.0, reduction: str = "mean") -> Call:
    std = 1.0 / max(1, k) ** 0.5  # logits of unit scale
    args = {
        "x": d.normal(n, k),
        "weight": d.normal(v, k, std=std),
        "target": _targets(d, n, v, ignore, ignore_index, "int64"),
        "bias": d.normal(v, std=0.5) if bias else None,
        "ignore_index": ignore_index,
        "label_smoothing": smoothing,
        "reduction": reduction,
    }
    return Call(args, result_dtypes=(_loss_dtype(d),))


def _lce_backward(d: Draw, **kw: Any) -> Call:
    fwd = lce_args(d, **kw)
    return Call({"grad_out": _grad_out(d, fwd.args["reduction"], kw["n"]), **fwd.args})


CE: dict[str, tuple[dict[str, Any], bool]] = {
    "mean_1000_classes": (dict(n=16, c=1000, ignore=0.2), True),
    "sum": (dict(n=16, c=100, ignore=0.2, reduction="sum"), True),
    "none": (dict(n=33, c=77, ignore=0.2, reduction="none"), True),
    "label_smoothing": (dict(n=20, c=50, ignore=0.1, smoothing=0.1), False),
    "smoothing_none": (dict(n=9, c=31, smoothing=0.2, reduction="none"), False),
    "class_as_ignore_index": (dict(n=24, c=10, ignore=0.3, ignore_index=3), False),
    "int32_targets": (dict(n=12, c=40, target_dtype="int32"), False),
    "single_class": (dict(n=5, c=1), False),
    "all_ignored_mean_is_nan": (dict(n=6, c=9, ignore=1.0), False),
    "large_logits": (dict(n=8, c=64, magnitude=1000.0), False),
    "vocab_32000": (dict(n=8, c=32000, ignore=0.25), False),
    "empty_batch": (dict(n=0, c=10), False),
}

LCE: dict[str, tuple[dict[str, Any], bool]] = {
    "lm_head": (dict(n=32, k=64, v=1000), True),
    "no_bias_sum": (dict(n=17, k=48, v=300, bias=False, reduction="sum"), True),
    "none_smoothing": (dict(n=13, k=32, v=257, reduction="none", smoothing=0.1), False),
    "many_row_blocks": (dict(n=600, k=16, v=4096, ignore=0.3), False),
    "class_as_ignore_index": (dict(n=20, k=16, v=50, ignore=0.3, ignore_index=7), False),
    "empty_batch": (dict(n=0, k=16, v=40), False),
    "no_features": (dict(n=6, k=0, v=12), False),
}


def _cases(table: dict[str, tuple[dict[str, Any], bool]], build: Any, skip: Optional[set[str]] = None) -> list:
    return [case(name, build, quick=quick, **kw) for name, (kw, quick) in table.items() if not skip or name not in skip]


CASES = {
    "cross_entropy": _cases(CE, ce_args),
    "cross_entropy_backward": _cases(CE, _ce_backward),
    "linear_cross_entropy": _cases(LCE, lce_args),
    "linear_cross_entropy_backward": _cases(LCE, _lce_backward),
}
