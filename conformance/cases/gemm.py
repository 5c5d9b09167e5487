"""Cases of linear, matmul, grouped_gemm and their backward ops.

Transformer widths (GPT-2 small: 768 / 3072, attention heads of 64) at CPU-sized token counts,
torch.matmul's shape rules (vectors, 0-d results, batch broadcasting), odd and prime sizes, long
reductions, transposed weights (``W.T`` views, as nn.Linear's weights are used) and non-contiguous
activations. Second operands are drawn with std 1/sqrt(K) so results are of the first operand's
scale. grouped_gemm draws ragged MoE group sizes with empty groups.
"""

from __future__ import annotations

import dataclasses

import math
from typing import Any, Optional

from hal.ops import ACTIVATIONS
from hal.ops.gemm import matmul_shape

from . import Call, Draw, Table, backward_call, case, from_table

# --- linear -------------------------------------------------------------------------------------


def linear_args(
    d: Draw,
    x: tuple[int, ...],
    n: int,
    act: str = "none",
    bias: bool = True,
    layout: str = "contiguous",
    w_layout: str = "contiguous",
    values: str = "unit",
    bias_mean: float = 0.0,
) -> Call:
    k = x[-1]
    mag = d.magnitude(values)
    args = {
        "x": d.normal(*x, std=mag, layout=layout),
        "weight": d.normal(n, k, std=1 / math.sqrt(max(1, k)), layout=w_layout),
        "bias": d.normal(n, std=0.5 * mag, mean=bias_mean * mag) if bias else None,
        "act": act,
    }
    return Call(args, scale=mag)


def _linear_backward(d: Draw, output_mask: Optional[tuple] = None, **kw: Any) -> Call:
    """The backward call; with ``output_mask`` only those gradients (the others must come back None)."""
    fwd = linear_args(d, **kw)
    x, w = fwd.args["x"], fwd.args["weight"]
    call = backward_call("linear_backward", d, fwd, tuple(x.shape[:-1]) + (int(w.shape[0]),))
    return call if output_mask is None else dataclasses.replace(call, args={**call.args, "output_mask": output_mask})


LINEAR_SHAPES: Table = {
    "mlp_small_gelu_tanh": (dict(x=(4, 64), n=96, act="gelu_tanh"), True, True),
    "transformer_qkv": (dict(x=(2, 16, 512), n=1536), False, False),
    "transformer_mlp_up_gelu": (dict(x=(2, 16, 768), n=3072, act="gelu"), False, True),
    "transformer_mlp_down": (dict(x=(2, 16, 3072), n=768), False, False),
    "swiglu_gate_silu_no_bias": (dict(x=(2, 8, 512), n=1024, act="silu", bias=False), False, True),
    "vector_input": (dict(x=(37,), n=23), True, True),
    "odd_prime": (dict(x=(3, 7, 13), n=11, act="relu", bias_mean=1.5), False, True),
    "k1": (dict(x=(5, 1), n=7), False, False),
    "long_reduction": (dict(x=(4, 8192), n=16), False, True),
    "noncontig_x": (dict(x=(6, 10, 33), n=20, layout="noncontig"), False, True),
    "transposed_weight": (dict(x=(8, 48), n=40, w_layout="transposed"), True, True),
    "large_values": (dict(x=(4, 64), n=32, values="big"), False, False),
    "fp16_underflow": (dict(x=(4, 64), n=32, values="tiny", dtypes=("float16",)), False, False),
    # zero-size dimensions: no rows, no output features, or K = 0 (act(bias) in every row)
    "empty_rows": (dict(x=(0, 16), n=8, act="gelu"), True, True),
    "empty_batch_3d": (dict(x=(2, 0, 16), n=8), False, True),
    "empty_out_features": (dict(x=(3, 4), n=0), False, True),
    "empty_k_sigmoid": (dict(x=(3, 0), n=5, act="sigmoid"), True, True),
    "empty_k_no_bias": (dict(x=(2, 3, 0), n=5, bias=False, act="relu"), False, True),
}

