"""Multi-tensor optimizer kernels: fused AdamW (master weights, unscale, skip on overflow) and
amp_unscale_ (unscale in place, report non-finite values).

One launch covers a whole list of tensors. The host writes a table of the tensors' addresses and
sizes to the device once per list (cached by the addresses, so steady-state steps and CUDA graph
replays upload nothing); each program takes one span of ITERS * BLOCK elements of one tensor,
finds that tensor by binary search over the prefix of span counts (a few dependent loads, paid once
per span), then streams the span in ITERS steps. Element types are compile-time constants of the launch,
so the tensors of one table share their dtypes (amp_unscale_ launches once per dtype).

Nothing is read back to the host: ``found_inf`` and ``inv_scale`` may be device tensors read by
every program, and a non-zero ``found_inf`` masks every load and store (the step is skipped).
"""

from __future__ import annotations

import math
import operator
import threading
from collections import OrderedDict
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from hal.arrays import address_columns, float32_value, grouped, table_rows

from ._launch import TL_DTYPES, cdiv, compute_dtype, launch

Scalar = Union[float, torch.Tensor]


@triton.jit
def _find(prefix_ptr, T, pid):
    """(tensor index, chunk within it) of chunk pid: the last t with prefix[t] <= pid."""
    lo = 0
    hi = T - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(prefix_ptr + mid) <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo, pid - tl.load(prefix_ptr + lo)


@triton.jit
def _addr(table_ptr, row, field: tl.constexpr, FIELDS: tl.constexpr, DT: tl.constexpr):
    return tl.load(table_ptr + row * FIELDS + field).to(tl.pointer_type(DT))


