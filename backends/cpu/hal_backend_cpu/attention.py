"""softmax and scaled_dot_product_attention on torch's CPU kernels: native softmax and its
backward (and, for a NumPy caller's small array, a numba softmax with no tensor made), the fused
flash-attention CPU kernels behind F.scaled_dot_product_attention (forward and backward, the
forward's output and log-sum-exp kept for the backward: hal.integration.kept), and an attention
backward written as GEMMs for the rest (no autograd graph: kernels also run inside torch.ops.hal
calls, where autograd is off)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from hal.plugin_sdk.kept import KeptForBackward, param_state
from hal.plugin import Inputs
from hal_torch import attention as eager
from hal_torch.overlap import dense as _dense_copy

from . import _numba
from ._common import FLOATS, contiguous, kernel, numba_kernel, numpy_caller

kernel("softmax", name="torch", priority=20, dtypes=FLOATS, differentiable=True)(eager.softmax)

#: torch's C test for elements sharing memory: 0 where none do (contiguous, or a permutation of a
#: dense layout, as a transposed projection is), else 1 (some do) or 2 (too hard to say)
_has_internal_overlap = getattr(torch, "_debug_has_internal_overlap", None)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its elements may share memory (:func:`hal_torch.overlap.dense`),
    with torch's C test first: hal_torch's test sorts the strides in Python (1.2 us of host time a
    call on the project's VM, about 0.2 for this one where it settles it)."""
    if _has_internal_overlap is not None and _has_internal_overlap(t) == 0:
        return t
    return _dense_copy(t)

#: elements up to which the numba softmax serves a NumPy caller. Measured on the project's 2-core
#: EPYC VM (2026-12-07, one thread, float32 / float64): numba 0.79 / 0.82 us against torch's
#: softmax with the two conversions 2.38 / 2.40 us at (4, 4); 1.19 / 1.35 against 2.26 / 3.04 at
#: (8, 16); 1.72 / 1.89 against 2.29 / 3.07 at (8, 32); 2.68 / 2.95 against 2.36 / 3.27 at
#: (8, 64): numba's exp is a scalar libm call, torch's vectorised. Within the bound the dispatcher's
#: measured choice still times both where HAL_TUNE allows.
NUMBA_SOFTMAX_ELEMENTS = 256


def _small_softmax(inputs: Inputs) -> list[str]:
    x = inputs["x"]
    if x.ndim == 0:
        return ["a 0-d array: torch's kernel (a softmax over one value)"]
    if x.size > NUMBA_SOFTMAX_ELEMENTS:
        return [f"{x.size} elements: beyond {NUMBA_SOFTMAX_ELEMENTS}, torch's vectorised exp outruns numba's scalar one even with the conversions"]
    return []


@numba_kernel("softmax", priority=30, checks=[numpy_caller, contiguous("x"), _small_softmax])
def softmax_numba(x, dim):
    """A NumPy caller's small softmax in one numba call: no torch tensor made on the way in or out
    (those two conversions were most of such a call: issue 41 item 13)."""
    return _numba.family("softmax").softmax(x, dim)

kernel("softmax_backward", name="torch", priority=20, dtypes=FLOATS)(eager.softmax_backward)
#: (output, its version, logsumexp) of flash forwards that autograd will differentiate, for the
#: backward of the same q, k and v (hal.integration.kept; few and bounded: one per attention layer in flight)
KEPT = KeptForBackward(size=64)
_FLASH_DTYPES = (torch.float32, torch.float64)
_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask) -> bool:
    """torch's flash CPU kernels, forward and backward, as F.scaled_dot_product_attention runs
    them: no mask, 4-D inputs with the same batch and heads, one head size, float32 or float64."""
    return (attn_mask is None and q.ndim == k.ndim == v.ndim == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2]
            and q.shape[-1] == k.shape[-1] == v.shape[-1] and q.dtype in _FLASH_DTYPES and q.dtype == k.dtype == v.dtype
            and q.shape[-2] > 0 and k.shape[-2] > 0)


def _state(k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float) -> tuple:
    return (param_state(k, v), is_causal, scale)


def _recorded_flash(inputs: Inputs) -> list[str]:
    """torch's autograd records the call where its flash kernels run it (their backward takes the
    saved output and log-sum-exp), and inside torch.compile graphs, where Inductor runs torch's own
    attention kernels forward and backward. Elsewhere, in eager calls, hal's node and GEMM backward
    are faster: in bfloat16 at (4, 4, 128, 32), causal, forward + backward took 4953 us recorded
    against 2604 us through hal's node (CPU VM, 2026-12-01). In a graph that node's backward was the
    slower one: 162 against 38 ms for torch's flash backward in a bf16 Llama step at (4, 8, 512,
    64), whose compiled step ran at 0.66x of torch.compile's (1.01x since, CPU VM, 2026-12-03)."""
    if inputs.traced or _flash_takes(inputs["q"], inputs["k"], inputs["v"], inputs["attn_mask"]):
        return []
    return ["not what torch's flash CPU kernels take, in an eager call (hal's backward op is faster there)"]


