"""An expert-parallel mixture-of-experts layer: top-k routing, all-to-all dispatch, grouped GEMM experts.

Every rank of the expert-parallel group routes its own tokens with a replicated router, sends each
token copy to the rank that owns the chosen expert (``hal.dist.all_to_all`` with split sizes, through
:func:`hal.parallel.comm.all_to_all` so autograd reverses the exchange), runs its experts as SwiGLU
MLPs in two ``hal.ops.grouped_gemm`` calls, and sends the results back, where they are weighted and
summed per token. The layer computes what the same layer with all experts on one process computes
over the concatenation of the group's tokens (rank order):

* routing: router logits and softmax in float32 (float64 for float64 input), the ``top_k`` largest probabilities, renormalised
  to sum to one (``normalize_weights``, as Mixtral);
* capacity (``capacity_factor``): each expert takes at most ``ceil(capacity_factor * tokens * top_k /
  num_experts)`` token copies of the group's step; first choices before second choices, then rank
  order, then token order (GShard's priority); copies over capacity are dropped (their share of the
  output is zero, as in Switch/GShard, the residual stream carries the token). ``None``: dropless;
* the auxiliary load-balancing loss (Switch): ``num_experts * sum_e f_e * P_e``, ``f_e`` the share of
  the group's token copies routed to expert ``e`` (before dropping), ``P_e`` the mean router
  probability of ``e``. Each rank's :attr:`ExpertParallelMoE.aux_loss` uses the group's ``f`` and its
  own tokens' probabilities, scaled so that the *mean over the group's ranks* is the loss over all
  the group's tokens (it composes with data-parallel gradient averaging; no gradient crosses ranks).

With ``overlap_chunks > 1`` the exchange runs in that many chunks: chunk ``i + 1``'s dispatch and
chunk ``i - 1``'s return are in flight while chunk ``i``'s experts compute, in the forward and in
the backward (asynchronous ``hal.dist.all_to_all``). Results equal the unchunked layer's up to the
rounding of the grouped GEMM over fewer rows.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

import hal
import hal.dist as hd
from hal.errors import InvalidArgumentError
from hal.parallel import checks, comm

GroupLike = Union[None, dist.ProcessGroup, Any]  # a ProcessGroup, a 1-D DeviceMesh, or None (no parallelism)
_SEED_STRIDE = 1_000_003


def resolve_group(group: GroupLike, what: str) -> Optional[dist.ProcessGroup]:
    """A ProcessGroup from a ProcessGroup, a 1-D DeviceMesh (``mesh["ep"]``), or None."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out
        raise checks.not_member(group, what)
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    get_group = getattr(group, "get_group", None)
    if callable(get_group) and getattr(group, "ndim", 1) == 1:
        return get_group()
    raise InvalidArgumentError(
        what, "group", "a torch.distributed ProcessGroup, a 1-D DeviceMesh (slice a mesh: mesh['ep']) or None", repr(group)
    )


def _experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: two grouped GEMMs around hal's SwiGLU."""
    gate, up = hal.ops.grouped_gemm(x, w_gate_up, sizes).chunk(2, dim=-1)
    return hal.ops.grouped_gemm(hal.ops.swiglu(gate, up), w_down, sizes)


def _part(m: int, i: int, c: int) -> tuple[int, int]:
    """(start, length) of part ``i`` of ``c`` near-equal parts of a block of ``m`` rows."""
    q, r = divmod(m, c)
    return i * q + min(i, r), q + (1 if i < r else 0)


def _ranges(pieces: list[tuple[int, int]]) -> torch.Tensor:
    """The indices of consecutive (start, length) ranges, concatenated."""
    pieces = [(s, n) for s, n in pieces if n]
    if not pieces:
        return torch.zeros(0, dtype=torch.int64)
    starts = torch.tensor([s for s, _ in pieces], dtype=torch.int64)
    lengths = torch.tensor([n for _, n in pieces], dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - offsets, lengths)


