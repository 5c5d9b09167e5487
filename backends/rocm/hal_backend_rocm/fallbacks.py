"""torch's own kernels for whatever the tuned kernels reject: every op with an implementation in
:mod:`hal_torch` and no kernel here that takes all its inputs on every AMD GPU gets a ``torch``
kernel of the lowest priority. So every op runs on any architecture torch's ROCm build supports
(gfx1100 included, where no Triton table exists), and on gfx90a/gfx942 for the inputs the Triton
kernels turn down (non-contiguous optimizer lists, float64 AdamW); ``hal.explain`` names the
reasons of the kernels that were passed over. Imported last: it reads what the other modules
registered."""

from __future__ import annotations

from hal.plugin import KernelSpec
from hal.plugin_sdk.declarations import OPS, get_op
from hal.plugin_sdk.fp8_hardware import FP8_CHECKS
from hal_torch.table import has_eager

from . import plugin
from ._common import eager_kernel
from ._device import ANY_GFX

PRIORITY = 1


def takes_everything(k: KernelSpec) -> bool:
    """Whether a kernel runs every input of its op on every AMD GPU (no dtype, architecture or
    other limit beyond the op's own)."""
    return k.check is None and k.archs in (None, ANY_GFX) and (k.dtypes is None or k.dtypes >= set(get_op(k.op).dtypes))


def missing() -> list[str]:
    """The ops that need a torch fallback."""
    covered = {k.op for k in plugin.kernels if k.backend == plugin.name and takes_everything(k)}
    return [name for name in OPS if has_eager(name) and name not in covered]


for _op in missing():
    # the FP8 emulation keeps the eager backend's refusal on GPUs without FP8
    eager_kernel(_op, name="torch", priority=PRIORITY, checks=[FP8_CHECKS[_op]] if _op in FP8_CHECKS else ())
