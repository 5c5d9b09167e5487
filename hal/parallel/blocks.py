"""Attention and the MLP, tensor-parallel: a column-parallel entry, the local compute, a row-parallel exit.

Attention splits its heads across the group (q/k/v column-parallel, hal's rotary embedding and SDPA
on the local heads, grouped key/value heads kept whole per rank), the MLP its hidden features (gate
and up column-parallel, the activation on the local slice, down row-parallel). Each needs one
collective in the forward and one in the backward, both in :mod:`hal.parallel.tensor`'s linear
layers (sequence parallelism and the overlapped all-gather included).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import hal
from hal.errors import InvalidArgumentError
from hal.parallel.tensor import ColumnParallelLinear, RowParallelLinear, column_parallel_linears

__all__ = ["ParallelAttention", "ParallelMLP", "attend", "head_parallel_attention", "parallel_mlp"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None, is_causal: bool = False,
           scale: Optional[float] = None) -> torch.Tensor:
    """``hal.ops.scaled_dot_product_attention`` of q ``(B, H, T, D)`` over k, v ``(B, Hkv, S, D)``
    with H a multiple of Hkv (grouped-query attention: a key/value head broadcasts over its group
    of query heads, no copies). ``mask`` broadcasts to ``(B, H, T, S)``."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise InvalidArgumentError("attend", "k", f"a number of heads that divides the {h} query heads", str(hkv))
    groups = h // hkv
    if groups == 1:
        return hal.ops.scaled_dot_product_attention(q, k, v, mask, is_causal, scale)
    if mask is not None and mask.dim() == 4:
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], hkv, groups, *mask.shape[2:])
    out = hal.ops.scaled_dot_product_attention(q.reshape(b, hkv, groups, t, d), k.unsqueeze(2), v.unsqueeze(2), mask,
                                               is_causal, scale)
    return out.reshape(b, h, t, v.shape[-1])


