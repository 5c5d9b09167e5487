"""hal.nn.patch for FP8 Hugging Face decoders: the amaxes of the FP8 projections' inputs, reduced by the
ops that write those inputs (issue 40's FP8 lever "quantisation fused into its producers").

``hal.fp8.convert`` with per-tensor current scaling (which ``hal.nn.patch(model, fp8=...)`` and
``hal.optimize(fp8=...)`` run after the swaps of :mod:`hal.nn.patch_hf`) calls :func:`pass_amaxes`: a
Llama-family decoder layer whose norms, attention and MLP are hal.nn.patch's changes class to a
subclass (:class:`_AmaxDecoderLayer`) that hands its FP8 projections the amaxes of their inputs
(``hal.ops.rms_norm_amax`` for q/k/v and gate/up, ``hal.ops.swiglu_amax`` for down), so each input's
FP8 cast reads it once; the same numbers as without. Its forward is checked to wire the modules as
the original does (stand-in children record what each is given).
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable

import torch
from torch import nn

import hal
from hal.nn.agreement import has_hooks
from hal.nn.patch_hf import X_AMAX, _HalAttention, _subclass, log


def _norm_amax(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`hal.nn.patch.RMSNorm`'s forward on ``hal.ops.rms_norm_amax``: its result and amax."""
    weight = norm.weight
    if x.dtype != weight.dtype:  # promoted as the module does it
        dtype = torch.promote_types(x.dtype, weight.dtype)
        x, weight = x.to(dtype), weight.to(dtype)
    return hal.ops.rms_norm_amax(x, (x.shape[-1],), weight, norm.variance_epsilon)


