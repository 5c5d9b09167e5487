"""Cross-entropy over class logits, and the LM head fused with it, forward and backward.

Rows of logits are walked in BLOCK_C chunks with an online log-sum-exp (one read), so vocabularies
of any size fit; each program owns one row. The forward writes each row's float32 loss (0 at ignored
rows, NaN for a target outside [0, C)); mean and sum are reduced on the device. The backward reads a
row twice (its log-sum-exp, then the gradient) and writes the gradient in the logits' dtype, scaled
by grad_out (per row, or one value; the mean's count of rows is read on the device, never on the
host). The count and the reductions never synchronise with the host.

linear_cross_entropy runs blocks of rows: the block's logits come from the vendor's GEMM in float32
(``gemm_f32``), the row kernels above turn them into losses or logit gradients, and the backward
multiplies those gradients back through the weight (grad_x, and grad_weight accumulated in float32).
At most ``block_elements`` logits exist at a time. A training forward (a mean or a sum under hal's
autograd node) computes the gradients from the logits it has at hand, with each row's loss from the
same log-sum-exp pass (one kernel), and keeps them for the backward, which then only scales them by
grad_out: the logits' GEMM runs once a step instead of twice.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from hal.integration.kept import KeptForBackward, backward_follows
from hal.plugin_sdk.linear import kept_gradients_state

from ._launch import compute_dtype, launch

#: how grad_out scales a row's gradient: per row (reduction none), one value (sum), one value over
#: the count of counted rows (mean)
GRAD_PER_ROW, GRAD_SUM, GRAD_MEAN = 0, 1, 2
MODES = {"none": GRAD_PER_ROW, "sum": GRAD_SUM, "mean": GRAD_MEAN}


@triton.jit
def _row_lse(z_ptr, C, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr):
    """log-sum-exp and plain sum of one row of C logits, in one pass (online maximum)."""
    m = tl.full([BLOCK_C], -float("inf"), COMPUTE)
    s = tl.zeros([BLOCK_C], COMPUTE)
    total = tl.zeros([BLOCK_C], COMPUTE)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        valid = cols < C
        z = tl.load(z_ptr + cols, mask=valid, other=-float("inf")).to(COMPUTE)
        m_new = tl.maximum(m, z)
        alpha = tl.where(m_new > -float("inf"), tl.exp(m - m_new), 0.0)
        s = s * alpha + tl.where(valid, tl.exp(z - m_new), 0.0)
        m = m_new
        total += tl.where(valid, z, 0.0)
    row_max = tl.max(m, axis=0)
    safe = tl.where(row_max > -float("inf"), row_max, 0.0)
    row_sum = tl.sum(s * tl.where(m > -float("inf"), tl.exp(m - safe), 0.0), axis=0)
    log_sum = tl.log(row_sum)
    if COMPUTE == tl.float64:
        # NVIDIA's tl.log of a double is float32-accurate (about 1e-8 relative, measured on an
        # H200) while tl.exp is not: one Newton step, y + s * exp(-y) - 1, restores full precision.
        log_sum = log_sum + row_sum * tl.exp(-log_sum) - 1.0
    return safe + log_sum, tl.sum(total, axis=0)


# C and the row strides stay specialised: 16 dividing them makes every row start 16-byte aligned
# and the column masks constant over vectors, so rows load in 16-byte accesses
@triton.jit
def _store_row_loss(loss_ptr, row, z_row, t, lse, total, C, ignore_index, eps: tl.float64, COMPUTE: tl.constexpr):
    """One row's loss from its log-sum-exp and plain sum: 0 where the target is ignored, NaN for a
    target outside [0, C). Reads the target's logit: call it before anything overwrites the row."""
    in_range = (t >= 0) & (t < C)
    z_t = tl.load(z_row + tl.where(in_range, t, 0)).to(COMPUTE)
    keep, spread = tl.cast(1.0 - eps, COMPUTE), tl.cast(eps / C, COMPUTE)
    loss = lse - keep * z_t - spread * total
    loss = tl.where(in_range, loss, float("nan"))
    loss = tl.where(t == ignore_index, 0.0, loss)
    tl.store(loss_ptr + row, loss)


