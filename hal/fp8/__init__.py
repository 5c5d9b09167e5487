"""hal.fp8: FP8 training recipes on top of the FP8 ops (``hal.ops.fp8_quantize``, ``fp8_scaled_mm``).

- Recipes (:mod:`hal.fp8.recipes`): :class:`CurrentScaling`, :class:`DelayedScaling`,
  :func:`RowwiseScaling`, :func:`BlockwiseScaling`.
- :class:`Linear`, an ``nn.Linear`` whose GEMMs run in FP8 (e4m3 forward, e5m2 gradients), and
  :func:`convert`, which swaps a model's linear layers for it (first and last kept by default).
"""

from hal.fp8.linear import Linear, convert
from hal.fp8.recipes import BlockwiseScaling, CurrentScaling, DelayedScaling, Recipe, RowwiseScaling

__all__ = ["Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "BlockwiseScaling", "Linear", "convert"]
