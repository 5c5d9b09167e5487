"""Apply tensor and sequence parallelism to a model: ``parallelize(model, mesh, plan)``.

In the style of ``torch.distributed.tensor.parallel.parallelize_module``: a *plan* maps module
names (``fnmatch`` patterns: ``"layers.*.mlp"``) to *styles* that say how each module is split.
Each style replaces its module by the parallel one of :mod:`hal.parallel.tensor`, built from this
rank's shard of the module's existing weights, so the model computes the same function (to
rounding) with the same ``state_dict`` keys. Without a plan, :func:`llama_plan` finds the
Llama-style blocks: hal's (``bench/models_llama.py``'s ``Block``: ``attn_norm``, ``q/k/v/o_proj``,
``mlp_norm``, ``gate/up/down_proj``) and Hugging Face ``transformers``' (``LlamaDecoderLayer`` and
the blocks written like it: ``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``).

Every rank must hold the same full model before the call (built from one seed, or loaded from one
checkpoint; ``broadcast_from`` copies one rank's weights to the others first). Parameters become
this rank's shards: plain tensors (the default: any optimizer, ``DistributedDataParallel`` over the
data-parallel group), or ``DTensor`` with ``dtensor=True`` (``Shard``/``Replicate`` placements on the
tensor-parallel mesh; torch's foreach/fused optimizers then want DTensor and plain parameters in
separate groups: :func:`hal.parallel.state.param_groups`). :mod:`hal.parallel.state` gathers the
whole weights (the unparallelized model's state_dict) and loads them.
"""

from __future__ import annotations

import abc
import dataclasses
import fnmatch
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hal
import hal.dist as hd
from hal.errors import InvalidArgumentError, UnsupportedError
from hal.parallel.comm import _agree, axis, gather_from_parallel, group_size, scatter_to_parallel
from hal.parallel.blocks import ParallelAttention, ParallelMLP, head_parallel_attention, parallel_mlp
from hal.parallel.tensor import (
    ColumnParallelLinear,
    DeviceMesh,
    ParallelLayerNorm,
    ParallelRMSNorm,
    RowParallelLinear,
    _Sharded,
    norm_inputs,
    tp_group,
)

__all__ = [
    "parallelize",
    "llama_plan",
    "PlanContext",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "NormParallel",
    "AttentionParallel",
    "MLPParallel",
    "BlockParallel",
    "SequenceEntry",
    "SequenceExit",
    "ParallelLlamaBlock",
    "HFParallelAttention",
]


@dataclasses.dataclass
class PlanContext:
    """What every style of one :func:`parallelize` call shares."""

    mesh: Any  # a 1-D DeviceMesh, a process group, or None (the default group)
    sequence_parallel: bool = False
    overlap: bool = False
    chunks: int = 2
    dtensor: bool = False
    sequence_dim: int = 1

    def options(self, sequence_parallel: Optional[bool] = None, column: bool = True) -> dict[str, Any]:
        """Keyword arguments of the parallel modules' constructors."""
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        out: dict[str, Any] = dict(mesh=self.mesh, sequence_parallel=sp, dtensor=self.dtensor)
        if column:
            out.update(overlap=self.overlap and sp, chunks=self.chunks)
        return out


class ParallelStyle(abc.ABC):
    """How one module is parallelized: :meth:`apply` returns its replacement (or the module itself,
    changed). ``replaces`` False: a style that only adds hooks, applied after the replacing ones."""

    replaces = True

    @abc.abstractmethod
    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        """``module`` parallelized in ``ctx`` (each style says how)."""


def _need(style: str, module: nn.Module, ok: bool, what: str) -> None:
    if not ok:
        raise InvalidArgumentError(f"hal.parallel {style}", "module", what, type(module).__name__)


@dataclasses.dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """An ``nn.Linear`` -> :class:`ColumnParallelLinear` (``act`` fused into its epilogue).
    ``sequence_parallel`` None: the call's setting."""

    gather_output: bool = False
    act: str = "none"
    sequence_parallel: Optional[bool] = None

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        _need("ColwiseParallel", module, isinstance(module, nn.Linear), "an nn.Linear")
        return ColumnParallelLinear.from_linear(module, self.act, gather_output=self.gather_output,
                                                sequence_dim=ctx.sequence_dim, **ctx.options(self.sequence_parallel))


