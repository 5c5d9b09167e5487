"""hal's errors found while torch.compile traces a call, reaching the user as hal errors.

Dynamo runs a graph node's fake kernel while it traces (``hal.ops.linear`` with a weight of the
wrong shape fails there, in the op's checker) and wraps whatever that raises in its own
``TorchRuntimeError``: a user catching ``hal.HalError`` or ``hal.InvalidArgumentError`` would miss
it (API.md: a bad argument raises a ``hal.HalError`` also under torch.compile). The one kind of
exception Dynamo lets through from a fake kernel unchanged is its ``Unsupported`` (a graph break).
So a hal error met while tracing is raised again as an instance of a class deriving from both its
own class and ``Unsupported`` (:func:`while_tracing`):

- with ``fullgraph=True`` the user gets that exception: an ``InvalidArgumentError`` (say) with the
  op's own message;
- without, Dynamo breaks the graph at the call and runs it eagerly, where hal raises the plain
  error as in any eager call.

Where torch has no Dynamo (or another layout of it), the error is raised as it is.
"""

from __future__ import annotations

import functools
from typing import Optional

from hal.errors import HalError


def _unsupported() -> Optional[type]:
    try:
        from torch._dynamo.exc import Unsupported
    except Exception:  # noqa: BLE001 - a torch without Dynamo, or one that moved it
        return None
    return Unsupported


@functools.lru_cache(maxsize=None)
def traced_class(cls: type) -> Optional[type]:
    """The class of ``cls``'s errors met while tracing: ``cls`` and Dynamo's ``Unsupported``."""
    unsupported = _unsupported()
    if unsupported is None:
        return None
    doc = f"A {cls.__name__} met while torch.compile traced the call (hal.integration.errors)."
    return type(cls.__name__, (cls, unsupported), {"__module__": cls.__module__, "__doc__": doc, "__qualname__": cls.__qualname__})


def while_tracing(exc: HalError) -> BaseException:
    """``exc`` as the error to raise from a fake kernel (see the module docstring): the same message,
    attributes and class (plus Dynamo's ``Unsupported``)."""
    cls = traced_class(type(exc))
    if cls is None:
        return exc
    try:
        out = cls.__new__(cls)
        cls.__mro__[cls.__mro__.index(_unsupported())].__init__(out, str(exc))  # Dynamo's bookkeeping (msg, stack)
        out.__dict__.update(exc.__dict__)  # the op, argument, expected and given of an InvalidArgumentError
        out.args = exc.args
    except Exception:  # noqa: BLE001 - another Dynamo's Unsupported: the plain error is still right
        return exc
    out.__cause__ = exc.__cause__
    return out
