"""hal.quant: calibration observers, quantisation-aware training and int8 conversion.

- Observers (:class:`MinMaxObserver`, :class:`PercentileObserver`, :class:`EntropyObserver`):
  ``observe(x)`` on sample batches, then ``qparams() -> (scale, zero_point)`` per tensor or per
  channel.
- QAT: :class:`FakeQuantize`, :class:`QATLinear`, :func:`prepare_qat` (``hal.ops.fake_quantize``,
  straight-through gradient).
- Conversion: :class:`Int8Linear` and :func:`convert` (``hal.ops.quantize`` + ``hal.ops.int8_linear``
  with calibrated scales).
"""

from hal.quant.int8 import Int8Linear, convert
from hal.quant.observers import EntropyObserver, MinMaxObserver, Observer, PercentileObserver, qparams_from_range
from hal.quant.qat import FakeQuantize, QATLinear, prepare_qat

__all__ = [
    "Observer",
    "MinMaxObserver",
    "PercentileObserver",
    "EntropyObserver",
    "qparams_from_range",
    "FakeQuantize",
    "QATLinear",
    "prepare_qat",
    "Int8Linear",
    "convert",
]