# An address read from the table tells the compiler nothing of its alignment, nor a size of its
# divisibility, so every access was a scalar one (ld.global.b16 / .b32 in the sm_90 PTX, and fused
# AdamW at 70% of the H200's copy bandwidth; swiglu's and cross_entropy's scalar accesses had cost
# them half theirs). Where the host vouches for 16-byte alignment and sizes in multiples of 16
# elements, saying so lets the masked accesses of the aligned BLOCK-wide spans be 16-byte vectors.
@triton.jit
def _aligned_addr(table_ptr, row, field: tl.constexpr, FIELDS: tl.constexpr, DT: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = _addr(table_ptr, row, field, FIELDS, DT)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _numel(table_ptr, row, field: tl.constexpr, FIELDS: tl.constexpr, ALIGNED: tl.constexpr):
    n = tl.load(table_ptr + row * FIELDS + field)
    if ALIGNED:
        n = tl.multiple_of(n, 16)
    return n


@triton.jit(do_not_specialize=["T"])
def adamw_kernel(
    table_ptr, prefix_ptr, T, found_ptr, inv_ptr, inv_val, step_ptr, lr,
    decay, step_size, bc2_sqrt, beta1, beta2, eps,
    P_DT: tl.constexpr, G_DT: tl.constexpr, S_DT: tl.constexpr, HAS_MASTER: tl.constexpr, HAS_FOUND: tl.constexpr,
    INV_TENSOR: tl.constexpr, STEP_TENSOR: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, COMPUTE: tl.constexpr,
    ALIGNED: tl.constexpr = False,
):
    """Table rows: (param, grad, exp_avg, exp_avg_sq, master, numel) addresses and size. Grads
    are of G_DT: P_DT, or float32 beside masters (float32 weights' grads, their copies the params).
    With STEP_TENSOR the step count is read from step_ptr and the bias corrections computed here
    (else the host gives step_size = lr / (1 - beta1**step) and bc2_sqrt = sqrt(1 - beta2**step)).
    ALIGNED: the host checked that every address is 16-byte aligned and every size a multiple of
    16 (:func:`aligned`), so the accesses are 16-byte vectors (:func:`_numel`, :func:`_aligned_addr`)."""
    t, span = _find(prefix_ptr, T, tl.program_id(0))
    numel = _numel(table_ptr, t, 5, 6, ALIGNED)
    p_ptr = _aligned_addr(table_ptr, t, 0, 6, P_DT, ALIGNED)
    g_ptr = _aligned_addr(table_ptr, t, 1, 6, G_DT, ALIGNED)
    m_ptr = _aligned_addr(table_ptr, t, 2, 6, S_DT, ALIGNED)
    v_ptr = _aligned_addr(table_ptr, t, 3, 6, S_DT, ALIGNED)
    w_ptr = _aligned_addr(table_ptr, t, 4, 6, tl.float32, ALIGNED)
    lanes = tl.arange(0, BLOCK)
    numel_kept = numel
    if HAS_FOUND:  # a skipped step moves nothing: no element is below a size of 0
        numel_kept = tl.where(tl.load(found_ptr) == 0.0, numel, 0)
    if INV_TENSOR:
        inv = tl.load(inv_ptr).to(COMPUTE)
    else:
        inv = inv_val
    if STEP_TENSOR:
        step = tl.load(step_ptr).to(tl.float32)
        step_size = lr / (1.0 - tl.exp2(step * tl.log2(beta1)))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    # The first moment as torch.optim.AdamW moves it, exp_avg.lerp_(grad, w) with w = 1 - beta1,
    # in at::native::lerp's two forms: m + w * (g - m) for w < 0.5, else g - (g - m) * (1 - w).
    # The same number as beta1 * m + w * g up to rounding (two more flops in registers, no more
    # memory traffic), but not at infinities: with w < 0.5 an infinite m (an earlier infinite
    # gradient's) meeting a finite or same-signed infinite g gives NaN, with w >= 0.5 an infinite
    # g meeting a finite m does; the sum gave infinities there (tests/cuda/_adamw_specials.py).
    w = 1.0 - beta1
    w_rest = 1.0 - w
    w_small = w < 0.5
    for i in range(ITERS):
        offs = (span.to(tl.int64) * ITERS + i) * BLOCK + lanes
        mask = offs < numel_kept
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE) * inv
        if HAS_MASTER:
            p = tl.load(w_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        else:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        p = p * decay
        d = g - m
        m = tl.where(w_small, m + w * d, g - d * w_rest)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(m_ptr + offs, m.to(S_DT), mask=mask)
        tl.store(v_ptr + offs, v.to(S_DT), mask=mask)
        if HAS_MASTER:
            tl.store(w_ptr + offs, p.to(tl.float32), mask=mask)
        tl.store(p_ptr + offs, p.to(P_DT), mask=mask)


@triton.jit
def _non_finite(v):
    return (v != v) | (tl.abs(v) == float("inf"))


@triton.jit(do_not_specialize=["T"])
def unscale_kernel(
    table_ptr, prefix_ptr, T, found_ptr, inv_ptr, inv_val,
    DT: tl.constexpr, INV_TENSOR: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, COMPUTE: tl.constexpr,
    ALIGNED: tl.constexpr = False,
):
    """Table rows: (address, numel). found_ptr (zeroed by the host) becomes 1.0 when any value,
    before or after scaling, is NaN or infinite. ALIGNED: as adamw_kernel's."""
    t, span = _find(prefix_ptr, T, tl.program_id(0))
    numel = _numel(table_ptr, t, 1, 2, ALIGNED)
    ptr = _aligned_addr(table_ptr, t, 0, 2, DT, ALIGNED)
    if INV_TENSOR:
        inv = tl.load(inv_ptr).to(COMPUTE)
    else:
        inv = inv_val
    lanes = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = (span.to(tl.int64) * ITERS + i) * BLOCK + lanes
        mask = offs < numel
        v = tl.load(ptr + offs, mask=mask, other=0.0)
        scaled = (v.to(COMPUTE) * inv).to(DT)
        tl.store(ptr + offs, scaled, mask=mask)
        bad += tl.where(mask & (_non_finite(v.to(COMPUTE)) | _non_finite(scaled.to(COMPUTE))), 1, 0)
    tl.store(found_ptr, 1.0, mask=tl.sum(bad, axis=0) > 0)


# --- host side ----------------------------------------------------------------------------------


class _Tables:
    """Device tables of tensor addresses, cached by (device, fields, block): an LRU of a few lists."""

    def __init__(self, size: int = 32) -> None:
        self._lru: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, columns: tuple[tuple[int, ...], ...], device: torch.device, span: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(address table, prefix of span counts, total spans) of the tensors of ``columns``
        (hal.arrays.address_columns: one column per field, element counts last); the table holds a
        row of those fields per tensor."""
        key = (str(device), span, columns)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit[:3]
        chunks = [cdiv(n, span) for n in columns[-1]]
        prefix = [0]
        for c in chunks[:-1]:
            prefix.append(prefix[-1] + c)
        host = torch.cat([table_rows(columns).reshape(-1), torch.tensor(prefix, dtype=torch.int64)])
        if device.type == "cuda":  # pinned, so the upload is asynchronous and graph-capturable
            host = host.pin_memory()
        flat = host.to(device, non_blocking=True)
        n = len(chunks) * len(columns)
        entry = (flat[:n], flat[n:], sum(chunks), host)
        with self._lock:
            self._lru[key] = entry  # the pinned host copy stays alive with the device table
            while len(self._lru) > self._size:
                self._lru.popitem(last=False)
        return entry[:3]


TABLES = _Tables()

#: what ALIGNED launches need of every tensor: its address a multiple of this many bytes, its size
#: of this many elements (the kernels' tl.multiple_of hints)
ALIGNMENT = 16


def aligned(columns: tuple[tuple[int, ...], ...]) -> bool:
    """Whether every address of ``columns`` (hal.arrays.address_columns; a list that is None has
    zeros) is 16-byte aligned and every size a multiple of 16 elements: the kernels may then access
    16-byte vectors. torch's allocations are aligned far beyond that; a view at an odd offset, or a
    tensor of an odd size (a 50257-wide bias), makes the whole launch take scalar accesses."""
    *addresses, sizes = columns
    return all(a % ALIGNMENT == 0 for column in addresses for a in column) and all(n % ALIGNMENT == 0 for n in sizes)


def _scalar_args(v: Optional[Scalar], device: torch.device, default: float) -> tuple[torch.Tensor, float, bool]:
    """(tensor, number, is_tensor) kernel arguments of an inv_scale, which the ops take as a float32
    value: a tensor is read as float32, a number rounded to float32."""
    if isinstance(v, torch.Tensor):
        return v.reshape(-1).float(), 0.0, True
    return torch.empty(0, device=device), default if v is None else float32_value(float(v)), False


def fused_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    master_params: Optional[Sequence[torch.Tensor]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    inv_scale: Optional[Scalar],
    found_inf: Optional[Scalar],
    block: int,
    iters: int,
    num_warps: int,
) -> None:
    """One AdamW step over contiguous float16/bfloat16/float32 tensors, in place (see
    hal.ops.fused_adamw_; grads of the params' dtype, or float32 beside master weights, read as
    they are in the same pass); hyper-parameters travel as float32 kernel arguments."""
    if not params:
        return
    if found_inf is not None and not isinstance(found_inf, torch.Tensor) and float(found_inf) != 0.0:
        return
    device = params[0].device
    columns = address_columns((params, grads, exp_avgs, exp_avg_sqs, master_params))
    table, prefix, n_chunks = TABLES.get(columns, device, block * iters)
    inv_t, inv_v, inv_is_t = _scalar_args(inv_scale, device, 1.0)
    found_t = found_inf.reshape(-1) if isinstance(found_inf, torch.Tensor) else inv_t
    step_on_device = isinstance(step, torch.Tensor)
    if step_on_device:  # read by the kernel (the host never sees the count: capturable, no sync)
        step_t, step_size, bc2_sqrt = step.reshape(-1), 0.0, 0.0
    else:
        step_t, step_size, bc2_sqrt = inv_t, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)
    launch(
        adamw_kernel, (n_chunks,),
        table, prefix, len(params), found_t, inv_t, inv_v, step_t, lr,
        1.0 - lr * weight_decay, step_size, bc2_sqrt, beta1, beta2, eps,
        num_warps=num_warps, P_DT=TL_DTYPES[params[0].dtype], G_DT=TL_DTYPES[grads[0].dtype], S_DT=TL_DTYPES[exp_avgs[0].dtype],
        HAS_MASTER=master_params is not None, HAS_FOUND=isinstance(found_inf, torch.Tensor), INV_TENSOR=inv_is_t,
        STEP_TENSOR=step_on_device, BLOCK=block, ITERS=iters, COMPUTE=compute_dtype(params[0].dtype), ALIGNED=aligned(columns),
    )


def amp_unscale(tensors: Sequence[torch.Tensor], inv_scale: Scalar, *, block: int, iters: int, num_warps: int, device: torch.device) -> torch.Tensor:
    """Multiply contiguous tensors by inv_scale in place; returns the 0-d float32 found-inf flag."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    inv_t, inv_v, inv_is_t = _scalar_args(inv_scale, device, 1.0)
    for dtype, group in grouped(tensors, _DTYPE).items():
        if dtype == torch.float64 and not inv_is_t:  # the float32 value, read by float64 arithmetic
            inv_t, inv_v, inv_is_t = torch.full((1,), inv_v, dtype=torch.float64, device=device), 0.0, True
        columns = address_columns((group,))
        table, prefix, n_chunks = TABLES.get(columns, device, block * iters)
        launch(
            unscale_kernel, (n_chunks,), table, prefix, len(group), found, inv_t, inv_v,
            num_warps=num_warps, DT=TL_DTYPES[dtype], INV_TENSOR=inv_is_t, BLOCK=block, ITERS=iters, COMPUTE=compute_dtype(dtype),
            ALIGNED=aligned(columns),
        )
    return found


_DTYPE = operator.attrgetter("dtype")
