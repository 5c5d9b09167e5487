"""act(x * scale + shift) with broadcast scale and shift, and its gradient.

The kernels see x as a dense matrix of R rows and C columns in x's memory order (contiguous and
channels_last inputs alike, no copy). Each of scale and shift is a number or a tensor that
broadcasts to x; a tensor is addressed through up to four collapsed dimensions: the innermost one
moves along the columns, the other three are decoded once per row. The common patterns cost no
per-element index arithmetic: a per-column bias (linear's epilogue) is one column stride, a
per-channel vector of an NCHW tensor one row stride.

This kernel is also the epilogue of GEMMs (bias + activation, in place) and the elementwise step of
batch-norm inference.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from ._launch import LaunchPlan, Plans, cdiv, compute_dtype, next_pow2, torch_compute_dtype
from .activation import ACT_CODES, act_fwd, act_grad

Scalar = Union[float, torch.Tensor]


@triton.jit
def _row_offsets(rows, D1, D2, s0, s1, s2):
    """Offset of each row's first element in a parameter with collapsed strides (s0, s1, s2)."""
    i2 = rows % D2
    rest = rows // D2
    return (rest // D1).to(tl.int64) * s0 + (rest % D1).to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def _load_param(ptr, val, rows, cols, mask, C, D1, D2, s0, s1, s2, s3, MODE: tl.constexpr, COMPUTE: tl.constexpr):
    """A parameter's values for a tile: MODE 0 the number ``val``, 1 a tensor (any broadcast), 2 a
    tensor constant along rows (a bias over the last dimension: one vector load for the tile)."""
    if MODE == 2:
        p = tl.load(ptr + cols.to(tl.int64) * s3, mask=cols < C, other=0.0).to(COMPUTE)[None, :]
    elif MODE == 1:
        offs = _row_offsets(rows, D1, D2, s0, s1, s2)[:, None] + cols[None, :].to(tl.int64) * s3
        p = tl.load(ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    else:
        p = val
    return p


@triton.jit(do_not_specialize=["R", "n_col_blocks", "D1", "D2", "ss0", "ss1", "ss2", "hs0", "hs1", "hs2"])
def affine_act_kernel(
    x_ptr, out_ptr, scale_ptr, shift_ptr, scale_val, shift_val,
    R, C, n_col_blocks, D1, D2,
    ss0, ss1, ss2, ss3, hs0, hs1, hs2, hs3,
    ACT: tl.constexpr, SCALE_TENSOR: tl.constexpr, SHIFT_TENSOR: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    s = _load_param(scale_ptr, scale_val, rows, cols, mask, C, D1, D2, ss0, ss1, ss2, ss3, SCALE_TENSOR, COMPUTE)
    h = _load_param(shift_ptr, shift_val, rows, cols, mask, C, D1, D2, hs0, hs1, hs2, hs3, SHIFT_TENSOR, COMPUTE)
    y = act_fwd(x * s + h, ACT)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "n_col_blocks", "D1", "D2", "ss0", "ss1", "ss2", "hs0", "hs1", "hs2"])
def affine_act_backward_kernel(
    g_ptr, x_ptr, gx_ptr, dz_ptr, part_ptr, scale_ptr, shift_ptr, scale_val, shift_val,
    R, C, n_col_blocks, D1, D2,
    ss0, ss1, ss2, ss3, hs0, hs1, hs2, hs3,
    ACT: tl.constexpr, SCALE_TENSOR: tl.constexpr, SHIFT_TENSOR: tl.constexpr, WRITE_DZ: tl.constexpr,
    PARTIALS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr,
):
    """grad_x = g * act'(z) * scale. With PARTIALS, each program writes its partial sums of dz * x
    and dz (dz = g * act'(z): the gradients of scalar scale and shift) to part_ptr[pid] and
    [pid + P]; with WRITE_DZ, dz itself is written (in COMPUTE) for the host to reduce onto
    tensor-shaped ones. Neither when those gradients are not asked for."""
    pid = tl.program_id(0)
    rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    s = _load_param(scale_ptr, scale_val, rows, cols, mask, C, D1, D2, ss0, ss1, ss2, ss3, SCALE_TENSOR, COMPUTE)
    h = _load_param(shift_ptr, shift_val, rows, cols, mask, C, D1, D2, hs0, hs1, hs2, hs3, SHIFT_TENSOR, COMPUTE)
    dz = tl.where(mask, g * act_grad(x * s + h, ACT), 0.0)
    tl.store(gx_ptr + offs, (dz * s).to(gx_ptr.dtype.element_ty), mask=mask)
    if WRITE_DZ:
        tl.store(dz_ptr + offs, dz, mask=mask)
    if PARTIALS:
        n_programs = tl.num_programs(0)
        tl.store(part_ptr + pid, tl.sum(tl.sum(dz * x, axis=1), axis=0))
        tl.store(part_ptr + n_programs + pid, tl.sum(tl.sum(dz, axis=1), axis=0))


# --- host side ----------------------------------------------------------------------------------


class Layout:
    """How the kernels address x and its parameters: x's memory order and the collapsed dims."""

    __slots__ = ("perm", "dims", "strides", "rows", "cols")

    def __init__(self, perm: tuple[int, ...], dims: tuple[int, int, int, int], strides: tuple[tuple[int, ...], ...]) -> None:
        self.perm = perm
        self.dims = dims  # (d0, d1, d2, d3): rows decode into (d0, d1, d2), columns run along d3
        self.strides = strides  # per parameter tensor: 4 strides, 0 along broadcast dimensions
        self.rows = dims[0] * dims[1] * dims[2]
        self.cols = dims[3]


def memory_order(x: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The permutation putting x's dimensions in memory order, if x is dense in that order."""
    perm = tuple(sorted(range(x.ndim), key=lambda d: (x.stride(d), x.shape[d]), reverse=True))
    return perm if x.permute(perm).is_contiguous() else None


def _collapse(shape: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dimensions and merge neighbours that every parameter walks contiguously."""
    dims: list[int] = []
    out: list[list[int]] = [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if dims and all(o[-1] == st[d] * size for o, st in zip(out, strides)):
            dims[-1] *= size
            for o, st in zip(out, strides):
                o[-1] = st[d]
            continue
        dims.append(size)
        for o, st in zip(out, strides):
            o.append(st[d])
    return dims, out


def plan_layout(x: torch.Tensor, params: list[Optional[torch.Tensor]]) -> tuple[Layout, list[Optional[torch.Tensor]]]:
    """The layout for x (dense in some order) and broadcast parameters; parameters whose pattern
    needs more than four dimensions are materialised in x's order (rare: returned replaced)."""
    perm = memory_order(x)
    assert perm is not None, "x must be dense (the caller makes it contiguous otherwise)"
    shape = [int(x.shape[d]) for d in perm]
    tensors = [p for p in params if p is not None]
    views = [p.broadcast_to(x.shape).permute(perm) for p in tensors]
    dims, strides = _collapse(shape, [list(v.stride()) for v in views])
    if len(dims) > 4:
        tensors = [v.contiguous() for v in views]
        dims, strides = _collapse(shape, [list(t.stride()) for t in tensors])
        # materialised views are in x's order already: undo the permutation for the caller
        inverse = sorted(range(len(perm)), key=lambda i: perm[i])
        tensors = [t.permute(inverse) for t in tensors]
        it = iter(tensors)
        params = [next(it) if p is not None else None for p in params]
    pad = 4 - len(dims)
    dims4 = tuple([1] * pad + dims)
    strides4 = tuple(tuple([0] * pad + s) for s in strides)
    return Layout(perm, dims4, strides4), params  # type: ignore[arg-type]


def _param_args(x: torch.Tensor, value: Scalar, strides: Optional[tuple[int, ...]]) -> tuple[Any, Any, tuple[int, ...], int]:
    """(pointer, scalar, strides, mode) of one parameter as the kernels take it (mode: see _load_param)."""
    if isinstance(value, torch.Tensor):
        assert strides is not None
        return value, 0.0, strides, 2 if strides[:3] == (0, 0, 0) else 1
    return (*_number_args(x, value), (0, 0, 0, 0), 1 if x.dtype == torch.float64 else 0)


def _number_args(x: torch.Tensor, value: Any) -> tuple[torch.Tensor, float]:
    """(pointer, scalar) of a parameter that is a number: x stands in for the unused pointer. For
    float64 the number goes in a one-element tensor (read in mode 1 with zero strides)."""
    if x.dtype == torch.float64:  # Triton passes Python floats as float32: a float64 fill keeps it exact
        return torch.full((1,), float(value), dtype=torch.float64, device=x.device), 0.0
    return x, float(value)


#: widest column tile when there are several rows: per-column parameters are then loaded once for a
#: few rows instead of once per row
MAX_BLOCK_C = 1024


def _blocks(layout: Layout, block_elems: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, column blocks): about block_elems elements a program, no idle tile rows."""
    block_c = min(next_pow2(layout.cols), block_elems)
    if layout.rows > 1:
        block_c = min(block_c, MAX_BLOCK_C)
    block_r = max(1, min(block_elems // block_c, next_pow2(layout.rows)))
    return block_r, block_c, cdiv(layout.cols, block_c)


def _geometry(t: Any) -> Any:
    return (t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None


def _prepare(x: torch.Tensor, scale: Scalar, shift: Scalar) -> tuple[torch.Tensor, Layout, list[Any], bool]:
    """x dense, its layout, the kernels' (pointer, scalar, strides, mode) of scale and shift, and
    whether a plan of this geometry may be kept (nothing was copied or materialised for it)."""
    kept = True
    if not x.is_contiguous() and memory_order(x) is None:
        x, kept = x.contiguous(), False
    tensors = [v if isinstance(v, torch.Tensor) else None for v in (scale, shift)]
    layout, planned = plan_layout(x, tensors)
    kept = kept and all(a is b for a, b in zip(planned, tensors))
    strides = iter(layout.strides)
    args = []
    for value, t in zip((scale, shift), planned):
        args.append(_param_args(x, t if t is not None else value, next(strides) if t is not None else None))
    return x, layout, args, kept


def _live(x: torch.Tensor, value: Scalar) -> tuple[Any, Any]:
    """(pointer, scalar) of a parameter for one call of a kept plan."""
    return (value, 0.0) if isinstance(value, torch.Tensor) else _number_args(x, value)


class _Site:
    """What the calls of one geometry share: the launch plan and, for the backward, its program
    count (the length of the partial sums)."""

    __slots__ = ("plan", "n_programs")

    def __init__(self, plan: LaunchPlan, n_programs: int = 0) -> None:
        self.plan, self.n_programs = plan, n_programs


#: kept plans by call geometry (a model calls the same shapes over and over: planning a launch costs
#: more host time than the launch)
_SITES = Plans()


def affine_act(
    x: torch.Tensor,
    scale: Scalar,
    shift: Scalar,
    act: str,
    *,
    block_elems: int,
    num_warps: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(x * scale + shift)`` into a new tensor of x's layout (or into ``out``, which may be x
    itself: the GEMM epilogue runs in place). ``block_elems`` elements per program."""
    key = (0, x.shape, x.stride(), x.dtype, _geometry(scale), _geometry(shift), act, block_elems, num_warps)
    site = _SITES.get(key)
    if site is None:
        x, layout, ((sp, sv, ss, st), (hp, hv, hs, ht)), kept = _prepare(x, scale, shift)
        block_r, block_c, n_col_blocks = _blocks(layout, block_elems)
        _, d1, d2, _ = layout.dims
        site = _Site(LaunchPlan(
            affine_act_kernel, (cdiv(layout.rows, block_r) * n_col_blocks,), (layout.rows, layout.cols, n_col_blocks, d1, d2, *ss, *hs),
            num_warps=num_warps, ACT=ACT_CODES[act], SCALE_TENSOR=st, SHIFT_TENSOR=ht, BLOCK_R=block_r, BLOCK_C=block_c,
            COMPUTE=compute_dtype(x.dtype),
        ))
        if kept:
            _SITES.put(key, site)
    else:
        sp, sv = _live(x, scale)
        hp, hv = _live(x, shift)
    if out is None:
        out = torch.empty_like(x)
    assert out.stride() == x.stride(), "out must have x's layout"
    site.plan(x, out, sp, hp, sv, hv)
    return out


def _reduce_to(full: torch.Tensor, like: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sum ``full`` (x's shape) over the dimensions ``like`` was broadcast along, in x's dtype."""
    return full.sum_to_size(_bshape(like, x)).reshape(like.shape).to(x.dtype)


def _bshape(p: torch.Tensor, x: torch.Tensor) -> tuple[int, ...]:
    """p's shape left-padded with ones to x's rank (the shape its gradient is summed to)."""
    return (1,) * (x.ndim - p.ndim) + tuple(p.shape)


def affine_act_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    scale: Scalar,
    shift: Scalar,
    act: str,
    output_mask: Sequence[bool] = (True, True, True),
    *,
    block_elems: int,
    num_warps: int,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(grad_x, grad_scale, grad_shift); the parameter gradients have the parameters' shapes (0-d
    for numbers) and x's dtype; those ``output_mask`` leaves out are neither reduced nor returned
    (grad_x is computed anyway: it is the pass itself)."""
    want_x, want_scale, want_shift = output_mask
    scale_t, shift_t = isinstance(scale, torch.Tensor), isinstance(shift, torch.Tensor)
    write_dz = (want_scale and scale_t) or (want_shift and shift_t)
    partials = (want_scale and not scale_t) or (want_shift and not shift_t)
    key = (1, x.shape, x.stride(), x.dtype, _geometry(scale), _geometry(shift), act, block_elems, num_warps, write_dz, partials)
    site = _SITES.get(key)
    if site is None:
        x, layout, ((sp, sv, ss, st), (hp, hv, hs, ht)), kept = _prepare(x, scale, shift)
        block_r, block_c, n_col_blocks = _blocks(layout, block_elems)
        n_programs = cdiv(layout.rows, block_r) * n_col_blocks
        _, d1, d2, _ = layout.dims
        site = _Site(LaunchPlan(
            affine_act_backward_kernel, (n_programs,), (layout.rows, layout.cols, n_col_blocks, d1, d2, *ss, *hs),
            num_warps=num_warps, ACT=ACT_CODES[act], SCALE_TENSOR=st, SHIFT_TENSOR=ht, WRITE_DZ=write_dz,
            PARTIALS=partials, BLOCK_R=block_r, BLOCK_C=block_c, COMPUTE=compute_dtype(x.dtype),
        ), n_programs)
        if kept:
            _SITES.put(key, site)
    else:
        sp, sv = _live(x, scale)
        hp, hv = _live(x, shift)
    if grad_out.stride() != x.stride():
        grad_out = _like_layout(grad_out, x)
    gx = torch.empty_like(x)
    acc = torch_compute_dtype(x.dtype)
    dz = torch.empty_like(x, dtype=acc) if write_dz else gx
    n_programs = site.n_programs
    part = torch.empty(2 * n_programs if partials else 1, dtype=acc, device=x.device)
    site.plan(grad_out, x, gx, dz, part, sp, hp, sv, hv)
    grad_scale = grad_shift = None
    if want_scale:
        grad_scale = _reduce_to(dz * x.to(acc), scale, x) if scale_t else part[:n_programs].sum().to(x.dtype)
    if want_shift:
        grad_shift = _reduce_to(dz, shift, x) if shift_t else part[n_programs:].sum().to(x.dtype)
    return gx if want_x else None, grad_scale, grad_shift


def _like_layout(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A copy of t laid out as x (the kernels index both with one set of offsets)."""
    out = torch.empty_like(x, dtype=t.dtype)
    out.copy_(t)
    return out