class _Exchange:
    """Where the rows of one chunk travel: the host-side plan every rank derives from the same counts.

    ``kept[j][p]`` is how many token copies group rank ``j`` sends to the expert at slot ``p`` (slots:
    the experts ordered by owner rank, then id). This rank sends part ``i`` of each of its blocks and
    receives part ``i`` of every block addressed to its experts.
    """

    def __init__(self, kept: list[list[int]], me: int, owner_of_slot: list[int], mine: range, i: int, c: int, device: torch.device) -> None:
        n = len(kept)
        start, send_pieces = 0, []
        self.send_sizes = [0] * n
        for p, m in enumerate(kept[me]):
            s, length = _part(m, i, c)
            send_pieces.append((start + s, length))
            self.send_sizes[owner_of_slot[p]] += length
            start += m
        self.send_index = _ranges(send_pieces).to(device)
        blocks: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, source) -> (offset in the received chunk, rows)
        offset = 0
        self.recv_sizes = [0] * n
        for j in range(n):
            for p in mine:
                length = _part(kept[j][p], i, c)[1]
                blocks[p, j] = (offset, length)
                self.recv_sizes[j] += length
                offset += length
        # the received chunk is source-major; the experts want it expert-major
        self.perm = _ranges([blocks[p, j] for p in mine for j in range(n)]).to(device)
        self.inverse = torch.argsort(self.perm)
        self.group_sizes = torch.tensor([sum(blocks[p, j][1] for j in range(n)) for p in mine], dtype=torch.int64, device=device)


class _OverlappedExchange(torch.autograd.Function):
    """Dispatch, experts and return in chunks, each chunk's transfers in flight beside another's compute."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, plans: list[_Exchange], group: Any) -> torch.Tensor:
        ctx.plans, ctx.group = plans, group
        out = rows.new_empty(rows.shape)
        sent = [hd.all_to_all(rows[plans[0].send_index], group, plans[0].send_sizes, plans[0].recv_sizes, async_op=True)]
        back, graphs = [], []
        for i, plan in enumerate(plans):
            if i + 1 < len(plans):
                nxt = plans[i + 1]
                sent.append(hd.all_to_all(rows[nxt.send_index], group, nxt.send_sizes, nxt.recv_sizes, async_op=True))
            received = sent[i].wait()
            with torch.enable_grad():
                x = received[plan.perm].requires_grad_(True)
                w1, w2 = w_gate_up.detach().requires_grad_(True), w_down.detach().requires_grad_(True)
                h = _experts(x, w1, w2, plan.group_sizes)
            graphs.append((x, w1, w2, h))
            back.append(hd.all_to_all(h.detach()[plan.inverse], group, plan.recv_sizes, plan.send_sizes, async_op=True))
        for plan, work in zip(plans, back):
            out[plan.send_index] = work.wait()
        ctx.graphs = graphs
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        plans, group, graphs = ctx.plans, ctx.group, ctx.graphs
        grad = grad.contiguous()
        grad_rows = torch.empty_like(grad)
        grad_w1 = grad_w2 = None
        sent = [hd.all_to_all(grad[plans[0].send_index], group, plans[0].send_sizes, plans[0].recv_sizes, async_op=True)]
        back = []
        for i, plan in enumerate(plans):
            if i + 1 < len(plans):
                nxt = plans[i + 1]
                sent.append(hd.all_to_all(grad[nxt.send_index], group, nxt.send_sizes, nxt.recv_sizes, async_op=True))
            g = sent[i].wait()[plan.perm]
            x, w1, w2, h = graphs[i]
            gx, g1, g2 = torch.autograd.grad(h, (x, w1, w2), g, allow_unused=True)
            gx = torch.zeros_like(x) if gx is None else gx
            grad_w1 = g1 if grad_w1 is None else grad_w1 + g1
            grad_w2 = g2 if grad_w2 is None else grad_w2 + g2
            back.append(hd.all_to_all(gx[plan.inverse].contiguous(), group, plan.recv_sizes, plan.send_sizes, async_op=True))
        for plan, work in zip(plans, back):
            grad_rows[plan.send_index] = work.wait()
        ctx.graphs = None
        return grad_rows, grad_w1, grad_w2, None, None


class _AttachAux(torch.autograd.Function):
    """Forward: ``y`` as is. Backward: ``y``'s gradient, and ``coef`` as the auxiliary loss's gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef, ctx.aux_dtype = coef, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, torch.full((), ctx.coef, dtype=ctx.aux_dtype, device=grad.device), None