LINEAR = from_table(LINEAR_SHAPES, linear_args)
LINEAR += [case(f"act_{a}", linear_args, quick=a == "none", x=(3, 5, 48), n=40, act=a) for a in ACTIVATIONS]
LINEAR_BACKWARD = from_table(LINEAR_SHAPES, _linear_backward, backward=True)
# ReLU's gradient depends on the sign of the pre-activation: a positive bias keeps most of it away
# from the kink, where half-precision and float64 may disagree.
LINEAR_BACKWARD += [
    case(f"act_{a}", _linear_backward, quick=a == "none", x=(3, 5, 48), n=40, act=a, bias_mean=1.5 if a == "relu" else 0.0)
    for a in ACTIVATIONS
]
# what the autograd node asks for: no grad_bias of a bias-free layer, no grad_weight of a frozen one.
# Activations whose gradient is exact in half precision (none; ReLU away from its kink): these
# cases test the masks, the act_* cases above the rounding of the pre-activation's gradient.
LINEAR_BACKWARD += [
    case("no_bias_gradient", _linear_backward, quick=True, x=(2, 8, 64), n=48, bias=False, output_mask=(True, True, False)),
    case("frozen_weight_relu", _linear_backward, x=(4, 64), n=32, act="relu", bias_mean=1.5, output_mask=(True, False, True)),
    case("weight_only", _linear_backward, x=(3, 5, 48), n=40, output_mask=(False, True, False)),
]

# --- matmul -------------------------------------------------------------------------------------


def matmul_args(
    d: Draw,
    a: tuple[int, ...],
    b: tuple[int, ...],
    a_layout: str = "contiguous",
    b_layout: str = "contiguous",
    values: str = "unit",
) -> Call:
    k = a[-1]
    mag = d.magnitude(values)
    return Call({"a": d.normal(*a, std=mag, layout=a_layout), "b": d.normal(*b, std=1 / math.sqrt(max(1, k)), layout=b_layout)}, scale=mag)


def _matmul_backward(d: Draw, **kw: Any) -> Call:
    fwd = matmul_args(d, **kw)
    return backward_call("matmul_backward", d, fwd, matmul_shape("matmul", fwd.args["a"], fwd.args["b"]))


MATMUL_SHAPES: Table = {
    "square_64": (dict(a=(64, 64), b=(64, 64)), True, True),
    "attention_scores": (dict(a=(2, 8, 16, 64), b=(2, 8, 64, 16)), False, True),
    "batch_broadcast": (dict(a=(3, 1, 5, 7), b=(4, 7, 6)), False, True),
    "vector_vector_0d": (dict(a=(37,), b=(37,)), True, True),
    "vector_matrix": (dict(a=(13,), b=(13, 9)), False, True),
    "matrix_vector": (dict(a=(9, 13), b=(13,)), False, True),
    "batched_vector": (dict(a=(2, 3, 13), b=(13,)), False, False),
    "batched_times_2d": (dict(a=(4, 5, 32), b=(32, 17)), False, True),
    "odd_primes": (dict(a=(13, 17), b=(17, 19)), False, True),
    "long_reduction": (dict(a=(4, 16384), b=(16384, 3)), False, False),
    "transposed_b": (dict(a=(24, 40), b=(40, 32), b_layout="transposed"), True, True),
    "noncontig_a": (dict(a=(6, 20, 33), b=(33, 12), a_layout="noncontig"), False, True),
    "large_values": (dict(a=(16, 32), b=(32, 8), values="big"), False, False),
    "fp16_underflow": (dict(a=(16, 32), b=(32, 8), values="tiny", dtypes=("float16",)), False, False),
    # zero-size dimensions: K = 0 gives zeros, empty rows or batches give empty results
    "empty_k": (dict(a=(3, 0), b=(0, 4)), True, True),
    "empty_vector_dot": (dict(a=(0,), b=(0,)), False, True),
    "empty_rows": (dict(a=(0, 5), b=(5, 3)), False, True),
    "empty_batch_broadcast": (dict(a=(0, 3, 2), b=(2, 4)), False, True),
    "empty_cols_batched": (dict(a=(2, 3, 4), b=(2, 4, 0)), False, True),
}

