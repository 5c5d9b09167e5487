"""Host side of the C++ batch norm (kernels/batchnorm.cu): layouts, grids, buffers and launches.

Forward (training): ``bn_stats`` (one pass over x: Welford moments, merged by the last block, which
also updates the running statistics) then ``bn_apply`` (one read, one write). Eval: ``bn_eval_params``
then ``bn_apply``. Backward: ``bn_bwd_stats`` (one pass over x and grad: the co-moments give the
batch statistics and both parameter gradients) then ``bn_bwd_apply``; with the ReLU of the fused op,
a statistics pass first gives the mask's affine pair.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from .kit import C_TYPES, DTYPE_CODES, DTYPE_NAMES, Kit, cdiv

THREADS = 256  # BN_THREADS of batchnorm.cu
COLS = 8  # channel vectors across a rows-layout block
ROWS_PER_STEP = THREADS // COLS
MAX_GRID_Y = 65535


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch sizes: reduction blocks and elementwise blocks per multiprocessor (vendor plugins may
    pass their own, measured)."""

    reduce_blocks_per_sm: int = 2
    apply_blocks_per_sm: int = 8


@dataclasses.dataclass(frozen=True)
class Layout:
    """x (dense) as ``units`` of a rows layout (channels contiguous) or planes (NCHW)."""

    rows: bool
    units: int  # rows (N * S) or images (N)
    channels: int
    spatial: int  # S
    vec: int  # values per access


def layout(x: torch.Tensor, *others: torch.Tensor) -> Optional[Layout]:
    """The layout of x (None when it is neither NCHW-contiguous nor channels-last); the vector
    width is the widest that the addresses of x and ``others`` (same strides) and the sizes allow.
    From the contiguity flags, which torch keeps: this runs on every call."""
    n, c = int(x.shape[0]), int(x.shape[1])
    s = x.numel() // (n * c) if n * c else 0
    if x.is_contiguous():
        rows = s == 1
    elif (x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.ndim == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
    ):
        rows = True
    else:
        return None
    vec = 16 // x.element_size()
    if (c if rows else s) % vec or x.data_ptr() % 16 or any(t.data_ptr() % 16 for t in others):
        vec = 1
    return Layout(rows, n * s if rows else n, c, s, vec)


