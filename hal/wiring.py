"""How hal is put together: the one place that connects the layers, when ``import hal`` runs.

The layers do not reach for each other on import: the registry (:mod:`hal.registry`) knows neither
the dispatcher nor the torch integration, the dispatcher (:mod:`hal.dispatch`) does not import the
integration (:mod:`hal.integration`), and neither they nor :mod:`hal.dist` fill a slot of another
module as a side effect of being imported. :func:`wire` does it all, in this order:

1. the registry builds each op's public function with the dispatcher's entry
   (:func:`hal.dispatch.entry.make_entry`), and registers each op with torch as it is declared
   (:func:`hal.integration.library.register_op`: ``torch.ops.hal.<name>``);
2. hal's own ops are declared (importing :mod:`hal.ops`, which finds its family modules), every op
   declared from then on is set on :mod:`hal.ops` as it is declared, and hal's own are put in
   the order of their families (:data:`hal.ops.NAMES`, whatever order the modules were imported in)
   and sealed: their declarations are complete and immutable from now on (an op declared later is
   sealed by its first call);
3. the dispatcher is connected to the torch integration (:class:`hal.dispatch.Integration`: the
   autograd node, the traced call, torch.compile's caches and decisions);
4. :mod:`hal.dist`'s algorithms beyond the native ones (:mod:`~hal.dist.algorithms` registers
   those) are installed, in this order: ``hierarchical``, ``compressed_fp16``, ``compressed_bf16``
   (the order of ``hal.explain`` and of ``auto``'s ties); and the names that are no ops but that
   ``hal.explain`` and ``hal.use(kernel=...)`` take, the collectives, are added to the dispatcher's
   tables.
"""

from __future__ import annotations

from hal import dispatch, registry
from hal.dispatch.entry import make_entry
from hal.integration import autograd, compile, library


def _publish(decl: registry.OpDecl) -> None:
    """``hal.ops.<name>``: the public function of an op declared anywhere, set on the package as it
    is declared (an attribute lookup CPython specialises, where a module ``__getattr__`` would not)."""
    import hal.ops

    setattr(hal.ops, decl.name, decl.entry)


def wire() -> None:
    """Connect registry, declarations, dispatcher and torch integration (``hal/__init__.py`` calls
    it once; see the module docstring for the order and why)."""
    registry.set_entry_factory(make_entry)
    registry.on_declare(library.register_op)
    import hal.ops  # (hal's own declarations; here, since declaring needs the entry builder above)

    registry.on_declare(_publish)
    registry.arrange(hal.ops.NAMES)
    registry.seal_declared()
    dispatch.DISPATCHER.connect(dispatch.Integration(
        autograd=autograd.autograd_runner,
        traced=library.traced_call,
        loaded=compile.tag_compile_caches,
        for_compile=compile.measure_for_compile,
        compiled=compile.traced_alternative,
    ))
    from hal.dist import EXPLAINERS, algorithms, compressed, hierarchical
    from hal.dist.algorithms import install

    install((*hierarchical.ALGORITHMS, *compressed.ALGORITHMS))
    dispatch.EXPLAINERS.update(EXPLAINERS)
    dispatch.FORCEABLE.update({name: (lambda name=name: set(algorithms(name))) for name in EXPLAINERS})