@kernel("scaled_dot_product_attention", name="torch", priority=20, dtypes=FLOATS, differentiable=_recorded_flash)
def sdpa(q, k, v, attn_mask, is_causal, scale):
    """F.scaled_dot_product_attention. Where torch's autograd records the call, that is all (its
    node keeps what the backward needs). Where hal's node will differentiate it (an input requires
    grad, recording off) and the flash kernel takes it, that kernel directly, its output and
    log-sum-exp kept for the backward op (which then runs torch's flash backward)."""
    wants = q.requires_grad or k.requires_grad or v.requires_grad
    if wants and not torch.is_grad_enabled() and _flash_takes(q, k, v, attn_mask):
        out, lse = _flash_forward(dense(q), k, v, 0.0, is_causal, scale=scale)  # dense: see hal_torch.overlap
        KEPT.keep(q, _state(k, v, is_causal, scale), (out, out._version, lse))
        return out
    return eager.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale)


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Grouped-query attention as ``hal.nn.patch`` spells it: q (B, Hkv, G, L, E) against k, v
    (B, Hkv, 1, S, E), each key/value head shared by the G query heads of its group."""
    return (q.ndim == k.ndim == v.ndim == 5 and q.shape[:2] == k.shape[:2] == v.shape[:2]
            and k.shape[2] == 1 and v.shape[2] == 1)


def _grouped_flash(inputs: Inputs) -> list[str]:
    """A check for :func:`sdpa_flash`: the grouped layout (:func:`_grouped`), which torch's flash CPU
    kernels take, forward and backward, as grouped-query attention; no mask, one head size, no empty
    dimension. (B, H, L, E) inputs are the ``torch`` kernel's (recorded flash in float32 and
    float64; hal's node in half precision, the faster there at (4, 4, 128, 32) in bfloat16)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if not _grouped(q, k, v):
        return ["not the grouped layout: queries (B, Hkv, G, L, E) over keys and values (B, Hkv, 1, S, E)"]
    reasons = []
    if inputs["attn_mask"] is not None:
        reasons.append("attn_mask given (the torch kernel's GEMM backward runs masks)")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        reasons.append("head sizes differ")
    if 0 in (*q.shape, *k.shape, *v.shape):
        reasons.append("empty dimensions")
    return reasons


@kernel("scaled_dot_product_attention", name="flash", priority=25, dtypes=FLOATS, checks=[_grouped_flash], differentiable=True)
def sdpa_flash(q, k, v, attn_mask, is_causal, scale):
    """Grouped-query attention (:func:`_grouped`, as ``hal.nn.patch`` calls it) on torch's flash CPU
    kernels, recorded by torch's autograd (its node runs the flash backward from the saved output
    and log-sum-exp): the queries go in as (B, Hkv * G, L, E) over (B, Hkv, S, E) keys and values
    with ``enable_gqa`` (query head h reads key/value head h // G, the grouped layout's order), so
    no key or value is repeated. The ``torch`` kernel ran such a call as a 5-D broadcast (torch's
    math path) in hal's node with its GEMM backward. Forward + backward as hal's measured choice
    timed them (the project's 2-core EPYC VM, one thread, causal, 2026-12-07), torch's kernel in
    hal's node against this one: (B, Hkv, G, T, E) (2, 1, 4, 16, 16) bfloat16 242 / 150 us, float32
    219 / 84; (2, 2, 4, 128, 64) bfloat16 8288 / 6922, float32 7901 / 3578; (1, 2, 4, 512, 64)
    bfloat16 54671 / 22447, float32 60898 / 26653; one head a group, (4, 4, 1, 128, 32) bfloat16
    4718 / 5135 (the measured choice, HAL_TUNE, keeps the faster)."""
    b, hkv, g, t, e = q.shape
    # dense: torch's flash kernels misread a query whose rows share memory (hal_torch.overlap)
    out = F.scaled_dot_product_attention(dense(q.reshape(b, hkv * g, t, e)), k.squeeze(2), v.squeeze(2), dropout_p=0.0,
                                         is_causal=is_causal, scale=scale, enable_gqa=True)
    return out.view(b, hkv, g, t, v.shape[-1])


@kernel("scaled_dot_product_attention_backward", name="torch", priority=20, dtypes=FLOATS)
def sdpa_backward(grad_out, q, k, v, attn_mask, is_causal, scale):
    """Where the flash kernel takes the inputs: torch's flash backward, from the output and
    log-sum-exp the forward kept for these q, k, v (unchanged since, the output too), else from a
    flash forward run again. Otherwise the attention weights P are recomputed in float32 (float64
    for float64), masked scores at -inf and a query row with nothing to attend to at zero weight
    (torch's safe softmax); then dV = P^T dO, dS = P (dO V^T - rowsum(dO V^T P)), dQ = dS K scale,
    dK = dS^T Q scale."""
    if _flash_takes(q, k, v, attn_mask):
        kept = KEPT.take(q, _state(k, v, is_causal, scale))
        qd = dense(q)  # torch's flash kernels misread a query whose rows share memory (hal_torch.overlap)
        if kept is not None and kept[0]._version == kept[1]:
            out, lse = kept[0], kept[2]
        else:
            out, lse = _flash_forward(qd, k, v, 0.0, is_causal, scale=scale)
        return _flash_backward(grad_out.contiguous(), qd, k, v, out, lse, 0.0, is_causal, scale=scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qa, ka, va, ga = (t.to(acc) for t in (q, k, v, grad_out))
    s = torch.matmul(qa, ka.transpose(-2, -1)).mul_(scale)
    if is_causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool).triu_(1), -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.to(acc)
    blocked = (s == -math.inf).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill_(blocked, 0.0), dim=-1).masked_fill_(blocked, 0.0)
    dv = torch.matmul(p.transpose(-2, -1), ga)
    dp = torch.matmul(ga, va.transpose(-2, -1))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ka).mul_(scale)
    dk = torch.matmul(ds.transpose(-2, -1), qa).mul_(scale)
    # inputs whose batch dimensions were broadcast get their gradients summed back to their shapes
    return dq.sum_to_size(q.shape).to(q.dtype), dk.sum_to_size(k.shape).to(k.dtype), dv.sum_to_size(v.shape).to(v.dtype)
