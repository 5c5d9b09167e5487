"""Batch normalisation over dimension 1 (+ optional ReLU), forward and backward, any dense layout.

x is seen as (N, C, S) with strides (sN, sC, sS): NCHW has sS = 1, channels_last has sC = 1 (and
its N folds into S). Every kernel works on [BLOCK_C, BLOCK_S] tiles of (channel, position), so a
channel's parameters are loaded once per tile row and no per-element index is decoded. Triton
specialises the stride that equals 1, which tells it which tile axis is contiguous, and the
divisibility by 16 of C and of every stride, sN included, which lets it move 16 bytes an access
along that axis: with sN unspecialised, every channels-last access was scalar (sm_90 PTX of
``bn_apply``: 0 of 18 loads in vectors, 6 of 6 with it; ``bn_bwd_apply`` 0/37 against 13/13).

The two reductions differ, as measured on an H200 (backends/cuda/PERF_NOTES.md): ``stats`` folds
each tile into per-channel sums at once (29 us at ResNet's 64 x 56 x 56 x 64, against 61 us with
tile-shaped accumulators), ``bwd_reduce`` adds tiles elementwise into tile-shaped accumulators and
folds them once at the end (38 us, against 137 us folding every tile). The elementwise passes use
smaller tiles and many programs.

Forward (training): ``stats`` writes per-chunk partial sums of (x - K) and (x - K)^2, K being each
channel's first element (a shift that keeps one-pass float32 sums accurate); ``finalize`` combines
them per channel into mean, 1/std, the affine pair (a, b) with y = x * a + b, and updates the
running statistics in place; ``apply`` writes act(x * a + b). In eval mode ``finalize`` takes the
running statistics. A convolution bias in front of the norm is taken out of the data (it cancels in
training) and put back into the running mean.

Backward: ``bwd_reduce`` writes per-chunk sums of dz and dz * xhat (dz = g masked by the ReLU of the
recomputed forward), ``bwd_finalize`` turns them into grad_weight, grad_bias and the per-channel
(A, B, C) with dx = A * dz + B * x + C, and ``bwd_apply`` writes dx.

Per-channel vectors live in one (8, C) buffer in the compute precision, rows: 0 a, 1 b, 2 mean,
3 1/std, 4 A, 5 B, 6 C.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hal.integration.kept import KeptForBackward, param_state

from ._launch import LaunchPlan, Plans, cdiv, compute_dtype, split_f64, torch_compute_dtype
from .config import BNConfig

_A, _B, _MEAN, _INVSTD, _GA, _GB, _GC = range(7)


@triton.jit
def _tile(pid, C, S, n_cblocks, n_sblocks, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """(n, channels, positions, mask) of program pid in a (N, channel-blocks, position-blocks) grid."""
    cb = pid % n_cblocks
    rest = pid // n_cblocks
    sb = rest % n_sblocks
    n = rest // n_sblocks
    chans = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    pos = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = (chans < C)[:, None] & (pos < S)[None, :]
    return n, chans, pos, mask


@triton.jit
def _offsets(n, chans, pos, sN, sC, sS):
    return tl.cast(n, tl.int64) * sN + chans.to(tl.int64)[:, None] * sC + pos.to(tl.int64)[None, :] * sS


@triton.jit(do_not_specialize=["N", "n_per", "s_per", "n_sgroups", "n_cblocks"])
def bn_stats_kernel(
    x_ptr, part_ptr, N, C, S, sN, sC, sS, n_per, s_per, n_sgroups, n_cblocks,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Program (chunk, channel block): sums of (x - K) and (x - K)^2 over its rows and positions."""
    pid = tl.program_id(0)
    cb = pid % n_cblocks
    chunk = pid // n_cblocks
    ng = chunk // n_sgroups
    sg = chunk % n_sgroups
    chans = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < C
    shift = tl.load(x_ptr + chans.to(tl.int64) * sC, mask=cmask, other=0.0).to(COMPUTE)
    acc1 = tl.zeros([BLOCK_C], dtype=COMPUTE)
    acc2 = tl.zeros([BLOCK_C], dtype=COMPUTE)
    s_end = tl.minimum(sg * s_per + s_per, S)
    for n in range(ng * n_per, tl.minimum(ng * n_per + n_per, N)):
        for s0 in range(sg * s_per, s_end, BLOCK_S):
            pos = s0 + tl.arange(0, BLOCK_S)
            mask = cmask[:, None] & (pos < s_end)[None, :]
            v = tl.load(x_ptr + _offsets(n, chans, pos, sN, sC, sS), mask=mask, other=0.0).to(COMPUTE)
            d = tl.where(mask, v - shift[:, None], 0.0)
            acc1 += tl.sum(d, axis=1)
            acc2 += tl.sum(d * d, axis=1)
    row = part_ptr + chunk.to(tl.int64) * 2 * C
    tl.store(row + chans, acc1, mask=cmask)
    tl.store(row + C + chans, acc2, mask=cmask)


