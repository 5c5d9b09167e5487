"""Host side of the C++ layer_norm / rms_norm backward (kernels/norm.cu): rows of up to 4096
values, one pass over x and grad, then the column sums of grad_weight and grad_bias."""

from __future__ import annotations

from typing import Optional

import torch

from .kit import C_TYPES, DTYPE_CODES, DTYPE_NAMES, Kit, cdiv

THREADS = 256  # NORM_THREADS of norm.cu
MAX_ROW = 4096  # NORM_THREADS * PER: a row lives in registers
BLOCKS_PER_SM = 2


def unsupported_reason(n: int) -> Optional[str]:
    """Why the kernel cannot take rows of n values, or None."""
    if n > MAX_ROW:
        return f"rows of {n} values (the C++ kernel holds rows of up to {MAX_ROW} in registers)"
    return None


def norm_backward(kit: Kit, grad_out: torch.Tensor, x: torch.Tensor, n: int, weight: Optional[torch.Tensor], eps: float,
                  rms: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(grad_x, grad_weight, grad_bias) of a norm over the last n values of x, the parameter
    gradients flat (n,) in x's dtype (grad_bias None for rms_norm)."""
    x2 = x.reshape(-1, n).contiguous()
    g2 = grad_out.reshape(-1, n).contiguous()
    rows = int(x2.shape[0])
    dx = torch.empty_like(x2)
    gw = torch.empty(n, dtype=x.dtype, device=x.device)
    gb = None if rms else torch.empty(n, dtype=x.dtype, device=x.device)
    if rows == 0:
        gw.zero_()
        if gb is not None:
            gb.zero_()
        return dx.view(x.shape), gw, gb
    vec = 16 // x.element_size()
    if n % vec or x2.data_ptr() % 16 or g2.data_ptr() % 16:
        vec = 1
    per_block = cdiv(rows, min(rows, BLOCKS_PER_SM * kit.runtime.multiprocessors(x.device)))
    blocks = cdiv(rows, per_block)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    part = torch.empty((blocks, 2, n), dtype=acc, device=x.device)
    mod = kit.module("norm", x.device, HAL_T=C_TYPES[DTYPE_NAMES[x.dtype]], HAL_VEC=str(vec))
    wcode = DTYPE_CODES[DTYPE_NAMES[weight.dtype]] if weight is not None else 0
    mod["norm_bwd"]((blocks,), THREADS, g2, x2, dx, weight, wcode, part, rows, n, eps, per_block, int(rms), device=x.device)
    code = DTYPE_CODES[DTYPE_NAMES[x.dtype]]
    mod["norm_bwd_columns"]((cdiv(n, 32),), THREADS, part, blocks, n, gw, gb, code | (code << 4), device=x.device)
    return dx.view(x.shape), gw, gb
