"""Matrix products: linear with a fused activation epilogue, matmul, and ragged grouped GEMM (MoE)."""

from __future__ import annotations

from typing import Any, Mapping

from hal.arrays import FLOAT_DTYPES
from hal.registry import Autocast, declare
from hal.types import OptionalTensor, OutputMask, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like, matmul_shape as fake_matmul_shape, param_like
from ._tolerances import REDUCTION
from .elementwise import ACTIVATIONS

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 30

# --- linear ---------------------------------------------------------------------------------


def _check_linear(op: str, x: Any, weight: Any, bias: Any) -> None:
    c.min_rank(op, "x", x, 1, "(..., in_features)")
    c.float_dtype(op, "x", x)
    c.rank(op, "weight", weight, (2,), "(out_features, in_features)")
    c.same_dtype(op, "weight", weight, "x", x)
    if int(weight.shape[1]) != int(x.shape[-1]):
        raise c.fail(op, "weight", f"of shape (out_features, {int(x.shape[-1])}) to match x's last dimension", weight)
    if bias is not None:
        c.rank(op, "bias", bias, (1,))
        c.shape_is(op, "bias", bias, (int(weight.shape[0]),), "(out_features,)")
        c.same_dtype(op, "bias", bias, "x", x)
    c.result_fits(op, "x", c.shape_of(x)[:-1] + (int(weight.shape[0]),), c.itemsize(x))


def _linear_k(a: dict) -> int:
    return int(a["x"].shape[-1])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="linear_backward", gradients=("x", "weight", "bias"), reduction=_linear_k,
         autocast=Autocast("lower"))
def linear(x: Tensor, weight: Tensor, bias: OptionalTensor = None, act: str = "none") -> Tensor:
    """``act(x @ weight.T + bias)`` as ``F.linear`` followed by an activation (a GEMM epilogue).

    x is (..., in_features), weight (out_features, in_features), bias (out_features,); act as in
    scale_shift_act.
    """


@linear.checker
def _check_linear_entry(x, weight, bias, act):
    _check_linear("linear", x, weight, bias)
    c.choice("linear", "act", act, ACTIVATIONS)


def _pre_activation_row(a: Mapping[str, Any]) -> Any:
    """x @ weight.T + bias for K = 0: every row is the bias (zeros without one), shape (N,)."""
    return a["bias"] if a["bias"] is not None else e.zeros(a["x"], (int(a["weight"].shape[0]),))


def _empty_linear(a: Mapping[str, Any]) -> Any:
    """An empty result, or for K = 0 (a sum over nothing) ``act(bias)`` in every row, as torch."""
    from hal.ops import scale_shift_act

    x = a["x"]
    shape = c.shape_of(x)[:-1] + (int(a["weight"].shape[0]),)
    if 0 in shape:
        return e.zeros(x, shape)
    return e.broadcast_copy(scale_shift_act(_pre_activation_row(a), 1.0, 0.0, a["act"]), shape)


def _product(a: Mapping[str, Any]) -> Any:
    """x @ weight.T: the composite rounds it to the op's dtype before adding the bias."""
    from hal.ops import matmul

    return matmul(a["x"], a["weight"].T)


@linear.composite(rounds=_product)
def _linear_composite(x, weight, bias, act):
    from hal.ops import matmul, scale_shift_act

    y = matmul(x, weight.T)
    if bias is None and act == "none":
        return y
    return scale_shift_act(y, 1.0, 0.0 if bias is None else bias, act)


@linear.composite(fallback=False, training=True, when=lambda a: a["act"] != "none")
def _linear_for_training(x, weight, bias, act):
    """linear, then the activation as its own op: the activation's backward reuses the saved
    pre-activation (one elementwise pass), where linear_backward would recompute the GEMM."""
    from hal.ops import linear, scale_shift_act

    return scale_shift_act(linear(x, weight, bias, "none"), 1.0, 0.0, act)


@linear.fake
def _fake_linear(a):
    return like(a["x"], tuple(a["x"].shape[:-1]) + (a["weight"].shape[0],))


def _linear_backward_k(a: dict) -> int:
    """grad_weight sums over the rows of x, grad_x over the output features."""
    rows = 1
    for size in a["x"].shape[:-1]:
        rows *= int(size)
    return max(rows, int(a["weight"].shape[0]))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="linear", reduction=_linear_backward_k)
