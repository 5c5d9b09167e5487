"""The Hugging Face ``transformers`` part of :func:`hal.nn.patch`: module kinds of decoder LMs
(Llama, Mistral, Qwen2, Gemma, Mixtral as ``transformers`` 5.x writes them) recognised by structure
and put on hal ops, each only after it was checked to compute what the module computed.

- Gemma's RMSNorm (``weight`` and ``eps``; ``x * rsqrt(mean(x²) + eps) * (1 + weight)`` in float32,
  rounded to x's dtype) becomes :class:`OffsetRMSNorm` (``hal.ops.rms_norm`` with ``1 + weight``).
- A GeGLU MLP (Llama's layout, ``act_fn`` the tanh GELU: Gemma's) becomes :class:`GeGLUMLP`: the gate's
  GELU fused into its GEMM (``hal.ops.linear(..., act="gelu_tanh")``), times ``up_proj``, then
  ``down_proj``.
- An attention module written as Llama's (``q_proj k_proj v_proj o_proj``, ``head_dim``,
  ``num_key_value_groups``, ``scaling``; the rotary embedding applied with ``rotate_half``) changes
  class to a subclass whose forward applies the rotary embedding with ``hal.ops.rotary_embedding``
  and attends with ``hal.ops.scaled_dot_product_attention`` (grouped-query attention by broadcasting
  a key/value head over its group of query heads, no copies). Inside a torch.compile graph it reads
  the rotary angles through :func:`hal.nn.realized.realized`, so that they are computed once, not in
  every layer's rotary kernel; eagerly it cuts the halves of them that the rotary op takes once per
  forward (:func:`_rotary_halves`), not in every layer. It does so for the ``"sdpa"`` and
  ``"eager"`` attention implementations, the masks those build (packed sequences' block-diagonal
  mask among them); anything else (flash attention, an attention dropout while training, a paged
  cache, a position bias, attention weights asked for by ``output_attentions``, as a keyword or in
  the config) runs the original forward. The model's config is not touched: other models, of the
  same class too, still run torch's code.
- Mixtral's experts (3-d ``gate_up_proj`` and ``down_proj``) change class to a subclass whose forward
  sorts the (token, expert) pairs by expert and runs each projection as one ``hal.ops.grouped_gemm``
  (``hal.ops.swiglu`` between them when ``act_fn`` is SiLU), with shapes that do not depend on the
  data (``torch.compile(fullgraph=True)`` traces it). It replaces the experts implementation the
  model had when patched; one picked afterwards with ``set_experts_implementation`` runs instead.
- The LM head with its loss: a causal LM whose ``lm_head`` is an ``nn.Linear`` and whose loss is
  ``ForCausalLMLoss`` changes class (keeping its class name, which ``save_pretrained`` records) so
  that a forward given ``labels`` computes the loss with ``hal.ops.linear_cross_entropy`` without
  materialising the logits: the output's ``logits`` is None then. Labels are shifted as HF does
  (or ``shift_labels`` is used), ``ignore_index`` (-100) rows are skipped, the mean is over counted
  rows, or the sum divided by ``num_items_in_batch`` when that is given (as ``ForCausalLMLoss``);
  Mixtral's router auxiliary loss is added as its forward adds it. Without labels the forward is the
  original one (logits returned). The patched ``forward`` has the original's signature (``generate``
  and ``Trainer`` read it) and takes every argument the original takes, by name or position.

- FP8 (``hal.fp8.convert`` with per-tensor current scaling): the attention takes the amax of its
  input for its q/k/v projections (the keyword ``X_AMAX``), which :mod:`hal.nn.patch_hf_amax`'s
  decoder layer passes.

Every check runs a randomised copy of the module (the LM head: the model itself, in eval mode, on six
random tokens) through the original and the replacement; the replacement is used only if they agree
to the dtype's rounding. Parameters are shared, never copied; state_dict keys do not change.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hal
from hal.nn.agreement import has_hooks, own_state, probe, random_copy, same
from hal.nn.modules import _cast, autocast_dtype
from hal.nn.realized import realized
from hal.nn.weight_copies import PLAIN_LINEARS, weight_in
from hal.tracing import is_compiling

_HALF = (torch.float16, torch.bfloat16)

log = logging.getLogger("hal.nn.patch")


# --- checks ---------------------------------------------------------------------------------------


def _is_function(act: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """``act`` computes ``fn`` (to float32 rounding) on [-6, 6]: sharper than a check through GEMMs."""
    x = torch.linspace(-6.0, 6.0, 481)
    try:
        with torch.no_grad():
            return bool(torch.allclose(act(x.clone()), fn(x), rtol=1e-6, atol=1e-7))
    except Exception:  # noqa: BLE001
        return False


def _subclass(cls: type, mixin: type, name: Optional[str] = None, namespace: Optional[Callable[[type], dict]] = None) -> type:
    """``cls`` with ``mixin``'s forward in front (one subclass per class, cached on the mixin);
    ``namespace(cls)`` adds class attributes made for ``cls``."""
    cache = mixin.__dict__.get("_hal_classes")
    if cache is None:
        cache = {}
        setattr(mixin, "_hal_classes", cache)
    if cls not in cache:
        attrs = {"__module__": __name__, "__doc__": mixin.__doc__, **(namespace(cls) if namespace else {})}
        cache[cls] = type(name or f"Hal{cls.__name__}", (mixin, cls), attrs)
    return cache[cls]


# --- norms and MLPs -----------------------------------------------------------------------------


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm on ``hal.ops.rms_norm``: ``x / sqrt(mean(x²) + eps) * (1 + weight)`` computed in
    float32 and rounded to x's dtype once (Gemma multiplies before the cast, unlike Llama). Attributes
    ``weight`` and ``eps`` as there."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hal.ops.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GeGLUMLP(nn.Module):
    """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``, the gate's GELU fused into its GEMM
    (``hal.ops.linear``, in the autocast dtype under autocast as ``nn.Linear``); the three
    ``nn.Linear`` children are those of the replaced MLP."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x)
        g = self.gate_proj
        gate = hal.ops.linear(_cast(x, dtype), _cast(g.weight, dtype), _cast(g.bias, dtype), "gelu_tanh")
        return self.down_proj(gate * self.up_proj(x))