def _rotary_table(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """cos or sin in a dtype rotary_embedding takes beside x: float32 beside half precision, else x's."""
    c = c.detach()
    if c.dtype == x.dtype or (c.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
        return c
    return c.to(x.dtype)


class ParallelAttention(nn.Module):
    """Self-attention with its heads split across the group: q, k, v column-parallel (one
    collective for the three), rotary embedding and attention on this rank's heads with hal's ops,
    the output projection row-parallel. Heads and key/value heads must be multiples of the group size.

    ``forward(x, cos, sin, attn_mask=None, is_causal=True)``: x ``(B, T, hidden)`` (this rank's part of
    the sequence under ``sequence_parallel``); cos, sin broadcastable to ``(B, H, T, head_dim / 2)``
    for the whole sequence (``hal.ops.rotary_embedding``'s non-interleaved layout) or None for no
    rotary embedding; ``attn_mask`` broadcastable to ``(B, 1 or heads, T, S)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 bias: bool = False, *, out_bias: Optional[bool] = None, scale: Optional[float] = None, mesh: Any = None,
                 sequence_parallel: bool = False, overlap: bool = False, chunks: int = 2, dtensor: bool = False,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        kv = num_heads if num_kv_heads is None else num_kv_heads
        hd = hidden_size // num_heads if head_dim is None else head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, kv, hd, scale
        opts = dict(mesh=mesh, sequence_parallel=sequence_parallel, dtensor=dtensor, device=device, dtype=dtype)
        col = dict(opts, overlap=overlap, chunks=chunks)
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * hd, bias, **col)
        self.k_proj = ColumnParallelLinear(hidden_size, kv * hd, bias, **col)
        self.v_proj = ColumnParallelLinear(hidden_size, kv * hd, bias, **col)
        self.o_proj = RowParallelLinear(num_heads * hd, hidden_size, bias if out_bias is None else out_bias, **opts)
        tp = self.q_proj.tp_size
        for name, n in (("num_heads", num_heads), ("num_kv_heads", kv)):
            if n % tp:
                raise InvalidArgumentError("ParallelAttention", name, f"a multiple of the tensor-parallel group's {tp} ranks", str(n))

    @classmethod
    def from_projections(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, num_heads: int, num_kv_heads: int,
                         head_dim: int, **options: Any) -> "ParallelAttention":
        """This rank's shard of existing projections (copied; heads in blocks of ``head_dim`` rows)."""
        new = cls(q.in_features, num_heads, num_kv_heads, head_dim, False, device="meta", **options)
        col = {"overlap": options.get("overlap", False), "chunks": options.get("chunks", 2)}
        row = {k_: v_ for k_, v_ in options.items() if k_ not in ("overlap", "chunks", "scale")}
        for name, lin in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            setattr(new, name, ColumnParallelLinear.from_linear(lin, **dict(row, **col)))
        new.o_proj = RowParallelLinear.from_linear(o, **row)
        return new

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = True, kv_update: Any = None) -> torch.Tensor:
        return head_parallel_attention(x, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.head_dim, self.num_heads,
                                       cos, sin, attn_mask, is_causal, self.scale, kv_update)


def head_parallel_attention(x: torch.Tensor, q_proj: ColumnParallelLinear, k_proj: ColumnParallelLinear,
                            v_proj: ColumnParallelLinear, o_proj: RowParallelLinear, head_dim: int, num_heads: int,
                            cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                            attn_mask: Optional[torch.Tensor] = None, is_causal: bool = True, scale: Optional[float] = None,
                            kv_update: Any = None) -> torch.Tensor:
    """:class:`ParallelAttention`'s computation on given projections (for modules that keep their
    projections under other names). ``kv_update(k, v) -> (k, v)``: a key/value cache's update
    (this rank's heads, after the rotary embedding)."""
    b = x.shape[0]
    q, k, v = column_parallel_linears(x, [q_proj, k_proj, v_proj])
    t = q.shape[1]
    q, k, v = (y.view(b, t, -1, head_dim).transpose(1, 2) for y in (q, k, v))
    if cos is not None:
        q = hal.ops.rotary_embedding(q, _rotary_table(cos, q), _rotary_table(sin, q))
        k = hal.ops.rotary_embedding(k, _rotary_table(cos, k), _rotary_table(sin, k))
    if kv_update is not None:
        k, v = kv_update(k, v)
    if attn_mask is not None:
        if attn_mask.dim() == 4 and attn_mask.shape[1] == num_heads > 1:  # a mask per head: this rank's heads
            local = q.shape[1]
            attn_mask = attn_mask.narrow(1, q_proj.tp_rank * local, local)
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(q.dtype)
    out = attend(q, k.to(q.dtype), v.to(q.dtype), attn_mask, is_causal, scale)
    return o_proj(out.transpose(1, 2).reshape(b, t, -1))


class ParallelMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (Llama's MLP) with the hidden width split across the group:
    gate and up column-parallel (one collective for both), down row-parallel. ``act="silu"`` runs
    ``hal.ops.swiglu``; another activation is fused into the gate's GEMM epilogue."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False, *, mesh: Any = None,
                 sequence_parallel: bool = False, overlap: bool = False, chunks: int = 2, dtensor: bool = False,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        opts = dict(mesh=mesh, sequence_parallel=sequence_parallel, dtensor=dtensor, device=device, dtype=dtype)
        col = dict(opts, overlap=overlap, chunks=chunks)
        self.act = act
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, "none" if act == "silu" else act, **col)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, **col)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, **opts)

    @classmethod
    def from_projections(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act: str = "silu", **options: Any) -> "ParallelMLP":
        """This rank's shard of existing projections (copied)."""
        new = cls(gate.in_features, gate.out_features, act, False, device="meta", **options)
        row = {k: v for k, v in options.items() if k not in ("overlap", "chunks")}
        new.gate_proj = ColumnParallelLinear.from_linear(gate, "none" if act == "silu" else act, **options)
        new.up_proj = ColumnParallelLinear.from_linear(up, **options)
        new.down_proj = RowParallelLinear.from_linear(down, **row)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.act)


def parallel_mlp(x: torch.Tensor, gate_proj: ColumnParallelLinear, up_proj: ColumnParallelLinear, down_proj: RowParallelLinear,
                 act: str = "silu") -> torch.Tensor:
    """:class:`ParallelMLP`'s computation on given projections (the gate's own ``act`` is its fused
    epilogue; ``act="silu"`` applies ``hal.ops.swiglu`` to the gate's plain output)."""
    gate, up = column_parallel_linears(x, [gate_proj, up_proj])
    h = hal.ops.swiglu(gate, up) if act == "silu" else gate * up
    return down_proj(h)
