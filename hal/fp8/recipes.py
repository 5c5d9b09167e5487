"""FP8 scaling recipes: how each tensor of an FP8 layer gets its dequantising scale.

A recipe is a frozen description (format, granularity); :meth:`Recipe.scaler` makes the per-tensor
state that quantises one tensor role (input, weight, gradient) of one layer. Quantisation is
``hal.ops.fp8_quantize`` and its variants; the recipes add no kernels.

- :class:`CurrentScaling`: the scale of each group (tensor, row or block) from this call's amax,
  reduced inside ``fp8_quantize`` (``amax / largest finite``). :class:`RowwiseScaling` and
  :class:`BlockwiseScaling` are current scaling per row and per ``block_size`` square block. Per
  tensor, the amax may come from the op that produced x (``hal.ops.rms_norm_amax`` /
  ``swiglu_amax``, reducing it as they write x: :meth:`Scaler.quantize`'s ``amax``), and the cast
  is ``hal.ops.fp8_quantize_from_amax``: one pass over x instead of two.
- :class:`DelayedScaling` (Transformer Engine's recipe): one scale per tensor from a history of the
  amaxes of earlier calls, so the cast needs no reduction before it. Each call quantises with the
  scale it holds (``hal.ops.fp8_quantize_amax`` / ``fp8_quantize_transpose_amax``, which reduce the
  tensor's amax in the cast's own pass over it: x is read once, as in Transformer Engine's cast),
  then records that amax in the history and recomputes the scale
  ``amax_h * 2**margin / largest finite`` (``amax_h``: the history's max, or its most recent entry).
  Where ``amax_h`` is 0 (nothing seen yet, or all-zero tensors) or not finite (a NaN or an infinity
  in the tensor: the max propagates NaN, as ``torch.amax``) the previous scale is kept, as Transformer
  Engine does: a 0, NaN or infinite scale would quantise nothing. A NaN stays in the history, so the
  scale is frozen until it has left the window (``history`` calls later) under ``"max"``.

The state lives in tensors updated in place on the tensor's device (no host synchronisation), as
non-persistent buffers: they do not change a model's ``state_dict`` keys.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional

import torch
from torch import nn

from hal.ops import (fp8_quantize, fp8_quantize_amax, fp8_quantize_from_amax, fp8_quantize_transpose, fp8_quantize_transpose_amax,
                     fp8_quantize_transpose_from_amax)
from hal.ops.fp8 import FORMATS, GRANULARITIES

AMAX_COMPUTE = ("max", "most_recent")


def grad_format_for(fmt: str) -> str:
    """The gradient format paired with a forward format: e5m2, or e5m2fnuz for AMD's fnuz formats."""
    return "e5m2fnuz" if fmt.endswith("fnuz") else "e5m2"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"hal.fp8: unknown FP8 format {fmt!r}; use one of {', '.join(FORMATS)}")


