"""Which algorithm runs a collective call, and why: the ``auto`` choice and ``hal.explain``.

A call names an algorithm or ``auto``. A named one must be able to run the call, or the call raises
:class:`hal.UnsupportedError` with its reasons. ``hal.use(kernel={"all_reduce": ...})`` and
``HAL_KERNEL_ALL_REDUCE`` force one the same way when the call says ``auto``. Otherwise every
algorithm that can run the call (lossy ones only when the cost model allows them) is estimated
with the engine's :class:`~hal.dist.cost.CostModel`, and the cheapest wins; ties go to the first
registered (``native``). Choices are cached per (collective, dtype, size, op, group, settings).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hal import config
from hal.arrays import describe
from hal.dispatch.decision import Candidate, Decision
from hal.dist import settings
from hal.dist.algorithms import REGISTRY, Algorithm, Call
from hal.dist.cost import CostModel, cost_model
from hal.errors import HalError, InvalidArgumentError, UnsupportedError

_cache: dict[tuple[Any, ...], Algorithm] = {}
_MAX_CACHE = 4096


@dataclasses.dataclass
class _Assessment:
    algorithm: Algorithm
    reasons: list[str]
    seconds: Optional[float]  # the estimate; None when the algorithm cannot run the call


def _forced(collective: str, requested: str) -> tuple[Optional[str], str]:
    """(algorithm name or None, where the demand comes from)."""
    if requested != "auto":
        return requested, "algorithm= argument"
    choice = config.choice_for(collective, config.current())
    if choice.kernel is None:
        return None, ""
    if choice.kernel in REGISTRY[collective] or choice.kernel_required:
        return choice.kernel, choice.kernel_source
    return None, ""  # a kernel name forced for every op ("composite"...) that is no algorithm here


def _assess(call: Call, model: CostModel, forced: Optional[str]) -> list[_Assessment]:
    out = []
    for alg in REGISTRY[call.collective].values():
        reasons = list(alg.reasons(call))
        seconds = None if reasons else alg.cost(call, model)
        if not reasons and alg.lossy and not model.allow_lossy and forced is None:
            reasons.append(
                "lossy (sent in 16 bits): auto picks it only after hal.dist.set_cost_model(allow_lossy=True); "
                "or name it with algorithm="
            )
        out.append(_Assessment(alg, reasons, seconds))
    return out


def _unknown(call: Call, name: str, source: str) -> InvalidArgumentError:
    names = ", ".join(["auto", *REGISTRY[call.collective]])
    return InvalidArgumentError(call.collective, "algorithm", f"one of {names} (from {source})", repr(name))


def _pick(call: Call, assessed: list[_Assessment], forced: Optional[str], source: str) -> Algorithm:
    if forced is not None:
        found = next((a for a in assessed if a.algorithm.name == forced), None)
        if found is None:
            raise _unknown(call, forced, source)
        if found.reasons:
            raise UnsupportedError(
                f"{call.collective}: algorithm {forced!r} (from {source}) cannot run {describe(call.tensor)} "
                f"on {call.gi.describe()}: " + "; ".join(found.reasons)
            )
        return found.algorithm
    runnable = [a for a in assessed if not a.reasons]
    if not runnable:  # every collective has a native algorithm without conditions
        raise UnsupportedError(f"{call.collective}: no algorithm can run this call")
    return min(runnable, key=lambda a: a.seconds or 0.0).algorithm


def choose(call: Call, requested: str) -> Algorithm:
    """The algorithm that runs ``call`` (cached; raises when a forced one cannot run it).

    The cache key holds what the choice depends on except the environment (HAL_KERNEL_*), which
    is read when a choice is made, as for kernels; ``hal.dist.settings.refresh()`` re-reads it.
    """
    t = call.tensor
    gi = call.gi
    key = (call.collective, t.dtype, t.numel(), call.op, gi.group, gi.engine, gi.nodes, settings.version, config.current(), requested)
    found = _cache.get(key)
    if found is not None:
        return found
    forced, source = _forced(call.collective, requested)
    if forced is not None and forced not in REGISTRY[call.collective]:
        raise _unknown(call, forced, source)
    model = cost_model(call.gi.engine)
    alg = _pick(call, _assess(call, model, forced), forced, source)
    if len(_cache) >= _MAX_CACHE:
        _cache.clear()
    _cache[key] = alg
    return alg


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def decision(call: Call, requested: str) -> Decision:
    """The choice for ``call`` with every algorithm, its reasons and estimate (for ``hal.explain``)."""
    forced, source = _forced(call.collective, requested)
    model = cost_model(call.gi.engine)
    inputs = [f"t: {describe(call.tensor)} ({call.nbytes} bytes)", f"group: {call.gi.describe()}; this is group rank {call.gi.rank}"]
    if call.op:
        inputs.append(f"op: {call.op}")
    params = ", ".join(f"{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(model))
    inputs.append(f"cost model ({call.gi.engine}): {params}")
    assessed = _assess(call, model, forced)
    error: Optional[HalError] = None
    try:
        chosen: Optional[Algorithm] = _pick(call, assessed, forced, source)
    except HalError as exc:
        chosen, error = None, exc
    candidates = []
    for a in assessed:
        note = [] if a.seconds is None else [f"est. {_seconds(a.seconds)}"]
        if a.algorithm.lossy:
            note.append("lossy")
        candidates.append(Candidate(backend=call.gi.engine, kernel=a.algorithm.name, reasons=a.reasons,
                                    chosen=chosen is a.algorithm, note=", ".join(note)))
    return Decision(op=call.collective, inputs=inputs, device=str(call.tensor.device),
                    backend=call.gi.engine if error is None else None, kernel=chosen.name if chosen is not None else None,
                    forced=[f"algorithm {forced} ({source})"] if forced is not None else [], candidates=candidates, error=error)