MATMUL = from_table(MATMUL_SHAPES, matmul_args)
MATMUL_BACKWARD = from_table(MATMUL_SHAPES, _matmul_backward, backward=True)

# --- grouped_gemm -------------------------------------------------------------------------------


def grouped_args(
    d: Draw,
    sizes: Optional[list[int]],
    k: int,
    n: int,
    groups: int = 0,
    rows: int = 0,
    sizes_dtype: str = "int64",
    layout: str = "contiguous",
    w_layout: str = "contiguous",
    values: str = "unit",
) -> Call:
    """Group sizes as given, or ``rows`` spread at random over ``groups`` groups, one left empty."""
    if sizes is None:
        cuts = sorted(d.rng.integers(0, rows + 1, groups - 1).tolist())
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
        empty = int(d.rng.integers(0, groups))
        sizes[(empty + 1) % groups] += sizes[empty]
        sizes[empty] = 0
    mag = d.magnitude(values)
    args = {
        "x": d.normal(sum(sizes), k, std=mag, layout=layout),
        "weight": d.normal(len(sizes), k, n, std=1 / math.sqrt(max(1, k)), layout=w_layout),
        "group_sizes": d.tensor(sizes, dtype=sizes_dtype),
    }
    return Call(args, scale=mag)


def _grouped_backward(d: Draw, **kw: Any) -> Call:
    fwd = grouped_args(d, **kw)
    return backward_call("grouped_gemm_backward", d, fwd, (int(fwd.args["x"].shape[0]), int(fwd.args["weight"].shape[2])))


GROUPED_SHAPES: Table = {
    "moe_8_experts": (dict(sizes=None, groups=8, rows=100, k=64, n=96), True, True),
    "single_group": (dict(sizes=[17], k=24, n=31), False, True),
    "odd_sizes": (dict(sizes=[3, 0, 7, 1, 11], k=13, n=9), False, True),
    "many_empty": (dict(sizes=[0, 0, 5, 0, 0, 4], k=16, n=8), False, True),
    "int32_sizes": (dict(sizes=None, groups=4, rows=40, k=32, n=24, sizes_dtype="int32"), False, True),
    "long_k": (dict(sizes=[3, 5], k=4096, n=8), False, False),
    "noncontig_x": (dict(sizes=None, groups=3, rows=30, k=20, n=12, layout="noncontig"), False, True),
    "transposed_weight": (dict(sizes=None, groups=4, rows=32, k=24, n=16, w_layout="transposed"), True, True),
    "large_values": (dict(sizes=[4, 6], k=32, n=8, values="big"), False, False),
    # experts with no tokens at all, no experts, K = 0, N = 0
    "empty_all_groups": (dict(sizes=[0, 0, 0], k=8, n=4), True, True),
    "empty_no_groups": (dict(sizes=[], k=8, n=4), False, True),
    "empty_k": (dict(sizes=[2, 0, 3], k=0, n=4), False, True),
    "empty_n": (dict(sizes=[2, 3], k=6, n=0), False, True),
}

GROUPED = from_table(GROUPED_SHAPES, grouped_args)
GROUPED_BACKWARD = from_table(GROUPED_SHAPES, _grouped_backward, backward=True)

CASES = {
    "linear": LINEAR,
    "linear_backward": LINEAR_BACKWARD,
    "matmul": MATMUL,
    "matmul_backward": MATMUL_BACKWARD,
    "grouped_gemm": GROUPED,
    "grouped_gemm_backward": GROUPED_BACKWARD,
}
