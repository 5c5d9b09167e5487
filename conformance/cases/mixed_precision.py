"""Cases of amp_unscale_ and fused_adamw_ (in-place ops: the suite compares the returned value and
every argument the op writes).

amp_unscale_: scaled gradients (values up to ~6e4 in half precision) over several tensors, the
inverse scale as a number or a one-element float32 tensor, a power of two or not, and a NaN or an
infinity in one tensor (found_inf must be 1.0 and every tensor is still scaled). A value that
overflows only after scaling is not drawn: the float64 reference cannot overflow where the case
dtype does.

fused_adamw_: one AdamW step over lists of parameters of odd sizes, with states in the parameters'
dtype or float32, float32 master weights (with gradients in the parameters' dtype, or float32 ones:
half-precision copies of float32 weights stepped on the weights' gradients), gradient unscaling, a
skipped step (found_inf = 1 writes nothing), the first step (largest bias corrections) and a late
one, and many small tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import Call, Draw, case

HALF = ("float16", "bfloat16")


def unscale_args(d: Draw, shapes: list[tuple[int, ...]], inv_scale: float, as_tensor: bool = False, special: Optional[float] = None) -> Call:
    grads_scale = 1.0 / inv_scale
    tensors = []
    for i, shape in enumerate(shapes):
        raw = np.clip(d.rng.standard_normal(shape) * grads_scale * 2e-3, -6e4, 6e4)
        if special is not None and i == len(shapes) // 2 and raw.size:
            raw.reshape(-1)[d.rng.integers(0, raw.size)] = special
        tensors.append(d.tensor(raw))
    inv = d.tensor([inv_scale], dtype="float32") if as_tensor else inv_scale
    return Call({"tensors": tensors, "inv_scale": inv}, result_dtypes=("float32",))


SHAPES = [(1000,), (3, 7), (64, 64)]
AMP_UNSCALE = [
    case("three_tensors_pow2", unscale_args, quick=True, shapes=SHAPES, inv_scale=2.0**-10),
    case("tensor_inv_scale", unscale_args, shapes=SHAPES, inv_scale=2.0**-16, as_tensor=True),
    case("non_pow2_scale", unscale_args, shapes=SHAPES, inv_scale=0.37),
    case("single_tensor", unscale_args, shapes=[(31, 17)], inv_scale=2.0**-8),
    case("inf_in_one", unscale_args, quick=True, shapes=SHAPES, inv_scale=2.0**-10, special=float("inf")),
    case("nan_in_one", unscale_args, shapes=SHAPES, inv_scale=2.0**-10, as_tensor=True, special=float("nan")),
    # a factor above 1: half-precision values overflow while scaling (flagged), float32 ones do not
    case("factor_above_one", unscale_args, shapes=SHAPES, inv_scale=4.0),
    case("factor_above_one_tensor", unscale_args, shapes=SHAPES, inv_scale=64.0, as_tensor=True),
    # empty tensors hold nothing to scale or flag
    case("empty_tensor_among", unscale_args, quick=True, shapes=[(0,), (3, 7), (2, 0)], inv_scale=2.0**-10),
    case("empty_all", unscale_args, shapes=[(0,), (0, 4)], inv_scale=2.0**-10),
    case("empty_among_inf", unscale_args, shapes=[(0,), (5,), (0, 3)], inv_scale=0.5, special=float("inf")),
]


def adamw_args(
    d: Draw,
    shapes: list[tuple[int, ...]],
    state_dtype: Optional[str] = None,
    master: bool = False,
    inv_scale: Any = None,
    found_inf: Optional[float] = None,
    step: float = 5.0,
    weight_decay: float = 1e-2,
    grad_dtype: Optional[str] = None,
) -> Call:
    """``inv_scale``: None, a number, or "tensor" (a float32 one-element tensor of 1/1024);
    ``grad_dtype``: the grads' dtype (default: the case dtype, the params')."""
    grad_scale = 1024.0 if inv_scale is not None else 1.0
    params = [d.normal(*s) for s in shapes]
    args: dict[str, Any] = {
        "params": params,
        "grads": [d.normal(*s, std=grad_scale, dtype=grad_dtype) for s in shapes],
        "exp_avgs": [d.normal(*s, std=0.1, dtype=state_dtype) for s in shapes],
        "exp_avg_sqs": [d.uniform(*s, low=1e-3, high=1e-2, dtype=state_dtype) for s in shapes],
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": weight_decay,
        "step": step,
        "master_params": None,
        "inv_scale": None,
        "found_inf": None,
    }
    if master:  # float32 masters carry bits the low-precision params lost
        args["master_params"] = [p.float() + d.normal(*p.shape, std=1e-3, dtype="float32") for p in params]
    if inv_scale == "tensor":
        args["inv_scale"] = d.tensor([1 / grad_scale], dtype="float32")
    elif inv_scale is not None:
        args["inv_scale"] = 1 / grad_scale
    if found_inf is not None:
        args["found_inf"] = d.tensor([found_inf], dtype="float32")
    return Call(args, keep_dtype=("master_params",) + (("grads",) if grad_dtype else ()))


PARAMS = [(64,), (16, 33), (7,)]
FUSED_ADAMW = [
    case("three_params", adamw_args, quick=True, shapes=PARAMS),
    case("fp32_states", adamw_args, quick=True, shapes=PARAMS, state_dtype="float32", dtypes=HALF),
    case("master_weights", adamw_args, quick=True, shapes=PARAMS, state_dtype="float32", master=True, dtypes=HALF + ("float32",)),
    case("master_weights_unscale", adamw_args, shapes=PARAMS, state_dtype="float32", master=True, inv_scale="tensor", dtypes=HALF),
    # half-precision copies of float32 weights (the masters), stepped on the weights' float32 grads
    case("master_fp32_grads", adamw_args, quick=True, shapes=PARAMS, state_dtype="float32", master=True, grad_dtype="float32",
         dtypes=HALF),
    case("master_fp32_grads_unscale", adamw_args, shapes=PARAMS, state_dtype="float32", master=True, grad_dtype="float32",
         inv_scale="tensor", dtypes=HALF),
    case("master_fp32_grads_skipped", adamw_args, shapes=PARAMS, state_dtype="float32", master=True, grad_dtype="float32",
         inv_scale="tensor", found_inf=1.0, dtypes=HALF),
    case("inv_scale_number", adamw_args, shapes=PARAMS, inv_scale=1),
    case("inv_scale_tensor", adamw_args, shapes=PARAMS, inv_scale="tensor"),
    case("found_inf_skips_step", adamw_args, shapes=PARAMS, inv_scale="tensor", found_inf=1.0),
    case("found_inf_zero_steps", adamw_args, shapes=PARAMS, found_inf=0.0),
    case("first_step", adamw_args, shapes=PARAMS, step=1.0),
    case("late_step", adamw_args, shapes=PARAMS, step=10000.0),
    case("no_weight_decay", adamw_args, shapes=PARAMS, weight_decay=0.0),
    case("single_param", adamw_args, shapes=[(257, 3)]),
    case("many_small_params", adamw_args, shapes=[(n,) for n in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71)]),
    # empty parameters have nothing to step
    case("empty_param_among", adamw_args, quick=True, shapes=[(64,), (0,), (3, 0)]),
    case("empty_all", adamw_args, shapes=[(0,), (0, 5)]),
    case("empty_master_weights", adamw_args, shapes=[(0, 3), (9,)], state_dtype="float32", master=True, inv_scale="tensor", dtypes=HALF),
]

CASES = {"amp_unscale_": AMP_UNSCALE, "fused_adamw_": FUSED_ADAMW}