@triton.jit
def _sum_partials(part_ptr, n_chunks, C, chans, cmask, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, COMPUTE: tl.constexpr):
    """Per-channel totals of both rows of every chunk's partial sums, BLOCK_R chunks a step (one
    chunk a step is a chain of dependent load latencies: hundreds of chunks, tens of microseconds)."""
    s1 = tl.zeros([BLOCK_C], dtype=COMPUTE)
    s2 = tl.zeros([BLOCK_C], dtype=COMPUTE)
    rows = tl.arange(0, BLOCK_R)
    for r0 in range(0, n_chunks, BLOCK_R):
        r = r0 + rows
        mask = (r < n_chunks)[:, None] & cmask[None, :]
        first = part_ptr + r.to(tl.int64)[:, None] * 2 * C + chans[None, :]
        s1 += tl.sum(tl.load(first, mask=mask, other=0.0), axis=0)
        s2 += tl.sum(tl.load(first + C, mask=mask, other=0.0), axis=0)
    return s1, s2


@triton.jit(do_not_specialize=["n_chunks", "C", "sC"])
def bn_finalize_kernel(
    x_ptr, part_ptr, vec_ptr, w_ptr, b_ptr, rm_ptr, rv_ptr, cbias_ptr,
    n_chunks, C, sC, count, momentum_hi, momentum_lo, eps_hi, eps_lo,
    TRAINING: tl.constexpr, UPDATE_RUNNING: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, COMPUTE: tl.constexpr,
):
    chans = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < C
    # float arguments arrive as float32: a float64 value travels as a float32 pair (hi + lo)
    momentum = tl.cast(momentum_hi, COMPUTE) + tl.cast(momentum_lo, COMPUTE)
    eps = tl.cast(eps_hi, COMPUTE) + tl.cast(eps_lo, COMPUTE)
    cbias = tl.zeros([BLOCK_C], dtype=COMPUTE)
    if HAS_CONV_BIAS:
        cbias = tl.load(cbias_ptr + chans, mask=cmask, other=0.0).to(COMPUTE)
    count = tl.cast(count, COMPUTE)  # an exact integer; count / (count - 1) must not round in float32
    if TRAINING:
        shift = tl.load(x_ptr + chans.to(tl.int64) * sC, mask=cmask, other=0.0).to(COMPUTE)
        s1, s2 = _sum_partials(part_ptr, n_chunks, C, chans, cmask, BLOCK_C, BLOCK_R, COMPUTE)
        d = s1 / count
        var = tl.maximum(s2 / count - d * d, 0.0)
        mean = shift + d
        if UPDATE_RUNNING:
            rm = tl.load(rm_ptr + chans, mask=cmask, other=0.0).to(COMPUTE)
            rv = tl.load(rv_ptr + chans, mask=cmask, other=0.0).to(COMPUTE)
            rm = (1.0 - momentum) * rm + momentum * (mean + cbias)
            rv = (1.0 - momentum) * rv + momentum * var * (count / (count - 1.0))
            tl.store(rm_ptr + chans, rm.to(rm_ptr.dtype.element_ty), mask=cmask)
            tl.store(rv_ptr + chans, rv.to(rv_ptr.dtype.element_ty), mask=cmask)
    else:
        mean = tl.load(rm_ptr + chans, mask=cmask, other=0.0).to(COMPUTE) - cbias
        var = tl.load(rv_ptr + chans, mask=cmask, other=1.0).to(COMPUTE)
    invstd = 1.0 / tl.sqrt(var + eps)
    a = invstd
    if HAS_W:
        a = a * tl.load(w_ptr + chans, mask=cmask, other=0.0).to(COMPUTE)
    b = -mean * a
    if HAS_B:
        b = b + tl.load(b_ptr + chans, mask=cmask, other=0.0).to(COMPUTE)
    tl.store(vec_ptr + 0 * C + chans, a, mask=cmask)
    tl.store(vec_ptr + 1 * C + chans, b, mask=cmask)
    tl.store(vec_ptr + 2 * C + chans, mean, mask=cmask)
    tl.store(vec_ptr + 3 * C + chans, invstd, mask=cmask)


