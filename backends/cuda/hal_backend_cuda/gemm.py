"""linear, matmul and grouped_gemm.

linear has three kernels:

- ``cublaslt``: cuBLAS(Lt) through torch; relu and gelu_tanh run as cuBLASLt epilogues
  (``torch._addmm_activation``), none as a plain GEMM with the bias;
- ``cublas_triton``: cuBLAS GEMM with the bias, then the activation in place by one Triton pass
  (any activation; exact erf GELU among them);
- ``triton``: a Triton GEMM with bias and activation applied to the accumulator before its only
  store (autotuned tiles).

grouped_gemm is Triton (group sizes stay on the device: no synchronisation, capturable).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from hal.plugin import Inputs

from . import autotune, launch
from ._common import FLOATS, NOT_F64, family, kernel

_LT_ACTS = ("none", "relu", "gelu_tanh")
_zeros_lock = threading.Lock()
_zeros: dict[tuple, torch.Tensor] = {}


def _zero_bias(n: int, like: torch.Tensor) -> torch.Tensor:
    """A cached zero vector standing in for a missing bias of the cuBLASLt epilogue."""
    key = (n, like.dtype, like.device)
    z = _zeros.get(key)
    if z is None:
        with _zeros_lock:
            z = _zeros.setdefault(key, torch.zeros(n, dtype=like.dtype, device=like.device))
    return z


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _lt_act(inputs: Inputs) -> list[str]:
    act = inputs["act"]
    return [] if act in _LT_ACTS else [f"act {act!r} has no cuBLASLt epilogue (relu, gelu_tanh or none)"]


@kernel("linear", name="cublaslt", priority=30, dtypes=NOT_F64, checks=[_lt_act])
def linear_cublaslt(x, weight, bias, act):
    x2 = _rows(x)
    if act == "none":
        y = F.linear(x2, weight, bias)
    else:
        b = bias if bias is not None else _zero_bias(weight.shape[0], x)
        y = torch._addmm_activation(b, x2, weight.t(), use_gelu=act == "gelu_tanh")
    return y.view(*x.shape[:-1], weight.shape[0])


@kernel("linear", name="cublas_triton", priority=20, dtypes=FLOATS, triton=True)
def linear_cublas_triton(x, weight, bias, act):
    y = F.linear(_rows(x), weight, bias)
    if act != "none":
        family("elementwise").affine_act(y, 1.0, 0.0, act, out=y, **launch.elementwise(y))
    return y.view(*x.shape[:-1], weight.shape[0])


def gemm_config(x: torch.Tensor, key: str, candidates, run, flops: float):
    """Tiles for a Triton GEMM: FMA tiles for float64, small ones for CPU tensors (interpreter),
    else the candidate timed fastest on this device for this problem."""
    if x.dtype == torch.float64:
        return launch.FMA_GEMM
    if x.device.type != "cuda":
        return launch.CPU_GEMM
    return autotune.choose(x.device, key, candidates, run, flops)


@kernel("linear", name="triton", priority=10, dtypes=FLOATS, triton=True)
def linear_triton(x, weight, bias, act):
    gemm = family("gemm")
    x2 = _rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    key = f"linear/{x.dtype}/m{autotune.bucket(m)}/k{k}/n{n}"
    cfg = gemm_config(x, key, launch.GEMM_CANDIDATES, lambda c: gemm.linear(x2, weight, bias, act, c), 2.0 * m * n * k)
    return gemm.linear(x2, weight, bias, act, cfg).view(*x.shape[:-1], n)


@kernel("linear_backward", name="cublas_triton", priority=20, dtypes=FLOATS, triton=True)
def linear_backward(grad_out, x, weight, bias, act):
    """The pre-activation is recomputed by cuBLAS; one Triton pass turns grad_out into its gradient."""
    x2 = _rows(x)
    g2 = _rows(grad_out)
    if act == "none":
        gz = g2
    else:
        z = F.linear(x2, weight, bias)
        gz = family("elementwise").affine_act_backward(g2, z, 1.0, 0.0, act, **launch.elementwise(z))[0]
    grad_x = (gz @ weight).view(x.shape)
    return grad_x, gz.t() @ x2, gz.sum(0)


# --- matmul ------------------------------------------------------------------------------------


@kernel("matmul", name="cublas", priority=10, dtypes=FLOATS)
def matmul(a, b):
    return torch.matmul(a, b)


@kernel("matmul_backward", name="cublas", priority=10, dtypes=FLOATS)
def matmul_backward(grad_out, a, b):
    """grad_a = g @ b^T, grad_b = a^T @ g, broadcast batch dimensions summed back; vectors are
    promoted to matrices as torch.matmul does."""
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    g = grad_out
    if a.ndim == 1 and b.ndim == 1:
        g = g.reshape(1, 1)
    elif a.ndim == 1:
        g = g.unsqueeze(-2)
    elif b.ndim == 1:
        g = g.unsqueeze(-1)
    grad_a = torch.matmul(g, b2.mT).sum_to_size(a2.shape).view(a.shape)
    grad_b = torch.matmul(a2.mT, g).sum_to_size(b2.shape).view(b.shape)
    return grad_a, grad_b


# --- grouped_gemm --------------------------------------------------------------------------------


def _gg_key(what: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    g, k, n = weight.shape
    return f"{what}/{x.dtype}/m{autotune.bucket(x.shape[0])}/g{g}/k{k}/n{n}"


@kernel("grouped_gemm", name="triton", priority=20, dtypes=FLOATS, triton=True)
def grouped_gemm(x, weight, group_sizes):
    """On the GPU the group sizes are not read back: rows past sum(group_sizes) come out as zeros
    and groups past x's rows are cut (the op's contract asks for sum == rows)."""
    gg = family("grouped_gemm")
    flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
    cfg = gemm_config(x, _gg_key("grouped_gemm", x, weight), launch.GEMM_CANDIDATES,
                      lambda c: gg.grouped_gemm(x, weight, group_sizes, c), flops)
    return gg.grouped_gemm(x, weight, group_sizes, cfg)


@kernel("grouped_gemm_backward", name="triton", priority=20, dtypes=FLOATS, triton=True)
def grouped_gemm_backward(grad_out, x, weight, group_sizes):
    gg = family("grouped_gemm")
    flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
    sg, sk, sn = weight.stride()
    k = int(weight.shape[1])
    cfg_x = gemm_config(x, _gg_key("grouped_gemm_dx", x, weight), launch.GEMM_CANDIDATES,
                        lambda c: gg.grouped_matmul(grad_out, weight, (sg, sn, sk), k, group_sizes, c), flops)
    cfg_w = gemm_config(x, _gg_key("grouped_gemm_dw", x, weight), launch.GEMM_WGRAD_CANDIDATES,
                        lambda c: gg.grouped_gemm_backward(grad_out, x, weight, group_sizes, cfg_x, c), flops)
    return gg.grouped_gemm_backward(grad_out, x, weight, group_sizes, cfg_x, cfg_w)