def _mlp_amax(mlp: nn.Module, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """:class:`hal.nn.patch.SwiGLUMLP`'s forward with the amaxes of its projections' inputs: x's
    (given) for gate and up, the SwiGLU's own (``hal.ops.swiglu_amax``) for down."""
    h, h_amax = hal.ops.swiglu_amax(mlp.gate_proj(x, x_amax=amax), mlp.up_proj(x, x_amax=amax))
    return mlp.down_proj(h, x_amax=h_amax)


#: (hal.nn.patch's RMSNorm, its SwiGLUMLP, hal.fp8.Linear), read once by :func:`pass_amaxes` (so a
#: forward traced by torch.compile reads a plain global, no module lookup)
_CLASSES: list[type] = []


def _classes() -> list[type]:
    """:data:`_CLASSES`, filled on first use. ``hal.fp8.convert`` imports this module and calls
    :func:`pass_amaxes`, so hal.fp8.linear and hal.nn.patch are loaded when it runs; they are read
    from ``sys.modules``, not imported: hal.nn.patch imports hal.fp8, whose convert imports this, and
    the core imports one way (tests/core/test_wiring.py refuses a cycle, lazy imports included)."""
    if not _CLASSES:
        patch, fp8 = sys.modules["hal.nn.patch"], sys.modules["hal.fp8.linear"]
        _CLASSES[:] = [patch.RMSNorm, patch.SwiGLUMLP, fp8.Linear]
    return _CLASSES


def _takes_amax(*linears: nn.Module) -> bool:
    """Each is a ``hal.fp8.Linear`` whose input cast uses a given amax (per-tensor current scaling)."""
    fp8_linear = (_CLASSES or _classes())[2]
    return all(isinstance(m, fp8_linear) and m.takes_input_amax and not has_hooks(m) for m in linears)


def _amax_plan(layer: nn.Module) -> tuple[bool, bool]:
    """(the attention's projections get the input norm's amax, the MLP's get theirs): where the norm
    is hal.nn.patch's RMSNorm, the attention hal's (:class:`_HalAttention`) and the MLP hal.nn.patch's
    SwiGLUMLP, without hooks (their forwards are run here, not called), and the projections take
    amaxes. Read at every forward: the model may change after it was patched."""
    LlamaRMSNorm, SwiGLUMLP, _ = _CLASSES or _classes()  # (filled by pass_amaxes, which made the layer's class)
    modules = layer._modules
    norm1, attn, norm2, mlp = (modules.get(n) for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))
    attn_ok = (type(norm1) is LlamaRMSNorm and not has_hooks(norm1) and isinstance(attn, _HalAttention)
               and _takes_amax(attn.q_proj, attn.k_proj, attn.v_proj))
    mlp_ok = (type(norm2) is LlamaRMSNorm and not has_hooks(norm2) and type(mlp) is SwiGLUMLP and not has_hooks(mlp)
              and _takes_amax(mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return attn_ok, mlp_ok


def _layer_body(layer: nn.Module, hidden_states: torch.Tensor, attention_mask: Any, position_ids: Any, past_key_values: Any,
                use_cache: Any, position_embeddings: Any, kwargs: dict[str, Any], plan: tuple[bool, bool]) -> torch.Tensor:
    """transformers' Llama decoder layer (pre-norm attention, then pre-norm MLP, each added to the
    residual), the amaxes passed along where ``plan`` says (else its modules are called as there)."""
    residual = hidden_states
    if plan[0]:
        hidden_states, amax = _norm_amax(layer.input_layernorm, hidden_states)
        kwargs = {**kwargs, X_AMAX: amax}
    else:
        hidden_states = layer.input_layernorm(hidden_states)
    hidden_states, _ = layer.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                       past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings,
                                       **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    if plan[1]:
        hidden_states, amax = _norm_amax(layer.post_attention_layernorm, hidden_states)
        hidden_states = _mlp_amax(layer.mlp, hidden_states, amax)
    else:
        hidden_states = layer.mlp(layer.post_attention_layernorm(hidden_states))
    return residual + hidden_states


class _AmaxDecoderLayer(nn.Module):
    """A Llama-family decoder layer (``transformers``' ``LlamaDecoderLayer`` and those written as it)
    whose FP8 projections get the amax of their input from the op that produced it: the RMSNorms run
    ``hal.ops.rms_norm_amax``, the SwiGLU ``hal.ops.swiglu_amax``, and the q/k/v, gate/up and down
    projections (``hal.fp8.Linear`` with per-tensor current scaling) take that amax
    (``forward(x, x_amax)``), so each input's FP8 cast reads it once instead of twice. Otherwise (other
    recipes, bf16 layers, hooks) the original forward runs. Its forward is checked, when the class
    is changed, to wire its modules as the original does (:func:`_same_wiring`)."""

    _hal_kind = "DecoderLayer(fp8 amaxes)"
    #: read by hal.optimize's explain (hal.fast.plan.fp8), which counts such layers
    _hal_passes_amaxes = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = _amax_plan(self)
        if not (plan[0] or plan[1]):
            return super().forward(*args, **kwargs)
        return _fused_call(self, plan, *args, **kwargs)


def _fused_call(layer: nn.Module, plan: tuple[bool, bool], hidden_states: torch.Tensor, attention_mask: Any = None,
                position_ids: Any = None, past_key_values: Any = None, use_cache: Any = False, position_embeddings: Any = None,
                **kwargs: Any) -> torch.Tensor:
    """:func:`_layer_body` called with the arguments of transformers' Llama decoder layer."""
    return _layer_body(layer, hidden_states, attention_mask, position_ids, past_key_values, use_cache, position_embeddings, kwargs, plan)


class _Stub(nn.Module):
    """A stand-in child of :func:`_same_wiring`'s probe: records its calls, returns ``fn`` of them."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn, self.calls = fn, []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


def _same_wiring(layer: nn.Module) -> bool:
    """Whether ``layer``'s own forward wires its norms, attention and MLP as :func:`_layer_body`
    does: both run on a copy of the layer whose four children are stand-ins (distinct affine maps,
    the attention's recording every argument it is given), on the same probe; their results and the
    attention's arguments must be identical. No weight is copied or run."""
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(23))
    extra = {"attention_mask": torch.zeros(1, 1, 3, 3, dtype=torch.float64), "position_ids": torch.arange(3)[None],
             "past_key_values": None, "use_cache": False, "position_embeddings": (x[..., :2].clone(), x[..., 2:].clone()),
             "hal_probe": object()}
    runs = []
    for body in (type(layer).forward, None):
        trial = copy.copy(layer)
        trial._modules = dict(layer._modules)
        stubs = {"input_layernorm": _Stub(lambda t: t * 2 + 1), "post_attention_layernorm": _Stub(lambda t: t * 3 - 2),
                 "self_attn": _Stub(lambda hidden_states=None, **kw: (hidden_states * 5 - 1, None)), "mlp": _Stub(lambda t: t * 7 + 3)}
        trial._modules.update(stubs)
        try:
            with torch.no_grad():
                if body is not None:
                    out = body(trial, x, **extra)
                else:
                    kw = {k: v for k, v in extra.items() if k not in ("attention_mask", "position_ids", "past_key_values", "use_cache",
                                                                     "position_embeddings")}
                    out = _layer_body(trial, x, extra["attention_mask"], extra["position_ids"], None, False, extra["position_embeddings"],
                                      kw, (False, False))
        except Exception as exc:  # noqa: BLE001 - a forward the probe cannot run is left alone
            log.debug("hal.nn.patch: wiring probe of %s failed: %s", type(layer).__name__, exc)
            return False
        runs.append((out, [(n, s.calls) for n, s in stubs.items()]))
    (want, want_calls), (got, got_calls) = runs
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and torch.equal(want, got)):
        return False
    return all(len(a) == len(b) and all(_same_call(c, d) for c, d in zip(a, b)) for (_, a), (_, b) in zip(want_calls, got_calls))


def _same_call(a: tuple, b: tuple) -> bool:
    """Two recorded calls with equal tensor arguments and identical other arguments, by position and name."""
    (args_a, kw_a), (args_b, kw_b) = a, b
    if len(args_a) != len(args_b) or set(kw_a) != set(kw_b):
        return False
    pairs = list(zip(args_a, args_b)) + [(kw_a[k], kw_b[k]) for k in kw_a]
    return all(torch.equal(u, v) if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) else u is v for u, v in pairs)


