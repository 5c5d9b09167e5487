"""hal.parallel: distributed operators on torch.distributed device meshes, proven against one device.

Tensor and sequence parallelism, vocabulary parallelism, expert parallelism and pipeline stages,
built on ``DeviceMesh`` / ``DTensor`` and ``torch.distributed.pipelining``. hal adds its fused
kernels inside each rank's share of the work, and every collective these layers issue goes through
:mod:`hal.dist` (algorithm choice, ``hal.explain``, :class:`hal.dist.CommError` on a dead or
stalled peer).
"""

from __future__ import annotations

__all__: list[str] = []
