"""linear, matmul and grouped_gemm on torch's CPU GEMMs (MKL / oneDNN).

linear has two kernels:

- ``onednn``: ``mkldnn._linear_pointwise``, oneDNN's inner product with the activation as a
  post-op (gelu erf and tanh, silu, sigmoid, tanh) or none: one GEMM, no extra pass; relu runs as
  ``relu_`` on the GEMM's result, because oneDNN's relu post-op (and its leaky_relu and hardtanh)
  turns NaN into 0 where torch's relu keeps NaN (measured on torch 2.13's oneDNN, float32 and
  bfloat16; the other post-ops keep NaN and infinities as torch does);
- ``torch``: ``F.linear`` (MKL) and the activation as a separate vectorised pass (every dtype,
  float64 included, which oneDNN does not take);
- ``numba``: for a small float32 linear with GELU (erf or tanh), ``F.linear`` (MKL) and numba's
  vectorised GELU in place on its result (:mod:`hal_backend_cpu._nb.gelu`). At (128, 64) x (96, 64)
  on the project's 2-core EPYC VM (2026-12-07, one thread) MKL's GEMM took 12.5 us against
  oneDNN's 20.4 (its inner product's fixed cost) and torch's GELU 8.8 (erf) and 17.1 us (tanh)
  against numba's 3.3: the GELU was as long as the GEMM, so neither the fused oneDNN call (24.9 us
  with tanh) nor MKL with torch's GELU reached 1.2x torch's ``F.gelu(F.linear(...))``. Bounded to
  :data:`NUMBA_GELU_ELEMENTS` outputs (one thread; beyond, the GEMM dominates and oneDNN's fused
  call is the better default); the dispatcher's measured choice times it against the other two.

Every float32 GEMM of these kernels goes to oneDNN's inner product (:func:`mm`): MKL's sgemm,
torch's own float32 GEMM on the CPU, ran 2.2x slower than oneDNN on the project's AMD EPYC VM
((2048, 1024) x (1024, 1024): 22.0 against 10.1 ms; the weight gradient's transposed operands 23.1
against 14.0 ms, 2026-12-02) and on par on the Intel Xeon of earlier sessions. Half precision goes
to oneDNN inside torch already (the same call measured 5.5 against 5.5 ms in bfloat16).

The backward ops call the GEMMs directly instead of building an autograd graph.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from hal.errors import InvalidArgumentError
from hal.plugin import Inputs
from hal.plugin_sdk.linear import grads_of_rows
from hal_torch import gemm as eager

from . import _numba
from ._common import FLOATS, kernel, numba_kernel, onednn_dtype
from ._device import onednn_dtype_reason
from .elementwise import act_backward, activate_

#: hal's activation -> (oneDNN post-op, its algorithm argument).
_POST_OPS = {
    "none": ("none", ""),
    "relu": ("none", ""),  # then relu_: oneDNN's relu post-op maps NaN to 0 (module docstring)
    "gelu": ("gelu", "none"),
    "gelu_tanh": ("gelu", "tanh"),
    "silu": ("swish", ""),
    "sigmoid": ("sigmoid", ""),
    "tanh": ("tanh", ""),
}
ONEDNN_DTYPES = ("float32", "bfloat16", "float16")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@functools.lru_cache(maxsize=None)
def _onednn_float32() -> bool:
    return onednn_dtype_reason("float32") is None


def linear_rows(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x2 @ weight.T + bias for 2-D operands of any strides: oneDNN's inner product for float32 (see
    the module's docstring), F.linear otherwise."""
    if x2.dtype == torch.float32 and x2.numel() and weight.numel() and _onednn_float32():
        return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return F.linear(x2, weight, bias)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D operands, as :func:`linear_rows` computes it."""
    return linear_rows(a, b.t(), None)


@kernel("linear", name="onednn", priority=30, dtypes=ONEDNN_DTYPES, checks=[onednn_dtype])
def linear_onednn(x, weight, bias, act):
    attr, algorithm = _POST_OPS[act]
    y = torch.ops.mkldnn._linear_pointwise(_rows(x), weight, bias, attr, [], algorithm)
    if act == "relu":
        y.relu_()
    return y.view(*x.shape[:-1], weight.shape[0])


#: outputs (rows x features) up to which the numba GELU kernel of linear serves (see the module's docstring)
NUMBA_GELU_ELEMENTS = 1 << 16
_NUMBA_GELUS = {"gelu": "gelu_erf_", "gelu_tanh": "gelu_tanh_"}


def _small_gelu(inputs: Inputs) -> list[str]:
    act, x, weight = inputs["act"], inputs["x"], inputs["weight"]
    if act not in _NUMBA_GELUS:
        return [f"act {act!r}: this kernel is numba's GELU after MKL's GEMM (gelu, gelu_tanh); oneDNN fuses the others"]
    outputs = (x.numel() // max(1, x.shape[-1])) * weight.shape[0]
    if outputs > NUMBA_GELU_ELEMENTS:
        return [f"{outputs} outputs: beyond {NUMBA_GELU_ELEMENTS}, the GEMM dominates and oneDNN's fused GELU is the default"]
    return []


@numba_kernel("linear", priority=35, dtypes=("float32",), checks=[_small_gelu], array_api="torch")
def linear_numba(x, weight, bias, act):
    """MKL's GEMM, then numba's vectorised GELU in place on its result (one thread, no extra buffer)."""
    z = F.linear(x, weight, bias)
    if not z.is_contiguous():
        z = z.contiguous()
    gelu_ = getattr(_numba.family("gelu"), _NUMBA_GELUS[act])
    try:
        flat = z.numpy().ravel()  # 1.1 us; z.detach().view(-1).numpy() cost 3.0 (2026-12-07)
    except RuntimeError:  # z requires grad (autograd records the caller's GEMM): the same memory, detached
        flat = z.detach().numpy().ravel()
    gelu_(flat)
    return z


@kernel("linear", name="torch", priority=20, dtypes=FLOATS, differentiable=True)
def linear_torch(x, weight, bias, act):
    return activate_(F.linear(x, weight, bias), act)


@kernel("linear_backward", name="torch", priority=20, dtypes=FLOATS)
def linear_backward(grad_out, x, weight, bias, act, output_mask):
    """The pre-activation is recomputed (one GEMM) when the activation needs it. Only the gradients
    in ``output_mask`` are computed.

    float16 runs in float32 throughout: the operands are upcast (exactly), the pre-activation, its
    gradient and the GEMMs are float32, and each gradient is rounded to float16 once. Rounding the
    pre-activation and then its gradient to float16 before float16 GEMMs put grad_weight past the
    op's tolerance where the rows cancel (conformance linear_backward[torch,float16,act_silu],
    seed 1419674743: 0.00280 against 0.00276). It costs no speed: without avx512_fp16 oneDNN takes
    no float16 and torch's own float16 GEMM is slow (the whole backward at (1024, 1024) x (1024,
    1024), act silu, one thread on the EPYC VM, 2026-12-08: 2583 ms in float16, 37 ms this way).
    bfloat16 keeps its GEMMs in bfloat16 (oneDNN, float32 accumulation: 2.2x faster than the
    float32 detour there) on the pre-activation's gradient computed in float32 and rounded once."""
    if x.dtype == torch.float16:
        f32 = [None if t is None else t.float() for t in (grad_out, x, weight, bias)]
        grads = _linear_backward_rows(*f32, act, output_mask)
        return tuple(None if g is None else g.to(torch.float16) for g in grads)
    return _linear_backward_rows(grad_out, x, weight, bias, act, output_mask)


