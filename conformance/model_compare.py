"""Comparing a run with the reference run call by call, each result within its budget.

The two runs (:mod:`hal.conformance.model_record`) make the same top-level calls in the same order
(the model's code is the same; a run whose calls differ in op or shapes is reported where they
part). Call ``i`` of the run under test (A) is compared with call ``i`` of the reference run (R,
float64): each result (returned arrays, arrays written in place) and each gradient the call gives
its inputs. Every element must satisfy

    |A - R| <= atol + rtol * max(|R|, |P|) + |P - R|

- ``atol, rtol``: the op's declared tolerance for the call's dtype (its backward op's for a
  gradient), ``atol`` widened by ``sqrt(K)`` where the op accumulates (``K``, its reduction length
  on the call's arguments: :attr:`hal.registry.OpDecl.reduction`) and scaled by the root mean square
  of the component (R's, or P's where larger), as the op suite resolves it
  (:func:`hal.conformance.compare.resolve`, with the backend's tolerance overrides);
- ``P``: the reference op run on A's own inputs in float64 (for a gradient: its backward, on A's
  inputs and the gradient that reached A's results). ``|P - R|`` is the error the call inherited
  from everything before it (earlier calls, torch's own ops between them, the optimizer's updates):
  the reference computes exactly what the call should give for the inputs it got. The op's
  tolerance holds the kernel to ``|A - P| <= atol + rtol * |P|`` on those inputs, so by the triangle
  inequality ``|A - R| <= atol + rtol * |P| + |P - R|``: the relative term takes ``|P|`` where it
  exceeds ``|R|`` (with ``|R|`` alone, a kernel within its tolerance failed by up to
  ``rtol * |P - R|`` where the drift had moved its result away from a small reference value, as a
  ReLU output the reference run clips to 0: cnn in float16, seed 0, call #17, 1.003x its budget
  with the call's own error 0.90 of the op's tolerance). So a call passes when the error its own
  kernel adds stays within the op's tolerance, however far the run has drifted before it, and the
  first call past its budget is the first whose kernel is wrong.

Checks are ordered as the step computes them: the forward calls of a step in order, then the
gradients of its calls from the last call to the first (the order of the backward), then the
optimizer's calls; the first failing check is the divergence :mod:`hal.conformance.model` bisects.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hal import config
from hal.arrays import FLOAT_DTYPES, dtype_name
from hal.dispatch import prepare
from hal.registry import OPS, OpDecl, get_op
from hal.types import ARRAY_KINDS

from . import compare as cmp
from .model_record import CallRecord, Recording, components, invoke

_PHASE_RANK = {"forward": 0, "gradient": 1, "optimizer": 2}


@dataclasses.dataclass
class Check:
    """One component of one call compared with the reference run."""

    index: int
    #: "output" (a result, or an array written in place) or "gradient" (of an input)
    kind: str
    component: str
    ok: bool
    #: the largest |A - R| over the element's budget (1 = at the budget; inf: a NaN or infinity
    #: where the reference has a finite value, or another shape)
    used: float
    max_abs_err: float
    atol: float
    rtol: float
    k: int
    #: the largest |P - R|: the error the call inherited (None: the reference could not replay it)
    inherited: Optional[float]
    message: str
    order: tuple = ()
    #: the largest |A - P| over ``atol + rtol * |P|``: the error the call's own kernel added, over
    #: the op's tolerance (None without a replay). Where the inherited error dominates, ``used``
    #: nears 1 whatever the kernel does; this says how much of its tolerance the kernel took
    own: Optional[float] = None

    def record(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("order")
        for key in ("used", "max_abs_err", "inherited", "own"):
            v = out[key]
            out[key] = None if v is None or not math.isfinite(v) else float(v)
        return out


@dataclasses.dataclass
class Comparison:
    """Every check of two runs; ``mismatch`` says where their calls parted (None: they did not)."""

    checks: list[Check]
    aligned: int
    mismatch: Optional[str] = None

    @property
    def failing(self) -> list[Check]:
        return sorted((c for c in self.checks if not c.ok), key=lambda c: c.order)

    @property
    def first(self) -> Optional[Check]:
        bad = self.failing
        return bad[0] if bad else None

    def worst(self, index: int, field: str = "used") -> dict[str, float]:
        """The largest ``used`` (or ``own``) per kind of check of call ``index``."""
        out: dict[str, float] = {}
        for c in self.checks:
            value = getattr(c, field)
            if c.index == index and value is not None:
                out[c.kind] = max(out.get(c.kind, 0.0), value)
        return out


def order_of(call: CallRecord, kind: str) -> tuple[int, int, int]:
    """Where a check of ``call`` comes in its step (module docstring)."""
    if kind == "gradient":
        return call.step, _PHASE_RANK["gradient"], -call.index
    return call.step, _PHASE_RANK["optimizer" if call.phase == "optimizer" else "forward"], call.index


# --- the reference replayed on the run's own inputs ------------------------------------------------


@dataclasses.dataclass
class Replay:
    """The reference op on a call's inputs (float64): its results and the gradients it gives the
    inputs for the gradients that reached the call's results; ``error`` when it could not run."""

    outputs: list[tuple[str, Optional[torch.Tensor]]]
    grads: dict[str, torch.Tensor]
    error: Optional[str] = None


