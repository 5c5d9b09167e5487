"""The dispatcher: from an op call to its route and kernel, decided once per input signature.

The modules follow a call: :mod:`~hal.dispatch.entry` (the generated ``hal.ops.<name>`` and its
cache key) -> :mod:`~hal.dispatch.dispatcher` (the state, and the steps in order) ->
:mod:`~hal.dispatch.validate` -> :mod:`~hal.dispatch.select` (in the call's
:mod:`~hal.dispatch.context`, with :mod:`~hal.dispatch.adapt`)
-> :mod:`~hal.dispatch.route` -> :mod:`~hal.dispatch.measure` -> :mod:`~hal.dispatch.plan`;
:mod:`~hal.dispatch.explain` answers ``hal.explain`` with the same steps, and
:mod:`~hal.dispatch.held` keeps plans for callers that repeat one call.
"""

from __future__ import annotations

from hal.registry import OPS, OpDecl

from .adapt import map_outputs
from .decision import Decision
from .dispatcher import DISPATCHER, FORCEABLE, Decided, Dispatcher, Integration, install, kernel_names, list_ops, reset, reset_stats, stats
from .entry import make_entry
from .explain import EXPLAINERS, explain_call
from .held import Bound, Held, bind, layout_of
from .validate import Prepared, needs_autograd, prepare


__all__ = ["DISPATCHER", "Dispatcher", "Decided", "Decision", "Integration", "EXPLAINERS", "FORCEABLE", "OPS", "OpDecl", "Prepared",
           "Bound", "Held", "bind", "layout_of", "explain_call", "stats", "reset_stats", "list_ops", "install", "reset", "prepare",
           "needs_autograd", "map_outputs", "kernel_names", "make_entry"]
