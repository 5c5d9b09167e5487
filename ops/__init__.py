"""hal.ops: every op of hal, declared once (this folder is installed as the package ``hal.ops``).

Each name is the public, dispatching function of an op; ``hal.ops.<name>.op`` is its declaration.
Backward ops (``<op>_backward``) are ops too. Only declarations live here: no kernel code. An op
declared elsewhere (``hal.library.declare``) is ``hal.ops.<name>`` too: :func:`hal.wiring.wire` sets
it here as it is declared. (This package has no module ``__getattr__``: with one, CPython stops
specialising the ``hal.ops.<name>`` lookup, 6 -> 19 ns a call, benchmarks/results/dispatch_overhead-2026-12-07-issue42.md.)
``import hal`` imports this package (:func:`hal.wiring.wire`), once the dispatcher can build the
public functions.

The op families are found, not listed: every public module of this package (``_``-prefixed modules
are helpers), searched along its ``__path__``, is a family whose ops are declared when it is
imported. Adding an op is adding its declaration to its family's module; adding a family is adding a
module with an ``ORDER`` (an int): families stand in the order of their ``ORDER`` (ties by name),
their ops in the order of their declarations, which is the order of the registry, API.md,
docs/ops.md, ``hal info`` and the conformance reports. ``__all__`` and this package's names come
from the declarations (:data:`NAMES`); ``__init__.pyi`` beside this file repeats them for type
checkers and IDEs (generated with docs/ops.md by ``python -m hal.cli.docs``, which checks both).
"""

import importlib as _importlib
from types import ModuleType as _Module

from hal.plugin import family_names as _family_names
from hal.registry import OPS

from .elementwise import ACTIVATIONS  # the activations scale_shift_act and linear take (hal.nn reads them)


def _families() -> tuple[_Module, ...]:
    """The family modules on this package's ``__path__``, imported (declaring their ops), in the
    order of their ``ORDER``, then of their names."""
    modules = [_importlib.import_module(f"{__name__}.{name}") for name in _family_names(__path__)]
    unordered = [m.__name__ for m in modules if type(getattr(m, "ORDER", None)) is not int]
    if unordered:
        taken = ", ".join(f"{m.__name__} {m.ORDER}" for m in modules if m.__name__ not in unordered)
        raise ImportError(f"hal.ops: op family modules without an int ORDER (where their ops stand among hal's): "
                          f"{', '.join(unordered)}; the others have {taken}")
    return tuple(sorted(modules, key=lambda m: (m.ORDER, m.__name__)))


#: the op family modules, in declaration order
FAMILIES = _families()

#: hal's own ops (those of :data:`FAMILIES`), each family's in the order it declares them
NAMES = tuple(d.name for f in FAMILIES for d in OPS.values() if d.module == f.__name__)

globals().update({name: OPS[name].entry for name in NAMES})

__all__ = [*NAMES, "ACTIVATIONS"]

del _families, _family_names, _importlib, _Module  # (dir(hal.ops): the ops, their families and what they export)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(OPS))