def _upcast(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        dtype = torch.float64 if value.is_floating_point() else value.dtype
        return value.detach().to(device=device, dtype=dtype, copy=True)
    if isinstance(value, (list, tuple)):
        return [_upcast(v, device) for v in value]
    return value


def replay(decl: OpDecl, call: CallRecord, backend: str, device: torch.device) -> Replay:
    """Run the reference op on ``call``'s recorded arguments, upcast to float64 on ``device``."""
    args = {name: _upcast(call.args[name], device) for name in decl.param_names}
    leaves = {}
    for name in call.in_grads:
        v = args.get(name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            args[name] = leaves[name] = v.requires_grad_(True)
    try:
        with config.scope(backend=backend, tune="off"), torch.enable_grad(), np.errstate(all="ignore"):
            out = invoke(decl, [args[n] for n in decl.param_names])
            outputs = components(decl, out, args)
            grads: dict[str, torch.Tensor] = {}
            results = list(out) if isinstance(out, (list, tuple)) else [out]
            pairs = [(results[i], g) for i, g in sorted(call.out_grads.items())
                     if i < len(results) and isinstance(results[i], torch.Tensor) and results[i].requires_grad]
            if leaves and pairs:
                got = torch.autograd.grad([r for r, _ in pairs], list(leaves.values()),
                                          [g.to(device=device, dtype=r.dtype) for r, g in pairs], allow_unused=True)
                grads = {n: g.detach().to("cpu") for n, g in zip(leaves, got) if g is not None}
    except Exception as exc:  # noqa: BLE001 - a call the reference cannot replay is compared without it
        return Replay([], {}, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    return Replay(outputs, grads)


# --- budgets -------------------------------------------------------------------------------------


def call_dtype(decl: OpDecl, args: dict[str, Any]) -> Optional[str]:
    """The dtype of a call (the op's ``dtype_from`` argument, else its first array argument)."""
    names = [decl.dtype_from] if decl.dtype_from else [p.name for p in decl.params if p.kind in ARRAY_KINDS]
    for name in names:
        v = args.get(name)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if isinstance(v, torch.Tensor):
            return dtype_name(v)
    return None


def canonical_args(decl: OpDecl, args: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as the dispatcher hands them to kernels (the checker's canonical values)."""
    try:
        return decl.bind(prepare(decl, [args[n] for n in decl.param_names]).inputs.args)
    except Exception:  # noqa: BLE001 - recorded from a call that ran: only as a fallback
        return dict(args)


def reduction_length(decl: OpDecl, named: dict[str, Any]) -> int:
    """The op's reduction length K on these arguments (1 when it declares none)."""
    if decl.reduction is None:
        return 1
    try:
        return max(1, int(decl.reduction(named)))
    except Exception:  # noqa: BLE001 - arguments of another shape than the rule expects
        return 1


def backward_reduction(decl: OpDecl, named: dict[str, Any], result: Optional[torch.Tensor], forward_k: int) -> tuple[OpDecl, int]:
    """The backward op of ``decl`` and its reduction length on the call's arguments (the result
    stands in for ``grad_out`` and ``out``, whose shapes the rules read); ``decl`` and ``forward_k``
    where the op has no backward op."""
    bwd = OPS.get(decl.backward) if decl.backward else None
    if bwd is None:
        return decl, forward_k
    args = dict(named)
    if result is not None:
        args.setdefault("grad_out", result)
        args.setdefault("out", result)
    for p in bwd.params:
        if p.name not in args and not p.required:
            args[p.name] = p.default
    return bwd, max(reduction_length(bwd, args), 1)


def _check(index: int, kind: str, name: str, decl: OpDecl, case_dtype: Optional[str], k: int,
           got: Optional[torch.Tensor], want: Optional[torch.Tensor], replayed: Optional[torch.Tensor],
           overrides: cmp.Overrides, order: tuple) -> Check:
    """One component within its budget (module docstring)."""
    if got is None or want is None:
        ok = (got is None) == (want is None)
        msg = "" if ok else f"{name}: {'None' if got is None else 'an array'}, the reference run gives {'None' if want is None else 'an array'}"
        return Check(index, kind, name, ok, 0.0 if ok else math.inf, 0.0, 0.0, 0.0, k, None, msg, order)
    if tuple(got.shape) != tuple(want.shape):
        return Check(index, kind, name, False, math.inf, math.inf, 0.0, 0.0, k, None,
                     f"{name}: shape {tuple(got.shape)}, the reference run's {tuple(want.shape)}", order)
    result_dtype = dtype_name(got)
    if result_dtype not in FLOAT_DTYPES:
        ok = bool(torch.equal(got.to(torch.int64), want.to(torch.int64)))
        return Check(index, kind, name, ok, 0.0 if ok else math.inf, 0.0 if ok else math.inf, 0.0, 0.0, k, None,
                     "" if ok else f"{name}: integer results differ from the reference run's", order)
    want64 = want.to(torch.float64)
    slack = None
    inherited = None
    if replayed is not None and tuple(replayed.shape) == tuple(want.shape):
        slack = (replayed.to(torch.float64) - want64).abs()
        slack = torch.where(torch.isfinite(slack), slack, torch.zeros_like(slack))
        inherited = float(slack.max()) if slack.numel() else 0.0
    try:
        scale = max(cmp.magnitude(want64), cmp.magnitude(replayed.to(torch.float64)) if inherited is not None else 0.0)
        atol, rtol = cmp.resolve(decl, case_dtype or result_dtype, result_dtype, k, scale, False, overrides)
    except KeyError as exc:
        return Check(index, kind, name, False, math.inf, math.inf, 0.0, 0.0, k, inherited, f"{name}: {exc.args[0]}", order)
    if slack is not None:  # rtol * max(|R|, |P|): the op's tolerance scales with the exact result of the call's own inputs (module docstring)
        wider = rtol * (replayed.to(torch.float64).abs() - want64.abs()).clamp_min(0.0)  # type: ignore[union-attr]
        slack = slack + torch.where(torch.isfinite(wider), wider, torch.zeros_like(wider))
    c = cmp.compare(name, got, want64, atol, rtol, slack=slack)
    g = got.to(torch.float64)
    finite = torch.isfinite(g) & torch.isfinite(want64)
    bound = atol + rtol * want64.abs() + (slack if slack is not None else 0.0)
    ratio = torch.where(finite, (g - want64).abs() / bound, torch.zeros_like(g))
    used = float(ratio.max()) if ratio.numel() else 0.0
    if not c.ok and not math.isfinite(c.max_abs_err):
        used = math.inf
    own = None
    if inherited is not None:
        p = replayed.to(torch.float64)  # type: ignore[union-attr]
        both = torch.isfinite(g) & torch.isfinite(p)
        mine = torch.where(both, (g - p).abs() / (atol + rtol * p.abs()), torch.zeros_like(g))
        own = float(mine.max()) if mine.numel() else 0.0
    message = c.message
    if replayed is None and not c.ok:
        message += " (the reference could not replay this call on the run's inputs: its budget has no inherited error)"
    return Check(index, kind, name, c.ok, used, c.max_abs_err, atol, rtol, k, inherited, message, order, own)


def _aligned(a: CallRecord, r: CallRecord) -> bool:
    if a.op != r.op:
        return False
    for name, v in a.args.items():
        w = r.args.get(name)
        if isinstance(v, torch.Tensor) and (not isinstance(w, torch.Tensor) or v.shape != w.shape):
            return False
    return True


def compare_runs(test: Recording, ref: Recording, reference_backend: str, reference_device: torch.device,
                 overrides: Optional[cmp.Overrides] = None) -> Comparison:
    """Every check of ``test`` against ``ref`` (module docstring), up to where their calls part."""
    overrides = overrides or {}
    checks: list[Check] = []
    n = min(len(test.calls), len(ref.calls))
    mismatch = None
    aligned = n
    for i in range(n):
        if not _aligned(test.calls[i], ref.calls[i]):
            a, r = test.calls[i], ref.calls[i]
            mismatch = (f"the runs' calls part at call #{i}: the run under test called {a.op}({a.shapes()}), "
                        f"the reference run {r.op}({r.shapes()}) (control flow depending on values?)")
            aligned = i
            break
    if mismatch is None and len(test.losses) == len(ref.losses) and len(test.calls) != len(ref.calls):
        longer = "the run under test" if len(test.calls) > len(ref.calls) else "the reference run"
        mismatch = f"the runs made {len(test.calls)} and {len(ref.calls)} calls: {longer} made more, from call #{n} on"
    for i in range(aligned):
        checks += _checks_of(test.calls[i], ref.calls[i], reference_backend, reference_device, overrides)
    return Comparison(checks, aligned, mismatch)


def _checks_of(a: CallRecord, r: CallRecord, backend: str, device: torch.device, overrides: cmp.Overrides) -> list[Check]:
    decl = get_op(a.op)
    named = canonical_args(decl, a.args)
    case_dtype = call_dtype(decl, a.args)
    k = reduction_length(decl, named)
    p = replay(decl, a, backend, device)
    replayed = dict(p.outputs)
    out: list[Check] = []
    order = order_of(a, "output")
    for slot, ((name, got), (_, want)) in enumerate(zip(a.outputs, r.outputs)):
        out.append(_check(a.index, "output", name, decl, case_dtype, k, got, want, replayed.get(name), overrides, order + (slot,)))
    if len(a.outputs) != len(r.outputs):
        out.append(Check(a.index, "output", "out", False, math.inf, math.inf, 0.0, 0.0, k, None,
                         f"{len(a.outputs)} results, the reference run's call gave {len(r.outputs)}", order + (0,)))
    if a.in_grads:
        first = a.outputs[0][1] if a.outputs else None
        bwd, kb = backward_reduction(decl, named, first, k)
        grad_order = order_of(a, "gradient")
        for slot, name in enumerate(sorted(a.in_grads, key=decl.param_names.index)):
            label = f"grad {name}"
            if name not in r.in_grads:
                out.append(Check(a.index, "gradient", label, False, math.inf, math.inf, 0.0, 0.0, kb, None,
                                 f"{label}: the reference run's call gave no gradient for {name}", grad_order + (slot,)))
                continue
            tol_decl = bwd if case_dtype in bwd.tolerances else decl
            out.append(_check(a.index, "gradient", label, tol_decl, case_dtype, kb, a.in_grads[name], r.in_grads[name],
                              p.grads.get(name), overrides, grad_order + (slot,)))
    if p.error is not None:
        for c in out:
            if not c.ok:
                c.message += f" [replay on the reference failed: {p.error}]"
    return out


def summarise(calls: Sequence[CallRecord], comparison: Comparison) -> list[dict[str, Any]]:
    """Per call: where, what ran, the largest budget used by its results and gradients, and the
    largest part of the op's tolerance its kernel's own error took (see :class:`Check`)."""
    rows = []
    for c in calls[: comparison.aligned]:
        worst, own = comparison.worst(c.index), comparison.worst(c.index, "own")
        rows.append({
            "index": c.index, "step": c.step, "phase": c.phase, "op": c.op, "backend": c.backend, "kernel": c.kernel,
            "route": c.route, "forced": c.forced, "site": str(c.site) if c.site else None, "module": c.module,
            "args": c.shapes(), "inner": [k.label for k in c.inner],
            "used_output": _finite(worst.get("output")), "used_gradient": _finite(worst.get("gradient")),
            "own_output": _finite(own.get("output")), "own_gradient": _finite(own.get("gradient")),
        })
    return rows


def _finite(v: Optional[float]) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else round(float(v), 4)
