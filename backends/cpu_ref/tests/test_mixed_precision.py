"""cpu_ref's amp_unscale_ and fused_adamw_ against torch's own unscale kernel and torch.optim.AdamW
(and hal_torch's versions)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from refcheck import randn

import hal
from hal.arrays import to_numpy, torch_dtype
from hal_torch.table import eager

# --- amp_unscale_ ----------------------------------------------------------------------------------

AMP_IMPLS: dict[str, Callable[..., Any]] = {
    "cpu_ref": lambda *a, **k: hal.ops.amp_unscale_(*a, **k),
    "eager": lambda *a, **k: eager("amp_unscale_")(*a, **k),
}


def _grads(rng, dtype: torch.dtype) -> list[torch.Tensor]:
    """Three gradients: odd sizes, and a non-contiguous one."""
    strided = randn(rng, 4, 10, dtype=dtype)[:, ::2]
    assert not strided.is_contiguous()
    return [randn(rng, 7, dtype=dtype) * 100, randn(rng, 3, 5, dtype=dtype), strided]


def _torch_unscale(tensors: list[torch.Tensor], inv_scale: float) -> tuple[list[torch.Tensor], float]:
    """torch's own kernel on copies: (scaled copies, found_inf)."""
    out = [t.clone() for t in tensors]
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(out, found, torch.tensor([inv_scale], dtype=torch.float32))
    return out, float(found)


INV_SCALES = {
    "power_of_two": lambda: 2.0**-10,
    "not_power_of_two": lambda: 0.37,
    "tensor_0d": lambda: torch.tensor(0.37, dtype=torch.float32),
    "tensor_1d_float64": lambda: torch.tensor([0.37], dtype=torch.float64),
}


def _as_float(v: Any) -> float:
    return float(torch.as_tensor(v).reshape(()))


@pytest.mark.parametrize("impl", list(AMP_IMPLS))
@pytest.mark.parametrize("inv", list(INV_SCALES))
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_amp_unscale_finite(dtype, inv, impl, rng):
    tensors = _grads(rng, torch_dtype(dtype))
    inv_scale = INV_SCALES[inv]()
    want, _ = _torch_unscale(tensors, _as_float(inv_scale))
    found = AMP_IMPLS[impl](tensors, inv_scale)
    assert isinstance(found, torch.Tensor) and found.shape == () and found.dtype == torch.float32
    assert float(found) == 0.0
    for got, ref in zip(tensors, want):
        if dtype in ("float64", "float32"):  # one rounding of the product on both sides
            assert torch.equal(got, ref)
        else:  # torch rounds the float32 product again to 16 bits: at most one unit apart
            torch.testing.assert_close(got, ref, rtol=2**-7, atol=0)


#: a planted value: (which tensor, where in it, value, inv_scale)
NON_FINITE = {
    "inf": (1, (2, 4), math.inf, 0.25),
    "minus_inf": (0, (0,), -math.inf, 0.25),
    "nan_in_strided": (2, (3, 1), math.nan, 0.25),
    "overflow_when_scaling": (0, (2,), 60000.0, 4.0),
}


@pytest.mark.parametrize("impl", list(AMP_IMPLS))
@pytest.mark.parametrize("case", list(NON_FINITE))
def test_amp_unscale_non_finite(case, impl, rng):
    index, where, value, inv_scale = NON_FINITE[case]
    tensors = _grads(rng, torch.float16)
    tensors[index][where] = value
    want, torch_found = _torch_unscale(tensors, inv_scale)
    found = AMP_IMPLS[impl](tensors, inv_scale)
    assert float(found) == 1.0
    if case == "overflow_when_scaling":  # finite before, infinite after: torch's kernel misses it
        assert torch_found == 0.0 and not torch.isfinite(tensors[index]).all()
    for got, ref in zip(tensors, want):  # every tensor is scaled, before and after the bad one
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=0, equal_nan=True)


