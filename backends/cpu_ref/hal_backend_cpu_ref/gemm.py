"""linear (with its activation epilogue), matmul and the ragged grouped GEMM of MoE layers."""

from __future__ import annotations

import numpy as np

from hal.errors import InvalidArgumentError

from ._common import f64, like, reference
from .elementwise import activation, activation_grad, sum_to

# --- linear: act(x @ W.T + b) ------------------------------------------------------------------


def _pre_activation(x: np.ndarray, weight: np.ndarray, bias) -> np.ndarray:
    z = f64(x) @ f64(weight).T
    return z if bias is None else z + f64(bias)


@reference("linear")
def linear(x, weight, bias, act):
    return like(activation(_pre_activation(x, weight, bias), act), x)


@reference("linear_backward")
def linear_backward(grad_out, x, weight, bias, act):
    gz = f64(grad_out) * activation_grad(_pre_activation(x, weight, bias), act)
    rows_gz, rows_x = gz.reshape(-1, gz.shape[-1]), f64(x).reshape(-1, x.shape[-1])
    return like(gz @ f64(weight), x), like(rows_gz.T @ rows_x, x), like(rows_gz.sum(axis=0), x)


# --- matmul: torch.matmul's rules (1-D operands gain a unit dimension, then lose it) -------------


@reference("matmul")
def matmul(a, b):
    return like(np.matmul(f64(a), f64(b)), a)


@reference("matmul_backward")
def matmul_backward(grad_out, a, b):
    a2 = f64(a) if a.ndim > 1 else f64(a)[None, :]
    b2 = f64(b) if b.ndim > 1 else f64(b)[:, None]
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    g2 = f64(grad_out).reshape(batch + (a2.shape[-2], b2.shape[-1]))
    grad_a = sum_to(g2 @ np.swapaxes(b2, -1, -2), a2.shape)
    grad_b = sum_to(np.swapaxes(a2, -1, -2) @ g2, b2.shape)
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


@reference("grouped_gemm")
def grouped_gemm(x, weight, group_sizes):
    xs, w = f64(x), f64(weight)
    out = np.empty((xs.shape[0], w.shape[2]))
    for g, (lo, hi) in enumerate(_group_bounds("grouped_gemm", x, group_sizes)):
        out[lo:hi] = xs[lo:hi] @ w[g]
    return like(out, x)


@reference("grouped_gemm_backward")
def grouped_gemm_backward(grad_out, x, weight, group_sizes):
    go, xs, w = f64(grad_out), f64(x), f64(weight)
    grad_x, grad_w = np.empty_like(xs), np.empty_like(w)
    for g, (lo, hi) in enumerate(_group_bounds("grouped_gemm_backward", x, group_sizes)):
        grad_x[lo:hi] = go[lo:hi] @ w[g].T
        grad_w[g] = xs[lo:hi].T @ go[lo:hi]  # an empty group gives zeros
    return like(grad_x, x), like(grad_w, x)