@triton.jit(do_not_specialize=["n_cblocks", "n_sblocks"])
def bn_apply_kernel(
    x_ptr, y_ptr, vec_ptr, C, S, sN, sC, sS, n_cblocks, n_sblocks,
    RELU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, COMPUTE: tl.constexpr,
):
    n, chans, pos, mask = _tile(tl.program_id(0), C, S, n_cblocks, n_sblocks, BLOCK_C, BLOCK_S)
    cmask = chans < C
    a = tl.load(vec_ptr + chans, mask=cmask, other=0.0)
    b = tl.load(vec_ptr + C + chans, mask=cmask, other=0.0)
    offs = _offsets(n, chans, pos, sN, sC, sS)
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE) * a[:, None] + b[:, None]
    if RELU:
        y = tl.where(y < 0.0, 0.0, y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dz(g, x, a, b, RELU: tl.constexpr):
    """The gradient reaching the affine output: g, masked where the forward's ReLU cut."""
    if RELU:
        g = tl.where(x * a[:, None] + b[:, None] > 0.0, g, 0.0)
    return g


@triton.jit(do_not_specialize=["N", "n_per", "s_per", "n_sgroups", "n_cblocks"])
def bn_bwd_reduce_kernel(
    g_ptr, x_ptr, part_ptr, vec_ptr, N, C, S, sN, sC, sS, n_per, s_per, n_sgroups, n_cblocks,
    RELU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Program (chunk, channel block): sums of dz and dz * xhat."""
    pid = tl.program_id(0)
    cb = pid % n_cblocks
    chunk = pid // n_cblocks
    ng = chunk // n_sgroups
    sg = chunk % n_sgroups
    chans = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < C
    a = tl.load(vec_ptr + chans, mask=cmask, other=0.0)
    b = tl.load(vec_ptr + C + chans, mask=cmask, other=0.0)
    mean = tl.load(vec_ptr + 2 * C + chans, mask=cmask, other=0.0)
    invstd = tl.load(vec_ptr + 3 * C + chans, mask=cmask, other=0.0)
    acc1 = tl.zeros([BLOCK_C, BLOCK_S], dtype=COMPUTE)
    acc2 = tl.zeros([BLOCK_C, BLOCK_S], dtype=COMPUTE)
    s_end = tl.minimum(sg * s_per + s_per, S)
    for n in range(ng * n_per, tl.minimum(ng * n_per + n_per, N)):
        for s0 in range(sg * s_per, s_end, BLOCK_S):
            pos = s0 + tl.arange(0, BLOCK_S)
            mask = cmask[:, None] & (pos < s_end)[None, :]
            offs = _offsets(n, chans, pos, sN, sC, sS)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            dz = tl.where(mask, _dz(g, x, a, b, RELU), 0.0)
            acc1 += dz
            acc2 += dz * ((x - mean[:, None]) * invstd[:, None])
    row = part_ptr + chunk.to(tl.int64) * 2 * C
    tl.store(row + chans, tl.sum(acc1, axis=1), mask=cmask)
    tl.store(row + C + chans, tl.sum(acc2, axis=1), mask=cmask)


@triton.jit(do_not_specialize=["n_chunks", "C"])
def bn_bwd_finalize_kernel(
    part_ptr, vec_ptr, w_ptr, gw_ptr, gb_ptr, n_chunks, C, count,
    TRAINING: tl.constexpr, HAS_W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, COMPUTE: tl.constexpr,
):
    chans = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < C
    s_dz, s_dzx = _sum_partials(part_ptr, n_chunks, C, chans, cmask, BLOCK_C, BLOCK_R, COMPUTE)
    tl.store(gw_ptr + chans, s_dzx.to(gw_ptr.dtype.element_ty), mask=cmask)
    tl.store(gb_ptr + chans, s_dz.to(gb_ptr.dtype.element_ty), mask=cmask)
    invstd = tl.load(vec_ptr + 3 * C + chans, mask=cmask, other=0.0)
    ga = invstd
    if HAS_W:
        ga = ga * tl.load(w_ptr + chans, mask=cmask, other=0.0).to(COMPUTE)
    gbx = tl.zeros([BLOCK_C], dtype=COMPUTE)
    gc = tl.zeros([BLOCK_C], dtype=COMPUTE)
    if TRAINING:
        mean = tl.load(vec_ptr + 2 * C + chans, mask=cmask, other=0.0)
        gbx = -ga * invstd * s_dzx / count
        gc = -ga * s_dz / count - gbx * mean
    tl.store(vec_ptr + 4 * C + chans, ga, mask=cmask)
    tl.store(vec_ptr + 5 * C + chans, gbx, mask=cmask)
    tl.store(vec_ptr + 6 * C + chans, gc, mask=cmask)


@triton.jit(do_not_specialize=["n_cblocks", "n_sblocks"])
def bn_bwd_apply_kernel(
    g_ptr, x_ptr, dx_ptr, vec_ptr, C, S, sN, sC, sS, n_cblocks, n_sblocks,
    RELU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, COMPUTE: tl.constexpr,
):
    n, chans, pos, mask = _tile(tl.program_id(0), C, S, n_cblocks, n_sblocks, BLOCK_C, BLOCK_S)
    cmask = chans < C
    a = tl.load(vec_ptr + chans, mask=cmask, other=0.0)
    b = tl.load(vec_ptr + C + chans, mask=cmask, other=0.0)
    ga = tl.load(vec_ptr + 4 * C + chans, mask=cmask, other=0.0)
    gbx = tl.load(vec_ptr + 5 * C + chans, mask=cmask, other=0.0)
    gc = tl.load(vec_ptr + 6 * C + chans, mask=cmask, other=0.0)
    offs = _offsets(n, chans, pos, sN, sC, sS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    dx = ga[:, None] * _dz(g, x, a, b, RELU) + gbx[:, None] * x + gc[:, None]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --- host side ----------------------------------------------------------------------------------


class _View:
    """x (dense: see :func:`dense`) as (N, C, S) with strides. When N and S can be walked as one
    run (channels_last, or no spatial dimensions) they fold into S, so tiles stay full."""

    def __init__(self, x: torch.Tensor) -> None:
        v = x.unsqueeze(2) if x.ndim == 2 else x.flatten(2)  # a view for dense inputs
        n, c, s = (int(d) for d in v.shape)
        sn, sc, ss = v.stride()
        if s == 1 and n > 1:
            n, s, sn, ss = 1, n, 0, sn
        elif n > 1 and sn == s * ss:
            n, s, sn = 1, n * s, 0
        self.n, self.c, self.s, self.strides = n, c, s, (sn, sc, ss)


def dense(x: torch.Tensor) -> torch.Tensor:
    """x itself if its (N, C, spatial...) can be walked as (N, C, S) in place, else a contiguous copy."""
    if x.is_contiguous() or (x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        return x
    return x.contiguous()


def _chunks(view: _View, cfg: BNConfig) -> tuple[int, int, int, int]:
    """(n_per, s_per, n_sgroups, n_chunks) splitting the reduction over about cfg.programs programs."""
    want = max(1, cfg.programs // cdiv(view.c, cfg.block_c))
    if view.n >= want:
        n_per = cdiv(view.n, want)
        return n_per, view.s, 1, cdiv(view.n, n_per)
    block_s = cfg.reduce_block_s or cfg.block_s
    s_groups = max(1, min(cdiv(want, view.n), cdiv(view.s, block_s)))
    s_per = cdiv(cdiv(view.s, s_groups), block_s) * block_s
    s_groups = cdiv(view.s, s_per)
    return 1, s_per, s_groups, view.n * s_groups


class _Geometry:
    """The launches of one batch-norm geometry (x's shape, strides and dtype, the tiles, which
    optional tensors are given, momentum and eps), planned once: a model calls the same layers over
    and over, and planning costs more host time than the launches."""

    def __init__(self, x: torch.Tensor, cfg: BNConfig) -> None:
        view = self.view = _View(x)
        self.cfg = cfg
        self.cdt, self.acc = compute_dtype(x.dtype), torch_compute_dtype(x.dtype)
        n_per, s_per, n_sgroups, self.n_chunks = _chunks(view, cfg)
        ncb, nsb = cdiv(view.c, cfg.block_c), cdiv(view.s, cfg.block_s)
        self.reduce_grid = (self.n_chunks * cdiv(view.c, cfg.block_c),)
        self.reduce_fixed = (view.n, view.c, view.s, *view.strides, n_per, s_per, n_sgroups, ncb)
        self.apply_grid = (ncb * nsb * view.n,)
        self.apply_fixed = (view.c, view.s, *view.strides, ncb, nsb)
        self.vector_grid = (cdiv(view.c, cfg.finalize_block),)
        self.count = float(view.n * view.s)
        self.plans = Plans()

    def reduce(self, kernel, **constexprs) -> LaunchPlan:
        """A per-chunk reduction over the (N, C, S) view: stats, or the backward's sums."""
        cfg = self.cfg
        return LaunchPlan(kernel, self.reduce_grid, self.reduce_fixed, num_warps=cfg.reduce_warps or cfg.num_warps,
                          BLOCK_C=cfg.block_c, BLOCK_S=cfg.reduce_block_s or cfg.block_s, COMPUTE=self.cdt, **constexprs)

    def elementwise(self, kernel, relu: bool) -> LaunchPlan:
        cfg = self.cfg
        return LaunchPlan(kernel, self.apply_grid, self.apply_fixed, num_warps=cfg.num_warps, RELU=relu,
                          BLOCK_C=cfg.block_c, BLOCK_S=cfg.block_s, COMPUTE=self.cdt)


_GEOMETRIES = Plans(1024)


def _geometry(x: torch.Tensor, cfg: BNConfig) -> _Geometry:
    return _GEOMETRIES.get_or_build((x.shape, x.stride(), x.dtype, cfg), lambda: _Geometry(x, cfg))


def affine_params(
    x: torch.Tensor,
    geo: _Geometry,
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
    """The (8, C) per-channel buffer (rows 0-3 filled) of a batch norm of the dense x (``geo``: its
    geometry); with ``update_running`` (training, running statistics given) these are updated in
    place with ``momentum``."""
    c = geo.view.c
    vec = torch.empty((8, c), dtype=geo.acc, device=x.device)
    if training:
        part = torch.empty((geo.n_chunks, 2, c), dtype=geo.acc, device=x.device)
        geo.plans.get_or_build(("stats",), lambda: geo.reduce(bn_stats_kernel))(x, part)
        n_chunks = geo.n_chunks
    else:
        part, n_chunks = vec, 0
    update = update_running and training and running_mean is not None
    flags = (training, update, weight is not None, bias is not None, conv_bias is not None)

    def build() -> LaunchPlan:
        cfg = geo.cfg
        return LaunchPlan(
            bn_finalize_kernel, geo.vector_grid, (n_chunks, c, geo.view.strides[1], geo.count, *split_f64(momentum), *split_f64(eps)),
            num_warps=4, TRAINING=training, UPDATE_RUNNING=update, HAS_W=flags[2], HAS_B=flags[3], HAS_CONV_BIAS=flags[4],
            BLOCK_C=cfg.finalize_block, BLOCK_R=cfg.finalize_rows, COMPUTE=geo.cdt,
        )

    geo.plans.get_or_build(("finalize", flags, momentum, eps), build)(
        x, part, vec, _or(weight, vec), _or(bias, vec), _or(running_mean, vec), _or(running_var, vec), _or(conv_bias, vec))
    return vec


def _or(t: Optional[torch.Tensor], default: torch.Tensor) -> torch.Tensor:
    return t if t is not None else default


#: the training forward's per-channel buffer, kept for the backward of the same x (hal.integration.kept): rows
#: 2-3 (mean, 1/std) depend on x and eps alone; a backward with the ReLU also reads the affine pair of
#: rows 0-1, so it needs the same weight, bias and convolution bias too.
_KEPT = KeptForBackward()


def batch_norm_forward(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool,
    momentum: float,
    eps: float,
    relu: bool,
    cfg: BNConfig,
    conv_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(batch_norm(x + conv_bias))`` with act ReLU or none, in x's layout (x dense: see
    :func:`dense`). conv_bias is the bias of a convolution x came out of without it."""
    geo = _geometry(x, cfg)
    vec = affine_params(x, geo, weight, bias, running_mean, running_var, conv_bias, training, True, momentum, eps)
    if training:
        _KEPT.keep(x, eps, (vec, param_state(weight, bias, conv_bias)))
    y = torch.empty_like(x)
    assert y.stride() == x.stride()
    geo.plans.get_or_build(("apply", relu), lambda: geo.elementwise(bn_apply_kernel, relu))(x, y, vec)
    return y


def batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool,
    eps: float,
    relu: bool,
    cfg: BNConfig,
    grad_dtypes: tuple[torch.dtype, torch.dtype],
    conv_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of :func:`batch_norm_forward`; the parameter gradients in
    ``grad_dtypes``. The batch statistics are those the forward kept for this x (see
    ``_KEPT``), else recomputed; the running ones are read, never written."""
    geo = _geometry(x, cfg)
    kept = _KEPT.take(x, eps) if training else None
    vec = kept[0] if kept is not None and not (relu and kept[1] != param_state(weight, bias, conv_bias)) else None
    if vec is None:
        vec = affine_params(x, geo, weight, bias, running_mean, running_var, conv_bias, training, False, 0.0, eps)
    if grad_out.stride() != x.stride():
        g = torch.empty_like(x)
        g.copy_(grad_out)
    else:
        g = grad_out
    c = geo.view.c
    part = torch.empty((geo.n_chunks, 2, c), dtype=geo.acc, device=x.device)
    geo.plans.get_or_build(("bwd_reduce", relu), lambda: geo.reduce(bn_bwd_reduce_kernel, RELU=relu))(g, x, part, vec)
    gw = torch.empty(c, dtype=grad_dtypes[0], device=x.device)
    gb = torch.empty(c, dtype=grad_dtypes[1], device=x.device)
    has_w = weight is not None

    def finalize() -> LaunchPlan:
        return LaunchPlan(bn_bwd_finalize_kernel, geo.vector_grid, (geo.n_chunks, c, geo.count), num_warps=4, TRAINING=training,
                          HAS_W=has_w, BLOCK_C=cfg.finalize_block, BLOCK_R=cfg.finalize_rows, COMPUTE=geo.cdt)

    geo.plans.get_or_build(("bwd_finalize", training, has_w), finalize)(part, vec, _or(weight, vec), gw, gb)
    dx = torch.empty_like(x)
    geo.plans.get_or_build(("bwd_apply", relu), lambda: geo.elementwise(bn_bwd_apply_kernel, relu))(g, x, dx, vec)
    return dx, gw, gb
