"""The autograd route of eager calls: the chosen kernel as the forward of one autograd node.

When a call of a trainable op needs autograd, the dispatcher has already chosen its kernel (once per
input signature, cached); this module runs that kernel inside a ``torch.autograd.Function`` whose
backward calls the op's backward op through ``hal.ops`` (its own decision, cached too). What the
backward needs is read off the declarations (:mod:`hal.gradients`). Saved tensors go through
``ctx.save_for_backward``, so an in-place change of one between forward and backward raises as it
does in torch; a second derivative raises too (backward ops have no autograd formula).

Each trainable op gets its own Function class, generated from its declaration like the op's entry
function (:func:`hal.dispatch.entry.make_entry`): the forward saves exactly what the backward op takes and
the backward calls it positionally, with no per-call loops over a generic description. In a
profile or ``y.grad_fn`` the node is ``Hal<Op>Backward``. Its source is registered with
``linecache``, so tracebacks show it. An op declaring ``halves`` (swiglu's gate and up) gets a second
node for calls whose two tensors are the halves of one (``h.chunk(2, -1)``): it differentiates that
tensor, so a backward kernel's single buffer of both gradients reaches it with no concatenation. An op
declaring ``nondifferentiable_results`` (rms_norm_amax's amax) returns its tuple from the node with
those results marked non-differentiable; the backward op gets the first result's gradient. The backward op is decided under the ``hal.use`` scope
(and :func:`hal.graphs.device_bound`) the forward ran in, unless the backward's caller has its own:
torch runs the backward of CUDA tensors on its device threads, which see no scope of the caller's.

Why not ``torch.ops.hal.<op>`` with its registered autograd here as well: that path crosses torch's
dispatcher three times in Python (custom op, autograd wrapper, kernel) and cost 40-50 µs per call
on the host; one Function costs about what torch's own autograd node costs. Under torch.compile the
``torch.ops.hal`` operators are used (:mod:`hal.integration.library`), with the same mapping.
"""

from __future__ import annotations

import linecache
from typing import Any, Callable, Optional

import torch
from torch.autograd.function import once_differentiable

from hal import arrays, config
from hal.gradients import OUT, gradients_of
from hal.registry import Kind, OpDecl

from . import kept

#: parameter kinds whose value is always a tensor: saved without a type test.
_ALWAYS_TENSOR = (Kind.TENSOR,)
#: kinds that may be None or a tensor: saved as they are (save_for_backward takes None).
_TENSOR_OR_NONE = (Kind.OPTIONAL_TENSOR,)


