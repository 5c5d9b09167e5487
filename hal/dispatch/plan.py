"""Step 6: a route as the plan a cached call runs, ``(count, run)``.

``count()`` counts the call in ``hal.stats()``; ``run(*args)`` runs it on the call's arguments as
given (the checker's canonical static values substituted, volatile values validated, an unbatched
input batched, in-place writes marked, the kernel inside hal's autograd node on the ``node``
route). Every wrapper is added only where the route needs it, so that the plan of a plain call is
the kernel itself.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

import torch

from hal import arrays
from hal.registry import OpDecl

from .route import Route
from .validate import Prepared

#: A cached decision: (count one call, run the call's positional arguments).
Plan = tuple[Callable[[], Any], Callable[..., Any]]
#: ``autograd(decl, run) -> apply``: the kernel runner ``run`` as the forward of hal's autograd node
#: (installed by the torch integration, :mod:`hal.integration.autograd`).
AutogradHook = Callable[[OpDecl, Callable[..., Any]], Callable[..., Any]]

#: a C-level callable doing nothing, for plans that count inside their runner (or not at all).
NO_COUNT = ().__len__

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_increment_version = torch._C._increment_version


class Counter:
    """Thread-safe call and fallback counts of one (op, backend, kernel)."""

    __slots__ = ("calls", "fallbacks")

    def __init__(self) -> None:
        self.calls = itertools.count()
        self.fallbacks = itertools.count()

    @staticmethod
    def _value(counter: "itertools.count[int]") -> int:
        return int(repr(counter)[6:-1])  # "count(5)" -> 5; next() is atomic, reading must not advance

    def snapshot(self) -> dict[str, int]:
        return {"calls": self._value(self.calls), "fallbacks": self._value(self.fallbacks)}


def build(decl: OpDecl, route: Route, prepared: Prepared, counter: Optional[Counter], autograd: Optional[AutogradHook]) -> Plan:
    """The plan of ``route`` for calls of ``prepared``'s signature; ``counter`` None: not counted
    (a plan timed by :mod:`hal.dispatch.measure`)."""
    count_call = counter.calls.__next__ if counter is not None else NO_COUNT
    count_fallback = counter.fallbacks.__next__ if (counter is not None and route.fallback) else None
    checks = [(decl.index(name), name, check) for name, check in decl.volatile.items()]
    subs = prepared.subs
    target = route.option.fn
    if route.kind == "decomposition":
        run = canonical(decl.name, target, subs, checks)
        if count_fallback is None:
            return count_call, run

        def run_fallback(*args: Any) -> Any:
            count_fallback()
            return run(*args)

        return count_call, run_fallback
    recorded = route.kind == "recorded"
    fn = _writing(decl, target, recorded) if (decl.mutates and prepared.inputs.array_type == "torch") else target
    if decl.values is not None and prepared.inputs.device_kind == "cpu":
        fn = _validating(decl, fn)
    if prepared.unbatched is not None:
        fn = rebatching(fn, prepared.unbatched)
    count = count_call if count_fallback is None else _both(count_call, count_fallback)
    run = fn
    if route.kind == "node":
        if autograd is None:
            raise RuntimeError("hal's torch integration is not loaded (import hal, not hal.dispatch alone)")
        run = autograd(decl, fn)
    if not checks:
        return count, canonical(decl.name, run, subs, ())

    def run_checked(*args: Any) -> Any:
        a = list(args)
        for i, v in subs:
            a[i] = v
        for i, name, check in checks:
            a[i] = check(decl.name, name, a[i])
        count()  # after the checks: a call they refuse ran no kernel
        return run(*a)

    return NO_COUNT, run_checked


def observed(plan: Plan, observer: Callable[..., Any], decl: OpDecl, route: Route) -> Plan:
    """``plan`` with its runs handed to ``observer(decl, route, run, args)``, which runs the call
    and returns its result (a ``hal.use`` scope's observer: :attr:`hal.config.Overrides.observer`)."""
    count, run = plan

    def run_observed(*args: Any) -> Any:
        return observer(decl, route, run, args)

    return count, run_observed


def canonical(op: str, fn: Callable[..., Any], subs: Sequence[tuple[int, Any]], checks: Sequence[tuple[int, str, Any]]) -> Callable[..., Any]:
    """``fn`` called with the checker's canonical static values substituted into the arguments (and
    the volatile ones validated)."""
    if not subs and not checks:
        return fn

    def run(*args: Any) -> Any:
        a = list(args)
        for i, v in subs:
            a[i] = v
        for i, name, check in checks:
            a[i] = check(op, name, a[i])
        return fn(*a)

    return run


def rebatching(fn: Callable[..., Any], i: int) -> Callable[..., Any]:
    """``fn`` on a batch of one for an unbatched input at slot ``i``, its result unbatched again."""

    def run(*args: Any) -> Any:
        a = list(args)
        a[i] = a[i][None]
        return fn(*a)[0]

    return run


def _both(first: Callable[[], Any], second: Callable[[], Any]) -> Callable[[], None]:
    """One counting call that counts twice (a call and its fallback)."""

    def count() -> None:
        first()
        second()

    return count


def _validating(decl: OpDecl, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` after the op's value check (host-resident arrays: reading them costs no synchronisation)."""
    check, names = decl.values, decl.param_names
    assert check is not None

    def run(*a: Any) -> Any:
        check(dict(zip(names, a)))
        return fn(*a)

    return run


def _writing(decl: OpDecl, fn: Callable[..., Any], recorded: bool = False) -> Callable[..., Any]:
    """An in-place kernel on torch tensors: bump the version counter of every tensor it wrote
    (kernels that write through pointers or NumPy views do not), so that autograd notices a saved
    tensor that changed, as with torch's own in-place ops, and caches keyed on versions see the
    write. Running statistics (``mutates_statistics``) are written as torch's batch norm writes
    them, without a bump, and counted by :func:`hal.arrays.note_writes` instead. The kernel runs
    without grad recording, unless torch's autograd is to record it (``recorded``)."""
    slots = [decl.index(n) for n in decl.mutates]
    when = decl.index(decl.mutates_when) if decl.mutates_when else None
    mark = arrays.note_writes if decl.mutates_statistics else _increment_version

    def bump(a: Sequence[Any]) -> None:
        if when is None or a[when]:
            written = []
            for i in slots:
                v = a[i]
                if isinstance(v, (list, tuple)):
                    written.extend(v)
                elif v is not None:
                    written.append(v)
            mark(written)

    if recorded:  # marked before: a node that saves the written tensors saves them at their new version

        def run_recorded(*a: Any) -> Any:
            bump(a)
            return fn(*a)

        return run_recorded

    def run(*a: Any) -> Any:
        enabled = _grad_enabled()
        _set_grad_enabled(False)
        try:
            out = fn(*a)
        finally:
            _set_grad_enabled(enabled)
        bump(a)
        return out

    return run
