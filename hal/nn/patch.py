"""``hal.nn.patch(model)``: hal's modules swapped into a model in place, by structure, without
tracing: for models torch.fx cannot trace (Hugging Face ``transformers`` models among them).

What is swapped (parameters, buffers and state_dict keys stay as they were):

- ``nn.LayerNorm`` and ``nn.RMSNorm`` (exact types) become ``hal.nn.LayerNorm`` / ``hal.nn.RMSNorm``
  (the class of the module object changes; hal's classes add no state).
- RMSNorm modules written as Llama's (``transformers``' ``LlamaRMSNorm``, ``MistralRMSNorm``,
  ``Qwen2RMSNorm`` ...): a module whose only state is a 1-d ``weight`` and a float
  ``variance_epsilon`` becomes :class:`RMSNorm` (``hal.ops.rms_norm`` in the dtype that ``weight *
  x`` promotes to), if it computes the same function (below).
- SwiGLU MLPs written as Llama's: a module with ``nn.Linear`` children ``gate_proj``, ``up_proj``,
  ``down_proj`` and an activation child ``act_fn`` (and no other state) becomes :class:`SwiGLUMLP`
  (``down_proj(hal.ops.swiglu(gate_proj(x), up_proj(x)))``, the same linear modules), if it
  computes the same function.
- ``nn.Sequential`` (exact type) holding conv -> batch-norm -> ReLU, conv -> batch-norm or linear ->
  activation chains becomes :class:`Sequential`, whose forward runs each chain as one fused hal
  module (``hal.nn.FusedConvBNReLU2d``, ``hal.nn.FusedConvBN2d``: torchvision's downsample
  ``nn.Sequential(conv, bn)``, ``hal.nn.Linear`` with the activation) over the same child modules.
  A block's residual add is inside its ``forward``, out of reach without tracing (``hal.nn.fuse``
  fuses it into ``FusedConvBNAddReLU2d``).
  A module with hooks is never part of a chain (the hooks would no longer run).

"Computes the same function" is checked, not assumed: a copy of the module with random parameters
and its replacement are run on a random input; the replacement is used only if their results agree
to the dtype's rounding (same dtype and shape). A module whose structure only looks like a known one
(an RMSNorm scaling by another function of ``weight``, an MLP with another activation) is left alone, and so
is one the check cannot run on (parameters on the meta device). The check costs a copy of the
module and one small forward of each (milliseconds per module).

Hugging Face ``transformers`` decoder LMs (Llama, Mistral, Qwen2, Gemma, Mixtral; module
:mod:`hal.nn.patch_hf`, which says what and how): Gemma's ``(1 + weight)`` RMSNorm, Gemma's GeGLU MLP,
the attention with its rotary embedding (``hal.ops.rotary_embedding`` and
``hal.ops.scaled_dot_product_attention``, the attention module's class changed to a subclass: no
process-wide monkey patch, the config untouched), Mixtral's experts (``hal.ops.grouped_gemm``), and
the LM head with its loss (``hal.ops.linear_cross_entropy``; with ``labels`` the output's ``logits``
is None, the logits never materialised; without labels the logits are returned as before). The
head is patched only on the model given to ``patch`` itself (the causal LM), after its submodules,
checked by running the model on six random tokens both ways. The patched model keeps the
``transformers`` contract otherwise: ``forward``'s signature and arguments, packed sequences,
``output_attentions`` from the keyword or the config, ``set_experts_implementation`` and
``torch.compile`` (:mod:`hal.nn.patch_hf` says how).

Reporting: the logger ``hal.nn.patch`` says at INFO how many modules of each kind were swapped.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

import hal
from hal.nn import patch_hf
from hal.nn.agreement import has_hooks, probe, random_copy, same, state_is
from hal.nn.fuse import _ACT_MODULES
from hal.nn.modules import FusedConvBN2d, FusedConvBNReLU2d, LayerNorm, RMSNorm as HalRMSNorm, fusion_problem, linear_act
from hal.nn.weight_copies import PLAIN_LINEARS

log = logging.getLogger("hal.nn.patch")

#: (rtol, atol) within which a replacement must agree with the module it replaces


class RMSNorm(nn.Module):
    """Llama-style RMSNorm on ``hal.ops.rms_norm``: ``weight * x / sqrt(mean(x²) + eps)`` in the
    dtype that ``weight`` and ``x`` promote to (as ``transformers``' ``LlamaRMSNorm`` returns it,
    rounded once instead of twice). Attributes ``weight`` and ``variance_epsilon`` as there."""

    def __init__(self, weight: nn.Parameter, variance_epsilon: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != weight.dtype:  # else no conversion: Tensor.to costs host time even when it returns its tensor
            dtype = torch.promote_types(x.dtype, weight.dtype)
            x, weight = x.to(dtype), weight.to(dtype)
        return hal.ops.rms_norm(x, (x.shape[-1],), weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gate and product as one
    ``hal.ops.swiglu`` call; the three ``nn.Linear`` children are those of the replaced MLP."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(hal.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Sequential(nn.Sequential):
    """``nn.Sequential`` whose conv -> batch-norm (-> ReLU) and linear -> activation runs are each one
    fused hal computation over the same child modules, which it borrows (their parameters read as
    each call finds them; the fused conv modules take their mode from the batch norm).

    The plan is made when the module is patched (:meth:`plan`), not in ``forward``: building
    modules inside a forward that torch.compile traces breaks its graph (and under
    ``fullgraph=True`` fails), and an attribute first set by a traced forward costs a recompilation
    at the next step. It follows the children: an eager forward that finds a child replaced, or one
    that gained or lost hooks, plans again; a compiled one runs the children as ``nn.Sequential``
    does until an eager call has planned again."""

    _hal_steps: tuple = ()
    _hal_children: tuple = ()
    _hal_hooks: tuple = ()

    def plan(self) -> None:
        """Plan the fused steps over the current children (see the class docstring)."""
        children = tuple(self._modules.values())
        self._hal_steps, self._hal_children, self._hal_hooks = _plan(children), children, tuple(map(has_hooks, children))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Sequential's name
        children = tuple(self._modules.values())
        if not self._planned_for(children):
            if torch.compiler.is_compiling():
                return super().forward(input)
            self.plan()
        for run in self._hal_steps:
            input = run(input)
        return input

    def _planned_for(self, children: tuple[nn.Module, ...]) -> bool:
        built = self._hal_children
        return (len(built) == len(children) and all(a is b for a, b in zip(built, children))
                and self._hal_hooks == tuple(map(has_hooks, children)))


class _LinearAct:
    """linear -> activation as one ``hal.ops.linear`` call over the ``nn.Linear`` it borrows (its
    parameters read at each call); a plain object, made without a module or a parameter."""

    def __init__(self, linear: nn.Linear, act: str) -> None:
        self.linear, self.act = linear, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear_act(self.linear, self.act, x)


def _activation(m: nn.Module) -> Optional[str]:
    rule = _ACT_MODULES.get(type(m))
    return rule(m) if rule is not None and not has_hooks(m) else None


def _plan(children: tuple[nn.Module, ...]) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """The callables a :class:`Sequential` runs: fused wrappers for its chains, children elsewhere."""
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    i = 0
    while i < len(children):
        m = children[i]
        nxt = children[i + 1] if i + 1 < len(children) else None
        after = children[i + 2] if i + 2 < len(children) else None
        conv_bn = type(m) is nn.Conv2d and nxt is not None and not fusion_problem(m, nxt) and not has_hooks(m) and not has_hooks(nxt)
        if conv_bn and after is not None and _activation(after) == "relu":
            steps.append(FusedConvBNReLU2d.from_modules(m, nxt, borrow=True))
            i += 3
        elif conv_bn:
            steps.append(FusedConvBN2d.from_modules(m, nxt, borrow=True))
            i += 2
        elif type(m) in PLAIN_LINEARS and nxt is not None and _activation(nxt) is not None and not has_hooks(m):
            steps.append(_LinearAct(m, _activation(nxt)))
            i += 2
        else:
            steps.append(m)
            i += 1
    return tuple(steps)


def _llama_rms_norm(m: nn.Module) -> Optional[nn.Module]:
    weight = getattr(m, "weight", None)
    if not (state_is(m, {"weight"}, set()) and isinstance(getattr(m, "variance_epsilon", None), float) and weight.dim() == 1):
        return None
    trial = random_copy(m, 1, 0.5, 1.0)
    x = probe((2, 3, weight.shape[0]), weight, 0)
    if not same("Llama RMSNorm", lambda: (trial(x), RMSNorm(trial.weight, trial.variance_epsilon)(x)), weight):
        return None
    return RMSNorm(m.weight, m.variance_epsilon)


def _swiglu_mlp(m: nn.Module) -> Optional[nn.Module]:
    names = ("gate_proj", "up_proj", "down_proj")
    if not state_is(m, set(), {*names, "act_fn"}) or not all(type(m._modules[n]) in PLAIN_LINEARS for n in names):
        return None
    if any(has_hooks(c) for c in m.modules()):
        return None
    trial = random_copy(m, 2, 0.5, 1.0)
    gate = m._modules["gate_proj"]
    x = probe((2, 3, gate.in_features), gate.weight, 0)
    if not same("SwiGLU MLP", lambda: (trial(x), SwiGLUMLP(*(trial._modules[n] for n in names))(x)), gate.weight):
        return None
    replacement = SwiGLUMLP(*(m._modules[n] for n in names))
    replacement.train(m.training)
    return replacement


def _swap(m: nn.Module) -> Optional[nn.Module]:
    """The module to put in ``m``'s place (``m`` itself when its class was changed), or None."""
    if has_hooks(m):
        return None
    if type(m) is nn.LayerNorm:
        m.__class__ = LayerNorm
        return m
    if type(m) is nn.RMSNorm:
        m.__class__ = HalRMSNorm
        return m
    if type(m) is nn.Sequential:
        if any(s is not c for s, c in zip(_plan(tuple(m._modules.values())), m._modules.values())):
            m.__class__ = Sequential
            m.plan()
            return m
        return None
    if any(map(parametrize.is_parametrized, m.modules())):
        # reading a parametrized weight runs its parametrization (spectral_norm's power iteration
        # updates its vectors in training mode): recognising the module would change the model
        return None
    return _llama_rms_norm(m) or _swiglu_mlp(m) or patch_hf.swap(m)