def _node_source(decl: OpDecl, halves: bool = False) -> str:
    """Source of the ``forward`` and ``_backward`` of ``decl``'s autograd node.

    Forward arguments are the op's canonical arguments ``a0, a1, ...`` after the kernel runner (with
    ``halves``, after the tensor whose halves the op's ``halves`` parameters are: they come detached,
    and that tensor's gradient is returned whole).
    Each value the backward op takes is saved as a tensor (``save_for_backward``: version-checked)
    or kept as a plain value; a number-or-tensor parameter is decided per call. A parameter the
    forward writes reaches the backward as None (when ``mutates_when`` holds), an unbatched input
    gets a batch dimension of one (with grad_out) and its gradient loses it again.
    """
    spec = gradients_of(decl)
    n = len(decl.params)
    args = ", ".join(f"a{i}" for i in range(n))
    when = f"a{decl.index(decl.mutates_when)}" if decl.mutates_when else "True"
    fwd = [f"def forward(ctx, run, {'base, ' if halves else ''}{args}):", "    armed = _kept.armed  # kernels keep for the backward op (hal.integration.kept)",
           "    _kept.armed = True", "    try:", f"        out = run({args})", "    finally:", "        _kept.armed = armed"]
    extra = decl.nondifferentiable_results
    if extra:  # results after the first carry no gradient (an amax reduced beside the output)
        fwd.append("    ctx.mark_non_differentiable(*out[1:])")
    tensors, values = [], []  # expressions saved with save_for_backward / kept as plain values
    unpack, keep = [], []  # the names the backward gives them
    per_call = []  # needs decided per call (a number or a tensor): tensor part s{j}, number part k{j}
    for j, name in enumerate(spec.needs):
        if name == OUT:
            tensors.append("out[0]" if extra else "out")
            unpack.append(f"v{j}")
            continue
        i = decl.index(name)
        expr = f"(None if {when} else a{i})" if name in decl.mutates else f"a{i}"
        kind = decl.params[i].kind
        if kind in _ALWAYS_TENSOR or kind in _TENSOR_OR_NONE:
            tensors.append(expr)
            unpack.append(f"v{j}")
        elif kind is Kind.STATIC:
            values.append(expr)
            keep.append(f"v{j}")
        else:
            fwd.append(f"    s{j}, k{j} = ({expr}, None) if isinstance({expr}, _Tensor) else (None, {expr})")
            tensors.append(f"s{j}")
            unpack.append(f"s{j}")
            values.append(f"k{j}")
            keep.append(f"k{j}")
            per_call.append(j)
    fwd.append(f"    ctx.save_for_backward({', '.join(tensors)})")
    # which gradient slots received a tensor (a gradient for a number or None must come back None)
    checked = [(s, decl.index(s)) for s in decl.gradients if decl.params[decl.index(s)].kind not in _ALWAYS_TENSOR]
    flags = "".join(f"isinstance(a{i}, _Tensor), " for _, i in checked)
    # the hal.use / device_bound scope of the forward, for the backward op's decision: torch runs a
    # CUDA graph's backward on its own device thread, where this thread's scope is not seen
    fwd += [f"    ctx.hal = ({''.join(v + ', ' for v in values)}), ({flags}), _local.overrides if _scopes[0] else None",
            "    return out", ""]

    bwd = [f"def _backward(ctx, grad_out{', *_' if extra else ''}):"]  # the results without gradient get none
    if unpack:
        bwd.append(f"    {''.join(u + ', ' for u in unpack)}= ctx.saved_tensors")
    bwd.append(f"    ({''.join(k + ', ' for k in keep)}), given, scope = ctx.hal")
    for j in per_call:
        bwd.append(f"    v{j} = k{j} if s{j} is None else s{j}")
    batched = False
    if decl.unbatched is not None and decl.unbatched[0] in spec.needs:
        name, rank = decl.unbatched
        j = spec.needs.index(name)
        bwd += [
            f"    batched = v{j} is not None and v{j}.ndim == {rank}",
            "    if batched:",
            f"        v{j}, grad_out = v{j}[None], grad_out[None]",
        ]
        batched = True
    call = ", ".join(["grad_out"] + [f"v{j}" for j in range(len(spec.needs))])
    if spec.masked:  # only the gradients autograd asks for (inputs of the node: run, a0, a1, ...)
        bwd.append("    needed = ctx.needs_input_grad")
        slot = {s: (1 if halves and s in decl.halves else 1 + halves + decl.index(s)) for s in decl.gradients}  # type: ignore[operator]
        call += ", (" + "".join(f"needed[{slot[s]}], " for s in decl.gradients) + ")"
    result = 'g0' if decl.single_gradient else 'r'
    bwd += ["    if scope is not None and _local.overrides is None:  # the forward's scope, where the caller has none",
            "        saved = _enter(scope)", "        try:", f"            {result} = _bwd({call})", "        finally:",
            "            _leave(saved)", "    else:", f"        {result} = _bwd({call})"]
    grads = {}
    for g, slot in enumerate(decl.gradients):
        expr = "g0" if decl.single_gradient else f"r[{g}]"
        if batched and slot == decl.unbatched[0]:  # type: ignore[index]
            bwd.append(f"    d{g} = {expr}[0] if batched and {expr} is not None else {expr}")
            expr = f"d{g}"
        flag = [k for k, (s, _) in enumerate(checked) if s == slot]
        grads[decl.index(slot)] = f"({expr} if given[{flag[0]}] else None)" if flag else expr
    lead = ["None"]
    if halves:  # the gradient of the base: the two halves' buffer, or their concatenation
        lead.append(f"_join({', '.join(grads.pop(decl.index(s)) for s in decl.halves)})")  # type: ignore[union-attr]
    ret = ", ".join(lead + [grads.get(i, "None") for i in range(n)])
    bwd += [f"    return ({ret},)", ""]
    return "\n".join(fwd + bwd)