@triton.jit(do_not_specialize=["N"])
def ce_forward_kernel(z_ptr, t_ptr, loss_ptr, N, C, stride, ignore_index, eps: tl.float64,
                      BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride
    t = tl.load(t_ptr + row).to(tl.int64)
    lse, total = _row_lse(z_row, C, BLOCK_C, COMPUTE)
    _store_row_loss(loss_ptr, row, z_row, t, lse, total, C, ignore_index, eps, COMPUTE)


@triton.jit(do_not_specialize=["N"])
def ce_backward_kernel(z_ptr, t_ptr, go_ptr, count_ptr, dz_ptr, loss_ptr, N, C, z_stride, g_stride, ignore_index, eps: tl.float64,
                       MODE: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr, IN_PLACE: tl.constexpr = False,
                       WITH_LOSS: tl.constexpr = False):
    """IN_PLACE: dz_ptr is the row's own storage (dz's elements no wider than z's, the same row
    stride in bytes): the row is read whole for its log-sum-exp before anything is written, and each
    chunk's store lands on bytes of this chunk or earlier ones; a barrier between a chunk's loads and
    its stores keeps one warp's store from overtaking another warp's load of the same chunk.
    WITH_LOSS: each row's loss too, as ce_forward_kernel writes it, from the same log-sum-exp pass
    (a training forward's losses and gradients read the logits twice instead of three times)."""
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * z_stride
    dz_row = dz_ptr + row.to(tl.int64) * g_stride
    t = tl.load(t_ptr + row).to(tl.int64)
    if MODE == 0:
        scale = tl.load(go_ptr + row).to(COMPUTE)
    else:
        scale = tl.load(go_ptr).to(COMPUTE)
    if MODE == 2:
        scale = scale / tl.load(count_ptr).to(COMPUTE)
    counted = t != ignore_index
    scale = tl.where(counted, scale, 0.0)
    scale = tl.where(counted & ((t < 0) | (t >= C)), float("nan"), scale)
    lse, total = _row_lse(z_row, C, BLOCK_C, COMPUTE)
    if WITH_LOSS:  # before the stores below overwrite the target's logit (IN_PLACE)
        _store_row_loss(loss_ptr, row, z_row, t, lse, total, C, ignore_index, eps, COMPUTE)
    keep, spread = tl.cast(1.0 - eps, COMPUTE), tl.cast(eps / C, COMPUTE)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        valid = cols < C
        z = tl.load(z_row + cols, mask=valid, other=0.0).to(COMPUTE)
        d = tl.exp(z - lse) - spread - tl.where(cols == t, keep, 0.0)
        if IN_PLACE:
            tl.debug_barrier()
        tl.store(dz_row + cols, (d * scale).to(dz_ptr.dtype.element_ty), mask=valid)


def _block_c(c: int, cap: int) -> int:
    b = 16
    while b < c and b < cap:
        b *= 2
    return b


def row_losses(z: torch.Tensor, target: torch.Tensor, ignore_index: int, eps: float, *, block_c: int, num_warps: int) -> torch.Tensor:
    """Each row's loss (float32; float64 for float64 logits), rows with unit column stride."""
    n, c = z.shape
    out = torch.empty(n, dtype=torch.float64 if z.dtype == torch.float64 else torch.float32, device=z.device)
    if n:
        launch(ce_forward_kernel, (n,), z, target, out, n, c, z.stride(0), ignore_index, float(eps),
               num_warps=num_warps, BLOCK_C=_block_c(c, block_c), COMPUTE=compute_dtype(z.dtype))
    return out


def counted_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The count of rows whose target is not ignored, as a 0-d float tensor on the device."""
    return (target != ignore_index).sum(dtype=torch.float32)


def reduce_losses(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                  count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows' losses reduced; a mean divides by ``count`` (counted_rows), counted here if not given."""
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (count if count is not None else counted_rows(target, ignore_index)).to(total.dtype)


def logit_grads(z: torch.Tensor, target: torch.Tensor, grad_out: torch.Tensor, count: Optional[torch.Tensor], ignore_index: int, eps: float,
                reduction: str, out: torch.Tensor, losses: Optional[torch.Tensor] = None, *, block_c: int, num_warps: int) -> torch.Tensor:
    """The gradient of the rows' losses with respect to the logits z, written into ``out``
    (``out`` may be :func:`over_logits` of z: the gradient then replaces the logits in their memory);
    given ``losses`` (a contiguous vector of the rows' count), the rows' losses as :func:`row_losses`
    writes them, from the same pass over the logits."""
    n, c = z.shape
    in_place = out.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()
    if in_place and not (z.is_contiguous() and out.stride() == (z.stride(0) * z.element_size() // out.element_size(), 1)):
        raise ValueError("logit_grads: a gradient written over its logits must be over_logits(z) of contiguous logits")
    if n:
        launch(ce_backward_kernel, (n,), z, target, grad_out.reshape(-1), count if count is not None else grad_out.reshape(-1), out,
               losses if losses is not None else out, n, c, z.stride(0), out.stride(0), ignore_index, float(eps),
               num_warps=num_warps, MODE=MODES[reduction], BLOCK_C=_block_c(c, block_c), COMPUTE=compute_dtype(z.dtype), IN_PLACE=in_place,
               WITH_LOSS=losses is not None)
    return out


def over_logits(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (rows, classes) view in ``dtype`` (no wider than z's) over contiguous logits z's memory, each
    row at the start of its own row's bytes: where :func:`logit_grads` writes the gradient in place,
    so a block of linear_cross_entropy holds its logits or their gradient, never both (0.5 GiB less
    at Llama-3's vocabulary with 2^28 logits a block)."""
    ratio = z.element_size() // torch.empty((), dtype=dtype).element_size()
    return z.view(dtype)[:, : z.shape[1]] if ratio > 1 else z.view(dtype)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, eps: float, reduction: str, **cfg: int) -> torch.Tensor:
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    return reduce_losses(row_losses(z, target, ignore_index, eps, **cfg), target, ignore_index, reduction)


def cross_entropy_backward(grad_out: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, eps: float,
                           reduction: str, **cfg: int) -> torch.Tensor:
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    count = counted_rows(target, ignore_index) if reduction == "mean" else None
    return logit_grads(z, target, grad_out, count, ignore_index, eps, reduction, torch.empty_like(z), **cfg)


# --- linear_cross_entropy -----------------------------------------------------------------------

Gemm = Callable[..., torch.Tensor]  # gemm_f32(a, b, acc=None): VendorLibs.gemm_f32


def _rows_per_block(n: int, v: int, block_elements: int) -> int:
    return max(1, min(n, block_elements // max(1, v)))


def _block_logits(gemm_f32: Gemm, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A block's logits x @ weight^T (+ bias) in float32 (float64 for float64): the loss is a float32
    result and keeps float32's accuracy for half-precision inputs, where an eager LM head rounds its
    logits to bfloat16 before the loss upcasts them."""
    z = gemm_f32(x, weight.t())
    return z.add_(bias) if bias is not None else z


#: the gradients a training forward computes beside its loss, for the backward of the same call
_KEPT = KeptForBackward()


class _Grads:
    """Gradient buffers of linear_cross_entropy, filled block by block: grad_x in x's dtype,
    grad_weight and grad_bias accumulated in float32 (float64 for float64)."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.weight: Optional[torch.Tensor] = None  # the first block's product, then the blocks' sum
        self._weight_zeros = lambda: torch.zeros(weight.shape, dtype=acc, device=x.device)  # no rows, no block
        self.bias = torch.zeros(int(weight.shape[0]), dtype=acc, device=x.device)

    def add_block(self, i: int, z: torch.Tensor, xb: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                  grad_out: torch.Tensor, count: Optional[torch.Tensor], ignore_index: int, eps: float, reduction: str, gemm_f32: Gemm,
                  losses: Optional[torch.Tensor] = None, **cfg: int) -> None:
        """The block of rows from ``i`` (logits ``z``): its logit gradients in x's dtype, written over
        the logits (:func:`over_logits`), and its rows' losses into ``losses`` where given (the same
        kernel); then grad_x = dz @ W, grad_W += dz^T x, grad_b += sum(dz)."""
        rows = int(xb.shape[0])
        g = grad_out[i : i + rows] if reduction == "none" else grad_out
        d = logit_grads(z, target[i : i + rows], g, count, ignore_index, eps, reduction, over_logits(z, xb.dtype), losses, **cfg)
        torch.mm(d, weight, out=self.x[i : i + rows])
        if self.weight is None:
            self.weight = gemm_f32(d.t(), xb)
        else:  # added in place: no grad_weight-sized temporary per block
            gemm_f32(d.t(), xb, acc=self.weight)
        self.bias += d.sum(0, dtype=self.bias.dtype)

    def result(self, x: torch.Tensor, grad_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients in x's dtype, scaled by ``grad_out`` (one value) when they were computed
        for a grad_out of one."""
        gx, gw, gb = self.x, self.weight if self.weight is not None else self._weight_zeros(), self.bias
        if grad_out is not None:
            g = grad_out.reshape(())
            gx, gw, gb = gx.mul_(g), gw.mul_(g), gb.mul_(g)
        return gx, gw.to(x.dtype), gb.to(x.dtype)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor], ignore_index: int,
                         eps: float, reduction: str, gemm_f32: Gemm, block_elements: int, **cfg: int) -> torch.Tensor:
    """The loss; in a training forward (hal's autograd node, a mean or sum) also the gradients for
    a grad_out of one, from the same logits, kept for the backward op (:mod:`hal.integration.kept`): three
    GEMMs for the step instead of four (the backward need not compute the logits again)."""
    n, v = int(x.shape[0]), int(weight.shape[0])
    step = _rows_per_block(n, v, block_elements)
    rows = torch.empty(n, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    count = counted_rows(target, ignore_index) if reduction == "mean" else None
    grads = _Grads(x, weight) if reduction != "none" and backward_follows(x, weight, bias) else None
    if grads is not None:
        one = torch.ones((), dtype=rows.dtype, device=x.device)
    for i in range(0, n, step):
        xb = x[i : i + step]
        z = _block_logits(gemm_f32, xb, weight, bias)
        if grads is not None:  # the losses from the gradients' kernel: one pass fewer over the logits
            grads.add_block(i, z, xb, weight, target, one, count, ignore_index, eps, reduction, gemm_f32, rows[i : i + step], **cfg)
        else:
            rows[i : i + step] = row_losses(z, target[i : i + step], ignore_index, eps, **cfg)
        del z  # before the next block's GEMM: one block of logits alive, not two
    if grads is not None:
        _KEPT.keep(x, kept_gradients_state(weight, target, bias, ignore_index, eps, reduction), grads)
    return reduce_losses(rows, target, ignore_index, reduction, count)


def linear_cross_entropy_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                                  ignore_index: int, eps: float, reduction: str, gemm_f32: Gemm, block_elements: int,
                                  **cfg: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's kept gradients scaled by grad_out, where it kept them; otherwise, per block of
    rows, the logits again, their gradient (in x's dtype, over the logits), grad_x = dz @ W, and grad_W += dz^T x,
    grad_b += sum(dz) in float32."""
    kept = _KEPT.take(x, kept_gradients_state(weight, target, bias, ignore_index, eps, reduction)) if reduction != "none" else None
    if kept is not None:
        return kept.result(x, grad_out)
    n, v = int(x.shape[0]), int(weight.shape[0])
    step = _rows_per_block(n, v, block_elements)
    count = counted_rows(target, ignore_index) if reduction == "mean" else None
    grads = _Grads(x, weight)
    for i in range(0, n, step):
        xb = x[i : i + step]
        z = _block_logits(gemm_f32, xb, weight, bias)
        grads.add_block(i, z, xb, weight, target, grad_out, count, ignore_index, eps, reduction, gemm_f32, **cfg)
        del z  # before the next block's GEMM
    return grads.result(x)
