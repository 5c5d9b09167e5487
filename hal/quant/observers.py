"""Calibration observers: from sample batches to a quantisation scale and zero point.

Each observer watches tensors with ``observe(x)`` (torch or NumPy, any float dtype) and answers
``qparams() -> (scale, zero_point)``: float32 and int32 torch tensors, 0-d per tensor or ``(C,)``
per channel along ``axis``. They differ in the range they choose:

- :class:`MinMaxObserver`: the smallest and largest values seen (no clipping);
- :class:`PercentileObserver`: the given percentiles of the values seen (clips rare outliers);
- :class:`EntropyObserver`: the clipping threshold minimising the KL divergence between the value
  histogram and its quantised version (TensorRT's entropy calibration).

A range becomes qparams as in ``torch.ao.quantization`` observers: the range is widened to include
0; asymmetric: ``scale = (max - min) / (qmax - qmin)``, ``zero_point = qmin - round(min / scale)``
(clamped); symmetric: ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)``, zero point the middle of
the range (0 for int8, 128 for uint8); the scale is at least float32's machine epsilon.
"""

from __future__ import annotations

import abc

import math
from typing import Any, Optional

import numpy as np
import torch

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}


def qparams_from_range(
    lo: torch.Tensor, hi: torch.Tensor, quant_min: int, quant_max: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, zero_point int32) for the float range [lo, hi] (tensors of equal shape)."""
    lo = torch.clamp(lo.to(torch.float32), max=0.0)
    hi = torch.clamp(hi.to(torch.float32), min=0.0)
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        bound = torch.maximum(-lo, hi)
        scale = torch.clamp(bound / ((quant_max - quant_min) / 2), min=eps)
        zero_point = torch.full_like(scale, (quant_min + quant_max + 1) // 2, dtype=torch.int32)
        return scale, zero_point
    scale = torch.clamp((hi - lo) / float(quant_max - quant_min), min=eps)
    zero_point = torch.clamp(quant_min - torch.round(lo / scale), quant_min, quant_max).to(torch.int32)
    return scale, zero_point


class Observer(abc.ABC):
    """Base of the observers: dtype and range, symmetry, per-tensor or per-channel layout.

    ``axis`` None: one (scale, zero_point) for the whole tensor; an int: one per channel along it
    (e.g. 0 for a Linear's output channels). ``quant_min``/``quant_max`` default to the dtype's range.
    """

    def __init__(
        self,
        dtype: str = "int8",
        symmetric: bool = False,
        axis: Optional[int] = None,
        quant_min: Optional[int] = None,
        quant_max: Optional[int] = None,
    ) -> None:
        if dtype not in QRANGE:
            raise ValueError(f"dtype must be one of {', '.join(QRANGE)}, not {dtype!r}")
        lo, hi = QRANGE[dtype]
        self.dtype = dtype
        self.quant_min = lo if quant_min is None else int(quant_min)
        self.quant_max = hi if quant_max is None else int(quant_max)
        if not lo <= self.quant_min < self.quant_max <= hi:
            raise ValueError(f"quant_min/quant_max must satisfy {lo} <= quant_min < quant_max <= {hi}")
        self.symmetric = bool(symmetric)
        self.axis = axis
        self.count = 0  # values observed (per channel)
        self.channels: Optional[int] = None  # rows seen by the first observe()

    def _rows(self, x: Any) -> torch.Tensor:
        """x as a float32 CPU tensor of shape (channels, values): one row per tensor or per channel."""
        t = torch.as_tensor(x).detach()
        if not t.is_floating_point():
            raise TypeError(f"{type(self).__name__}.observe takes a float tensor or array, got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{type(self).__name__}.observe got an empty tensor")
        t = t.to("cpu", torch.float32)
        if self.axis is None:
            return t.reshape(1, -1)
        if not -t.ndim <= self.axis < t.ndim:
            raise ValueError(f"axis {self.axis} is out of range for a tensor of {t.ndim} dimensions")
        return t.movedim(self.axis, 0).reshape(t.shape[self.axis], -1)

    def observe(self, x: Any) -> None:
        """Take a batch of values into account."""
        rows = self._rows(x)
        self._check_channels(rows.shape[0])
        self._observe_rows(rows)
        self.count += rows.shape[1]

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) for what was observed: float32 and int32, 0-d or (channels,)."""
        if not self.count:
            raise RuntimeError(f"{type(self).__name__}.qparams() was called before any observe(x)")
        lo, hi = self._range()
        scale, zero_point = qparams_from_range(lo, hi, self.quant_min, self.quant_max, self.symmetric)
        if self.axis is None:
            return scale.reshape(()), zero_point.reshape(())
        return scale, zero_point

    def _check_channels(self, channels: int) -> None:
        if self.channels is not None and self.channels != channels:
            raise ValueError(f"{type(self).__name__} saw {self.channels} channels along axis {self.axis} before, now {channels}")
        self.channels = channels

    @abc.abstractmethod
    def _observe_rows(self, rows: torch.Tensor) -> None:
        """Record a (rows, values) float32 view of a batch (one row per channel, or one row)."""

    @abc.abstractmethod
    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) per row, float32 tensors of shape (rows,)."""


class MinMaxObserver(Observer):
    """The range is the smallest and largest value observed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.min_val: Optional[torch.Tensor] = None
        self.max_val: Optional[torch.Tensor] = None

    def _observe_rows(self, rows: torch.Tensor) -> None:
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
        self.min_val = lo if self.min_val is None else torch.minimum(self.min_val, lo)
        self.max_val = hi if self.max_val is None else torch.maximum(self.max_val, hi)

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        return self.min_val, self.max_val


