"""layer_norm and rms_norm over the last N elements of each row, forward and backward.

x is seen as an (M, N) row-major matrix. Two kernel shapes per direction:

- tile: BLOCK_M rows of BLOCK_N >= N columns per program, the whole row in registers (one read of
  x, one write of y);
- loop: one row per program in BLOCK_N chunks, for rows too long for registers (the row is read
  two or three times; the re-reads mostly hit L2).

The forward kernels optionally reduce the amax of what they write (``AMAX``, rms_norm_amax: the
FP8 cast of y under per-tensor current scaling then needs no pass over y to find it): each program
maxes the float32 bits of its largest |y| into one int32 word (:func:`amax_bits`).

The backward recomputes the statistics from x. Programs of the backward are persistent: each takes
every P-th block of rows and accumulates its partial grad_weight / grad_bias (layer_norm only) in
registers (tile) or in its own row of a partial buffer (loop); the host sums the P partial rows.
The tile kernel can load a program's next block while it reduces the current one (``PREFETCH``);
which launch runs is the autotuner's choice among the plugin's candidates (``NormBwdConfig``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from ._launch import LaunchPlan, Plans, cdiv, compute_dtype, split_f64, torch_compute_dtype


@triton.jit
def _stats(x, mask, N, eps, RMS: tl.constexpr):
    """(centred x, rstd) of the rows of a [BLOCK_M, BLOCK_N] tile (masked entries are zero)."""
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    return xc, 1.0 / tl.sqrt(var + eps)


@triton.jit
def amax_bits(y, mask):
    """The largest float32 bits of ``|y|`` over the entries of a 2-D tile where ``mask`` holds, as
    int32: the bits of a non-negative float order like its values and a NaN's lie above every other
    (infinity included), with -0.0 as +0.0; so an int32 ``atomic_max`` of them across programs is the
    amax with NaN propagating (one zeroed word, read back as float32). ``y`` as written (its dtype)."""
    bits = y.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(tl.max(tl.where(mask, bits, 0), axis=1), axis=0)


@triton.jit(do_not_specialize=["M"])
def norm_fwd_tile_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, amax_ptr, M, N, eps, eps_lo,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, AMAX: tl.constexpr,
):
    """BLOCK_M rows a program; AMAX: the tile's largest |y| (as written) maxed into the int32 word at
    amax_ptr (:func:`amax_bits`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    xc, rstd = _stats(x, mask, N, tl.cast(eps, COMPUTE) + tl.cast(eps_lo, COMPUTE), RMS)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    out = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, out, mask=mask)
    if AMAX:
        tl.atomic_max(amax_ptr, amax_bits(out, mask))


@triton.jit
def _row_stats_loop(row_ptr, N, eps, RMS: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    """(mean, rstd) of one long row, read in BLOCK_N chunks (mean is 0 for RMS)."""
    cols = tl.arange(0, BLOCK_N)
    mean = 0.0
    if not RMS:
        acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
        for start in range(0, N, BLOCK_N):
            acc += tl.load(row_ptr + start + cols, mask=start + cols < N, other=0.0).to(COMPUTE)
        mean = tl.sum(acc, axis=0) / N
    acc2 = tl.zeros([BLOCK_N], dtype=COMPUTE)
    for start in range(0, N, BLOCK_N):
        m = start + cols < N
        v = tl.where(m, tl.load(row_ptr + start + cols, mask=m, other=0.0).to(COMPUTE) - mean, 0.0)
        acc2 += v * v
    return mean, 1.0 / tl.sqrt(tl.sum(acc2, axis=0) / N + eps)


@triton.jit
def norm_fwd_loop_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, amax_ptr, N, eps, eps_lo,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
    AMAX: tl.constexpr,
):
    """One long row a program; AMAX: the row's largest |y| into the word at amax_ptr, once."""
    base = tl.program_id(0).to(tl.int64) * N
    mean, rstd = _row_stats_loop(x_ptr + base, N, tl.cast(eps, COMPUTE) + tl.cast(eps_lo, COMPUTE), RMS, BLOCK_N, COMPUTE)
    cols = tl.arange(0, BLOCK_N)
    if AMAX:
        top = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        m = c < N
        y = (tl.load(x_ptr + base + c, mask=m, other=0.0).to(COMPUTE) - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=m, other=0.0).to(COMPUTE)
        if HAS_B:
            y = y + tl.load(b_ptr + c, mask=m, other=0.0).to(COMPUTE)
        out = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + base + c, out, mask=m)
        if AMAX:
            bits = out.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            top = tl.maximum(top, tl.where(m, bits, 0))
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(top, axis=0))