def _gemma_rms_norm(m: nn.Module) -> Optional[nn.Module]:
    params, children, buffers = own_state(m)
    weight, eps = getattr(m, "weight", None), getattr(m, "eps", None)
    if params != {"weight"} or children or buffers or not isinstance(eps, float) or weight.dim() != 1 or hasattr(m, "variance_epsilon"):
        return None
    trial = random_copy(m, 11, 0.5)
    x = probe((2, 3, weight.shape[0]), weight, 12)
    if not same("Gemma RMSNorm", lambda: (trial(x), OffsetRMSNorm(trial.weight, eps)(x)), weight):
        return None
    return OffsetRMSNorm(m.weight, eps)


def _geglu_mlp(m: nn.Module) -> Optional[nn.Module]:
    names = ("gate_proj", "up_proj", "down_proj")
    params, children, buffers = own_state(m)
    if params or buffers or children != {*names, "act_fn"} or not all(type(m._modules[n]) in PLAIN_LINEARS for n in names):
        return None
    if any(has_hooks(c) for c in m.modules()) or not _is_function(m._modules["act_fn"], lambda t: F.gelu(t, approximate="tanh")):
        return None
    trial = random_copy(m, 13, 0.2)
    gate = m._modules["gate_proj"]
    x = probe((2, 3, gate.in_features), gate.weight, 14)
    if not same("GeGLU MLP", lambda: (trial(x), GeGLUMLP(*(trial._modules[n] for n in names))(x)), gate.weight):
        return None
    replacement = GeGLUMLP(*(m._modules[n] for n in names))
    replacement.train(m.training)
    return replacement


# --- attention with rotary embeddings -----------------------------------------------------------


