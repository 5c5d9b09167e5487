"""Drawing the inputs of one conformance case: fresh random values, rounded to the case dtype,
placed on the device under test in the requested memory layout.

Values are drawn in float64 with NumPy (so a seed gives the same data on every machine) and then
converted with torch, which rounds to nearest-even into the case dtype (bfloat16 included). The
reference later receives exactly these rounded values, upcast to float64.

Layouts exercise kernels that assume too much about their inputs:

- ``"contiguous"``: a plain row-major tensor;
- ``"noncontig"``: a view taking every other element of the last dimension larger than one, whose
  skipped elements hold NaN (or the dtype's largest integer), so that a kernel reading memory as if
  the view were dense produces garbage that cannot pass;
- ``"channels_last"``: ``torch.channels_last`` (4-D arrays);
- ``"transposed"``: the last two dimensions stored swapped (a ``W.T`` view, as linear weights are).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from hal.arrays import FLOAT_DTYPES, numpy_dtype, torch_dtype

#: a large magnitude per dtype: its square overflows float16 but not float32, so a half-precision
#: kernel that accumulates squares or products in its own dtype fails, while float32 kernels are not
#: asked to survive overflowing float32.
BIG = {"float16": 1024.0, "bfloat16": 1e15, "float32": 1e15, "float64": 1e100}

LAYOUTS = ("contiguous", "noncontig", "channels_last", "transposed")


def place(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (a contiguous tensor) re-laid out in memory as ``layout``, same values and device."""
    if layout == "contiguous":
        return values
    if layout == "channels_last":
        if values.ndim != 4:
            raise ValueError(f"channels_last needs a 4-D tensor, got shape {tuple(values.shape)}")
        return values.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        if values.ndim < 2:
            raise ValueError(f"transposed needs at least 2 dimensions, got shape {tuple(values.shape)}")
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "noncontig":
        dims = [i for i, s in enumerate(values.shape) if s > 1]
        if not dims:
            raise ValueError(f"noncontig needs a dimension larger than one, got shape {tuple(values.shape)}")
        d = dims[-1]
        shape = list(values.shape)
        shape[d] *= 2
        if values.is_floating_point():
            base = torch.full(shape, float("nan"), dtype=values.dtype, device=values.device)
        else:
            fill = True if values.dtype == torch.bool else torch.iinfo(values.dtype).max
            base = torch.full(shape, fill, dtype=values.dtype, device=values.device)
        view = base[(slice(None),) * d + (slice(None, None, 2),)]
        view.copy_(values)
        return view
    raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")


class Draw:
    """Random inputs of one case, for one dtype on one device.

    Floating draws default to the case dtype; ``dtype=`` picks another (float32 statistics beside
    half-precision activations, int8 for quantised data). ``big`` and ``tiny`` are magnitudes for
    value edge cases: ``big`` (see :data:`BIG`), and ``tiny``, the smallest normal number of the
    dtype, below which values are subnormal.
    """

    def __init__(self, rng: np.random.Generator, dtype: str, device: torch.device) -> None:
        self.rng = rng
        self.dtype = dtype
        self.device = device
        self.float_dtype = dtype if dtype in FLOAT_DTYPES else "float32"
        self.big = BIG[self.float_dtype]
        self.tiny = float(torch.finfo(torch_dtype(self.float_dtype)).tiny)

    def magnitude(self, which: str) -> float:
        """Scale of drawn data: "unit" (1), "big" (squares overflow fp16) or "tiny" (fp16 subnormals)."""
        return {"unit": 1.0, "big": self.big, "tiny": self.tiny}[which]

    def tensor(self, values: np.ndarray, dtype: Optional[str] = None, layout: str = "contiguous") -> torch.Tensor:
        """Given values as a tensor of ``dtype`` (default: the case's floating dtype) on the device."""
        name = dtype or self.float_dtype
        if name == "bfloat16":  # NumPy cannot hold bfloat16: round through torch from float64
            t = torch.from_numpy(np.array(values, dtype=np.float64)).to(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(values, dtype=numpy_dtype(name)))
        return place(t.to(self.device), layout)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0, dtype: Optional[str] = None, layout: str = "contiguous") -> torch.Tensor:
        return self.tensor(mean + std * self.rng.standard_normal(shape), dtype, layout)

    def uniform(self, *shape: int, low: float = -1.0, high: float = 1.0, dtype: Optional[str] = None, layout: str = "contiguous") -> torch.Tensor:
        return self.tensor(self.rng.uniform(low, high, shape), dtype, layout)

    def integers(self, *shape: int, low: int, high: int, dtype: str = "int64", layout: str = "contiguous") -> torch.Tensor:
        """Integers in [low, high] (both included)."""
        return self.tensor(self.rng.integers(low, high, shape, endpoint=True), dtype, layout)

    def mask(self, *shape: int, p: float = 0.7) -> torch.Tensor:
        """A boolean tensor, True with probability p."""
        return torch.from_numpy(self.rng.random(shape) < p).to(self.device)

    def scalar(self, low: float, high: float) -> float:
        """A Python number drawn uniformly in [low, high)."""
        return float(self.rng.uniform(low, high))
