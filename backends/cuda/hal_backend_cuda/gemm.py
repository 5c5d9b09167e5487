"""linear through cuBLASLt and matmul through cuBLAS.

linear has three kernels: ``cublaslt`` here (cuBLAS(Lt) through torch; relu and gelu_tanh run as
cuBLASLt epilogues, ``torch._addmm_activation``, none as a plain GEMM with the bias), and from
hal_triton.kernels ``cublas_triton`` (cuBLAS GEMM with the bias, then the activation in place by
one Triton pass, any activation) and ``triton`` (a Triton GEMM with bias and activation applied to
the accumulator before its only store, autotuned tiles). grouped_gemm: :mod:`.grouped`.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F

from hal.plugin import Inputs
from hal.plugin_sdk.linear import add_product_in_slices

from ._common import FLOATS, NOT_F64, ieee_fp32, kernel

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


def blas_linear(x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """cuBLAS GEMM with the bias, IEEE float32 for float32 data (the kit's ``<blas>_triton`` linear)."""
    with ieee_fp32(x2.dtype):
        return F.linear(x2, weight, bias)


#: whether torch's addmm with a float32 output accumulates half-precision products into a float32
#: tensor in place on this build (asked once per device)
_ADDMM_F32_IN_PLACE: dict[str, bool] = {}


def gemm_f32(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` returned in float32 (float64 for float64): half-precision operands go to cuBLAS as
    they are, with float32 accumulation and output (``torch.mm(..., out_dtype=)``); float32 in IEEE
    float32. CPU tensors (the interpreter tests) upcast first. Given ``acc``, the product is added
    into it (cuBLAS's beta = 1 where torch's build takes a float32 ``out`` for half operands, else
    through temporaries of ``SLICE_ELEMENTS`` at most) and ``acc`` is returned."""
    if acc is not None and a.dtype in (torch.float16, torch.bfloat16) and a.device.type == "cuda":
        key = str(a.device)
        if _ADDMM_F32_IN_PLACE.get(key, True):
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                _ADDMM_F32_IN_PLACE[key] = True
                return acc
            except (RuntimeError, TypeError, NotImplementedError):
                _ADDMM_F32_IN_PLACE[key] = False
    if acc is not None:  # small temporaries, not one of acc's size
        return add_product_in_slices(acc, a, b, gemm_f32)
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.device.type == "cuda":
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a.float(), b.float())
    with ieee_fp32(a.dtype):
        return torch.mm(a, b)


def _plain_gemm(inputs: Inputs) -> list[str]:
    """torch has no derivative of ``_addmm_activation``; the plain GEMM (F.linear) has one."""
    return [] if inputs["act"] == "none" else ["the cuBLASLt epilogue (torch._addmm_activation) has no autograd formula"]


def _lt_act(inputs: Inputs) -> list[str]:
    act = inputs["act"]
    return [] if act in _LT_ACTS else [f"act {act!r} has no cuBLASLt epilogue (relu, gelu_tanh or none)"]


@kernel("linear", name="cublaslt", priority=30, dtypes=NOT_F64, checks=[_lt_act], differentiable=_plain_gemm)
def linear_cublaslt(x, weight, bias, act):
    x2 = _rows(x)
    if act == "none":
        y = F.linear(x2, weight, bias)
    else:
        b = bias if bias is not None else _zero_bias(weight.shape[0], x)
        y = torch._addmm_activation(b, x2, weight.t(), use_gelu=act == "gelu_tanh")
    return y.view(*x.shape[:-1], weight.shape[0])


# --- matmul ------------------------------------------------------------------------------------


@kernel("matmul", name="cublas", priority=10, dtypes=FLOATS, differentiable=True)
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
