"""hal.conformance: the conformance suite, ``hal conformance`` (see ``runner`` for what a run does).

A user with a new device runs one command and learns, op by op, kernel by kernel and dtype by dtype,
whether the device computes what the reference computes. The pieces:

- ``cases/``: the case list of every op (static recipes; data drawn per case from a seed);
- ``draw``: random inputs on a device in a memory layout; ``poison``: poisoned output allocations;
- ``compare``: tolerances (declared, widened, overridable per backend) and the comparison;
- ``xfail``: known failures per backend (``xfail/<backend>.txt``);
- ``runner``: planning and running a backend's cases; ``report``: report.json, report.md, junit.xml;
- ``cli``: ``hal conformance``; ``pytest_plugin``: ``pytest --hal-backend NAME``;
- ``collectives`` (written with hal.dist): multi-process collective cases, run with --world-size;
- the model mode, ``hal conformance --model``: ``model`` (a model's training steps on a backend
  against the reference, bisected to the diverging call), ``model_zoo`` (the models),
  ``model_record`` (recording every hal call, forcing calls to the reference), ``model_compare``
  (call-by-call budgets), ``model_report`` (its three reports), ``model_golden`` (golden loss
  curves per device, ``golden/<device>/``), ``model_cli`` (its options).

This package imports nothing heavy until used (pytest loads its plugin in every session).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Suite": "runner",
    "Result": "runner",
    "reproduce": "runner",
    "case_inputs": "cases",
    "case_id": "cases",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