def pass_amaxes(model: nn.Module) -> int:
    """Give ``model``'s Llama-family decoder layers the forward of :class:`_AmaxDecoderLayer` (the
    class changes in place; no state changes), where the layer's norms, attention and MLP are
    hal.nn.patch's and its forward is checked to wire them as transformers' Llama layer does
    (:func:`_same_wiring`). ``hal.fp8.convert`` calls it: the layers whose projections it made FP8
    with per-tensor current scaling then pass the amaxes. Returns how many layers it changed."""
    from hal.nn.recompute import _Recomputed, _recomputed_class

    if "hal.fp8.linear" not in sys.modules:  # no FP8 layer can exist: no amax to pass
        return 0
    LlamaRMSNorm, SwiGLUMLP, _ = _classes()
    changed = 0
    for m in list(model.modules()):
        if isinstance(m, _AmaxDecoderLayer) or set(m._modules) != {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}:
            continue
        base = getattr(type(m), "_hal_original", type(m))  # under hal.nn.recompute: the layer's own class
        kids = m._modules
        ours = (type(kids["input_layernorm"]) is LlamaRMSNorm and type(kids["post_attention_layernorm"]) is LlamaRMSNorm
                and isinstance(kids["self_attn"], _HalAttention) and type(kids["mlp"]) is SwiGLUMLP)
        if not ours or not base.__module__.startswith("transformers.") or has_hooks(m) or not _same_wiring(m):
            continue
        cls = _subclass(base, _AmaxDecoderLayer)
        m.__class__ = _recomputed_class(cls, type(m)._hal_policy) if isinstance(m, _Recomputed) else cls
        changed += 1
    return changed


__all__ = ["pass_amaxes"]