class ExpertParallelMoE(nn.Module):
    """A top-k mixture of SwiGLU experts whose experts are spread over the ranks of ``group``.

    ``forward(x)`` takes this rank's tokens ``(..., dim)`` and returns the layer's output for them
    (same shape); :attr:`aux_loss` holds the load-balancing loss of that call (see the module doc)
    and :attr:`stats` the group's routing counts. ``group``: a ProcessGroup or a 1-D DeviceMesh of
    the expert-parallel ranks, or None for all experts on this process (no communication: the
    single-device layer). ``placement``: the group rank owning each expert (default: contiguous
    blocks, ``num_experts`` divisible by the group size); every rank must own at least one.
    Weights are drawn per expert from ``seed``, so every placement (and the one-process layer) holds
    the same experts. ``aux_loss_coef``: when set, the backward adds ``aux_loss_coef * aux_loss``'s
    gradient by itself (attached to the output, as Megatron-LM does), for losses computed where the
    layer's aux_loss cannot be added (another pipeline stage); leave None and add
    ``coef * layer.aux_loss`` to the loss otherwise. The router is replicated: reduce its gradient over the group as data-parallel
    gradients are (:meth:`replicated_parameters`); the expert weights (:meth:`expert_parameters`)
    get their whole gradient from the exchange.
    """

    def __init__(
        self,
        dim: int,
        ffn: int,
        num_experts: int,
        top_k: int = 2,
        *,
        group: GroupLike = None,
        placement: Optional[Sequence[int]] = None,
        capacity_factor: Optional[float] = None,
        overlap_chunks: int = 1,
        normalize_weights: bool = True,
        aux_loss_coef: Optional[float] = None,
        seed: int = 0,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        what = "ExpertParallelMoE"
        for name, value in (("dim", dim), ("ffn", ffn), ("num_experts", num_experts), ("top_k", top_k), ("overlap_chunks", overlap_chunks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(what, name, "a positive int", repr(value))
        if top_k > num_experts:
            raise InvalidArgumentError(what, "top_k", f"at most num_experts ({num_experts})", repr(top_k))
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise InvalidArgumentError(what, "capacity_factor", "a positive number, or None for dropless routing", repr(capacity_factor))
        self.group = resolve_group(group, what)
        self.group_size = 1 if self.group is None else comm.group_size(self.group)
        self.group_rank = 0 if self.group is None else comm.group_rank(self.group)
        self.dim, self.ffn, self.num_experts, self.top_k = dim, ffn, num_experts, top_k
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        if aux_loss_coef is not None and not (isinstance(aux_loss_coef, (int, float)) and aux_loss_coef >= 0):
            raise InvalidArgumentError(what, "aux_loss_coef", "a non-negative number or None", repr(aux_loss_coef))
        self.overlap_chunks, self.normalize_weights = overlap_chunks, normalize_weights
        self.aux_loss_coef = aux_loss_coef
        self.placement = self._placement(placement)
        # slots: the experts in the order of their owner rank, then id (the order rows travel in)
        self.slot_experts = sorted(range(num_experts), key=lambda e: (self.placement[e], e))
        self.owner_of_slot = [self.placement[e] for e in self.slot_experts]
        mine = [p for p, r in enumerate(self.owner_of_slot) if r == self.group_rank]
        self.my_slots = range(mine[0], mine[-1] + 1)
        self.expert_ids = [self.slot_experts[p] for p in self.my_slots]
        slot_of = torch.empty(num_experts, dtype=torch.int64)
        slot_of[torch.tensor(self.slot_experts)] = torch.arange(num_experts)
        self.register_buffer("slot_of", slot_of.to(device), persistent=False)

        factory = {"device": device, "dtype": dtype}
        self.router = nn.Parameter(torch.empty(num_experts, dim, **factory))
        self.w_gate_up = nn.Parameter(torch.empty(len(self.expert_ids), dim, 2 * ffn, **factory))
        self.w_down = nn.Parameter(torch.empty(len(self.expert_ids), ffn, dim, **factory))
        self.reset_parameters(seed)
        self.aux_loss: Optional[torch.Tensor] = None
        self.stats: dict[str, Any] = {}

    def _placement(self, placement: Optional[Sequence[int]]) -> list[int]:
        n, e = self.group_size, self.num_experts
        if placement is None:
            if e % n:
                raise InvalidArgumentError(
                    "ExpertParallelMoE", "num_experts", f"a multiple of the expert-parallel group size {n} "
                    "(or pass placement=[owner rank of each expert])", repr(e)
                )
            return [i // (e // n) for i in range(e)]
        owners = list(placement)
        if len(owners) != e or any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n for r in owners):
            raise InvalidArgumentError("ExpertParallelMoE", "placement", f"{e} group ranks in [0, {n}), one per expert", repr(placement))
        empty = sorted(set(range(n)) - set(owners))
        if empty:
            raise InvalidArgumentError("ExpertParallelMoE", "placement", f"every rank of the group owning an expert (ranks {empty} own none)", repr(placement))
        return owners

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Router and each expert drawn from their own generators (the same on every rank)."""
        gen = torch.Generator().manual_seed(seed)
        self.router.copy_(torch.randn(self.router.shape, generator=gen, dtype=torch.float64) * self.dim**-0.5)
        for i, e in enumerate(self.expert_ids):
            gen = torch.Generator().manual_seed(seed * _SEED_STRIDE + 1 + e)
            self.w_gate_up[i].copy_(torch.randn(self.dim, 2 * self.ffn, generator=gen, dtype=torch.float64) * self.dim**-0.5)
            self.w_down[i].copy_(torch.randn(self.ffn, self.dim, generator=gen, dtype=torch.float64) * self.ffn**-0.5)

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's expert weights: their gradients are complete after backward (replicas of them in
        other expert-parallel groups, e.g. along a data-parallel mesh dimension, still need a reduction)."""
        return [self.w_gate_up, self.w_down]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The router: each rank holds a gradient from its own tokens only; reduce it over the group."""
        return [self.router]

    def extra_repr(self) -> str:
        mode = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor:g}"
        return (f"dim={self.dim}, ffn={self.ffn}, experts={self.num_experts} ({len(self.expert_ids)} here: {self.expert_ids}), "
                f"top_k={self.top_k}, {mode}, group_size={self.group_size}, overlap_chunks={self.overlap_chunks}")

    # --- routing ------------------------------------------------------------------------------------

    def _counts(self, experts: torch.Tensor) -> torch.Tensor:
        """(group size, top_k, experts): every rank's token copies per choice slot and expert."""
        k, e = self.top_k, self.num_experts
        local = torch.zeros(k * e, dtype=torch.int64, device=experts.device)
        flat = (experts + torch.arange(k, device=experts.device) * e).reshape(-1)
        local.index_add_(0, flat, torch.ones_like(flat))
        if self.group_size == 1:
            return local.view(1, k, e)
        return hd.all_gather(local.view(1, k * e), group=self.group).view(self.group_size, k, e)

    def _keep(self, experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of this rank's copies fit their expert's capacity, and every rank's kept copies per expert.

        A copy's place in its expert's queue: copies of earlier choice slots (all ranks), then this
        slot's copies of earlier ranks, then this rank's earlier tokens."""
        e = self.num_experts
        before_slot = counts.sum(0).cumsum(0) - counts.sum(0)  # (k, E)
        before_rank = counts.cumsum(0) - counts  # (n, k, E)
        start = before_slot[None] + before_rank  # queue position of each rank's first copy, per slot and expert
        kept_all = (capacity - start).clamp(min=0).minimum(counts).sum(1)  # (n, E)
        onehot = torch.nn.functional.one_hot(experts, e)  # (T, k, E)
        earlier = (onehot.cumsum(0) - onehot).gather(2, experts[..., None])[..., 0]  # same slot and expert, earlier tokens
        position = start[self.group_rank].gather(1, experts.T).T + earlier
        return position < capacity, kept_all

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = checks.Local()  # this rank's own checks, carried in its row: every rank raises together
        if x.dim() == 0 or x.shape[-1] != self.dim:
            local.fail(_MOE_WIDTH, f"shape {tuple(x.shape)}"[:56], f"a tensor whose last dimension is dim={self.dim}")
        local.device(_MOE_X, x, self.router.device)
        if self.group is None:  # no peers
            local.raise_now()
        else:  # every exchange below follows from these: one check covers them, forward and backward
            checks.agree("ExpertParallelMoE", self.group, checks.row_device(self.router.device, x.device), [] if not local.ok else [
                ("x.dtype", x.dtype), ("x.shape[-1]", x.shape[-1]),
                ("settings", checks.config_code(self.num_experts, self.top_k, self.capacity_factor, self.overlap_chunks,
                                                self.normalize_weights, self.placement),
                 "the same num_experts, top_k, capacity_factor, overlap_chunks, normalize_weights and placement on every rank")],
                local=local)
        shape, k, n = x.shape, self.top_k, self.group_size
        x2 = x.reshape(-1, self.dim)
        rdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # the router runs in float32 at least
        probs = hal.ops.softmax(hal.ops.linear(x2.to(rdt), self.router.to(rdt)), dim=-1)
        weight, experts = probs.topk(k, dim=-1)
        if self.normalize_weights:
            weight = weight / weight.sum(-1, keepdim=True)
        counts = self._counts(experts)
        total = int(counts[:, 0].sum())  # tokens of the group
        per_expert = counts.sum((0, 1))
        if total:
            share = per_expert.to(probs.dtype) / (total * k)
            self.aux_loss = self.num_experts * (share * probs.sum(0)).sum() * (n / total)
        else:
            self.aux_loss = probs.sum() * 0
        if self.capacity_factor is None:
            keep, kept_all = None, counts.sum(1)
            capacity = None
        else:
            capacity = math.ceil(self.capacity_factor * total * k / self.num_experts)
            keep, kept_all = self._keep(experts, counts, capacity)
        flat_experts = experts.reshape(-1)
        chosen = torch.arange(flat_experts.numel(), device=x.device) if keep is None else keep.reshape(-1).nonzero()[:, 0]
        order = chosen[torch.argsort(self.slot_of[flat_experts[chosen]], stable=True)]
        tokens = torch.div(order, k, rounding_mode="floor")
        # rows travel in slot order; kept counts per rank, in slot order, decide every split size
        kept = kept_all[:, self.slot_of.new_tensor(self.slot_experts)].tolist()
        self.stats = {"tokens": total, "copies_per_expert": per_expert.tolist(), "capacity": capacity,
                      "dropped": total * k - sum(map(sum, kept))}
        rows = self._exchange(x2[tokens], kept)
        out = x2.new_zeros(x2.shape).index_add(0, tokens, rows * weight.reshape(-1)[order, None].to(rows.dtype))
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AttachAux.apply(out, self.aux_loss, float(self.aux_loss_coef))
        return out.reshape(shape)

    def _exchange(self, rows: torch.Tensor, kept: list[list[int]]) -> torch.Tensor:
        """The experts' outputs for ``rows`` (this rank's copies in slot order), wherever the experts live."""
        c, dev = self.overlap_chunks, rows.device
        if self.group_size > 1 and c > 1:
            plans = [_Exchange(kept, self.group_rank, self.owner_of_slot, self.my_slots, i, c, dev) for i in range(c)]
            return _OverlappedExchange.apply(rows, self.w_gate_up, self.w_down, plans, self.group)
        plan = _Exchange(kept, self.group_rank, self.owner_of_slot, self.my_slots, 0, 1, dev)
        if self.group_size == 1:
            return _experts(rows, self.w_gate_up, self.w_down, plan.group_sizes)
        received = comm.all_to_all(rows, self.group, plan.send_sizes, plan.recv_sizes, check=False)
        h = _experts(received[plan.perm], self.w_gate_up, self.w_down, plan.group_sizes)
        return comm.all_to_all(h[plan.inverse], self.group, plan.recv_sizes, plan.send_sizes, check=False)


_MOE_WIDTH = checks.check("ExpertParallelMoE", "x", "a tensor whose last dimension is the layer's dim")
_MOE_X = checks.device_check("ExpertParallelMoE", "x")


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the auxiliary losses of every :class:`ExpertParallelMoE` in ``model`` (last forward)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, ExpertParallelMoE) and m.aux_loss is not None]
    if not losses:
        raise InvalidArgumentError("moe_aux_loss", "model", "a model whose MoE layers have run a forward", type(model).__name__)
    return torch.stack([l.float() for l in losses]).sum()


__all__ = ["ExpertParallelMoE", "moe_aux_loss", "resolve_group"]
