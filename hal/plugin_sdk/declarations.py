"""The op declarations, as a backend's registration reads them: which ops exist (:data:`OPS`, by
name) and one op's declaration (:func:`get_op`: its parameters, dtypes, whether it trains ...).

A backend that registers a kernel for every op some implementation covers (the cuda backend's
``eager`` twins, the rocm backend's ``torch`` fallbacks) walks :data:`OPS` after its other modules
registered. The registry itself (:mod:`hal.registry`) is the core's; this module is the read-only
view of it that belongs to the plugin SDK.
"""

from __future__ import annotations

from hal.registry import OPS, OpDecl, get_op

__all__ = ["OPS", "OpDecl", "get_op"]
