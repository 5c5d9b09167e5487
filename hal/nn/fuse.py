"""``hal.nn.fuse(model)``: a torch.fx pass turning conv -> batch-norm -> ReLU, conv -> batch-norm ->
add -> ReLU, conv -> batch-norm and linear -> activation chains into hal's fused modules.

The model is traced with ``torch.fx.symbolic_trace``; a chain is fused when each intermediate result
has exactly one user (the next link) and each module of the chain is called from exactly one place,
so that replacing it cannot change another computation. A ReLU module called from several places
(torchvision's ResNet blocks reuse ``self.relu``) is fine: the ReLU *call* is what a chain absorbs.

- ``nn.Conv2d`` -> ``nn.BatchNorm2d`` -> ReLU becomes one call of a :class:`FusedConvBNReLU2d`
  that borrows the conv and batch-norm modules (``from_modules(..., borrow=True)``), registered
  beside the conv as ``<conv name>_fused``. The conv and the batch norm stay at their paths, so
  every state_dict key of the model stays as it was (API.md): a checkpoint of the original model
  loads into the fused one and back; the fused module has no state of its own.
- ``nn.Conv2d`` -> ``nn.BatchNorm2d`` -> add another tensor -> ReLU (a ResNet block's tail,
  ``relu(bn3(conv3(y)) + identity)``) becomes :class:`FusedConvBNAddReLU2d` called on the conv's
  input and the other tensor, placed the same way. The add is ``+``, ``+=``,
  ``torch.add`` or ``.add``/``.add_`` without further arguments, the batch norm's result either
  operand (the one written by an in-place add), and the sum must have the ReLU as its only user.
- Any other ``nn.Conv2d`` -> ``nn.BatchNorm2d`` (torchvision's downsample ``nn.Sequential(conv,
  bn)``, a tail whose sum is used elsewhere too) becomes :class:`FusedConvBN2d`, placed the same
  way; the batch norm's result may have several users.
- ``nn.Linear`` -> activation becomes :class:`hal.nn.modules.FusedLinearAct`, which borrows the
  linear the same way (``<linear name>_fused``) and reads its parameters at each call.

Nothing of the model moves: the returned module lists its submodules, parameters and buffers in the
model's order and under the model's names (``named_parameters()`` and ``state_dict()`` equal the
model's, so optimizer state saved from either loads into the other), modules the forward never calls
included.

Hooks: a fused module calls the modules of its chain one by one (not the fused op) while any of them
has a forward, forward-pre or backward hook, registered before or after fusing, so every hook runs
with the arguments it sees in the original model. A module with hooks that the trace would enter (a
``nn.Sequential``, a block) is kept as one call, and its hooks run. Hooks on the model itself cannot
be kept (the GraphModule replaces it): fuse raises ValueError. Parametrized modules
(``torch.nn.utils.parametrize``, ``spectral_norm``) are called as they are and never fused.
``fuse_notes(gm)`` lists what was left unfused or runs unfused for these reasons.

A fused conv module's train/eval mode is its batch norm's (``model.train()`` and ``.eval()`` reach
both; a batch norm put in eval on its own, to freeze its statistics, stays frozen).

ReLU is ``nn.ReLU``, ``F.relu``, ``torch.relu`` or ``.relu()``; the activations of a linear are those
of ``hal.ops.linear`` (relu, gelu, gelu_tanh, silu, sigmoid, tanh) as modules, functions or methods.
"""

from __future__ import annotations

import copy
import logging
import operator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from hal.nn.agreement import has_hooks
from hal.nn.modules import FusedConvBN2d, FusedConvBNAddReLU2d, FusedConvBNReLU2d, FusedLinearAct, fusion_problem

log = logging.getLogger("hal.nn.fuse")
#: the key of ``GraphModule.meta`` under which fuse leaves its notes (:func:`fuse_notes`)
_NOTES = "hal_fuse_notes"

_ACT_MODULES: dict[type, Callable[[nn.Module], Optional[str]]] = {
    nn.ReLU: lambda m: "relu",
    nn.GELU: lambda m: {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate),
    nn.SiLU: lambda m: "silu",
    nn.Sigmoid: lambda m: "sigmoid",
    nn.Tanh: lambda m: "tanh",
}
_ACT_FUNCTIONS: dict[Any, str] = {
    F.relu: "relu",
    torch.relu: "relu",
    torch.relu_: "relu",
    F.silu: "silu",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
}
_ACT_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid", "tanh": "tanh", "tanh_": "tanh"}
#: a plain sum of two tensors, as functions and as methods; the in-place ones write their first operand
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_ADD_METHODS = ("add", "add_")
_IN_PLACE_ADDS = (operator.iadd, "add_")