@dataclasses.dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """An ``nn.Linear`` -> :class:`RowParallelLinear`."""

    input_is_parallel: bool = True
    sequence_parallel: Optional[bool] = None

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        _need("RowwiseParallel", module, isinstance(module, nn.Linear), "an nn.Linear")
        return RowParallelLinear.from_linear(module, input_is_parallel=self.input_is_parallel, sequence_dim=ctx.sequence_dim,
                                             **ctx.options(self.sequence_parallel, column=False))


def _is_rms_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.RMSNorm) or (isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1
                                         and isinstance(getattr(m, "variance_epsilon", None), float) and not list(m.children()))


@dataclasses.dataclass(frozen=True)
class NormParallel(ParallelStyle):
    """RMSNorm (``nn.RMSNorm``, Hugging Face's ``*RMSNorm``) or ``nn.LayerNorm`` -> :class:`ParallelRMSNorm` /
    :class:`ParallelLayerNorm`: on the local part of the sequence under sequence parallelism, else
    the same norm on every rank (with hal's op)."""

    sequence_parallel: Optional[bool] = None

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        opts = ctx.options(self.sequence_parallel, column=False)
        if isinstance(module, nn.LayerNorm):
            return ParallelLayerNorm.from_module(module, **opts)
        _need("NormParallel", module, _is_rms_norm(module), "an nn.RMSNorm, nn.LayerNorm or Llama-style RMSNorm")
        return ParallelRMSNorm.from_module(module, **opts)


def _is_hf_attention(m: nn.Module) -> bool:
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return (all(isinstance(getattr(m, n, None), nn.Linear) for n in names) and isinstance(getattr(m, "head_dim", None), int)
            and hasattr(m, "scaling") and hasattr(m, "config"))


class AttentionParallel(ParallelStyle):
    """Hugging Face Llama-style attention -> :class:`HFParallelAttention` (heads split across ranks)."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        _need("AttentionParallel", module, _is_hf_attention(module),
              "a Llama-style attention (q_proj, k_proj, v_proj, o_proj as nn.Linear; head_dim, scaling, config)")
        return HFParallelAttention.from_hf(module, ctx)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def activation_name(fn: Any) -> Optional[str]:
    """The name in ``hal.ops.ACTIVATIONS`` of the function ``fn`` computes (checked on [-6, 6]), or None."""
    x = torch.linspace(-6.0, 6.0, 481, dtype=torch.float64)
    for name, ref in _ACTIVATIONS.items():
        try:
            with torch.no_grad():
                if torch.allclose(fn(x.clone()), ref(x), rtol=1e-7, atol=1e-9):
                    return name
        except Exception:  # noqa: BLE001 - not this one
            continue
    return None


def _is_llama_mlp(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) and callable(
        getattr(m, "act_fn", None))


class MLPParallel(ParallelStyle):
    """A Llama MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) -> :class:`ParallelMLP`."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        _need("MLPParallel", module, _is_llama_mlp(module), "a Llama-style MLP (gate_proj, up_proj, down_proj, act_fn)")
        act = activation_name(module.act_fn)
        if act is None:
            raise UnsupportedError(f"hal.parallel MLPParallel: the MLP's activation {module.act_fn!r} is none of "
                                   f"{', '.join(_ACTIVATIONS)}; parallelize its projections with ColwiseParallel/RowwiseParallel")
        return ParallelMLP.from_projections(module.gate_proj, module.up_proj, module.down_proj, act, **ctx.options())


_BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_hal_block(m: nn.Module) -> bool:
    return (all(isinstance(getattr(m, n, None), nn.Linear) for n in _BLOCK_LINEARS)
            and all(isinstance(m._parameters.get(n), nn.Parameter) for n in ("attn_norm", "mlp_norm"))
            and isinstance(getattr(m, "heads", None), int) and isinstance(getattr(m, "eps", None), float))