def _first_half(c: torch.Tensor) -> torch.Tensor:
    """HF's cos or sin (batch, T, D), its halves equal, as rotary_embedding takes it: the view
    (batch, 1, T, D/2) of its first half, detached (the angles carry no gradient)."""
    return c.detach()[..., : c.shape[-1] // 2].unsqueeze(1)


#: the first halves of the latest forward's cos and sin (:func:`_rotary_halves`): weak references
#: to the two, then their halves; None once either was freed
_last_halves: Optional[tuple[weakref.ref, weakref.ref, torch.Tensor, torch.Tensor]] = None


def _forget_halves(freed: weakref.ref) -> None:
    """Drop the cached halves when the cos or sin they view is freed (at the end of its forward),
    so that they do not hold its memory after it."""
    global _last_halves
    entry = _last_halves
    if entry is not None and (freed is entry[0] or freed is entry[1]):  # identity: == of live references compares tensors
        _last_halves = None


def _rotary_halves(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first halves of HF's cos and sin (:func:`_first_half`), cut once per forward: every layer
    of a forward gets the same two tensors, so the views made for the first layer serve the others
    (found by identity; being views, they always show the tensors' current values). Inside a
    torch.compile graph they are cut per layer, with no Python state in the trace, from the angles
    read through :func:`hal.nn.realized.realized` (computed once for every layer, not per element)."""
    global _last_halves
    if is_compiling():
        return _first_half(realized(cos)), _first_half(realized(sin))
    entry = _last_halves  # one read: another thread may replace it
    if entry is not None and entry[0]() is cos and entry[1]() is sin:
        return entry[2], entry[3]
    halves = _first_half(cos), _first_half(sin)
    _last_halves = (weakref.ref(cos, _forget_halves), weakref.ref(sin, _forget_halves), *halves)
    return halves


def _in_dtype_of(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A rotary half in x's dtype as rotary_embedding takes it (float32 beside a half-precision x
    stays float32)."""
    if c.dtype != x.dtype and not (c.dtype == torch.float32 and x.dtype in _HALF):
        return c.to(x.dtype)
    return c


class _HalAttention(nn.Module):
    """Llama-style attention whose rotary embedding and attention are hal ops (module docstring)."""

    _hal_kind = "Attention(rotary+sdpa)"

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                attention_mask: Optional[torch.Tensor] = None, past_key_values: Any = None, **kwargs: Any) -> tuple:
        amax = kwargs.pop(X_AMAX, None)  # hidden_states' amax, from the patched decoder layer's norm
        impl = getattr(self.config, "_attn_implementation", None)
        # the attention weights are wanted as transformers decides it (the keyword, else the config)
        weights_wanted = kwargs.get("output_attentions", getattr(self.config, "output_attentions", False))
        unusual = (impl not in ("sdpa", "eager") or position_embeddings is None or (self.training and self.attention_dropout > 0)
                   or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))
                   or weights_wanted or position_embeddings[0].shape[-1] != self.head_dim)
        if unusual:
            return super().forward(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                   past_key_values=past_key_values, **kwargs)
        input_shape = hidden_states.shape[:-1]
        shape = (*input_shape, -1, self.head_dim)
        if amax is None:
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        else:  # FP8 projections whose input cast takes the amax (_AmaxDecoderLayer checked them)
            q, k, v = (p(hidden_states, x_amax=amax) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = _rotary_halves(*position_embeddings)
        cq, sq = _in_dtype_of(cos, q), _in_dtype_of(sin, q)
        q = hal.ops.rotary_embedding(q, cq, sq, False)
        if k.dtype != q.dtype:  # else q's halves (they depend on the dtype alone)
            cq, sq = _in_dtype_of(cos, k), _in_dtype_of(sin, k)
        k = hal.ops.rotary_embedding(k, cq, sq, False)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if k.dtype != q.dtype:  # tested first: Tensor.to returning its tensor is still a call (about 0.5 us)
            k = k.to(q.dtype)
        if v.dtype != q.dtype:
            v = v.to(q.dtype)
        out = _attend(self, q, k, v, attention_mask, impl, kwargs.get("is_causal"), bool(kwargs.get(UNPADDED)))
        return self.o_proj(out.contiguous()), None


def _attend(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], impl: str,
            is_causal: Optional[bool], unpadded: bool = False) -> torch.Tensor:
    """HF's sdpa (or eager) attention of q (B, H, T, D) over k, v (B, Hkv, S, D) on hal's op; returns
    (B, T, H * D), the heads of a position side by side. A key/value head broadcasts over its group of
    query heads (heads h = g * G + i).

    ``unpadded``: the model was called without an attention mask and without position ids
    (:data:`UNPADDED`; with position ids the mask may keep packed sequences apart). With as many
    keys as queries and no sliding window, the mask HF gives is then the causal mask, which it
    materialises while a CUDA graph is captured or a graph traced (some versions): it is replaced by
    the op's ``is_causal``, as HF's own sdpa path does when it is not tracing, so that the fused
    attention kernels run instead of a masked one."""
    b, h, t, d = q.shape
    groups = int(module.num_key_value_groups)
    if impl == "sdpa":
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if unpadded and causal and mask is not None and k.shape[2] == t > 1 and not _sliding(module):
            mask = None
        causal = bool(t > 1 and mask is None and causal)
        if causal and k.shape[2] > t:  # as HF's sdpa: the keys no query can see are cut
            k, v = k[:, :, :t], v[:, :, :t]
    else:  # eager adds the mask it is given, nothing else
        causal = False
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
        if mask.dim() == 4:
            mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], -1, groups, *mask.shape[2:])
    qg = q.reshape(b, h // groups, groups, t, d)
    out = hal.ops.scaled_dot_product_attention(qg, k.unsqueeze(2), v.unsqueeze(2), mask, causal, float(module.scaling))
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, -1)  # (B, Hkv, G, T, D) -> (B, T, Hkv * G * D)


