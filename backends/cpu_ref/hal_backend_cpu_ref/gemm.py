"""linear (with its activation epilogue), matmul and the ragged grouped GEMM of MoE layers."""

from __future__ import annotations

import numpy as np

from hal.errors import InvalidArgumentError
from hal.plugin import Inputs

from ._common import elements, f64, like, reference, with_result
from .elementwise import activation, activation_grad

# --- linear: act(x @ W.T + b) ------------------------------------------------------------------


def _pre_activation(x: np.ndarray, weight: np.ndarray, bias) -> np.ndarray:
    z = f64(x) @ f64(weight).T
    return z if bias is None else z + f64(bias)


def _linear_result(inputs: Inputs) -> int:
    x, w = inputs["x"], inputs["weight"]
    return elements(x.shape[:-1]) * (int(w.shape[0]) + int(w.shape[1]))  # the result, and grad_x's size


@reference("linear", with_result(_linear_result))
def linear(x, weight, bias, act):
    return like(activation(_pre_activation(x, weight, bias), act), x)


@reference("linear_backward", with_result(_linear_result))
def linear_backward(grad_out, x, weight, bias, act, output_mask):
    gz = f64(grad_out) * activation_grad(_pre_activation(x, weight, bias), act)
    rows = elements(x.shape[:-1])
    rows_gz, rows_x = gz.reshape(rows, gz.shape[-1]), f64(x).reshape(rows, x.shape[-1])
    grads = (gz @ f64(weight), rows_gz.T @ rows_x, rows_gz.sum(axis=0))
    return tuple(like(g, x) if m else None for g, m in zip(grads, output_mask))


# --- matmul: torch.matmul's rules (1-D operands gain a unit dimension, then lose it) -------------


def _matmul_shapes(a_shape, b_shape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """a and b as matrices (a 1-D operand gains a unit dimension) and their broadcast batch shape."""
    a2 = tuple(a_shape) if len(a_shape) > 1 else (1,) + tuple(a_shape)
    b2 = tuple(b_shape) if len(b_shape) > 1 else tuple(b_shape) + (1,)
    return a2, b2, np.broadcast_shapes(a2[:-2], b2[:-2])


def _matmul_result(inputs: Inputs) -> int:
    a2, b2, batch = _matmul_shapes(inputs["a"].shape, inputs["b"].shape)
    return elements(batch) * a2[-2] * b2[-1]


@reference("matmul", with_result(_matmul_result))
def matmul(a, b):
    return like(np.matmul(f64(a), f64(b)), a)


def _batch_labels(shape: tuple[int, ...], batch: tuple[int, ...], letters: str) -> tuple[str, tuple[int, ...]]:
    """einsum letters of the batch dimensions an operand of ``shape`` (matrix dims last) really has
    (those it is not broadcast along), and its shape with the broadcast ones dropped."""
    own = (1,) * (len(batch) - (len(shape) - 2)) + tuple(shape[:-2])
    keep = [d for d, (n, full) in enumerate(zip(own, batch)) if n == full]
    return "".join(letters[d] for d in keep), tuple(own[d] for d in keep) + tuple(shape[-2:])


def _operand_grad(g: np.ndarray, other: np.ndarray, g_sub: str, other_sub: str, own_shape, batch, own_mat: str) -> np.ndarray:
    """The gradient of one matmul operand: the product of grad_out with the other operand, summed
    over the batch dimensions the operand is broadcast along, by one einsum (no intermediate of the
    broadcast batch shape times the operand's matrix)."""
    letters = "abcdefghijklmnop"[: len(batch)]
    own, _ = _batch_labels(own_shape, batch, letters)
    return np.einsum(f"{letters}{g_sub},{other_sub}->{own}{own_mat}", g, other, optimize=True)


@reference("matmul_backward", with_result(_matmul_result))
def matmul_backward(grad_out, a, b):
    a2s, b2s, batch = _matmul_shapes(a.shape, b.shape)
    letters = "abcdefghijklmnop"[: len(batch)]
    a_sub, a_shape = _batch_labels(a2s, batch, letters)
    b_sub, b_shape = _batch_labels(b2s, batch, letters)
    g = f64(grad_out).reshape(batch + (a2s[-2], b2s[-1]))
    a2, b2 = f64(a).reshape(a_shape), f64(b).reshape(b_shape)
    grad_a = _operand_grad(g, b2, "xz", b_sub + "yz", a2s, batch, "xy")  # g @ b^T
    grad_b = _operand_grad(g, a2, "xz", a_sub + "xy", b2s, batch, "yz")  # a^T @ g
    return like(grad_a.reshape(a.shape), a), like(grad_b.reshape(b.shape), b)


# --- grouped_gemm: rows [start_g, end_g) of x times weight[g] ----------------------------------


def _group_bounds(op: str, x: np.ndarray, group_sizes: np.ndarray) -> list[tuple[int, int]]:
    """Each group's row range; the sizes must be >= 0 and sum to x's rows (checked here, on the CPU)."""
    sizes = [int(s) for s in np.asarray(group_sizes)]
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[0]:
        raise InvalidArgumentError(
            op, "group_sizes", f"non-negative row counts summing to x's {x.shape[0]} rows", f"{sizes} (sum {sum(sizes)})"
        )
    ends = np.cumsum(sizes)
    return [(int(e) - s, int(e)) for s, e in zip(sizes, ends)]


def _grouped_result(inputs: Inputs) -> int:
    return int(inputs["x"].shape[0]) * (int(inputs["weight"].shape[2]) + int(inputs["x"].shape[1]))


@reference("grouped_gemm", with_result(_grouped_result))
def grouped_gemm(x, weight, group_sizes):
    xs, w = f64(x), f64(weight)
    out = np.empty((xs.shape[0], w.shape[2]))
    for g, (lo, hi) in enumerate(_group_bounds("grouped_gemm", x, group_sizes)):
        out[lo:hi] = xs[lo:hi] @ w[g]
    return like(out, x)


@reference("grouped_gemm_backward", with_result(_grouped_result))
def grouped_gemm_backward(grad_out, x, weight, group_sizes):
    go, xs, w = f64(grad_out), f64(x), f64(weight)
    grad_x, grad_w = np.empty_like(xs), np.empty_like(w)
    for g, (lo, hi) in enumerate(_group_bounds("grouped_gemm_backward", x, group_sizes)):
        grad_x[lo:hi] = go[lo:hi] @ w[g].T
        grad_w[g] = xs[lo:hi].T @ go[lo:hi]  # an empty group gives zeros
    return like(grad_x, x), like(grad_w, x)