def patch(model: nn.Module, fp8: Any = None) -> nn.Module:
    """Swap hal's modules into ``model`` in place (module docstring: what, and when) and return it.

    Never changes what the model computes beyond the dtypes' rounding; a module that cannot be
    recognised is left as it is. Logs (logger ``hal.nn.patch``, INFO) how many modules of each kind
    were swapped. Raises ValueError when ``model`` itself would have to be replaced (patch its
    parent, or the model's submodules).

    ``fp8``: a ``hal.fp8`` recipe (``hal.fp8.CurrentScaling()``, ...) to run, besides, the linear
    layers inside the model's repeated blocks (a transformer's layers) in FP8:
    ``hal.fp8.convert(model, fp8, within="auto")`` after the swap. FP8 changes the numbers beyond
    bf16's rounding, so only where asked; a device without FP8 raises ``UnsupportedError`` before
    anything is changed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hal.nn.patch expects an nn.Module, got {type(model).__name__}")
    if fp8 is not None:
        import hal.fp8

        if not isinstance(fp8, hal.fp8.Recipe):
            raise TypeError(f"hal.nn.patch: fp8 must be None or a hal.fp8 recipe (hal.fp8.CurrentScaling(), ...), "
                            f"not {type(fp8).__name__}")
        devices = {p.device for p in model.parameters() if not p.is_meta}
        for device in devices:  # before anything is swapped
            hal.fp8.device.require_fp8("hal.nn.patch(fp8=...)", device, (fp8.format, fp8.backward_format))
    top = _swap(model)
    if top is not None and top is not model:
        raise ValueError(f"hal.nn.patch cannot replace the model itself ({type(model).__name__}); call it on a module that contains it")
    counts: dict[str, int] = {}
    if top is not None:
        counts[_kind(model)] = 1
    _patch_children(model, counts, set())
    if patch_hf.patch_lm_head(model):
        counts[_kind(model)] = counts.get(_kind(model), 0) + 1
    if fp8 is not None:
        import hal.fp8

        before = sum(isinstance(m, hal.fp8.Linear) for m in model.modules())
        hal.fp8.convert(model, fp8, within="auto")
        counts["fp8.Linear"] = sum(isinstance(m, hal.fp8.Linear) for m in model.modules()) - before
    log.info("hal.nn.patch: %s", ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())) or "nothing to swap")
    return model


def _kind(m: nn.Module) -> str:
    """What a swapped module is called in the report: its class, or the kind a hal subclass of a
    ``transformers`` class names (those subclasses may keep the original class name)."""
    return getattr(type(m), "_hal_kind", type(m).__name__)


def _patch_children(parent: nn.Module, counts: dict[str, int], seen: set[int]) -> None:
    for name, child in list(parent._modules.items()):
        if child is None or id(child) in seen:
            continue
        seen.add(id(child))
        new = _swap(child)
        if new is not None:
            counts[_kind(new)] = counts.get(_kind(new), 0) + 1
            if new is not child:
                parent._modules[name] = new
                seen.add(id(new))
        _patch_children(new if new is not None else child, counts, seen)