class BlockParallel(ParallelStyle):
    """hal's Llama-style block (``bench/models_llama.py``'s layout) -> :class:`ParallelLlamaBlock`."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        _need("BlockParallel", module, _is_hal_block(module),
              "a Llama-style block with attn_norm, mlp_norm, q/k/v/o_proj, gate/up/down_proj, heads and eps")
        return ParallelLlamaBlock(module, ctx)


def _check_sequence(x: torch.Tensor, dim: int, group: Any) -> None:
    n = group_size(group)
    if x.shape[dim] % n:
        raise InvalidArgumentError("hal.parallel sequence parallelism", "hidden_states",
                                   f"a sequence (dim {dim}) whose length is a multiple of the {n} tensor-parallel ranks "
                                   "(pad the batch)", f"length {x.shape[dim]}")


class SequenceEntry(ParallelStyle):
    """Under sequence parallelism: this module's first input (or ``hidden_states=``) is split along
    the sequence, each rank keeping its part (the first block of a sequence-parallel stack)."""

    replaces = False

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        if ctx.sequence_parallel:
            group, dim = tp_group(ctx.mesh)[0], ctx.sequence_dim

            def scatter(x: torch.Tensor) -> torch.Tensor:
                # the agreement first (x's dtype and shape, the dimension), then the length: the same on every rank
                _agree("scatter_to_parallel", x, group, True, dim)
                _check_sequence(x, axis(x, dim, "hal.parallel sequence parallelism", "sequence_dim"), group)
                return scatter_to_parallel(x, dim, group, check=False)

            def split(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                if args:
                    return (scatter(args[0]),) + tuple(args[1:]), kwargs
                return args, dict(kwargs, hidden_states=scatter(kwargs["hidden_states"]))

            module.register_forward_pre_hook(split, with_kwargs=True)
        return module


class SequenceExit(ParallelStyle):
    """Under sequence parallelism: this module's output (or its first element) is gathered along the
    sequence, whole on every rank again (the last block of a sequence-parallel stack)."""

    replaces = False

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        if ctx.sequence_parallel:
            group, dim = tp_group(ctx.mesh)[0], ctx.sequence_dim

            def gather(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
                if isinstance(out, tuple):
                    return (gather_from_parallel(out[0], dim, group, grad_reduce=False),) + tuple(out[1:])
                return gather_from_parallel(out, dim, group, grad_reduce=False)

            module.register_forward_hook(gather, with_kwargs=True)
        return module


# --- the parallel forms of hal's and Hugging Face's Llama-style modules ------------------------------


class ParallelLlamaBlock(_Sharded):
    """hal's Llama-style decoder block (pre-norm RMSNorm, causal attention with rotary embeddings,
    SwiGLU MLP) with its heads and hidden width split across the group; same parameter names.
    ``forward(x, cos, sin)`` as the block's (cos, sin ``(T, head_dim / 2)`` for the whole sequence)."""

    def __init__(self, block: nn.Module, ctx: PlanContext) -> None:
        super().__init__()
        self._setup(ctx.mesh, ctx.dtensor)
        self.heads, self.eps, self.sequence_parallel = int(block.heads), float(block.eps), ctx.sequence_parallel
        self.head_dim = block.q_proj.out_features // self.heads
        for name in ("attn_norm", "mlp_norm"):
            p = getattr(block, name)
            self._param(name, self._shard_of(p, None), None, p.requires_grad)
        kv_heads = block.k_proj.out_features // self.head_dim
        att = ParallelAttention.from_projections(block.q_proj, block.k_proj, block.v_proj, block.o_proj, self.heads, kv_heads,
                                                 self.head_dim, **ctx.options())
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = att.q_proj, att.k_proj, att.v_proj, att.o_proj
        mlp = ParallelMLP.from_projections(block.gate_proj, block.up_proj, block.down_proj, "silu", **ctx.options())
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.train(block.training)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x, weight, _ = norm_inputs(x, self.local(name), None, self.group, self.sequence_parallel)
        return hal.ops.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = head_parallel_attention(self._norm(x, "attn_norm"), self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                                    self.head_dim, self.heads, cos, sin, None, True)
        x = x + a
        return x + parallel_mlp(self._norm(x, "mlp_norm"), self.gate_proj, self.up_proj, self.down_proj, "silu")