def linear_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: OptionalTensor = None,
    act: str = "none",
    output_mask: OutputMask = (True, True, True),
) -> tuple:
    """Gradients of linear: (grad_x, grad_weight, grad_bias); the pre-activation is recomputed.

    grad_bias is the sum of the pre-activation's gradient over the rows, whether or not the
    forward had a bias. ``output_mask`` says which of the three to compute; the others come back
    None (the autograd node asks for no grad_bias of a bias-free layer, nor a grad_weight of a
    frozen one).
    """


@linear_backward.checker
def _check_linear_backward(grad_out, x, weight, bias, act, output_mask):
    op = "linear_backward"
    _check_linear(op, x, weight, bias)
    c.choice(op, "act", act, ACTIVATIONS)
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(x)[:-1] + (int(weight.shape[0]),), "(..., out_features)")
    return {"output_mask": c.bool_tuple(op, "output_mask", output_mask, 3)}


def _empty_linear_backward(a: Mapping[str, Any]) -> tuple:
    """Zero grad_x and grad_weight (sums over nothing, or empty); grad_bias sums grad_out * act'
    over the rows, which for K = 0 is the activation's slope at the bias."""
    from hal.ops import scale_shift_act_backward

    g, x, w = a["grad_out"], a["x"], a["weight"]
    n = int(w.shape[0])
    if e.has_empty(g):
        grad_bias = e.zeros(x, (n,))
    else:  # K = 0: the pre-activation is the bias in every row
        rows = g.reshape(-1, n)
        grad_bias = scale_shift_act_backward(rows, e.zeros_like(rows), 1.0, _pre_activation_row(a), a["act"])[2]
    return e.masked((e.zeros_like(x), e.zeros(x, w.shape), grad_bias), a["output_mask"])


# --- matmul ---------------------------------------------------------------------------------


def matmul_shape(op: str, a: Any, b: Any) -> tuple[int, ...]:
    """Check torch.matmul's shape rules and return the result's shape."""
    c.min_rank(op, "a", a, 1)
    c.min_rank(op, "b", b, 1)
    sa, sb = c.shape_of(a), c.shape_of(b)
    ka = sa[-1]
    kb = sb[0] if len(sb) == 1 else sb[-2]
    if ka != kb:
        raise c.fail(op, "b", f"an array whose contraction dimension is {ka} (a's last dimension)", b)
    if len(sa) == 1 and len(sb) == 1:
        return ()
    batch = c.broadcast_shapes(sa[:-2], sb[:-2])
    if batch is None:
        raise c.fail(op, "b", f"batch dimensions broadcastable with a's {sa[:-2]}", b)
    rows = () if len(sa) == 1 else (sa[-2],)
    cols = () if len(sb) == 1 else (sb[-1],)
    return batch + rows + cols


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="matmul_backward", gradients=("a", "b"), reduction=lambda a: int(a["a"].shape[-1]),
         autocast=Autocast("lower"))
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with torch.matmul's rules: 1-D operands, batch broadcasting, 0-d for two vectors."""


@matmul.checker
def _check_matmul(a, b):
    c.float_dtype("matmul", "a", a)
    c.same_dtype("matmul", "b", b, "a", a)
    c.result_fits("matmul", "b", matmul_shape("matmul", a, b), c.itemsize(a))


def _empty_matmul(a: Mapping[str, Any]) -> Any:
    """Zeros: empty, or sums over an empty contraction (K = 0)."""
    return e.zeros(a["a"], matmul_shape("matmul", a["a"], a["b"]))


def _matmul_backward_k(a: Mapping[str, Any]) -> int:
    """Terms summed into one element of grad_a or grad_b, the larger: numel(grad_out) * K / numel(x)
    for x = a (N products, times the batch entries a was broadcast over) and x = b (M, times b's)."""
    g = a["grad_out"]
    widest = max((int(s) for s in g.shape), default=1)
    k = int(a["a"].shape[-1]) if a["a"].ndim else 1
    summed = [c.numel(g) * k // c.numel(x) for x in (a["a"], a["b"]) if c.numel(x)]
    return max([1, widest, *summed])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="matmul", reduction=_matmul_backward_k)
def matmul_backward(grad_out: Tensor, a: Tensor, b: Tensor) -> tuple:
    """Gradients of matmul: (grad_a, grad_b), broadcast batch dimensions summed back to each shape."""