def _linear_backward_rows(grad_out, x, weight, bias, act, output_mask):
    """linear_backward in the operands' dtype (for bfloat16, the activation's gradient in float32)."""
    x2 = _rows(x)
    g2 = _rows(grad_out)
    if act == "none":
        gz = g2
    else:
        z = linear_rows(x2, weight, bias)
        half = z.dtype in (torch.float16, torch.bfloat16)
        gz = act_backward(act, g2.float(), z.float()).to(z.dtype) if half else act_backward(act, g2, z)
    return grads_of_rows(gz, x2, x, weight, output_mask, mm)


# --- matmul ------------------------------------------------------------------------------------

kernel("matmul", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.matmul)


def _rows_by_matrix(inputs: Inputs) -> list[str]:
    a, b = inputs["a"], inputs["b"]
    if a.ndim >= 2 and b.ndim == 2:
        return []
    return [f"a of rank {a.ndim}, b of rank {b.ndim}: the inner product takes (..., M, K) @ (K, N); torch.matmul runs the rest"]


@kernel("matmul", name="onednn", priority=30, dtypes=("float32",), checks=[onednn_dtype, _rows_by_matrix])
def matmul_onednn(a, b):
    return mm(_rows(a), b).view(*a.shape[:-1], b.shape[-1])


