"""Tensor and sequence parallelism: linear layers split across the ranks of a tensor-parallel group.

A column-parallel layer holds a block of the weight's rows (its output features): every rank
computes its slice of the output from the whole input. A row-parallel layer holds a block of the
columns (input features): every rank computes a partial sum from its slice of the input, and the
group adds them up. A column-parallel layer followed by a row-parallel one (attention's q/k/v then
o; an MLP's gate/up then down) needs one collective in the forward and one in the backward.

Sequence parallelism (``sequence_parallel=True``) keeps the activations *between* such regions
split along the sequence: the column-parallel entry all-gathers the sequence instead of copying the
input, the row-parallel exit reduce-scatters it instead of all-reducing, and the norms in between
run on the local part of the sequence (:class:`ParallelRMSNorm`, :class:`ParallelLayerNorm`).
Attention and the MLP built from these layers are in :mod:`hal.parallel.blocks`. The
bytes moved are the same as without it; the activations and the norms' work are divided by the group.

``overlap=True`` (sequence parallelism only) splits that all-gather into ``chunks`` pieces and
multiplies each gathered piece while the next one travels (``hal.dist`` ``async_op``); its backward
reduce-scatters the input's gradient while the weight's gradient is computed.

The local compute is hal's: ``hal.ops.linear`` with its fused bias and activation epilogue,
``hal.ops.rms_norm`` / ``layer_norm``. Every collective goes through :mod:`hal.parallel.comm`, that
is :mod:`hal.dist`. ``mesh`` is a one-dimensional ``DeviceMesh`` (``mesh["tp"]`` of a larger one), a
process group, or None for the default group. Parameters are this rank's shard as a plain tensor,
or with ``dtensor=True`` (a ``DeviceMesh`` needed) a ``DTensor`` with a ``Shard``/``Replicate``
placement; :attr:`_Sharded.shard_dims` says which dimension of each parameter is split.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import nn

import hal
import hal.dist as hd
from hal.errors import InvalidArgumentError
from hal.nn.modules import _cast, autocast_dtype
from hal.parallel import checks
from hal.parallel.comm import (
    axis,
    copy_to_parallel,
    gather_from_parallel,
    group_size,
    member,
    reduce_from_parallel,
    reduce_scatter_to_parallel,
    scatter_to_parallel,
)

try:  # public since torch 2.5; the private home before
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelRMSNorm",
    "ParallelLayerNorm",
    "norm_inputs",
    "column_parallel_linears",
    "tp_group",
    "local_tensor",
]


def tp_group(mesh: Any) -> tuple[Any, Optional[DeviceMesh]]:
    """(process group, device mesh or None) of a 1-D ``DeviceMesh``, a process group or None."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise InvalidArgumentError("hal.parallel", "mesh", "a one-dimensional DeviceMesh (pass mesh['tp'] of a larger one)",
                                       f"a {mesh.ndim}-dimensional mesh {tuple(mesh.mesh.shape)}")
        return mesh.get_group(), mesh
    return mesh, None


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's part of ``t`` (``to_local()`` of a DTensor, differentiably), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _Sharded(nn.Module):
    """A module whose parameters are shards (or replicas) over a tensor-parallel group.

    ``shard_dims[name]`` is the dimension of parameter ``name`` split across the group's ranks in
    rank order (None: every rank holds all of it): what :func:`hal.parallel.plan.full_state_dict`
    gathers and :func:`~hal.parallel.plan.load_full_state_dict` slices.
    """

    def _setup(self, mesh: Any, dtensor: bool) -> None:
        group, device_mesh = tp_group(mesh)
        if dtensor and device_mesh is None:
            raise InvalidArgumentError(type(self).__name__, "mesh", "a DeviceMesh when dtensor=True", type(mesh).__name__)
        self.group = group
        self.device_mesh = device_mesh if dtensor else None
        self.tp_size, self.tp_rank = member(group, type(self).__name__)
        self.shard_dims: dict[str, Optional[int]] = {}

    def _divisible(self, arg: str, value: int) -> int:
        if value % self.tp_size:
            raise InvalidArgumentError(type(self).__name__, arg, f"a multiple of the tensor-parallel group's {self.tp_size} ranks",
                                       f"{value} (pad it, or choose a group size that divides it)")
        return value // self.tp_size

    def _param(self, name: str, value: Optional[torch.Tensor], dim: Optional[int], requires_grad: bool = True) -> None:
        """Register this rank's ``value`` as parameter ``name`` (a DTensor when the module has a mesh)."""
        self.shard_dims[name] = dim
        if value is None:
            self.register_parameter(name, None)
            return
        if self.device_mesh is not None:
            value = DTensor.from_local(value, self.device_mesh, [Replicate() if dim is None else Shard(dim)], run_check=False)
        setattr(self, name, nn.Parameter(value, requires_grad=requires_grad))

    def _shard_of(self, full: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
        """This rank's block of ``full`` along ``dim`` (a copy), or all of it for None."""
        t = full.detach()
        if dim is not None:
            t = t.chunk(self.tp_size, dim)[self.tp_rank]
        return t.clone()

    def local(self, name: str) -> Optional[torch.Tensor]:
        """This rank's part of parameter ``name`` as a plain tensor (differentiable)."""
        return local_tensor(getattr(self, name))


_SAME_LAYERS = ("the same layer settings on every rank of the group (in_features, out_features, bias, act, gather_output, "
                "input_is_parallel, sequence_parallel, sequence_dim, overlap, chunks)")


_ONE_GROUP = checks.check("column_parallel_linears", "layers", "layers of one group with the same sequence parallelism, "
                           "sequence_dim and overlap")
_COLUMN_X = checks.device_check("ColumnParallelLinear", "x")
_ROW_X = checks.device_check("RowParallelLinear", "x")
_NORM_X = {name: checks.device_check(name, "x") for name in ("ParallelRMSNorm", "ParallelLayerNorm")}


def _uniform(shape: tuple[int, ...], fan_in: int, device: Any, dtype: Any) -> torch.Tensor:
    """nn.Linear's initialisation (uniform in ±1/sqrt(fan_in) of the *full* layer)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound)


class ColumnParallelLinear(_Sharded):
    """``act(x @ W.T + b)`` with W's rows (output features) split across the group: this rank
    returns its ``out_features / tp`` slice of the last dimension (all of it with ``gather_output``).

    ``sequence_parallel``: ``x`` is this rank's part of the sequence (dimension ``sequence_dim``) and
    is all-gathered first; else ``x`` is the whole input on every rank. ``overlap``: the all-gather
    in ``chunks`` pieces, each multiplied while the next travels (sequence parallelism only).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, act: str = "none", *, mesh: Any = None,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 1, overlap: bool = False,
                 chunks: int = 2, dtensor: bool = False, device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self._setup(mesh, dtensor)
        if act not in hal.ops.ACTIVATIONS:
            raise InvalidArgumentError("ColumnParallelLinear", "act", f"one of {', '.join(hal.ops.ACTIVATIONS)}", repr(act))
        if overlap and not sequence_parallel:
            raise InvalidArgumentError("ColumnParallelLinear", "overlap", "False without sequence_parallel (there is no all-gather "
                                       "to overlap: the input is already whole on every rank)", "True")
        checks.count("ColumnParallelLinear", "chunks", chunks, 1)
        for arg, size in (("in_features", in_features), ("out_features", out_features)):
            checks.count("ColumnParallelLinear", arg, size, 0)
        self.in_features, self.out_features, self.act = in_features, out_features, act
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self.overlap, self.chunks = overlap, chunks
        local_out = self._divisible("out_features", out_features)
        self._param("weight", _uniform((local_out, in_features), in_features, device, dtype), 0)
        self._param("bias", _uniform((local_out,), in_features, device, dtype) if bias else None, 0)

    @classmethod
    def from_linear(cls, linear: nn.Linear, act: str = "none", **options: Any) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (copied), computing the same function."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, act, device="meta", **options)
        layer._param("weight", layer._shard_of(linear.weight, 0), 0, linear.weight.requires_grad)
        if linear.bias is not None:
            layer._param("bias", layer._shard_of(linear.bias, 0), 0, linear.bias.requires_grad)
        return layer

    def config(self) -> tuple:
        """The settings every rank's copy of this layer must share (compared by the agreement check)."""
        return ("column", self.in_features, self.out_features, self.bias is not None, self.act, self.gather_output,
                self.sequence_parallel, self.sequence_dim, self.overlap, self.chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_parallel_linears(x, [self])
        if self.gather_output:  # (y's shape agrees: x and the layers were checked)
            y = gather_from_parallel(y, -1, self.group, grad_reduce=False, check=False)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_features // self.tp_size} here), "
                f"bias={self.bias is not None}, act={self.act}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap}")


def column_parallel_linears(x: torch.Tensor, layers: Sequence[ColumnParallelLinear]) -> list[torch.Tensor]:
    """Each layer's (sharded) output for one input, with one collective for all of them: the
    sequence all-gathered once (chunked and overlapped with the GEMMs under ``overlap``) or the
    input's gradient all-reduced once in the backward. The layers share group and settings (as
    attention's q, k, v and an MLP's gate and up do)."""
    first = layers[0]
    weight_device = first.local("weight").device
    local = checks.Local()  # this rank's own checks, carried in its row: every rank raises together
    for layer in layers[1:]:
        same = (layer.group is first.group and layer.sequence_parallel == first.sequence_parallel
                and layer.sequence_dim == first.sequence_dim and layer.overlap == first.overlap)
        if not same and local.ok:
            local.fail(_ONE_GROUP, f"layers {layers.index(layer)} and 0 differ", f"layers of one group with the same sequence "
                       f"parallelism, sequence_dim and overlap ({first!r} and {layer!r})")
    local.device(_COLUMN_X, x, weight_device)
    if local.ok:
        dtype = autocast_dtype(x)
        x = _cast(x, dtype)
        settings = checks.config_code(*(layer.config() for layer in layers))
    checks.agree("ColumnParallelLinear", first.group, checks.row_device(weight_device, x.device),
                 [("x", x), ("layers", settings, _SAME_LAYERS)] if local.ok else [], local=local)
    weights = [_cast(layer.local("weight"), dtype) for layer in layers]
    biases = [_cast(layer.local("bias"), dtype) for layer in layers]
    acts = tuple(layer.act for layer in layers)
    if first.sequence_parallel:
        dim = axis(x, first.sequence_dim, "ColumnParallelLinear", "sequence_dim")
        if first.overlap and first.tp_size > 1:
            return list(_GatherLinear.apply(x, dim, first.group, first.chunks, acts, *weights, *biases))
        x = gather_from_parallel(x, dim, first.group, grad_reduce=True, check=False)
    else:
        x = copy_to_parallel(x, first.group, check=False)
    return [hal.ops.linear(x, w, b, a) for w, b, a in zip(weights, biases, acts)]


class _Beside:
    """Where the overlapped collectives are issued. On the CPU (gloo) hal.dist's ``async_op`` leaves
    the transfer in flight while this thread computes. On a GPU, hal.dist issues the engine's work
    and its stream wait at once, and the engine's stream first waits for the *current* stream: so
    the collectives are issued from a side stream (which waits only for the inputs), and the GEMMs
    run on the current one, which waits for a transfer only when it reads its result."""

    def __init__(self, device: torch.device) -> None:
        mod = getattr(torch, device.type, None) if device.type != "cpu" else None
        self.mod = mod if mod is not None and hasattr(mod, "Stream") and hasattr(mod, "stream") else None
        if self.mod is not None:
            self.main = self.mod.current_stream(device)
            self.side = self.mod.Stream(device=device)
            self.side.wait_stream(self.main)  # every input of the collectives exists by now

    def issue(self, fn: Any, *inputs: torch.Tensor) -> Any:
        """``fn()`` (a hal.dist call with ``async_op=True``) beside the compute (``inputs``: what it
        reads, made on the current stream before this object was)."""
        if self.mod is None:
            return fn()
        for t in inputs:
            t.record_stream(self.side)
        with self.mod.stream(self.side):
            return fn()

    def result(self, work: Any) -> torch.Tensor:
        """The collective's result, ready for the current stream."""
        out = work.wait()
        if self.mod is not None:
            self.main.wait_stream(self.side)
            out.record_stream(self.main)
        return out


class _GatherLinear(torch.autograd.Function):
    """all-gather(x along the sequence) then ``linear`` per weight, the gather in chunks overlapped
    with the GEMMs; backward: the input's gradient reduce-scattered while the weights' are computed.

    The gathered input is kept for the backward (what autograd keeps for a plain gather + linear).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, chunks: int, acts: tuple[str, ...], *params: Any) -> Any:
        n = len(acts)
        weights, biases = params[:n], params[n:]
        tp = group_size(group)
        local = x.movedim(dim, 0)  # sequence first: hal.dist gathers along dim 0
        pieces = [p.contiguous() for p in torch.tensor_split(local, min(chunks, max(1, local.shape[0])))]
        gathered = torch.empty((tp,) + tuple(local.shape), dtype=x.dtype, device=x.device)
        outs = [torch.empty((tp,) + tuple(local.shape[:-1]) + (w.shape[0],), dtype=x.dtype, device=x.device) for w in weights]
        beside = _Beside(x.device)  # after the pieces are made

        def gather(piece: torch.Tensor) -> Any:
            return beside.issue(lambda: hd.all_gather(piece, group=group, async_op=True), piece)

        pending = gather(pieces[0])
        start = 0
        for c, piece in enumerate(pieces):
            got = beside.result(pending).unflatten(0, (tp, piece.shape[0]))  # (tp, T_c, ...): rank r's c-th piece
            if c + 1 < len(pieces):
                pending = gather(pieces[c + 1])
            rows = slice(start, start + piece.shape[0])
            gathered[:, rows] = got
            for out, w, b, a in zip(outs, weights, biases, acts):
                out[:, rows] = hal.ops.linear(got, w, b, a)
            start += piece.shape[0]
        x_full = gathered.flatten(0, 1)
        ctx.dim, ctx.group, ctx.acts = dim, group, acts
        ctx.save_for_backward(x_full, *weights, *biases)
        return tuple(o.flatten(0, 1).movedim(0, dim).contiguous() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:
        x_full, *saved = ctx.saved_tensors
        acts, dim, group = ctx.acts, ctx.dim, ctx.group
        n = len(acts)
        weights, biases = saved[:n], saved[n:]
        want_w = ctx.needs_input_grad[5:5 + n]
        want_b = [ctx.needs_input_grad[5 + n + i] and biases[i] is not None for i in range(n)]
        gys = [None if g is None else g.movedim(dim, 0) for g in grads]
        # without a fused activation, dgrad and wgrad are separate GEMMs: reduce-scatter the input's
        # gradient while the weights' gradients are computed. With one, the pre-activation would be
        # recomputed twice: compute everything, then reduce-scatter.
        split = all(a == "none" for a in acts)
        grad_x: Optional[torch.Tensor] = None
        gw: list[Optional[torch.Tensor]] = [None] * n
        gb: list[Optional[torch.Tensor]] = [None] * n
        for i, gy in enumerate(gys):
            if gy is None:
                continue
            mask = (ctx.needs_input_grad[0], bool(want_w[i]) and not split, bool(want_b[i]) and not split)
            dx, gw[i], gb[i] = hal.ops.linear_backward(gy.contiguous(), x_full, weights[i], biases[i], acts[i], mask)
            if dx is not None:
                grad_x = dx if grad_x is None else grad_x + dx
        work = None
        if grad_x is not None:
            grad_x = grad_x.contiguous()
            beside = _Beside(grad_x.device)
            work = beside.issue(lambda: hd.reduce_scatter(grad_x, group=group, async_op=True), grad_x)
        if split:
            for i, gy in enumerate(gys):
                if gy is not None and (want_w[i] or want_b[i]):
                    _, gw[i], gb[i] = hal.ops.linear_backward(gy.contiguous(), x_full, weights[i], biases[i], acts[i],
                                                              (False, bool(want_w[i]), bool(want_b[i])))
        dx_local = None if work is None else beside.result(work).movedim(0, dim)
        return (dx_local, None, None, None, None, *gw, *gb)


class RowParallelLinear(_Sharded):
    """``x @ W.T + b`` with W's columns (input features) split across the group: this rank
    multiplies its ``in_features / tp`` slice of ``x`` (``input_is_parallel``, as a column-parallel
    layer leaves it; else it takes its slice of a whole ``x``) and the partial sums are added over
    the group: all-reduced, or reduce-scattered along ``sequence_dim`` under ``sequence_parallel``.

    The bias is added after the sum (once, not once per rank); there is no activation, which would
    have to follow the sum too.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mesh: Any = None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, sequence_dim: int = 1, dtensor: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self._setup(mesh, dtensor)
        for arg, size in (("in_features", in_features), ("out_features", out_features)):
            checks.count("RowParallelLinear", arg, size, 0)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = input_is_parallel, sequence_parallel, sequence_dim
        local_in = self._divisible("in_features", in_features)
        self._param("weight", _uniform((out_features, local_in), in_features, device, dtype), 1)
        self._param("bias", _uniform((out_features,), in_features, device, dtype) if bias else None, None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> "RowParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (copied), computing the same function."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta", **options)
        layer._param("weight", layer._shard_of(linear.weight, 1), 1, linear.weight.requires_grad)
        if linear.bias is not None:
            layer._param("bias", layer._shard_of(linear.bias, None), None, linear.bias.requires_grad)
        return layer

    def config(self) -> tuple:
        """The settings every rank's copy of this layer must share (compared by the agreement check)."""
        return ("row", self.in_features, self.out_features, self.bias is not None, self.input_is_parallel,
                self.sequence_parallel, self.sequence_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight_device = self.local("weight").device
        local = checks.Local()
        local.device(_ROW_X, x, weight_device)
        if not local.ok:  # every rank raises, through the row
            checks.agree("RowParallelLinear", self.group, checks.row_device(weight_device, x.device), [], local=local)
        dtype = autocast_dtype(x)
        x, weight, bias = _cast(x, dtype), _cast(self.local("weight"), dtype), _cast(self.local("bias"), dtype)
        # one check covers every collective below, forward and backward: their shapes follow from x's and the settings
        checks.agree("RowParallelLinear", self.group, x.device, [("x", x), ("layers", checks.config_code(self.config()), _SAME_LAYERS)],
                     local=local)
        if self.sequence_parallel:  # y has x's dimensions
            axis(x, self.sequence_dim, "RowParallelLinear", "sequence_dim")
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, -1, self.group, check=False)
        if self.tp_size == 1:
            return hal.ops.linear(x, weight, bias)
        y = hal.ops.linear(x, weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_parallel(y, self.sequence_dim, self.group, check=False)
            # each rank adds the bias to its part of the sequence: its gradient is summed over the group
            return y if bias is None else y + copy_to_parallel(bias, self.group, check=False)
        y = reduce_from_parallel(y, self.group, check=False)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features // self.tp_size} here), out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")


class _ParallelNorm(_Sharded):
    """A norm over the last dimension with replicated parameters. Under ``sequence_parallel`` it
    runs on this rank's part of the sequence and its parameters' gradients are summed over the
    group in the backward (each rank saw only its tokens); otherwise every rank computes the same."""

    def __init__(self, normalized_shape: int, eps: Optional[float], affine: bool, bias: bool, *, mesh: Any,
                 sequence_parallel: bool, dtensor: bool, device: Any, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self._setup(mesh, dtensor)
        self.normalized_shape, self.eps, self.sequence_parallel = (int(normalized_shape),), eps, sequence_parallel
        make = (lambda v: torch.full(self.normalized_shape, v, device=device, dtype=dtype))
        self._param("weight", make(1.0) if affine else None, None)
        self._param("bias", make(0.0) if affine and bias else None, None)

    def _params(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        weight, bias = self.local("weight"), self.local("bias")
        local = checks.Local()
        if weight is not None:
            name = type(self).__name__
            local.device(_NORM_X.get(name) or checks.device_check(name, "x"), x, weight.device)
        if weight is not None and self.sequence_parallel and torch.is_grad_enabled() and (
                weight.requires_grad or (bias is not None and bias.requires_grad)):
            # the backward sums the parameters' gradients over the group: gloo aborts a rank whose
            # parameters differ in size or dtype from a peer's (the next layer's check compares x,
            # which a weight of another dtype need not change)
            checks.agree(type(self).__name__, self.group, checks.row_device(weight.device, x.device), [] if not local.ok else [
                ("weight", weight),
                ("bias", bias is not None, "a bias on every rank of the group, or on none"),
                ("settings", checks.config_code(self.eps, weight.requires_grad, None if bias is None else (str(bias.dtype), bias.requires_grad)),
                 "the same eps, bias dtype and trained parameters on every rank of the group (under sequence parallelism "
                 "the backward sums the parameters' gradients over the group)")], local=local)
        local.raise_now()  # no collective in this call to carry it (no agreement ran): this rank alone
        return norm_inputs(x, weight, bias, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"


def norm_inputs(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], group: Any,
                sequence_parallel: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """x, weight, bias ready for a norm op: float32 under autocast (as torch's norms); under
    sequence parallelism the parameters pass :func:`copy_to_parallel`, so that their gradients,
    each from this rank's tokens only, are summed over the group in the backward."""
    up = torch.float32 if autocast_dtype(x) is not None else None
    params = []
    for p in (weight, bias):
        if p is not None and sequence_parallel:  # unchecked: the parameters' shape is x's last dim, checked downstream
            p = copy_to_parallel(p, group, check=False)
        params.append(_cast(p, up))
    return _cast(x, up), params[0], params[1]


class ParallelRMSNorm(_ParallelNorm):
    """RMSNorm (``hal.ops.rms_norm``) on this rank's part of the sequence (see :class:`_ParallelNorm`)."""

    def __init__(self, normalized_shape: int, eps: Optional[float] = None, elementwise_affine: bool = True, *, mesh: Any = None,
                 sequence_parallel: bool = True, dtensor: bool = False, device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, mesh=mesh, sequence_parallel=sequence_parallel,
                         dtensor=dtensor, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, norm: nn.Module, **options: Any) -> "ParallelRMSNorm":
        """From ``nn.RMSNorm`` or a module with ``weight`` and ``eps``/``variance_epsilon`` (Hugging Face's)."""
        weight = norm.weight
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        size = weight.shape[-1] if weight is not None else norm.normalized_shape[-1]
        layer = cls(size, eps, weight is not None, device="meta", **options)
        if weight is not None:
            layer._param("weight", layer._shard_of(weight, None), None, weight.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, _ = self._params(x)
        return hal.ops.rms_norm(x, self.normalized_shape, weight, self.eps)


class ParallelLayerNorm(_ParallelNorm):
    """LayerNorm (``hal.ops.layer_norm``) on this rank's part of the sequence (see :class:`_ParallelNorm`)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, *,
                 mesh: Any = None, sequence_parallel: bool = True, dtensor: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, mesh=mesh, sequence_parallel=sequence_parallel,
                         dtensor=dtensor, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, norm: nn.LayerNorm, **options: Any) -> "ParallelLayerNorm":
        """From ``nn.LayerNorm`` (one normalised dimension)."""
        if len(norm.normalized_shape) != 1:
            raise InvalidArgumentError("ParallelLayerNorm.from_module", "norm", "a LayerNorm over the last dimension only",
                                       str(tuple(norm.normalized_shape)))
        affine = norm.weight is not None
        layer = cls(norm.normalized_shape[0], norm.eps, affine, norm.bias is not None, device="meta", **options)
        for name in ("weight", "bias"):
            p = getattr(norm, name)
            if p is not None:
                layer._param(name, layer._shard_of(p, None), None, p.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = self._params(x)
        return hal.ops.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