class HFParallelAttention(ParallelAttention):
    """Hugging Face Llama-style attention with its heads split across the group: HF's call
    (``hidden_states, position_embeddings, attention_mask, past_key_values``) and result
    (``(output, None)``), for the ``"sdpa"`` and ``"eager"`` attention implementations."""

    @classmethod
    def from_hf(cls, attn: nn.Module, ctx: PlanContext) -> "HFParallelAttention":
        hd_ = int(attn.head_dim)
        heads, kv = attn.q_proj.out_features // hd_, attn.k_proj.out_features // hd_
        new = cls.from_projections(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, heads, kv, hd_, scale=float(attn.scaling),
                                   **ctx.options())
        new.config, new.layer_idx = attn.config, getattr(attn, "layer_idx", None)
        new.is_causal = bool(getattr(attn, "is_causal", True))
        new.attention_dropout = float(getattr(attn, "attention_dropout", 0.0) or 0.0)
        new.num_key_value_groups, new.scaling = heads // kv, attn.scaling
        new.train(attn.training)
        return new

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # type: ignore[override]
                attention_mask: Optional[torch.Tensor] = None, past_key_values: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        impl = getattr(self.config, "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager"):
            raise UnsupportedError(f"hal.parallel attention runs the 'sdpa' and 'eager' attention implementations, not {impl!r}; "
                                   "load the model with attn_implementation='sdpa'")
        if self.training and self.attention_dropout > 0:
            raise UnsupportedError("hal.parallel attention has no attention dropout; set config.attention_dropout = 0")
        if position_embeddings is None:
            raise InvalidArgumentError("HFParallelAttention", "position_embeddings", "the (cos, sin) pair of the model", "None")
        cos, sin = (c[..., : c.shape[-1] // 2].unsqueeze(1) for c in position_embeddings)  # (B, 1, T, D/2)
        t = hidden_states.shape[1] * (self.q_proj.tp_size if self.q_proj.sequence_parallel else 1)
        causal = False  # eager adds the mask it is given, nothing else
        if impl == "sdpa":  # as HF's sdpa_attention_forward
            wanted = kwargs.get("is_causal")
            causal = bool(t > 1 and attention_mask is None and (self.is_causal if wanted is None else wanted))

        def kv_update(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx)
            if causal and k.shape[2] > t:  # HF's sdpa cuts the keys no query can see
                k, v = k[:, :, :t], v[:, :, :t]
            return k, v

        out = head_parallel_attention(hidden_states, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.head_dim,
                                      self.num_heads, cos, sin, attention_mask, causal, self.scale, kv_update)
        return out, None


# --- the plan ----------------------------------------------------------------------------------------


def _is_hf_layer(m: nn.Module) -> bool:
    return (_is_hf_attention(getattr(m, "self_attn", None) or nn.Module()) and _is_llama_mlp(getattr(m, "mlp", None) or nn.Module())
            and all(_is_rms_norm(getattr(m, n, None) or nn.Module()) or isinstance(getattr(m, n, None), nn.LayerNorm)
                    for n in ("input_layernorm", "post_attention_layernorm")))


PlanValue = Union[ParallelStyle, tuple]


def llama_plan(model: nn.Module) -> dict[str, PlanValue]:
    """The plan for the Llama-style blocks of ``model`` (hal's and Hugging Face's): attention heads
    and MLP width split, norms sequence-parallel when asked, and the sequence split before the first
    block and gathered after the last. Raises when there is none."""
    plan: dict[str, list[ParallelStyle]] = {}
    blocks = []
    for name, m in model.named_modules():
        if _is_hal_block(m):
            plan[name] = [BlockParallel()]
            blocks.append(name)
        elif _is_hf_layer(m):
            plan[name] = []
            for child, style in (("self_attn", AttentionParallel()), ("mlp", MLPParallel()), ("input_layernorm", NormParallel()),
                                 ("post_attention_layernorm", NormParallel())):
                plan[f"{name}.{child}"] = [style]
            blocks.append(name)
    if not blocks:
        raise InvalidArgumentError("hal.parallel.llama_plan", "model", "a model with Llama-style blocks (hal's or transformers')",
                                   f"{type(model).__name__} with none; pass plan={{name: style}} to parallelize")
    plan[blocks[0]].append(SequenceEntry())
    plan[blocks[-1]].append(SequenceExit())
    return {k: v[0] if len(v) == 1 else tuple(v) for k, v in plan.items()}


def _from_torch(style: Any) -> Optional[ParallelStyle]:
    """hal's style for torch's ColwiseParallel / RowwiseParallel / SequenceParallel, or None."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor import parallel as tp
    except ImportError:  # pragma: no cover
        return None
    first = (lambda layouts: layouts[0] if isinstance(layouts, tuple) else layouts)
    if isinstance(style, tp.ColwiseParallel):
        return ColwiseParallel(gather_output=isinstance(first(style.output_layouts), Replicate),
                               sequence_parallel=isinstance(first(style.input_layouts), Shard))
    if isinstance(style, tp.RowwiseParallel):
        return RowwiseParallel(input_is_parallel=isinstance(first(style.input_layouts), Shard),
                               sequence_parallel=isinstance(first(style.output_layouts), Shard))
    if isinstance(style, tp.SequenceParallel):
        return NormParallel(sequence_parallel=True)
    return None


def _styles(value: Any, key: str) -> list[ParallelStyle]:
    out = []
    for s in value if isinstance(value, (tuple, list)) else (value,):
        if not isinstance(s, ParallelStyle):
            s = _from_torch(s) or s
        if not isinstance(s, ParallelStyle):
            raise InvalidArgumentError("hal.parallel.parallelize", f"plan[{key!r}]", "a hal.parallel style (ColwiseParallel, "
                                       "RowwiseParallel, NormParallel, AttentionParallel, MLPParallel, BlockParallel, "
                                       "SequenceEntry, SequenceExit) or a tuple of them", repr(s))
        out.append(s)
    return out


def _tp_mesh(mesh: Any, tp_dim: Optional[str]) -> Any:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim == 1:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    dim = tp_dim or ("tp" if "tp" in names else None)
    if dim not in names:
        raise InvalidArgumentError("hal.parallel.parallelize", "tp_dim", f"the name of the tensor-parallel dimension of the "
                                   f"mesh, one of {names}", repr(tp_dim))
    return mesh[dim]


def parallelize(model: nn.Module, mesh: Any = None, plan: Optional[dict[str, Any]] = None, *, tp_dim: Optional[str] = None,
                sequence_parallel: bool = False, overlap: bool = False, chunks: int = 2, dtensor: bool = False,
                broadcast_from: Optional[int] = None) -> nn.Module:
    """Split ``model``'s layers across the tensor-parallel ranks of ``mesh``, in place; returns it.

    ``mesh``: a ``DeviceMesh`` (its ``tp_dim`` dimension, "tp" by default, for a multi-dimensional
    one: the others are left to data/pipeline parallelism), a process group, or None (the default
    group). ``plan``: {module-name pattern: style or tuple of styles}; None: :func:`llama_plan`.
    ``sequence_parallel``: activations between the parallel regions split along ``sequence`` (dim 1);
    ``overlap``: the column-parallel all-gathers in ``chunks`` overlapped with their GEMMs (needs
    ``sequence_parallel``). ``dtensor``: parameters as DTensor shards (needs a mesh).
    ``broadcast_from``: a tensor-parallel group rank whose parameters and buffers every rank takes first.
    """
    if overlap and not sequence_parallel:
        raise InvalidArgumentError("hal.parallel.parallelize", "overlap", "False without sequence_parallel (there is no "
                                   "all-gather to overlap)", "True")
    ctx = PlanContext(_tp_mesh(mesh, tp_dim), sequence_parallel, overlap, chunks, dtensor)
    group = tp_group(ctx.mesh)[0]
    if broadcast_from is not None:
        src = dist.get_global_rank(group, broadcast_from) if group is not None else broadcast_from
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                hd.broadcast(t.data, src, group)
    plan = llama_plan(model) if plan is None else plan
    names = [name for name, _ in model.named_modules()]
    work: list[tuple[str, ParallelStyle]] = []
    for key, value in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, key)]
        if not matched:
            raise InvalidArgumentError("hal.parallel.parallelize", "plan", "module-name patterns that match modules of the model",
                                       f"{key!r}, which matches none")
        work += [(n, s) for n in matched for s in _styles(value, key)]
    # replace the deepest modules first, then add hooks to the (possibly new) modules
    work.sort(key=lambda item: (not item[1].replaces, -(item[0].count(".") + bool(item[0]))))
    for name, style in work:
        module = model.get_submodule(name)
        new = style.apply(module, ctx)
        if new is not module:
            if not name:
                model = new
            else:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
    return model