class PercentileObserver(Observer):
    """The range is the ``100 - percentile`` and ``percentile`` percentiles of the values observed
    (of their magnitudes when symmetric), with linear interpolation as ``numpy.percentile``.

    Values are kept in a uniform random sample of at most ``max_samples`` per channel (reservoir
    sampling, seeded by ``seed``); below that size the percentiles are exact.
    """

    def __init__(self, percentile: float = 99.99, *args: Any, max_samples: int = 1 << 20, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], not {percentile}")
        self.percentile = float(percentile)
        self.max_samples = int(max_samples)
        self._samples: Optional[torch.Tensor] = None
        self._rng = np.random.default_rng(seed)

    def _observe_rows(self, rows: torch.Tensor) -> None:
        if self.symmetric:
            rows = rows.abs()
        seen = self.count
        kept = self._samples
        room = self.max_samples - (0 if kept is None else kept.shape[1])
        head, tail = rows[:, :room], rows[:, room:]
        kept = head.clone() if kept is None else torch.cat([kept, head], dim=1)
        if tail.shape[1]:  # reservoir: the value seen as number n replaces a random slot with probability size / n
            first = seen + head.shape[1]
            slot = (self._rng.random(tail.shape[1]) * (first + 1 + np.arange(tail.shape[1]))).astype(np.int64)
            keep = slot < self.max_samples
            kept[:, torch.from_numpy(slot[keep])] = tail[:, torch.from_numpy(np.flatnonzero(keep))]
        self._samples = kept

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._samples is not None
        values = self._samples.double().numpy()
        hi = torch.from_numpy(np.percentile(values, self.percentile, axis=1)).float()
        if self.symmetric:
            return -hi, hi
        lo = torch.from_numpy(np.percentile(values, 100.0 - self.percentile, axis=1)).float()
        return lo, hi


