"""softmax through torch (the fallback of the Triton kernel) and scaled_dot_product_attention
(torch's SDPA backends).

SDPA runs through ``F.scaled_dot_product_attention`` with one backend forced per kernel, so each
backend is its own kernel with its own capability data: cuDNN and FlashAttention-2 for half
precision without a mask, memory-efficient attention for float32 too. Inputs of any batch rank
are expanded to their broadcast batch (q, k and v may share heads or batches, as in torch) and
flattened to (B, 1, L, E), the layout every backend takes; the backward differentiates through the
expansion, so gradients are summed back to each input's shape. Masked calls, float64 and causal
attention with L != S run the explicit ``math`` kernel, which keeps torch's reference semantics
(top-left causal alignment; a query row with nothing to attend to gets zero weights, as torch
2.13's CPU SDPA and cpu_ref give, API.md's NaN notwithstanding). The backward
recomputes the forward under autograd with the same backend (the op receives no saved state).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hal.ops.attention import attention_batch
from hal.plugin import Inputs

from ._common import FLOATS, HALF, NOT_F64, Check, kernel
from ._device import sm

# --- softmax -------------------------------------------------------------------------------------


@kernel("softmax", name="torch", priority=10, dtypes=FLOATS, differentiable=True)
def softmax_torch(x, dim):
    return torch.softmax(x, dim)


@kernel("softmax_backward", name="torch", priority=10, dtypes=FLOATS)
def softmax_backward_torch(grad_out, out, dim):
    return torch._softmax_backward_data(grad_out, out, dim, out.dtype)


# --- scaled_dot_product_attention ----------------------------------------------------------------


def _as_4d(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """t expanded to the call's broadcast batch and seen as (B, 1, rows, features)."""
    return t.expand(*batch, *t.shape[-2:]).reshape(-1, 1, t.shape[-2], t.shape[-1])


def _flash_like(max_head: int, multiple: int) -> Check:
    """A check for the fused backends: no mask, equal head sizes within limits, causal only square."""

    def check(inputs: Inputs) -> list[str]:
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        e, ev = int(q.shape[-1]), int(v.shape[-1])
        reasons = []
        if 0 in (*attention_batch(q, k, v), *q.shape[-2:], k.shape[-2], ev):
            reasons.append("zero-size dimensions (the math kernel runs them)")
        if inputs["attn_mask"] is not None:
            reasons.append("attn_mask given (the math kernel keeps NaN rows for fully masked queries)")
        if e != ev or e > max_head or e % multiple:
            reasons.append(f"head sizes E={e}, Ev={ev}: needs E == Ev <= {max_head}, a multiple of {multiple}")
        if inputs["is_causal"] and q.shape[-2] != k.shape[-2]:
            reasons.append("causal with L != S (torch's top-left alignment is kept by the math kernel)")
        return reasons

    return check


#: each fused backend's own aten op (differentiable: torch's autograd saves its output and
#: log-sum-exp for the backend's backward), and whether it takes (attn_bias, compute_log_sumexp)
_ATEN = {
    SDPBackend.CUDNN_ATTENTION: (torch.ops.aten._scaled_dot_product_cudnn_attention.default, True),
    SDPBackend.FLASH_ATTENTION: (torch.ops.aten._scaled_dot_product_flash_attention.default, False),
    SDPBackend.EFFICIENT_ATTENTION: (torch.ops.aten._scaled_dot_product_efficient_attention.default, True),
}