def dense(x: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """(x, its layout), x copied to contiguous first when it has none; ``others`` as in layout."""
    lay = layout(x, *others)
    if lay is None:
        x = x.contiguous()
        lay = layout(x, *others)
    return x, lay


def unsupported_reason(x: torch.Tensor) -> Optional[str]:
    """Why the kernels cannot take x (grid limits of the NCHW layout), or None."""
    lay = layout(x)
    n, c = int(x.shape[0]), int(x.shape[1])
    planes = (not lay.rows) if lay is not None else x.numel() > n * c  # a copy would be NCHW
    if planes and c > MAX_GRID_Y:
        return f"{c} channels in an NCHW layout (at most {MAX_GRID_Y}: one grid row per channel)"
    if planes and n * c >= 1 << 31:
        return f"{n * c} planes (N * C) in an NCHW layout (at most 2**31 - 1)"
    return None


def grad_dtype(param: Optional[torch.Tensor], x: torch.Tensor) -> torch.dtype:
    """The dtype of a per-channel parameter's gradient: the parameter's, or x's when it is absent."""
    return (param if param is not None else x).dtype


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _codes(*tensors: Optional[torch.Tensor]) -> int:
    """Dtype codes of the per-channel arguments in the kernels' 4-bit fields (absent: 0)."""
    code = 0
    for i, t in enumerate(tensors):
        if t is not None:
            code |= DTYPE_CODES[DTYPE_NAMES[t.dtype]] << (4 * i)
    return code


@dataclasses.dataclass(frozen=True)
class _Grids:
    reduce: tuple[int, int]
    reduce_per_block: int
    counters: int
    apply: tuple[int, int]
    apply_per_block: int


@functools.lru_cache(maxsize=1024)
def _grids(kit: Kit, lay: Layout, device: torch.device, cfg: Config) -> _Grids:
    sms = kit.runtime.multiprocessors(device)
    if lay.rows:
        tiles = cdiv(cdiv(lay.channels, lay.vec), COLS)
        want = max(1, cfg.reduce_blocks_per_sm * sms // tiles)
        per_block = max(ROWS_PER_STEP, cdiv(lay.units, want))
        apply_x = max(1, min(cdiv(lay.units, ROWS_PER_STEP), cfg.apply_blocks_per_sm * sms // tiles))
        return _Grids((cdiv(lay.units, per_block), tiles), per_block, tiles, (apply_x, tiles), 0)
    want = max(1, cfg.reduce_blocks_per_sm * sms // lay.channels)
    sv = lay.spatial // lay.vec
    per_block = max(1, min(cdiv(lay.units, want), (2**31 - 1) // max(sv, 1)))  # items counted in 32 bits
    chunk = max(4 * THREADS, cdiv(sv, MAX_GRID_Y))
    return _Grids((cdiv(lay.units, per_block), lay.channels), per_block, lay.channels,
                  (lay.units * lay.channels, cdiv(sv, chunk)), chunk)


def _module(kit: Kit, x: torch.Tensor, lay: Layout):
    return kit.module("batchnorm", x.device, HAL_T=C_TYPES[DTYPE_NAMES[x.dtype]], HAL_VEC=str(lay.vec))


def affine_params(
    kit: Kit,
    x: torch.Tensor,
    lay: Layout,
    grids: _Grids,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    conv_bias: Optional[torch.Tensor],
    training: bool,
    update_running: bool,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """The (8, C) per-channel buffer with rows 0-3 (a, b, mean, 1/std) of x's batch norm: batch
    statistics in training (the running ones updated in place when asked and given), else the
    running statistics."""
    c = lay.channels
    vec = torch.empty((8, c), dtype=_acc(x), device=x.device)
    codes = _codes(weight, bias, conv_bias, running_mean, running_var)
    mod = _module(kit, x, lay)
    if training:
        update = update_running and running_mean is not None
        part = torch.empty((grids.reduce[0], 2, c), dtype=_acc(x), device=x.device)
        kernel = mod["bn_stats_rows" if lay.rows else "bn_stats_planes"]
        kernel(grids.reduce, THREADS, x, part, kit.counters(x.device, grids.counters), vec, weight, bias, conv_bias,
               running_mean, running_var, codes, lay.units, c, lay.spatial, grids.reduce_per_block,
               float(lay.units * (1 if lay.rows else lay.spatial)), momentum, eps, int(update), device=x.device)
    else:
        mod["bn_eval_params"]((cdiv(c, THREADS),), THREADS, vec, weight, bias, conv_bias, running_mean, running_var,
                              codes, c, eps, device=x.device)
    return vec


def batch_norm_forward(
    kit: Kit,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool,
    momentum: float,
    eps: float,
    relu: bool,
    conv_bias: Optional[torch.Tensor] = None,
    cfg: Config = Config(),
) -> torch.Tensor:
    """``act(batch_norm(x + conv_bias))``, act ReLU or none, in x's layout (conv_bias: the bias of a
    convolution that x came out of without it; it cancels in training and enters the running mean)."""
    x, lay = dense(x)
    y = torch.empty_like(x)  # x's strides; a fresh block is aligned for the vector width
    grids = _grids(kit, lay, x.device, cfg)
    vec = affine_params(kit, x, lay, grids, weight, bias, running_mean, running_var, conv_bias, training, True, momentum, eps)
    kernel = _module(kit, x, lay)["bn_apply_rows" if lay.rows else "bn_apply_planes"]
    kernel(grids.apply, THREADS, x, x, y, vec, lay.units, lay.channels, lay.spatial, grids.apply_per_block, int(relu),
           device=x.device)
    return y


def batch_norm_backward(
    kit: Kit,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool,
    eps: float,
    relu: bool,
    grad_dtypes: tuple[torch.dtype, torch.dtype],
    conv_bias: Optional[torch.Tensor] = None,
    cfg: Config = Config(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of :func:`batch_norm_forward` (batch statistics recomputed,
    running statistics read in eval and never written); the parameter gradients in ``grad_dtypes``.
    ``bias`` matters only with ``relu`` (the mask)."""
    x, lay = dense(x)
    if grad_out.stride() != x.stride():
        g = torch.empty_like(x)
        g.copy_(grad_out)
    else:
        g = grad_out
        if g.data_ptr() % 16:
            lay = layout(x, g)
    dx = torch.empty_like(x)
    c = lay.channels
    grids = _grids(kit, lay, x.device, cfg)
    if relu or not training:
        vec = affine_params(kit, x, lay, grids, weight, bias, running_mean, running_var, conv_bias, training, False, 0.0, eps)
    else:
        vec = torch.empty((8, c), dtype=_acc(x), device=x.device)
    gw = torch.empty(c, dtype=grad_dtypes[0], device=x.device)
    gb = torch.empty(c, dtype=grad_dtypes[1], device=x.device)
    part = torch.empty((grids.reduce[0], 4, c), dtype=_acc(x), device=x.device)
    mod = _module(kit, x, lay)
    codes = _codes(weight, None, conv_bias, running_mean, running_var, gw, gb)
    mod["bn_bwd_stats_rows" if lay.rows else "bn_bwd_stats_planes"](
        grids.reduce, THREADS, g, x, part, kit.counters(x.device, grids.counters), vec, weight, conv_bias,
        running_mean, running_var, gw, gb, codes, lay.units, c, lay.spatial, grids.reduce_per_block,
        float(lay.units * (1 if lay.rows else lay.spatial)), eps, int(relu) | (int(training) << 1), device=x.device)
    mod["bn_bwd_apply_rows" if lay.rows else "bn_bwd_apply_planes"](
        grids.apply, THREADS, g, x, dx, vec, lay.units, c, lay.spatial, grids.apply_per_block, int(relu), device=x.device)
    return dx, gw, gb