def fuse(model: nn.Module, inplace: bool = False) -> fx.GraphModule:
    """Return a GraphModule computing the same function as ``model`` with its conv -> batch-norm
    (-> add -> ReLU, or -> ReLU) and linear -> activation chains replaced by hal's fused modules.

    ``inplace=False`` (default) works on a deep copy; ``inplace=True`` shares the model's modules and
    parameters with the result (the model object itself is not changed). Raises ValueError when the
    model cannot be traced by torch.fx, or has hooks of its own (module docstring)."""
    if has_hooks(model):
        raise ValueError(
            f"hal.nn.fuse cannot keep the hooks registered on {type(model).__name__} itself (the traced GraphModule "
            "replaces the model); fuse its submodules instead (their hooks are kept), or register the hooks on the "
            "module fuse returns"
        )
    if not inplace:
        model = copy.deepcopy(model)
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError ...) on untraceable code
        raise ValueError(
            f"hal.nn.fuse could not trace {type(model).__name__} with torch.fx ({type(exc).__name__}: {exc}); "
            "fuse the traceable submodules instead (for example each block of the model)"
        ) from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    calls = _call_counts(gm)
    erased: set[fx.Node] = set()
    notes: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node in erased:
            continue
        module = gm.get_submodule(node.target)
        if type(module) is nn.Conv2d:
            erased.update(_fuse_conv_bn(gm, node, calls, notes))
        elif type(module) is nn.Linear:
            erased.update(_fuse_linear_act(gm, node, calls, notes))
        elif isinstance(module, (nn.Conv2d, nn.Linear)) and parametrize.is_parametrized(module):
            notes.append(f"{node.target}: left unfused, parametrized ({', '.join(module.parametrizations)}): its weight is computed "
                         "by the parametrization at each call")
    # no dead-code elimination: each fusion erases its own chain, and fx counts methods as pure, so
    # it would drop an in-place write whose result goes unused (``g.add_(y); return relu(g)``)
    gm.graph.lint()
    gm.recompile()
    _keep_layout(gm, model)
    gm.meta[_NOTES] = notes
    for note in notes:
        log.info("hal.nn.fuse: %s", note)
    return gm


def fuse_notes(gm: nn.Module) -> list[str]:
    """What :func:`fuse` left unfused, or fused but runs unfused while hooks are registered, and why
    (empty for a module fuse did not return)."""
    meta = getattr(gm, "meta", None)
    return list(meta.get(_NOTES, [])) if isinstance(meta, dict) else []


class _Tracer(fx.Tracer):
    """torch.fx's tracer, keeping a module with hooks or parametrizations as one call (tracing into
    it would drop its hooks, or unroll its parametrization)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) or has_hooks(m) or parametrize.is_parametrized(m)


def _keep_layout(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` (and the containers fx made for it) ``model``'s parameters, buffers and children
    in ``model``'s order, adding those the forward never uses (fx keeps only what the graph uses, in
    the order of use); entries of ``gm``'s own (the fused modules) follow."""
    if gm is model:
        return
    for attr in ("_parameters", "_buffers", "_modules"):
        mine, theirs = getattr(gm, attr), getattr(model, attr)
        ordered = {name: mine.get(name, value) for name, value in theirs.items()}
        ordered.update((name, value) for name, value in mine.items() if name not in ordered)
        mine.clear()
        mine.update(ordered)
    gm._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
    for name, child in model._modules.items():
        mine_child = gm._modules.get(name)
        if child is not None and mine_child is not None:
            _keep_layout(mine_child, child)


def _hook_note(path: str, chain: str, modules: list[Optional[nn.Module]]) -> Optional[str]:
    """The note for a fused chain whose modules have hooks now (None: no hooks)."""
    if not any(m is not None and has_hooks(m) for m in modules):
        return None
    return f"{path}: {chain} fused, but runs its modules unfused while they have hooks (they have now)"


def _call_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            counts[n.target] = counts.get(n.target, 0) + 1
    return counts


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _activation(gm: fx.GraphModule, node: Optional[fx.Node], source: fx.Node) -> Optional[str]:
    """The hal activation name that ``node`` applies to ``source`` (None: not an activation of it)."""
    if node is None or not node.args or node.args[0] is not source:
        return None
    if node.op == "call_module":
        rule = _ACT_MODULES.get(type(gm.get_submodule(node.target)))
        return rule(gm.get_submodule(node.target)) if rule and len(node.args) == 1 and not node.kwargs else None
    extra = {k: v for k, v in node.kwargs.items() if k != "inplace"}
    if node.op == "call_function":
        if node.target is F.gelu and len(node.args) == 1 and set(extra) <= {"approximate"}:
            return {"none": "gelu", "tanh": "gelu_tanh"}.get(extra.get("approximate", "none"))
        if len(node.args) == 1 and not extra:
            return _ACT_FUNCTIONS.get(node.target)
        return None
    if node.op == "call_method" and len(node.args) == 1 and not extra:
        return _ACT_METHODS.get(node.target)
    return None


