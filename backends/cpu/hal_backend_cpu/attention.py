"""softmax and scaled_dot_product_attention on torch's CPU kernels: native softmax and its
backward, the fused flash-attention CPU kernel behind F.scaled_dot_product_attention, and an
attention backward written as GEMMs (no autograd graph: kernels also run inside torch.ops.hal
calls, where autograd is off)."""

from __future__ import annotations

import math

import torch

from hal.eager import attention as eager

from ._common import FLOATS, kernel

kernel("softmax", name="torch", priority=20, dtypes=FLOATS)(eager.softmax)
kernel("softmax_backward", name="torch", priority=20, dtypes=FLOATS)(eager.softmax_backward)
kernel("scaled_dot_product_attention", name="torch", priority=20, dtypes=FLOATS)(eager.scaled_dot_product_attention)


@kernel("scaled_dot_product_attention_backward", name="torch", priority=20, dtypes=FLOATS)
def sdpa_backward(grad_out, q, k, v, attn_mask, is_causal, scale):
    """The attention weights P are recomputed in float32 (float64 for float64), masked scores at
    -inf and a query row with nothing to attend to at zero weight (torch's safe softmax); then
    dV = P^T dO, dS = P (dO V^T - rowsum(dO V^T P)), dQ = dS K scale, dK = dS^T Q scale."""
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