def _join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The gradient of the tensor whose halves had gradients ``a`` and ``b``: the buffer a kernel
    wrote both into (no copy), else their concatenation (what torch's own chunk backward does)."""
    whole = arrays.halves_of(a, b)
    return whole if whole is not None else torch.cat((a, b), dim=-1)


def _halves_base(a: Any, b: Any) -> Any:
    """The tensor ``a`` and ``b`` are the halves of, when the node may differentiate it in their
    place: nothing watches the halves themselves (a hook, ``retain_grad``) and it takes gradients."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.retains_grad or b.retains_grad:
        return None
    if a._backward_hooks or b._backward_hooks:
        return None
    base = arrays.halves_of(a, b)
    return base if base is not None and base.requires_grad else None


def _node_class(decl: OpDecl, halves: bool = False) -> type:
    """Build the autograd Function of one trainable op from its declaration."""
    spec = gradients_of(decl)
    src = _node_source(decl, halves)
    filename = f"<hal.integration.autograd.{decl.name}{'.halves' if halves else ''}>"
    namespace: dict[str, Any] = {"_Tensor": torch.Tensor, "_bwd": spec.bwd.entry, "_kept": kept.STATE, "_local": config._local,
                                 "_scopes": config.ACTIVE_SCOPES, "_enter": config.enter, "_leave": config.leave,
                                 "_join": _join}
    exec(compile(src, filename, "exec"), namespace)
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    body = namespace["_backward"]
    second_order = once_differentiable(body)  # create_graph=True: results that raise if differentiated
    grad_enabled = torch.is_grad_enabled

    def backward(ctx: Any, grad_out: torch.Tensor, *rest: Any) -> tuple:
        # rest: the (unused) gradients of results declared without one (nondifferentiable_results)
        return second_order(ctx, grad_out, *rest) if grad_enabled() else body(ctx, grad_out, *rest)

    camel = "".join(part.capitalize() for part in decl.name.split("_"))
    cls = type(
        f"Hal{camel}{'Halves' if halves else ''}",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(namespace["forward"]),
            "backward": staticmethod(backward),
            "__doc__": f"The autograd node of hal.ops.{decl.name} (generated from its declaration).",
            "__module__": __name__,
            "__hal_source__": src,
        },
    )
    return cls


_NODES: dict[int, tuple[OpDecl, type, Optional[type]]] = {}
#: ``Function.apply`` below its Python wrapper: that wrapper checks for functorch transforms and
#: unwraps functorch tensors whose transform has exited (2.3 µs a call on the CI CPU, a third of an
#: autograd call's host time). Without an active transform the check is done here; a dead wrapper
#: (a tensor leaked out of ``vmap``) is the one case not unwrapped.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_transforms_active = torch._C._are_functorch_transforms_active


def autograd_runner(decl: OpDecl, run: Callable[..., Any]) -> Callable[..., Any]:
    """The dispatcher's autograd route for one plan: a function of the canonical arguments that runs
    ``run`` (the chosen kernel's runner) as the forward of ``decl``'s autograd node."""
    hit = _NODES.get(id(decl))
    if hit is None or hit[0] is not decl:
        hit = _NODES[id(decl)] = (decl, _node_class(decl), _node_class(decl, halves=True) if decl.halves else None)
    cls, halves_cls = hit[1], hit[2]
    fast, slow = _C_APPLY.__get__(None, cls), cls.apply

    def apply(*args: Any) -> Any:
        if _transforms_active():  # under vmap/grad: torch's own path (which says what it needs)
            return slow(run, *args)
        return fast(run, *args)

    if halves_cls is None:
        return apply
    ia, ib = (decl.index(name) for name in decl.halves)  # type: ignore[union-attr]
    fast_halves = _C_APPLY.__get__(None, halves_cls)

    def apply_halves(*args: Any) -> Any:
        base = None if _transforms_active() else _halves_base(args[ia], args[ib])
        if base is None:
            return apply(*args)
        parts = list(args)  # the halves of a detached base (a detached view is no view of anything)
        parts[ia], parts[ib] = base.detach().chunk(2, dim=-1)
        return fast_halves(run, base, *parts)

    return apply_halves