def _one_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """(B, H, L, E) inputs of one batch and head count, rows contiguous: what the fused backends
    take as they are."""
    return (
        q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2]
        and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    )


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Grouped-query attention as ``hal.nn.patch`` and torch's broadcasting spell it: q (B, Hkv, G,
    L, E) against k, v (B, Hkv, 1, S, E), each key/value head shared by G query heads."""
    return (
        q.ndim == 5 and k.ndim == 5 and v.ndim == 5 and q.shape[:2] == k.shape[:2] == v.shape[:2]
        and k.shape[2] == 1 and v.shape[2] == 1 and q.shape[2] > 1
    )


#: the backends whose aten op takes fewer key/value heads than query heads (GQA) as they are
_NATIVE_GQA = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)


def _aten(backend: SDPBackend, q, k, v, is_causal: bool, scale: float) -> torch.Tensor:
    op, takes_bias = _ATEN[backend]
    if takes_bias:
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return op(q, k, v, None, lse, 0.0, is_causal, scale=scale)[0]
    return op(q, k, v, 0.0, is_causal, False, scale=scale)[0]


def _run_backend(backend: SDPBackend, q, k, v, is_causal: bool, scale: float) -> torch.Tensor:
    """One SDPA backend. (B, H, L, E) inputs of one batch go straight to the backend's aten op:
    F.scaled_dot_product_attention would choose it again, under an ``sdpa_kernel`` scope, after the
    views every other input needs; on the H200's host that cost a training step 380 us per
    attention call (benchmarks/host_training.py, 2026-12-01: 578 against torch's 199 us).

    Grouped queries (:func:`_grouped`) go to cuDNN's and FlashAttention's aten ops as (B, H, L, E)
    queries over (B, Hkv, S, E) keys and values, which both take natively; repeating the key/value
    heads instead (what the broadcast below does) cost hal's attention 0.86 ms against cuDNN's
    0.48 ms forward + backward at Llama-3.2-1B's shape (B 2, H 32/8, T 2048, d 64; H100,
    benchmarks/levers40.py, 2026-12-07)."""
    if _one_batch(q, k, v):
        return _aten(backend, q, k, v, is_causal, scale)
    if backend in _NATIVE_GQA and _grouped(q, k, v) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        b, hkv, g, t, e = q.shape
        out = _aten(backend, q.reshape(b, hkv * g, t, e), k.squeeze(2), v.squeeze(2), is_causal, scale)
        return out.view(b, hkv, g, t, v.shape[-1])
    batch = attention_batch(q, k, v)
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(_as_4d(q, batch), _as_4d(k, batch), _as_4d(v, batch), is_causal=is_causal, scale=scale)
    return out.reshape(*batch, q.shape[-2], v.shape[-1])


def _backend_backward(backend: SDPBackend, grad_out, q, k, v, is_causal: bool, scale: float):
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = _run_backend(backend, qg, kg, vg, is_causal, scale)
        return torch.autograd.grad(out, (qg, kg, vg), grad_out)


def _register_backend(name: str, backend: SDPBackend, priority: int, dtypes, check, archs=None) -> None:
    def forward(q, k, v, attn_mask, is_causal, scale):
        return _run_backend(backend, q, k, v, is_causal, scale)

    def backward(grad_out, q, k, v, attn_mask, is_causal, scale):
        return _backend_backward(backend, grad_out, q, k, v, is_causal, scale)

    forward.__name__, backward.__name__ = f"sdpa_{name}", f"sdpa_{name}_backward"
    extra = {"archs": archs} if archs is not None else {}
    kernel("scaled_dot_product_attention", name=name, priority=priority, dtypes=dtypes, checks=[check], differentiable=True, **extra)(forward)
    kernel("scaled_dot_product_attention_backward", name=name, priority=priority, dtypes=dtypes, checks=[check], **extra)(backward)


_register_backend("cudnn", SDPBackend.CUDNN_ATTENTION, 40, HALF, _flash_like(128, 8), archs=sm(90))
_register_backend("flash", SDPBackend.FLASH_ATTENTION, 30, HALF, _flash_like(256, 8))
_register_backend("efficient", SDPBackend.EFFICIENT_ATTENTION, 20, NOT_F64, _flash_like(256, 8))


def math_attention(q, k, v, attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with torch's math semantics, accumulated in float32 (float64
    for float64 inputs): masked-out scores are -inf, and a row with nothing to attend to gets zero
    weights (torch's _safe_softmax), hence a zero output and no gradient. Batch dimensions
    broadcast (torch.matmul's rules)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.to(acc)
    blocked = (s == -math.inf).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(blocked, 0.0), dim=-1).masked_fill(blocked, 0.0)
    return torch.matmul(p, v.to(acc)).to(q.dtype)


@kernel("scaled_dot_product_attention", name="math", priority=10, dtypes=FLOATS, differentiable=True)
def sdpa_math(q, k, v, attn_mask, is_causal, scale):
    return math_attention(q, k, v, attn_mask, is_causal, scale)


@kernel("scaled_dot_product_attention_backward", name="math", priority=10, dtypes=FLOATS)
def sdpa_math_backward(grad_out, q, k, v, attn_mask, is_causal, scale):
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        return torch.autograd.grad(math_attention(qg, kg, vg, attn_mask, is_causal, scale), (qg, kg, vg), grad_out)