@triton.jit
def _row_block(block, M, N, cols, cmask, BLOCK_M: tl.constexpr):
    """(offsets, mask) of row block ``block``: rows block * BLOCK_M ... of the (M, N) matrix at the
    columns ``cols`` (``cmask``: those below N); rows from M on are masked."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows.to(tl.int64)[:, None] * N + cols[None, :], (rows < M)[:, None] & cmask[None, :]


@triton.jit
def _load_block(x_ptr, g_ptr, block, M, N, cols, cmask, BLOCK_M: tl.constexpr):
    """x and grad_out of row block ``block`` in their stored dtype (zero where masked; a block past
    the last row reads nothing)."""
    offs, mask = _row_block(block, M, N, cols, cmask, BLOCK_M)
    return tl.load(x_ptr + offs, mask=mask, other=0.0), tl.load(g_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _bwd_block(x, g, w, mask, N, eps, RMS: tl.constexpr):
    """(grad_x, column sums of g * xhat, column sums of g) of one [BLOCK_M, BLOCK_N] block; x, g
    and the weight row w (ones without a weight, zero past N) in the compute type."""
    xc, rstd = _stats(x, mask, N, eps, RMS)
    xhat = xc * rstd[:, None]
    wg = g * w[None, :]
    c1 = tl.sum(xhat * wg, axis=1) / N
    if RMS:
        dx = (wg - xhat * c1[:, None]) * rstd[:, None]
    else:
        c2 = tl.sum(wg, axis=1) / N
        dx = (wg - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    return dx, tl.sum(g * xhat, axis=0), tl.sum(g, axis=0)


@triton.jit(do_not_specialize=["M"])
def norm_bwd_tile_kernel(
    g_ptr, x_ptr, w_ptr, dx_ptr, part_ptr, M, N, eps, eps_lo,
    HAS_W: tl.constexpr, RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """grad_x of every row block pid, pid + P, ...; partial sums of g * xhat over those rows go to
    part_ptr row pid, for layer_norm those of g to row P + pid (rms_norm has no bias).

    PREFETCH: the next block's x and grad_out are loaded (masked, as stored) before the current
    block is reduced and carried into the next iteration, so that they are in flight during the
    reductions and the store. Triton pipelines no loads that do not feed ``tl.dot``: without it a
    program has no load in flight from the arrival of a block until its reductions and store are
    done. (In the sm_90 SASS of Triton 3.9 the loop's barriers do not wait on the prefetching
    loads; the loop's first use of the carried values does.)"""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    eps_c = tl.cast(eps, COMPUTE) + tl.cast(eps_lo, COMPUTE)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
    else:
        w = tl.where(cmask, 1.0, 0.0).to(COMPUTE)
    dw = tl.zeros([BLOCK_N], dtype=COMPUTE)
    db = tl.zeros([BLOCK_N], dtype=COMPUTE)
    if PREFETCH:
        x_next, g_next = _load_block(x_ptr, g_ptr, pid, M, N, cols, cmask, BLOCK_M)
    for block in range(pid, tl.cdiv(M, BLOCK_M), n_programs):
        if PREFETCH:
            x, g = x_next, g_next
            x_next, g_next = _load_block(x_ptr, g_ptr, block + n_programs, M, N, cols, cmask, BLOCK_M)
        else:
            x, g = _load_block(x_ptr, g_ptr, block, M, N, cols, cmask, BLOCK_M)
        offs, mask = _row_block(block, M, N, cols, cmask, BLOCK_M)
        dx, dw_block, db_block = _bwd_block(x.to(COMPUTE), g.to(COMPUTE), w, mask, N, eps_c, RMS)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dw_block
        if not RMS:
            db += db_block
    tl.store(part_ptr + pid.to(tl.int64) * N + cols, dw, mask=cmask)
    if not RMS:
        tl.store(part_ptr + (n_programs + pid).to(tl.int64) * N + cols, db, mask=cmask)


@triton.jit(do_not_specialize=["M"])
def norm_bwd_loop_kernel(
    g_ptr, x_ptr, w_ptr, dx_ptr, part_ptr, M, N, eps, eps_lo,
    HAS_W: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
):
    """As the tile kernel, one long row at a time; partial sums accumulate in part_ptr (zeroed by
    the host), each program in its own rows (rms_norm: g * xhat only)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    dw_row = part_ptr + pid.to(tl.int64) * N
    db_row = part_ptr + (n_programs + pid).to(tl.int64) * N
    for row in range(pid, M, n_programs):
        base = tl.cast(row, tl.int64) * N
        mean, rstd = _row_stats_loop(x_ptr + base, N, tl.cast(eps, COMPUTE) + tl.cast(eps_lo, COMPUTE), RMS, BLOCK_N, COMPUTE)
        s1 = tl.zeros([BLOCK_N], dtype=COMPUTE)
        s2 = tl.zeros([BLOCK_N], dtype=COMPUTE)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            m = c < N
            xhat = tl.where(m, (tl.load(x_ptr + base + c, mask=m, other=0.0).to(COMPUTE) - mean) * rstd, 0.0)
            wg = tl.load(g_ptr + base + c, mask=m, other=0.0).to(COMPUTE)
            if HAS_W:
                wg = wg * tl.load(w_ptr + c, mask=m, other=0.0).to(COMPUTE)
            s1 += xhat * wg
            s2 += wg
        c1 = tl.sum(s1, axis=0) / N
        c2 = tl.sum(s2, axis=0) / N
        for start in range(0, N, BLOCK_N):
            c = start + cols
            m = c < N
            xhat = (tl.load(x_ptr + base + c, mask=m, other=0.0).to(COMPUTE) - mean) * rstd
            g = tl.load(g_ptr + base + c, mask=m, other=0.0).to(COMPUTE)
            wg = g
            if HAS_W:
                wg = g * tl.load(w_ptr + c, mask=m, other=0.0).to(COMPUTE)
            if RMS:
                dx = (wg - xhat * c1) * rstd
            else:
                dx = (wg - xhat * c1 - c2) * rstd
            tl.store(dx_ptr + base + c, dx.to(dx_ptr.dtype.element_ty), mask=m)
            tl.store(dw_row + c, tl.load(dw_row + c, mask=m, other=0.0) + g * xhat, mask=m)
            if not RMS:
                tl.store(db_row + c, tl.load(db_row + c, mask=m, other=0.0) + g, mask=m)


# --- host side ----------------------------------------------------------------------------------


#: launch plans by call geometry (a model normalises the same shapes over and over)
_PLANS = Plans()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels walk it: rows of n contiguous elements from its first (no copy when dense)."""
    return t if t.is_contiguous() else t.contiguous()


def norm_forward(
    x: torch.Tensor,
    n: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    amax: bool = False,
) -> Any:
    """Normalise each run of the last ``n`` elements of x. ``block_n >= n`` runs the tile kernel
    (``block_m`` rows a program), a smaller ``block_n`` the loop kernel (one row a program).
    ``amax``: return ``(y, amax)``, amax ``max |float32(y)|`` (0-d float32) reduced by the same
    kernel as it writes y (one zeroed int32 word of float32 bits, atomically maxed per program)."""
    x2 = _dense(x)
    m = x2.numel() // n if n else 0
    y = torch.empty_like(x2)
    w = _dense(weight) if weight is not None else x2
    b = _dense(bias) if bias is not None else x2
    word = torch.zeros(1, dtype=torch.int32, device=x.device) if amax else y  # (unread without AMAX)

    def build() -> LaunchPlan:
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, COMPUTE=compute_dtype(x.dtype), AMAX=amax)
        if block_n >= n:
            return LaunchPlan(norm_fwd_tile_kernel, (cdiv(m, block_m),), (m, n, *split_f64(eps)),
                              num_warps=num_warps, BLOCK_M=block_m, BLOCK_N=block_n, **flags)
        return LaunchPlan(norm_fwd_loop_kernel, (m,), (n, *split_f64(eps)), num_warps=num_warps, BLOCK_N=block_n, **flags)

    key = (0, m, n, x.dtype, weight is None, bias is None, eps, rms, block_m, block_n, num_warps, amax)
    _PLANS.get_or_build(key, build)(x2, w, b, y, word)
    return (y, word.view(torch.float32).reshape(())) if amax else y


def norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    n: int,
    weight: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    programs: int,
    prefetch: bool = False,
    options: tuple[tuple[str, int], ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(grad_x, grad_weight, grad_bias) with grad_weight/grad_bias flat (n,) in x's dtype (the
    caller reshapes them); grad_bias None for rms_norm (no bias: its partial sums are neither
    written nor added). ``programs`` persistent programs (the partial rows to sum); ``prefetch``:
    the tile kernel loads each program's next row block before reducing the current one;
    ``options``: vendor launch options (:class:`~hal_triton.config.NormBwdConfig`).

    grad_x and the partial sums are fresh buffers of this call, so that running it again on the
    same inputs (the autotuner times candidates so) changes nothing the caller holds."""
    x2, g2 = _dense(x), _dense(grad_out)
    m = x2.numel() // n if n else 0
    dx = torch.empty_like(x2)
    w = _dense(weight) if weight is not None else x2
    acc = torch_compute_dtype(x.dtype)
    tile = block_n >= n
    p = max(1, min(programs, cdiv(m, block_m) if tile else m))
    sums = 1 if rms else 2  # grad_weight's partial rows, and grad_bias's

    def build() -> LaunchPlan:
        flags = dict(HAS_W=weight is not None, RMS=rms, COMPUTE=compute_dtype(x.dtype))
        if tile:
            return LaunchPlan(norm_bwd_tile_kernel, (p,), (m, n, *split_f64(eps)), num_warps=num_warps, options=options, BLOCK_M=block_m,
                              BLOCK_N=block_n, PREFETCH=prefetch, **flags)
        return LaunchPlan(norm_bwd_loop_kernel, (p,), (m, n, *split_f64(eps)), num_warps=num_warps, options=options, BLOCK_N=block_n,
                          **flags)

    part = (torch.empty if tile else torch.zeros)((sums * p, n), dtype=acc, device=x.device)  # the loop kernel accumulates
    key = (1, m, n, x.dtype, weight is None, eps, rms, block_m, block_n, num_warps, p, prefetch and tile, options)
    _PLANS.get_or_build(key, build)(g2, x2, w, dx, part)
    grads = part.view(sums, p, n).sum(dim=1).to(x.dtype)
    return dx, grads[0], None if rms else grads[1]