class Scaler(nn.Module, abc.ABC):
    """Quantises one tensor role of one layer: ``quantize(x) -> (q, scale)`` (uint8 bit patterns
    and float32 dequantising scales, as ``hal.ops.fp8_quantize`` returns them). Abstract: a
    scaler without both methods fails when it is made, not at its first call.

    ``amax``: ``max |float32(x)|`` where the caller knows it already (a 0-d float32 tensor, reduced by
    the op that produced x: ``hal.ops.rms_norm_amax``, ``swiglu_amax``). A scaler whose recipe reads
    that amax (:attr:`uses_amax`: per-tensor current scaling) skips its own pass over x for it;
    the others ignore it (their scales need other amaxes, or none)."""

    #: whether :meth:`quantize` uses a given ``amax`` (else it is ignored)
    uses_amax: bool = False

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.format = fmt

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scale)`` of x under this scaler's recipe."""

    @abc.abstractmethod
    def quantize_with_transpose(self, x: torch.Tensor,
                                amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``quantize(x)`` and the same quantisation of ``x.mT``, in one pass over x
        (``hal.ops.fp8_quantize_transpose``): ``(q, scale, q_t, scale_t)``."""


class CurrentScaler(Scaler):
    """Current scaling: the op reduces the amax of each group and quantises in one call. Per tensor,
    an ``amax`` given by the caller (the producer of x reduced it) replaces that reduction:
    ``hal.ops.fp8_quantize_from_amax`` computes the scale from it by the same formula (``amax /
    largest finite``, 1 where it is 0) in the cast kernel, so codes and scale are bit for bit those
    of the reduction's when the amax is x's. Row and block scales need per-group amaxes: a given
    (per-tensor) amax is ignored there."""

    def __init__(self, fmt: str, granularity: str, block_size: int) -> None:
        super().__init__(fmt)
        self.granularity = granularity
        self.block_size = block_size
        self.uses_amax = granularity == "tensor"

    def quantize(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if amax is not None and self.uses_amax:
            return fp8_quantize_from_amax(x, amax, self.format)
        return fp8_quantize(x, self.format, self.granularity, None, self.block_size)

    def quantize_with_transpose(self, x: torch.Tensor,
                                amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if amax is not None and self.uses_amax:  # one scale for both layouts
            q, scale, q_t = fp8_quantize_transpose_from_amax(x, amax, self.format)
            return q, scale, q_t, scale
        # the transpose's own current scales: per column of x for rows, the blocks transposed
        return fp8_quantize_transpose(x, self.format, self.granularity, None, self.block_size)


class DelayedScaler(Scaler):
    """Delayed scaling of one tensor: buffers ``amax_history`` (most recent first) and ``scale``."""

    def __init__(self, fmt: str, history: int, margin: float, amax_compute: str,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(fmt)
        self.margin = margin
        self.amax_compute = amax_compute
        self.register_buffer("amax_history", torch.zeros(history, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``model.to(torch.bfloat16)`` / ``.half()`` move the state but keep it float32 (the ops take
        float32 scales; a bfloat16 history would also round the amaxes)."""
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def quantize(self, x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        # A given amax is ignored: the cast reduces this call's amax itself, in its own pass.
        # One call casts with the held scale and reduces x's amax in the same pass (0 for an empty x).
        # The scale of this call is the op's returned copy of the buffer, not a clone taken here:
        # under torch.compile a clone of a buffer mutated right after may be read after the
        # mutation (the backward then saw the next call's scale); the op's result cannot alias it.
        q, scale, amax = fp8_quantize_amax(x, self.scale, self.format)
        if scale is self.scale:  # a kernel that handed the given scale back: keep this call's value
            scale = scale.clone()
        self.update(amax)
        return q, scale

    def quantize_with_transpose(self, x: torch.Tensor,
                                amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # one scale serves both layouts (per tensor): scale_t is this call's scale (amax ignored, as in quantize)
        q, scale, q_t, amax = fp8_quantize_transpose_amax(x, self.scale, self.format)
        if scale is self.scale:  # keep this call's value (see quantize)
            scale = scale.clone()
        self.update(amax)
        return q, scale, q_t, scale

    @torch.no_grad()
    def update(self, amax: torch.Tensor) -> None:
        """Record ``amax`` as the most recent history entry and recompute the scale from the history."""
        h = self.amax_history
        h.copy_(torch.roll(h, 1, 0))
        h[0] = amax.to(h.device, torch.float32)
        a = h.max() if self.amax_compute == "max" else h[0]
        new = a * (2.0 ** self.margin) / FORMATS[self.format].max_finite
        keep = (a <= 0) | ~torch.isfinite(a)
        self.scale.copy_(torch.where(keep, self.scale, new))


class Recipe(abc.ABC):
    """Base of the recipes: ``format`` (forward: inputs and weights), ``grad_format`` (gradients).
    Abstract: each recipe says how it makes its scalers (:meth:`scaler`)."""

    format: str
    grad_format: Optional[str]

    @property
    def backward_format(self) -> str:
        return self.grad_format or grad_format_for(self.format)

    @abc.abstractmethod
    def scaler(self, fmt: str, device: Optional[torch.device] = None) -> Scaler:
        """A fresh per-tensor scaler quantising to ``fmt`` (its state, if any, on ``device``)."""


@dataclasses.dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Current scaling at ``granularity`` ("tensor", "row" or "block" of ``block_size``)."""

    format: str = "e4m3fn"
    granularity: str = "tensor"
    grad_format: Optional[str] = None
    block_size: int = 128

    def __post_init__(self) -> None:
        _check_format(self.format)
        if self.grad_format is not None:
            _check_format(self.grad_format)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"hal.fp8: granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if int(self.block_size) < 1:
            raise ValueError(f"hal.fp8: block_size must be a positive integer, got {self.block_size!r}")

    def scaler(self, fmt: str, device: Optional[torch.device] = None) -> Scaler:
        return CurrentScaler(fmt, self.granularity, int(self.block_size))


def RowwiseScaling(format: str = "e4m3fn", grad_format: Optional[str] = None) -> CurrentScaling:
    """Current scaling with one scale per row (per token of an input, per output row of a weight)."""
    return CurrentScaling(format, "row", grad_format)


def BlockwiseScaling(format: str = "e4m3fn", block_size: int = 128, grad_format: Optional[str] = None) -> CurrentScaling:
    """Current scaling with one scale per ``block_size`` square block (DeepSeek-V3's 128 by default)."""
    return CurrentScaling(format, "block", grad_format, block_size)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling per tensor from an amax history of ``history`` calls (see the module docs)."""

    format: str = "e4m3fn"
    history: int = 16
    margin: float = 0
    amax_compute: str = "max"
    grad_format: Optional[str] = None

    def __post_init__(self) -> None:
        _check_format(self.format)
        if self.grad_format is not None:
            _check_format(self.grad_format)
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"hal.fp8: DelayedScaling needs history, an int >= 1, got {self.history!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < float("inf"):
            # a negative margin scales below the amax: every value above max_finite * 2**margin saturates
            raise ValueError(f"hal.fp8: DelayedScaling needs margin, a finite number >= 0 (the scale's headroom as a power "
                             f"of 2), got {self.margin!r}")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(f"hal.fp8: amax_compute must be one of {AMAX_COMPUTE}, got {self.amax_compute!r}")

    def scaler(self, fmt: str, device: Optional[torch.device] = None) -> Scaler:
        return DelayedScaler(fmt, int(self.history), float(self.margin), self.amax_compute, device)


__all__ = ["Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "BlockwiseScaling", "Scaler",
           "CurrentScaler", "DelayedScaler", "grad_format_for"]