@pytest.mark.parametrize("found_value", [0.0, 1.0])
def test_amp_unscale_numpy_in_place(found_value, rng):
    arrays = [to_numpy(t) for t in _grads(rng, torch.float32)]
    if found_value:
        arrays[1][0, 0] = np.nan
    before = [a.copy() for a in arrays]
    found = hal.ops.amp_unscale_(arrays, 0.5)
    assert isinstance(found, np.ndarray) and found.shape == () and found.dtype == np.float32
    assert float(found) == found_value
    for got, old in zip(arrays, before):
        np.testing.assert_array_equal(got, old * np.float32(0.5))


def test_amp_unscale_empty_list_finds_nothing():
    found = hal.ops.amp_unscale_([], 0.5)
    assert found.shape == () and float(found) == 0.0


# --- fused_adamw_ ----------------------------------------------------------------------------------

HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
SHAPES = [(7, 3), (11,), (2, 5, 3)]
STEPS = 20


def _adamw_reference(init: list[torch.Tensor], dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    ref = [torch.nn.Parameter(t.clone().to(dtype)) for t in init]
    betas = (HYPER["beta1"], HYPER["beta2"])
    opt = torch.optim.AdamW(ref, lr=HYPER["lr"], betas=betas, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    return ref, opt


def _noncontiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a transposed buffer (a non-contiguous view with t's values)."""
    view = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(*reversed(range(t.ndim)))
    view.copy_(t)
    return view


def _numpy(v: Any) -> Any:
    """Tensors (alone or in a list) as NumPy views; other values unchanged."""
    if isinstance(v, list):
        return [to_numpy(t) for t in v]
    return to_numpy(v) if isinstance(v, torch.Tensor) else v


def _run_adamw(
    rng,
    fn: Callable[..., Any],
    dtype: str,
    master: bool,
    inv_scale: Optional[float],
    skipped: tuple[int, ...],
    array: str = "torch",
) -> None:
    """STEPS steps of ``fn`` against torch.optim.AdamW on the same gradients.

    The reference works in the params' dtype, or on float32 copies for master weights. With
    ``inv_scale`` hal gets gradients multiplied by 1 / inv_scale and the reference their unscaled
    values; on ``skipped`` steps hal gets found_inf = 1 and the reference does not step.
    """
    pdtype = torch_dtype(dtype)
    init = [randn(rng, *s) for s in SHAPES]
    ref, opt = _adamw_reference(init, torch.float32 if master else pdtype)
    params = [t.to(pdtype) for t in init]
    params[0] = _noncontiguous_copy(params[0])
    masters = [t.float() for t in init] if master else None
    sdtype = torch.float32 if master else pdtype
    exp_avgs = [torch.zeros(s, dtype=sdtype) for s in SHAPES]  # AdamW's states start at zero
    exp_avg_sqs = [torch.zeros(s, dtype=sdtype) for s in SHAPES]
    step = 0
    for i in range(STEPS):
        grads = [randn(rng, *s, dtype=pdtype) for s in SHAPES]
        given = [g.clone() for g in grads]
        skip = i in skipped
        if not skip:
            step += 1
            inv32 = 1.0 if inv_scale is None else float(np.float32(inv_scale))
            for r, g in zip(ref, grads):
                r.grad = (g.double() * inv32).to(r.dtype)
            opt.step()
        before = [t.clone() for t in (*params, *exp_avgs, *exp_avg_sqs, *(masters or []))]
        state = [params, grads, exp_avgs, exp_avg_sqs]
        extra = dict(master_params=masters, inv_scale=inv_scale, found_inf=torch.tensor([float(skip)]) if skipped else None)
        if array == "numpy":  # NumPy views of the same memory: the op must write into them
            state = [_numpy(ts) for ts in state]
            extra = {k: _numpy(v) for k, v in extra.items()}
        fn(*state, step=float(max(step, 1)), **HYPER, **extra)
        for g, g0 in zip(grads, given):
            assert torch.equal(g, g0), "grads must never be modified"
        if skip:
            after = (*params, *exp_avgs, *exp_avg_sqs, *(masters or []))
            assert all(torch.equal(a, b) for a, b in zip(after, before)), "a step with found_inf wrote something"
    _assert_adamw_state(dtype, ref, opt, params, masters, exp_avgs, exp_avg_sqs)


def _assert_adamw_state(dtype, ref, opt, params, masters, exp_avgs, exp_avg_sqs) -> None:
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == "float64" and masters is None else dict(rtol=2e-5, atol=2e-6)
    for i, r in enumerate(ref):
        st = opt.state[r]
        torch.testing.assert_close(exp_avgs[i], st["exp_avg"], **tol)
        torch.testing.assert_close(exp_avg_sqs[i], st["exp_avg_sq"], **tol)
        if masters is None:
            torch.testing.assert_close(params[i], r.detach(), **tol)
        else:
            torch.testing.assert_close(masters[i], r.detach(), **tol)
            assert torch.equal(params[i], masters[i].to(params[i].dtype)), "params must be their masters, rounded"


ADAMW_CASES = {
    # id: (param dtype, master weights, inv_scale, skipped steps)
    "float64": ("float64", False, None, ()),
    "float32": ("float32", False, None, ()),
    "float64_inv_scale": ("float64", False, 2.0**-12, ()),
    "float64_inv_scale_not_pow2": ("float64", False, 1 / 3, ()),
    "float64_found_inf": ("float64", False, 2.0**-8, (0, 7, 8, 19)),
    "bfloat16_master": ("bfloat16", True, None, ()),
    "float16_master_inv_scale_found_inf": ("float16", True, 2.0**-6, (3, 11)),
}
ADAMW_IMPLS: dict[str, Callable[..., Any]] = {
    "cpu_ref": lambda *a, **k: hal.ops.fused_adamw_(*a, **k),
    "eager": lambda *a, **k: eager("fused_adamw_")(*a, **k),
}


@pytest.mark.parametrize("impl", list(ADAMW_IMPLS))
@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_fused_adamw_matches_torch_optim(case, impl, rng):
    _run_adamw(rng, ADAMW_IMPLS[impl], *ADAMW_CASES[case])


@pytest.mark.parametrize("case", ["float64_found_inf", "bfloat16_master"])
def test_fused_adamw_numpy_in_place(case, rng):
    _run_adamw(rng, ADAMW_IMPLS["cpu_ref"], *ADAMW_CASES[case], array="numpy")


def test_fused_adamw_low_precision_params_float32_states(rng):
    """float16 params with float32 states and no masters: cpu_ref and eager agree to fp16 rounding."""
    init = [randn(rng, *s, dtype=torch.float16) for s in SHAPES]
    grads = [[randn(rng, *s, dtype=torch.float16) for s in SHAPES] for _ in range(5)]
    runs = {}
    for name, fn in ADAMW_IMPLS.items():
        params = [t.clone() for t in init]
        exp_avgs = [torch.zeros(s) for s in SHAPES]
        exp_avg_sqs = [torch.zeros(s) for s in SHAPES]
        for step, g in enumerate(grads, start=1):
            fn(params, g, exp_avgs, exp_avg_sqs, step=float(step), **HYPER)
        runs[name] = params + exp_avgs + exp_avg_sqs
    assert [t.dtype for t in runs["cpu_ref"]] == [torch.float16] * 3 + [torch.float32] * 6
    for got, want in zip(runs["cpu_ref"], runs["eager"]):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"found_inf": torch.tensor([0.0, 0.0])}, r"argument 'found_inf' must be a number or a 0-d/1-d array of 1 elements"),
        ({"master_params": "float64"}, r"argument 'master_params\[0\]' must be of dtype float32"),
        ({"beta1": 1.0}, r"argument 'beta1' must be a number in \[0, 1\)"),
    ],
    ids=["found_inf_two_elements", "master_not_float32", "beta1_one"],
)
def test_fused_adamw_bad_arguments(change, match, rng):
    p = [randn(rng, 3, dtype=torch.float16)]
    args = dict(params=p, grads=[randn(rng, 3, dtype=torch.float16)], exp_avgs=[torch.zeros(3)], exp_avg_sqs=[torch.zeros(3)])
    kwargs = {**HYPER, "step": 1.0, **change}
    if kwargs.get("master_params") == "float64":
        kwargs["master_params"] = [randn(rng, 3)]
    with pytest.raises(hal.InvalidArgumentError, match=match):
        hal.ops.fused_adamw_(**args, **kwargs)