def _act_module(gm: fx.GraphModule, node: fx.Node) -> Optional[nn.Module]:
    """The module an activation node calls (None: a function or method call)."""
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _fuse_conv_bn(gm: fx.GraphModule, conv_node: fx.Node, calls: dict[str, int], notes: list[str]) -> list[fx.Node]:
    """Fuse the longest chain starting at ``conv_node`` (conv -> bn -> ReLU, conv -> bn -> add ->
    ReLU, or conv -> bn) if there is one; returns the erased nodes."""
    bn_node = _only_user(conv_node)
    if bn_node is None or _conv_of(gm, bn_node, calls) is not conv_node:
        return []
    conv, bn = gm.get_submodule(conv_node.target), gm.get_submodule(bn_node.target)
    after = _only_user(bn_node)
    residual = _residual(after, bn_node)
    if residual is not None and after.args[0] is residual and _only_user(residual) is after and _conv_of(gm, residual, calls) is not None:
        residual = None  # both operands end conv -> bn chains: the first one takes the add (``out += identity``: the block's own branch)
    relu_after_add = _only_user(after) if residual is not None else None
    if _activation(gm, after, bn_node) == "relu":
        act = _act_module(gm, after)
        fused, chain, args = FusedConvBNReLU2d.from_modules(conv, bn, borrow=True, act=act), [conv_node, bn_node, after], (conv_node.args[0],)
    elif residual is not None and _activation(gm, relu_after_add, after) == "relu":
        act = _act_module(gm, relu_after_add)
        fused, chain, args = (FusedConvBNAddReLU2d.from_modules(conv, bn, borrow=True, act=act), [conv_node, bn_node, after, relu_after_add],
                              (conv_node.args[0], residual))
    else:
        act = None
        fused, chain, args = FusedConvBN2d.from_modules(conv, bn, borrow=True), [conv_node, bn_node], (conv_node.args[0],)
    target = _free_path(gm, f"{conv_node.target}_fused")
    gm.add_submodule(target, fused)
    note = _hook_note(target, f"{conv_node.target} -> {bn_node.target}", [conv, bn, act])
    if note:
        notes.append(note)
    return _replace(gm, chain, target, args)


def _free_path(gm: fx.GraphModule, path: str) -> str:
    """``path``, or ``path`` with a number appended where a module of that path exists already."""
    candidate, n = path, 1
    while True:
        try:
            gm.get_submodule(candidate)
        except AttributeError:
            return candidate
        n += 1
        candidate = f"{path}{n}"


def _conv_of(gm: fx.GraphModule, bn_node: fx.Node, calls: dict[str, int]) -> Optional[fx.Node]:
    """The ``nn.Conv2d`` call feeding ``bn_node`` when the two can be fused (the batch norm a
    module call on the convolution's result alone, its only user, each module called once), else None."""
    if bn_node.op != "call_module" or len(bn_node.args) != 1 or bn_node.kwargs:
        return None
    conv_node = bn_node.args[0]
    if not isinstance(conv_node, fx.Node) or conv_node.op != "call_module" or _only_user(conv_node) is not bn_node:
        return None
    if fusion_problem(gm.get_submodule(conv_node.target), gm.get_submodule(bn_node.target)):
        return None
    return conv_node if calls[conv_node.target] == 1 and calls[bn_node.target] == 1 else None


def _residual(node: Optional[fx.Node], source: fx.Node) -> Optional[fx.Node]:
    """The other operand of ``node`` when it is a plain sum of ``source``'s result and another
    tensor (in place only into ``source``'s result: writing the other tensor would be lost), else None."""
    if node is None or len(node.args) != 2 or node.kwargs:
        return None
    is_add = (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (node.op == "call_method" and node.target in _ADD_METHODS)
    if not is_add:
        return None
    first, second = node.args
    if first is source and isinstance(second, fx.Node) and second is not source:
        return second
    if second is source and isinstance(first, fx.Node) and first is not source and node.target not in _IN_PLACE_ADDS:
        return first
    return None


def _fuse_linear_act(gm: fx.GraphModule, lin_node: fx.Node, calls: dict[str, int], notes: list[str]) -> list[fx.Node]:
    """Fuse the chain starting at ``lin_node`` if it is one; returns the erased nodes."""
    act_node = _only_user(lin_node)
    act = _activation(gm, act_node, lin_node)
    if act is None or calls[lin_node.target] != 1 or len(lin_node.args) != 1 or lin_node.kwargs:
        return []
    linear, act_module = gm.get_submodule(lin_node.target), _act_module(gm, act_node)
    target = _free_path(gm, f"{lin_node.target}_fused")
    gm.add_submodule(target, FusedLinearAct(linear, act, act_module))
    note = _hook_note(target, f"{lin_node.target} -> {act}", [linear, act_module])
    if note:
        notes.append(note)
    return _replace(gm, [lin_node, act_node], target, (lin_node.args[0],))


def _replace(gm: fx.GraphModule, chain: list[fx.Node], target: str, args: tuple) -> list[fx.Node]:
    """Replace ``chain`` (first to last link) by one call of module ``target`` on ``args`` (nodes
    defined before the last link); returns the erased nodes."""
    last = chain[-1]
    with gm.graph.inserting_before(last):
        new = gm.graph.call_module(target, args)
    new.meta.update(last.meta)
    last.replace_all_uses_with(new)
    for node in reversed(chain):
        gm.graph.erase_node(node)
    return chain