@kernel("matmul_backward", name="torch", priority=20, dtypes=FLOATS)
def matmul_backward(grad_out, a, b):
    """grad_a = g @ b^T, grad_b = a^T @ g with broadcast batch dimensions summed back; vectors are
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
    if a2.ndim >= 2 and b2.ndim == 2:  # rows by a matrix: two 2-D GEMMs
        g2, a_rows = _rows(g), _rows(a2)
        return mm(g2, b2.t()).view(a.shape), mm(a_rows.t(), g2).view(b.shape)
    grad_a = torch.matmul(g, b2.mT).sum_to_size(a2.shape).view(a.shape)
    grad_b = torch.matmul(a2.mT, g).sum_to_size(b2.shape).view(b.shape)
    return grad_a, grad_b


# --- grouped_gemm --------------------------------------------------------------------------------


def _groups(op: str, group_sizes: torch.Tensor, rows: int) -> list[int]:
    """The group sizes as ints, checked against x's rows (reading them costs nothing on the CPU)."""
    sizes = [int(s) for s in group_sizes.tolist()]
    if sum(sizes) != rows or min(sizes, default=0) < 0:
        raise InvalidArgumentError(op, "group_sizes", f"non-negative row counts summing to x's {rows} rows", str(sizes))
    return sizes


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b: oneDNN's product copied in for float32 (it has no output argument; the copy is
    one pass over the result against K multiply-adds per element), torch.mm writing in otherwise."""
    if a.dtype == torch.float32:
        out.copy_(mm(a, b))
    else:
        torch.mm(a, b, out=out)


@kernel("grouped_gemm", name="torch", priority=20, dtypes=FLOATS)
def grouped_gemm(x, weight, group_sizes):
    """One GEMM per group, each written into its rows of one output (no concatenation pass)."""
    out = x.new_empty((x.shape[0], weight.shape[2]))
    start = 0
    for g, n in enumerate(_groups("grouped_gemm", group_sizes, x.shape[0])):
        if n:
            _mm_into(out[start : start + n], x[start : start + n], weight[g])
        start += n
    return out


@kernel("grouped_gemm_backward", name="torch", priority=20, dtypes=FLOATS)
def grouped_gemm_backward(grad_out, x, weight, group_sizes):
    grad_x = x.new_empty(x.shape)
    grad_w = weight.new_zeros(weight.shape)
    start = 0
    for g, n in enumerate(_groups("grouped_gemm_backward", group_sizes, x.shape[0])):
        if n:
            rows = slice(start, start + n)
            _mm_into(grad_x[rows], grad_out[rows], weight[g].t())
            _mm_into(grad_w[g], x[rows].t(), grad_out[rows])
        start += n
    return grad_x, grad_w