class EntropyObserver(Observer):
    """The range is clipped at the threshold whose quantisation loses the least information: over
    candidate thresholds (histogram bin edges of |x| from ``levels`` bins on), the one minimising
    KL(P || Q) between the clipped histogram P and its quantisation Q to ``levels`` levels (TensorRT's
    entropy calibration; ``levels`` = 128 for the magnitudes of int8). The range is then
    ``[max(min, -threshold), min(max, threshold)]``.

    The histogram has ``bins`` bins over [0, amax]; when a later batch exceeds amax the range doubles
    as often as needed and bins merge in groups (exact, no re-binning error).
    """

    def __init__(self, *args: Any, bins: int = 2048, levels: int = 128, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if bins < levels or bins & (bins - 1):
            raise ValueError(f"bins must be a power of two >= levels ({levels}), not {bins}")
        self.bins, self.levels = int(bins), int(levels)
        self.hist: Optional[np.ndarray] = None  # (channels, bins) counts of |x|
        self.amax: Optional[np.ndarray] = None  # (channels,) upper edge of the histogram
        self.minmax = MinMaxObserver(self.dtype, axis=self.axis)

    def observe(self, x: Any) -> None:
        self.minmax.observe(x)
        super().observe(x)

    def _observe_rows(self, rows: torch.Tensor) -> None:
        mags = rows.abs().double().numpy()
        peak = mags.max(axis=1)
        if self.hist is None:
            self.hist = np.zeros((mags.shape[0], self.bins))
            self.amax = np.where(peak > 0, peak, np.finfo(np.float32).tiny)
        assert self.amax is not None
        for c in range(mags.shape[0]):
            if peak[c] > self.amax[c]:
                doublings = max(1, math.ceil(math.log2(peak[c] / self.amax[c])))
                while self.amax[c] * 2.0**doublings < peak[c]:  # log2's rounding must not lose the peak
                    doublings += 1
                group = 2 ** min(doublings, int(math.log2(self.bins)))
                merged = self.hist[c].reshape(-1, group).sum(axis=1)
                self.hist[c] = 0.0
                self.hist[c, : merged.size] = merged
                self.amax[c] *= 2.0**doublings
            counts, _ = np.histogram(mags[c], bins=self.bins, range=(0.0, self.amax[c]))
            self.hist[c] += counts

    def thresholds(self) -> np.ndarray:
        """The KL-optimal clipping threshold per channel (float64, shape (channels,))."""
        assert self.hist is not None and self.amax is not None
        width = self.amax / self.bins
        return np.array([(best_kl_bins(h, self.levels)) * w for h, w in zip(self.hist, width)])

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(self.thresholds()).float()
        lo, hi = self.minmax._range()
        return torch.maximum(lo, -t), torch.minimum(hi, t)


def best_kl_bins(hist: np.ndarray, levels: int) -> int:
    """The number of histogram bins i (levels <= i <= len(hist)) whose clipping minimises
    KL(P || Q): P is hist[:i] with the counts beyond added to its last bin, Q is hist[:i] merged into
    ``levels`` groups (the last one taking the remainder), each group's count spread evenly over its
    non-empty bins; both normalised. Q is zero only where hist[:i] is, so KL is infinite only when
    the clipped counts land in an empty last bin (that candidate loses). Ties go to the smaller i."""
    n = len(hist)
    if not hist.any():
        return n
    beyond = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # beyond[i] = sum(hist[i:])
    best, best_kl = n, math.inf
    for i in range(levels, n + 1):
        p = hist[:i].copy()
        p[-1] += beyond[i]
        per = i // levels
        starts = np.arange(levels) * per
        nonzero = hist[:i] != 0
        sums = np.add.reduceat(hist[:i], starts)
        filled = np.add.reduceat(nonzero.astype(np.float64), starts)
        group = np.minimum(np.arange(i) // per, levels - 1)
        q = np.where(nonzero, sums[group] / np.maximum(filled[group], 1.0), 0.0)
        kl = _kl(p / p.sum(), q / q.sum())
        if kl < best_kl:
            best, best_kl = i, kl
    return best


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) of normalised histograms (infinite where q is 0 and p is not)."""
    support = p > 0
    if np.any(q[support] == 0):
        return math.inf
    return float(np.sum(p[support] * np.log(p[support] / q[support])))