def _sliding(module: nn.Module) -> bool:
    """Whether the attention layer has a sliding window (its mask is then not the plain causal one)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window is not None
    return getattr(getattr(module, "config", None), "sliding_window", None) is not None


def _llama_attention(m: nn.Module) -> Optional[nn.Module]:
    names = {"q_proj", "k_proj", "v_proj", "o_proj"}
    params, children, buffers = own_state(m)
    if params or buffers or children != names or not all(type(m._modules[n]) in PLAIN_LINEARS for n in names):
        return None
    if not type(m).__module__.startswith("transformers.") or isinstance(m, _HalAttention):
        return None
    config = getattr(m, "config", None)
    if not all(isinstance(getattr(m, a, None), (int, float)) for a in ("head_dim", "num_key_value_groups", "scaling")) or config is None:
        return None
    hal_cls = _subclass(type(m), _HalAttention)
    if not same(type(m).__name__, lambda: _attention_pair(m, hal_cls), m.q_proj.weight):
        return None
    m.__class__ = hal_cls
    return m


def _attention_pair(m: nn.Module, hal_cls: type) -> tuple[torch.Tensor, torch.Tensor]:
    """The original attention and its hal subclass on random hidden states and rotary angles."""
    trial = random_copy(m, 15, 0.05).eval()
    ref = m.q_proj.weight
    b, t, hd = 2, 5, int(m.head_dim)
    x = probe((b, t, m.q_proj.in_features), ref, 16)
    angles = probe((b, t, hd // 2), ref, 17).float() * 3.0
    emb = torch.cat((angles, angles), dim=-1)
    pe = (emb.cos().to(ref.dtype), emb.sin().to(ref.dtype))
    want = trial(x, position_embeddings=pe, attention_mask=None)[0]
    trial.__class__ = hal_cls
    return want, trial(x, position_embeddings=pe, attention_mask=None)[0]


# --- FP8: the amax of the projections' input (hal.nn.patch_hf_amax passes it) -------------------

#: the keyword the patched decoder layer passes its attention: the amax of ``hidden_states`` (a 0-d
#: float32 tensor), which the attention hands to its q/k/v projections
X_AMAX = "hal_x_amax"


# --- mixture-of-experts -------------------------------------------------------------------------


class _HalExperts(nn.Module):
    """Mixtral-style experts as two ragged grouped GEMMs over the (token, expert) pairs sorted by expert.

    They replace the experts implementation the model ran when it was patched (``_hal_impl``, from
    ``config._experts_implementation``); once the user picks another one with transformers'
    ``set_experts_implementation``, the original forward runs it."""

    _hal_kind = "Experts(grouped_gemm)"
    _hal_impl: Optional[str] = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_is_expert_parallel", False) or _experts_implementation(self) != self._hal_impl:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        n_experts, k = int(self.num_experts), top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1)
        dropped = flat >= n_experts  # HF's index num_experts means "no expert here": weight 0, any group
        flat = torch.where(dropped, 0, flat)
        order = torch.argsort(flat, stable=True)
        token = order // k
        # rows per expert, a (num_experts,) tensor also while traced (bincount's length is data-dependent there)
        sizes = torch.zeros(n_experts, dtype=flat.dtype, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        dtype = autocast_dtype(hidden_states)
        x = _cast(hidden_states, dtype)[token]
        gate_up = hal.ops.grouped_gemm(x, _cast(self.gate_up_proj, dtype).transpose(1, 2), sizes)
        gate, up = gate_up.chunk(2, dim=-1)
        h = hal.ops.swiglu(gate, up) if self._hal_silu else self.act_fn(gate) * up
        out = hal.ops.grouped_gemm(h, _cast(self.down_proj, dtype).transpose(1, 2), sizes)
        scale = torch.where(dropped, 0.0, weights)[order]
        out = out * scale[:, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, out.to(hidden_states.dtype))


def _mixtral_experts(m: nn.Module) -> Optional[nn.Module]:
    params, children, buffers = own_state(m)
    if params != {"gate_up_proj", "down_proj"} or buffers or children != {"act_fn"} or isinstance(m, _HalExperts):
        return None
    up, down, e = m.gate_up_proj, m.down_proj, getattr(m, "num_experts", None)
    if not isinstance(e, int) or up.dim() != 3 or down.dim() != 3 or up.shape[0] != e or down.shape[0] != e:
        return None
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True, "has_post_expert_norm": False}
    if any(getattr(m, a, v) != v for a, v in layout.items()) or not type(m).__module__.startswith("transformers."):
        return None
    hal_cls = _subclass(type(m), _HalExperts)
    silu = _is_function(m._modules["act_fn"], F.silu)
    if not same(type(m).__name__, lambda: _experts_pair(m, hal_cls, silu), m.gate_up_proj):
        return None
    _make_hal_experts(m, hal_cls, silu)
    return m


def _experts_implementation(m: nn.Module) -> Optional[str]:
    """The experts implementation transformers' forward of ``m`` would run (None without a config)."""
    return getattr(getattr(m, "config", None), "_experts_implementation", None)