@matmul_backward.checker
def _check_matmul_backward(grad_out, a, b):
    op = "matmul_backward"
    c.float_dtype(op, "a", a)
    c.same_dtype(op, "b", b, "a", a)
    c.same_dtype(op, "grad_out", grad_out, "a", a)
    c.shape_is(op, "grad_out", grad_out, matmul_shape(op, a, b), "(the forward result's shape)")


def _empty_matmul_backward(a: Mapping[str, Any]) -> tuple:
    """Zero gradients: with any operand or the result empty, every product sums over nothing."""
    return e.zeros_like(a["a"]), e.zeros_like(a["b"])


# --- grouped_gemm ----------------------------------------------------------------------------


def _check_grouped(op: str, x: Any, weight: Any, group_sizes: Any) -> None:
    c.rank(op, "x", x, (2,), "(total_rows, K)")
    c.float_dtype(op, "x", x)
    c.rank(op, "weight", weight, (3,), "(groups, K, N)")
    c.same_dtype(op, "weight", weight, "x", x)
    if int(weight.shape[1]) != int(x.shape[1]):
        raise c.fail(op, "weight", f"of shape (groups, {int(x.shape[1])}, N) to match x's K", weight)
    c.rank(op, "group_sizes", group_sizes, (1,), "(groups,)")
    c.shape_is(op, "group_sizes", group_sizes, (int(weight.shape[0]),), "(one row count per group)")
    c.int_dtype(op, "group_sizes", group_sizes, ("int32", "int64"))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="grouped_gemm_backward", gradients=("x", "weight"), reduction=lambda a: int(a["x"].shape[1]),
         autocast=Autocast("lower"))  # a GEMM per group: torch's matmul family
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """Ragged grouped GEMM (horizontal fusion of MoE experts): rows of group g times ``weight[g]``.

    x is (sum(group_sizes), K) with the rows of group 0 first, weight (G, K, N), group_sizes (G,)
    int32/int64 (groups may be empty). Returns (sum(group_sizes), N). The sum must equal x's rows:
    backends check it where reading the sizes costs no device synchronisation.
    """


@grouped_gemm.checker
def _check_grouped_gemm(x, weight, group_sizes):
    _check_grouped("grouped_gemm", x, weight, group_sizes)


def _empty_grouped_gemm(a: Mapping[str, Any]) -> Any:
    """(total_rows, N) zeros: no rows, no output columns, or K = 0."""
    return e.zeros(a["x"], (int(a["x"].shape[0]), int(a["weight"].shape[2])))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="grouped_gemm", reduction=lambda a: max(int(a["x"].shape[0]), int(a["weight"].shape[2])))
def grouped_gemm_backward(grad_out: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor) -> tuple:
    """Gradients of grouped_gemm: (grad_x, grad_weight); an empty group's grad_weight is zero."""


@grouped_gemm_backward.checker
def _check_grouped_gemm_backward(grad_out, x, weight, group_sizes):
    op = "grouped_gemm_backward"
    _check_grouped(op, x, weight, group_sizes)
    c.same_dtype(op, "grad_out", grad_out, "x", x)
    c.shape_is(op, "grad_out", grad_out, (int(x.shape[0]), int(weight.shape[2])), "(total_rows, N)")


@linear_backward.fake
def _fake_linear_backward(a):
    x, w = a["x"], a["weight"]
    return e.masked((like(x), like(w), param_like(a["bias"], x, (w.shape[0],))), a["output_mask"])


@matmul.fake
def _fake_matmul(a):
    return like(a["a"], fake_matmul_shape(a["a"], a["b"]))


@matmul_backward.fake
def _fake_matmul_backward(a):
    return like(a["a"]), like(a["b"])


@grouped_gemm.fake
def _fake_grouped_gemm(a):
    return like(a["x"], (a["x"].shape[0], a["weight"].shape[2]))


@grouped_gemm_backward.fake
def _fake_grouped_gemm_backward(a):
    return like(a["x"]), like(a["weight"])


def _empty_grouped_gemm_backward(a: Mapping[str, Any]) -> tuple:
    return e.zeros_like(a["x"]), e.zeros_like(a["weight"])


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
linear.empty(_empty_linear)
linear_backward.empty(_empty_linear_backward)
matmul.empty(_empty_matmul)
matmul_backward.empty(_empty_matmul_backward)
grouped_gemm.empty(_empty_grouped_gemm)
grouped_gemm_backward.empty(_empty_grouped_gemm_backward)


__all__ = ["linear", "linear_backward", "matmul", "matmul_backward", "grouped_gemm", "grouped_gemm_backward"]
