"""Helpers of the CUDA backend's tests: fresh seeds, the cpu_ref reference in float64, tolerances.

The reference of a kernel is the op run by cpu_ref on the same values upcast to float64; results are
compared with the op's declared tolerance for the result dtype, widened by the reduction length as
the conformance suite widens it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch

import hal
from hal.registry import get_op


def fresh_seed() -> int:
    """A new seed per test (HAL_TEST_SEED pins it); printed so a failure can be replayed."""
    seed = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    print(f"seed={seed}")
    return seed


#: arguments whose dtype the op fixes (float32 master weights): copied, not upcast
KEEP_DTYPE = ("master_params",)


def upcast(v: Any) -> Any:
    """A float64 copy of a floating tensor (lists too); other values unchanged (integers copied)."""
    if isinstance(v, torch.Tensor):
        return v.detach().to(torch.float64).clone() if v.is_floating_point() else v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(upcast(x) for x in v)
    return v


def reference(op: str, *args: Any) -> Any:
    """``op`` computed by cpu_ref on float64 copies of ``args`` (canonical, positional). In-place
    arguments are updated in the copies: returns (result, copies)."""
    decl = get_op(op)
    copies = [[t.clone() for t in a] if p.name in KEEP_DTYPE and a is not None else upcast(a) for p, a in zip(decl.params, args)]
    names = decl.param_names
    pos = [c for p, c in zip(decl.params, copies) if not p.keyword_only]
    kw = {p.name: c for p, c in zip(decl.params, copies) if p.keyword_only}
    assert len(pos) + len(kw) == len(names)
    with hal.use(backend="cpu_ref"):
        out = getattr(hal.ops, op)(*pos, **kw)
    return out, copies


def tolerance(op: str, dtype: str, args: tuple) -> tuple[float, float]:
    """(atol, rtol) of ``op`` for results of ``dtype``, widened by the call's reduction length."""
    decl = get_op(op)
    tol = decl.tolerances[dtype]
    k = decl.reduction(decl.bind(args)) if decl.reduction else 1
    return tol.widened(int(k))


def assert_close(op: str, got: Any, want: Any, args: tuple, dtype: Optional[str] = None, what: str = "result") -> None:
    """got (a tensor of the kernel's dtype) against the float64 reference, within op's tolerance."""
    assert isinstance(got, torch.Tensor), f"{op} {what}: expected a tensor, got {type(got).__name__}"
    want = torch.as_tensor(want)
    assert tuple(got.shape) == tuple(want.shape), f"{op} {what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    name = dtype or str(got.dtype).removeprefix("torch.")
    atol, rtol = tolerance(op, name, args)
    g = got.detach().to(torch.float64)
    assert torch.isfinite(g).all() or not torch.isfinite(want).all(), f"{op} {what}: non-finite values"
    err = (g - want).abs()
    bound = atol + rtol * want.abs()
    bad = ~(err <= bound) & ~(torch.isnan(g) & torch.isnan(want))
    assert not bad.any(), (
        f"{op} {what} ({name}): {int(bad.sum())} of {g.numel()} values off; max abs err {float(err.nan_to_num(0).max()):.3g}"
        f" (atol {atol:.3g}, rtol {rtol:.3g})"
    )


# --- FP8 (the kernel tests in device/ and interpreted/) ----------------------------------------------


def assert_bits(got: torch.Tensor, want: Any, what: str) -> None:
    """``got`` (any device) equal to ``want`` element for element: uint8 codes exactly, floats
    exactly with NaN matching NaN."""
    want_t = torch.from_numpy(np.array(want, order="C"))
    g = got.cpu()
    assert tuple(g.shape) == tuple(want_t.shape), f"{what}: shape {tuple(g.shape)} != {tuple(want_t.shape)}"
    bad = (g != want_t) if g.dtype == torch.uint8 else ~((g == want_t) | (g.isnan() & want_t.isnan()))
    assert not bad.any(), f"{what}: {int(bad.sum())} of {g.numel()} differ, first at {bad.nonzero()[0].tolist()}: {g[bad][:4].tolist()} != {want_t[bad][:4].tolist()}"


def finite_codes(gen: torch.Generator, fmt: str, *shape: int) -> torch.Tensor:
    """Random uint8 codes of ``fmt``'s finite values."""
    from hal.ops.fp8 import format_values

    vals = format_values(fmt)
    ok = torch.from_numpy(np.flatnonzero(np.isfinite(vals))).to(torch.uint8)
    return ok[torch.randint(0, ok.numel(), shape, generator=gen)]


def rms(fmt: str) -> float:
    """The root mean square of ``fmt``'s finite values (to scale random codes to unit products)."""
    from hal.ops.fp8 import format_values

    vals = format_values(fmt)
    return float(np.sqrt(np.mean(vals[np.isfinite(vals)] ** 2)))