def _make_hal_experts(m: nn.Module, hal_cls: type, silu: bool) -> None:
    m.__class__ = hal_cls
    m._hal_silu = silu
    m._hal_impl = _experts_implementation(m)


def _experts_pair(m: nn.Module, hal_cls: type, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    trial = random_copy(m, 18, 0.2)
    e, hidden = int(m.num_experts), int(m.gate_up_proj.shape[2])
    tokens, k = 7, min(2, e)
    x = probe((tokens, hidden), m.gate_up_proj, 19)
    gen = torch.Generator().manual_seed(20)
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(x.device)
    weights = torch.rand(tokens, k, generator=gen).to(x.device)
    want = trial(x, index, weights)
    _make_hal_experts(trial, hal_cls, silu)
    return want, trial(x, index, weights)


# --- LM head and loss ---------------------------------------------------------------------------


class _HalHead(nn.Linear):
    """``nn.Linear`` LM head that, while its model computes a fused loss, hands its input over
    instead of computing logits."""

    #: its fused loss reads the weight through hal.nn.weight_copies.weight_in (a copy inside hal.optimize's step)
    reads_weight_copy = True

    def forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:  # type: ignore[override]
        taken = self.__dict__.get("_hal_take")
        if taken is None:
            return super().forward(x)
        taken.append(x)
        return None


#: the keyword the patched causal LM passes down to its attention layers (transformers forwards
#: extra keywords to them) when it was called without an attention mask and without position ids:
#: the mask transformers builds is then the plain causal one (with position ids it may be the
#: block-diagonal mask of packed sequences, which transformers builds from them)
UNPADDED = "hal_unpadded"


class _HalCausalLM(nn.Module):
    """A causal LM whose forward with ``labels`` computes the loss with ``hal.ops.linear_cross_entropy``
    from the last hidden states, never materialising the logits (``logits`` is None in its output).

    Its ``forward`` (made per class by :func:`_forward_namespace`) has the original's signature, so
    that code inspecting it (``generate``, ``Trainer``) sees every argument the model takes."""

    _hal_kind = "LMHead+loss(linear_cross_entropy)"
    #: the original forward's parameters that can be given by position, in order (after self)
    _hal_positional: tuple[str, ...] = ()

    def _hal_forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = self._hal_by_name(args, kwargs)
        if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None:
            kwargs[UNPADDED] = True  # no padding, no packing: hal's attention may take is_causal
        labels = kwargs.pop("labels", None)
        if labels is None or not getattr(self, "_hal_loss", True):
            return super().forward(labels=labels, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        head = self.lm_head
        taken: list[torch.Tensor] = []
        head._hal_take = taken
        try:
            out = super().forward(labels=None, return_dict=True, **kwargs)
        finally:
            del head._hal_take
        if len(taken) != 1:  # not the forward this was checked on: compute it the original way
            return super().forward(labels=labels, return_dict=return_dict, **kwargs)
        loss = _fused_loss(taken[0], head, labels, **kwargs)
        aux = getattr(out, "aux_loss", None)
        if aux is not None and hasattr(self, "router_aux_loss_coef"):
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields = dict(out.items())
        fields.pop("logits", None)
        out = type(out)(**{**fields, "loss": loss})
        return out if return_dict else out.to_tuple()

    def _hal_by_name(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, positional ones named as the original forward names them."""
        names = self._hal_positional
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward() takes {len(names)} positional arguments but {len(args)} were given")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}.forward() got multiple values for argument '{name}'")
            kwargs[name] = value
        return kwargs


def _forward_namespace(original: type) -> dict[str, Any]:
    """The patched causal LM class's ``forward`` (:meth:`_HalCausalLM._hal_forward` under the
    signature, name and docstring of ``original.forward``) and its ``_hal_positional``."""
    signature = inspect.signature(original.forward)

    def forward(self: _HalCausalLM, *args: Any, **kwargs: Any) -> Any:
        return self._hal_forward(*args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__, forward.__qualname__ = original.forward.__doc__, f"{original.__qualname__}.forward"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(n for n, p in signature.parameters.items() if p.kind in positional)[1:]  # without self
    return {"forward": forward, "_hal_positional": names}


def _takes_labels_by_name(original: type) -> bool:
    """``original.forward`` has a ``labels`` parameter and no ``*args`` (the patched forward names
    every argument it is given)."""
    try:
        params = inspect.signature(original.forward).parameters
    except (TypeError, ValueError):
        return False
    return "labels" in params and all(p.kind is not inspect.Parameter.VAR_POSITIONAL for p in params.values())


def _fused_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, ignore_index: int = -100,
                num_items_in_batch: Any = None, shift_labels: Optional[torch.Tensor] = None, **_: Any) -> torch.Tensor:
    """``ForCausalLMLoss`` of ``head(hidden)`` against ``labels`` on hal's fused op."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(x.device)
    dtype = autocast_dtype(x)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = hal.ops.linear_cross_entropy(_cast(x, dtype), weight_in(head, dtype), target, _cast(head.bias, dtype),
                                        ignore_index, 0.0, reduction)
    if reduction == "sum":
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return loss


def patch_lm_head(model: nn.Module) -> bool:
    """Give ``model`` (a ``transformers`` causal LM) the fused LM head + loss if it computes the same
    loss on six random tokens (module docstring). Returns whether it did."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or isinstance(model, _HalCausalLM) or any(map(has_hooks, model.modules())):
        return False  # hooks anywhere: the check below runs the model, and they would see its probe calls
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    config = getattr(model, "config", None)
    if config is None or getattr(model, "loss_function", None) is not ForCausalLMLoss or getattr(config, "final_logit_softcapping", None):
        return False
    if getattr(config, "vocab_size", None) != head.out_features or head.weight.device.type == "meta":
        return False
    original = type(model)
    if not _takes_labels_by_name(original):
        return False
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        gen = torch.Generator().manual_seed(21)
        ids = torch.randint(0, head.out_features, (1, 6), generator=gen).to(head.weight.device)
        labels = ids.clone()
        labels[0, 2] = -100

        def pair() -> tuple[torch.Tensor, torch.Tensor]:
            want = model(input_ids=ids, labels=labels, use_cache=False).loss.float()
            head.__class__ = _HalHead
            model.__class__ = _subclass(original, _HalCausalLM, original.__name__, _forward_namespace)
            return want, model(input_ids=ids, labels=labels, use_cache=False).loss.float()

        agree = same(original.__name__, pair, head.weight)
    finally:
        for m, training in modes.items():
            m.training = training
    if not agree:
        head.__class__, model.__class__ = nn.Linear, original
    return agree


def swap(m: nn.Module) -> Optional[nn.Module]:
    """The ``transformers`` module kinds above: the module to put in ``m``'s place (``m`` itself when
    its class was changed), or None. A module with hooks on it or on any of its submodules is left
    alone: the replacement may not call those submodules, so their hooks would stop running."""
    if any(map(has_hooks, m.modules())):
        return None
    return _gemma_rms_norm(m) or _geglu_mlp(m) or _llama_attention(m) or _mixtral_experts(m)
