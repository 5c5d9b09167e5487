"""Vocabulary parallelism: the embedding and the LM head with its loss, the vocabulary split across ranks.

Each rank of the tensor-parallel group holds a contiguous slice of the vocabulary: rows
``[rank * per_rank, (rank + 1) * per_rank)`` of the embedding table and of the LM head's weight,
``per_rank = ceil(vocab_size / ranks)`` (the last slices padded with rows no id addresses).

* :class:`VocabParallelEmbedding`: ids outside this rank's slice look up zeros here; the ranks'
  outputs are summed (:func:`hal.parallel.comm.reduce_from_parallel`), or summed and split along the
  sequence for sequence parallelism. Ids outside the vocabulary (and, for the loss, targets that are
  neither a class nor ``ignore_index``) raise :class:`hal.parallel.IndexOutOfRangeError`, an
  ``IndexError`` as torch's; :mod:`hal.parallel.checks` says where they are found and on which ranks.
* :func:`vocab_parallel_linear_cross_entropy` / :class:`VocabParallelLMHead`: the LM head and its
  cross-entropy without any rank ever holding the whole logits, nor even its own slice of them
  for all rows at once. Rows go in chunks: each rank computes a chunk's local logits with
  ``hal.ops.linear``, reduces them to three numbers per row (log-sum-exp, target logit, sum of
  logits for label smoothing) and drops the chunk. Two collectives per call then combine the
  ranks' numbers (a max and a sum over ``hal.dist.all_reduce``: O(rows) bytes, whatever the
  vocabulary). The backward recomputes each chunk's local logits, turns them into
  ``softmax - onehot`` with the global log-sum-exp, and accumulates the local weight gradient and
  this rank's partial input gradient, which one all-reduce sums.

Peak memory per rank is a few chunks of logits (``chunk_rows`` x ``per_rank``), a fraction of the rank's
share ``rows x per_rank``: :class:`hal.parallel.memory.PeakMemory` measures it in the tests.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hal
import hal.dist as hd
from hal.errors import InvalidArgumentError
from hal.nn.modules import _cast, autocast_dtype
from hal.parallel import checks, comm

#: the most logits a chunk holds (per rank): 16 MiB in float32, as hal's fused loss kernels
BLOCK_ELEMENTS = 1 << 22
#: a call makes at least this many chunks (when it has the rows), so that a chunk's temporaries
#: (logits in the GEMM's dtype, in float32, their exponentials) stay well below one rank's share
MIN_CHUNKS = 8
REDUCTIONS = ("none", "mean", "sum")


def vocab_slice(vocab_size: int, group: Any = None, op: str = "vocab_slice") -> tuple[int, int, int]:
    """(first id, rows held, rows that are real ids) of this rank's slice of a vocabulary of
    ``vocab_size`` ids split over ``group``: every rank holds ``ceil(vocab_size / ranks)`` rows; the
    last ranks' tails (ids >= vocab_size) are padding. ``op`` names the caller in the error raised
    when this rank is not in ``group``."""
    n, r = comm.member(group, op)
    per_rank = -(-vocab_size // n)
    start = r * per_rank
    return start, per_rank, max(0, min(per_rank, vocab_size - start))


def _shard_rows(full: torch.Tensor, vocab_size: int, group: Any) -> torch.Tensor:
    """This rank's rows of a full (vocab_size, ...) table, zero-padded to the slice size."""
    start, per_rank, real = vocab_slice(vocab_size, group)
    out = full.new_zeros((per_rank, *full.shape[1:]))
    out[:real] = full[start : start + real]
    return out


# --- embedding ------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(vocab_size, dim)`` with its rows split over the ranks of ``group``.

    ``weight`` is this rank's slice, (``ceil(vocab_size / ranks)``, dim). The forward looks up the
    ids of this slice (others give zeros) and sums the ranks' results, so every rank gets the full
    embedding; with ``sequence_dim`` the sum is reduce-scattered along that dimension instead
    (sequence parallelism: each rank keeps its part of the sequence). ``padding_idx`` as
    ``nn.Embedding`` (a global id: its row gets no gradient).
    """

    def __init__(self, vocab_size: int, embedding_dim: int, group: Any = None, *, padding_idx: Optional[int] = None,
                 sequence_dim: Optional[int] = None, device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        checks.count("VocabParallelEmbedding", "vocab_size", vocab_size, 1)
        checks.count("VocabParallelEmbedding", "embedding_dim", embedding_dim, 1)
        if padding_idx is not None and not -vocab_size <= padding_idx < vocab_size:
            raise InvalidArgumentError("VocabParallelEmbedding", "padding_idx", f"an id in [-{vocab_size}, {vocab_size})", repr(padding_idx))
        self.vocab_size, self.embedding_dim, self.group = vocab_size, embedding_dim, group
        self.padding_idx = None if padding_idx is None else padding_idx % vocab_size
        self.sequence_dim = sequence_dim
        self.vocab_start, per_rank, self.vocab_real = vocab_slice(vocab_size, group, "VocabParallelEmbedding")
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 1) rows, as ``nn.Embedding`` (each rank draws its own; use :meth:`from_embedding`
        to split a table made on one process); padding rows and ``padding_idx`` zero."""
        with torch.no_grad():
            nn.init.normal_(self.weight)
            self.weight[self.vocab_real :].zero_()
            local = self._local_padding()
            if local is not None:
                self.weight[local].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Any = None, *, sequence_dim: Optional[int] = None) -> "VocabParallelEmbedding":
        """This rank's slice of ``embedding`` (the same table on every rank), copied."""
        w = embedding.weight
        out = cls(w.shape[0], w.shape[1], group, padding_idx=embedding.padding_idx, sequence_dim=sequence_dim, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(_shard_rows(w.detach(), w.shape[0], group))
        return out

    def _local_padding(self) -> Optional[int]:
        p = self.padding_idx
        if p is None or not self.vocab_start <= p < self.vocab_start + self.vocab_real:
            return None
        return p - self.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = checks.Local()  # this rank's own checks, carried in its row: every rank raises together
        if ids.dtype not in (torch.int64, torch.int32):  # bool and uint8 too: nn.Embedding takes these two only
            local.fail(_IDS_DTYPE, f"a {ids.dtype} tensor")
        local.device(_IDS_DEVICE, ids, self.weight.device)
        self._check(ids, local)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_start + self.vocab_real)
        local = torch.where(inside, ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight, self._local_padding())
        # zeros where another rank holds the id: filled, not multiplied by the mask, so that a NaN or
        # Inf in the row looked up in their place (local row 0) does not reach the sum of every rank
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        if self.sequence_dim is None:  # (out's shape and dtype agree: ids, the table and the settings were checked)
            return comm.reduce_from_parallel(out, self.group, check=False)
        dim = comm.axis(out, self.sequence_dim, "VocabParallelEmbedding", "sequence_dim", of="the output (the ids' dimensions, then the embedding's)")
        return comm.reduce_scatter_to_parallel(out, dim, self.group, check=False)

    def _check(self, ids: torch.Tensor, local: checks.Local) -> None:
        """Every id in [0, vocab_size), as ``nn.Embedding`` requires (an :class:`IndexError`), and, with
        the agreement check, the same ids, table dtype and settings on every rank, and this rank's
        own checks (``local``) passed on every rank."""
        device = checks.row_device(self.weight.device, ids.device)
        if not local.ok:  # every rank raises, through the row (nothing else of this rank's is read)
            checks.agree("VocabParallelEmbedding", self.group, device, [], local=local)
        bounds = checks.Bounds("ids", f"token ids in [0, {self.vocab_size}) (index out of range in self)",
                               checks.out_of_range(ids, self.vocab_size))
        same_ids = checks.content_code(ids) if checks.exchanged(self.group, ids.device) else 0
        checks.agree("VocabParallelEmbedding", self.group, device, [
            ("ids", ids),
            ("ids", same_ids, "the same token ids on every rank of the group (each rank looks up its slice of the "
             "vocabulary for all of them: feed the tensor-parallel ranks the same batch)"),
            ("weight", self.weight.dtype),
            ("settings", checks.config_code(self.vocab_size, self.embedding_dim, self.padding_idx, self.sequence_dim),
             "the same vocab_size, embedding_dim, padding_idx and sequence_dim on every rank of the group"),
        ], bounds)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, embedding_dim={self.embedding_dim}, ids [{self.vocab_start}, "
                f"{self.vocab_start + self.vocab_real}) here, sequence_dim={self.sequence_dim}")


_IDS_DTYPE = checks.check("VocabParallelEmbedding", "ids", "an int64 or int32 tensor of token ids (as nn.Embedding)")
_IDS_DEVICE = checks.device_check("VocabParallelEmbedding", "ids")


# --- LM head + cross-entropy ----------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows_for(rows: int, per_rank: int, chunk_rows: Optional[int] = None) -> int:
    """Rows per chunk: ``chunk_rows`` when given, else at most BLOCK_ELEMENTS logits and at most
    1/MIN_CHUNKS of the rows."""
    if chunk_rows is not None:
        return max(1, int(chunk_rows))
    return max(1, min(BLOCK_ELEMENTS // max(1, per_rank), -(-rows // MIN_CHUNKS)))


class _Setup:
    """What the forward and the backward of one call share (no tensors that need saving)."""

    def __init__(self, group: Any, vocab_size: int, start: int, real: int, ignore_index: int, label_smoothing: float,
                 reduction: str, chunk: int, reduce_grad_x: bool) -> None:
        self.group, self.vocab_size, self.start, self.real = group, vocab_size, start, real
        self.ignore_index, self.eps, self.reduction, self.chunk = ignore_index, label_smoothing, reduction, chunk
        self.reduce_grad_x = reduce_grad_x

    def owned(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows whose target id is in this slice, the target's local column (0 elsewhere))."""
        inside = (target >= self.start) & (target < self.start + self.real) & (target != self.ignore_index)
        return inside, torch.where(inside, target - self.start, 0).long()

    def logits(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], rows: slice) -> torch.Tensor:
        """A chunk's local logits over the real ids of this slice, in float32 (float64 for float64):
        the GEMM runs in x's dtype (hal.ops.linear), rounded once, as autocast's F.linear."""
        return hal.ops.linear(x[rows], w, b).to(_acc(x.dtype))


def _local_partials(s: _Setup, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, over this rank's slice: log-sum-exp, the target's logit (0 where another rank owns
    it) and the sum of the logits (label smoothing only), chunk by chunk."""
    n, acc = x.shape[0], _acc(x.dtype)
    lse = torch.full((n,), -math.inf, dtype=acc, device=x.device)
    tgt = torch.zeros(n, dtype=acc, device=x.device)
    total = torch.zeros(n, dtype=acc, device=x.device)
    if s.real == 0:  # a slice of padding alone: nothing to add
        return lse, tgt, total
    inside, col = s.owned(target)
    for i in range(0, n, s.chunk):
        r = slice(i, min(n, i + s.chunk))
        z = s.logits(x, w, b, r)
        tgt[r] = torch.where(inside[r], z.gather(1, col[r, None]).squeeze(1), 0.0)
        if s.eps:
            total[r] = z.sum(1)
        m = z.amax(1)
        lse[r] = m + z.sub_(m[:, None]).exp_().sum(1).log_()
        del z
    return lse, tgt, total


def _combine(s: _Setup, lse: torch.Tensor, tgt: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks' partials combined: (global log-sum-exp, target logit, sum of logits) per row.
    Two all-reduces over hal.dist: the max of the local log-sum-exps, then one sum of the
    exponentials relative to it, the target logits and the logit sums stacked."""
    if comm.group_size(s.group) == 1:
        return lse, tgt, total
    top = lse.clone()
    hd.all_reduce(top, op="max", group=s.group)
    top = torch.where(torch.isfinite(top), top, 0.0)  # (a row with no class anywhere cannot happen: V >= 1)
    packed = torch.stack([torch.exp(lse - top), tgt, total])
    hd.all_reduce(packed, op="sum", group=s.group)
    return top + packed[0].log(), packed[1], packed[2]


def _row_losses(s: _Setup, lse: torch.Tensor, tgt: torch.Tensor, total: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``lse - (1 - e) z_t - e / V sum_c z_c`` per row: cross-entropy with label smoothing e; 0 at ignored rows."""
    rows = lse - (1.0 - s.eps) * tgt
    if s.eps:
        rows = rows - (s.eps / s.vocab_size) * total
    return torch.where(counted, rows, 0.0)


def _reduce(rows: torch.Tensor, counted: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / counted.sum()


class _VocabParallelLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor, s: _Setup) -> torch.Tensor:
        wr = w[: s.real]
        br = None if b is None else b[: s.real]
        counted = target != s.ignore_index
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen already
            lse, tgt, total = _combine(s, *_local_partials(s, x, wr, br, target))
        ctx.save_for_backward(x, w, b, target, lse)
        ctx.setup = s
        return _reduce(_row_losses(s, lse, tgt, total, counted), counted, s.reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w, b, target, lse = ctx.saved_tensors
        s: _Setup = ctx.setup
        with torch.autocast(x.device.type, enabled=False):
            grad_x, grad_w, grad_b = _backward(s, grad, x, w, b, target, lse, ctx.needs_input_grad)
        return grad_x, grad_w, grad_b, None, None


def _backward(s: _Setup, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor,
              lse: torch.Tensor, needs: tuple) -> tuple:
    """(grad_x, grad_weight, grad_bias): each chunk's local logits again, ``softmax - (1 - e) onehot
    - e / V`` on this slice times the row's scale; grad_x summed over the ranks (unless the caller's
    gather reduces it)."""
    n, acc = x.shape[0], _acc(x.dtype)
    counted = target != s.ignore_index
    g = grad.to(acc)
    if s.reduction == "mean":
        g = g / counted.sum().clamp_min(1)
    scale = torch.where(counted, g.expand(n), 0.0)
    gx = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if needs[0] else None
    gw = torch.zeros(w.shape, dtype=acc, device=w.device) if needs[1] else None
    gb = torch.zeros(w.shape[0], dtype=acc, device=w.device) if (b is not None and needs[2]) else None
    if s.real and n:
        wr, br = w[: s.real], None if b is None else b[: s.real]
        inside, col = s.owned(target)
        for i in range(0, n, s.chunk):
            r = slice(i, min(n, i + s.chunk))
            d = s.logits(x, wr, br, r).sub_(lse[r, None]).exp_()
            if s.eps:
                d.sub_(s.eps / s.vocab_size)
            hit = inside[r].nonzero().squeeze(1)
            d[hit, col[r][hit]] -= 1.0 - s.eps
            d.mul_(scale[r, None])
            if gb is not None:
                gb[: s.real] += d.sum(0)
            d = d.to(x.dtype)
            if gx is not None:
                gx[r] = hal.ops.matmul(d, wr)
            if gw is not None:
                gw[: s.real] += hal.ops.matmul(d.t(), x[r])
    if gx is not None and s.reduce_grad_x and comm.group_size(s.group) > 1:
        hd.all_reduce(gx, op="sum", group=s.group)
    return gx, None if gw is None else gw.to(w.dtype), None if gb is None else gb.to(w.dtype)


def vocab_parallel_linear_cross_entropy(
    x: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    group: Any = None,
    *,
    vocab_size: Optional[int] = None,
    bias_shard: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    sequence_parallel: bool = False,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """``cross_entropy(x @ W.T + b, target)`` with W's rows (the vocabulary) split over ``group``.

    ``x`` (N, K) is the same on every rank of ``group`` (or, ``sequence_parallel=True``, this rank's
    block of the rows, as a sequence-parallel norm leaves it: the rows are gathered and the input
    gradient reduce-scattered back); ``weight_shard`` (per_rank, K) and ``bias_shard`` (per_rank,)
    are this rank's rows ``[rank * per_rank, (rank + 1) * per_rank)`` of W and b; ``vocab_size``
    the real vocabulary (default ``per_rank * ranks``: no padding; rows past it are padding and
    take no part). ``target`` (N,) class ids (this rank's block under sequence parallelism).
    ``ignore_index``, ``label_smoothing`` and ``reduction`` as ``F.cross_entropy`` (float32 loss;
    float64 for float64; a mean over no counted row is NaN); ``reduction="none"`` gives the rows
    of ``x`` as passed. Under ``torch.autocast`` the GEMMs run in the autocast dtype, the loss in
    float32. The result is the same on every rank. No rank holds more than ``chunk_rows`` (default:
    :func:`chunk_rows_for`) rows of its local logits at a time.
    """
    return _linear_cross_entropy(x, weight_shard, target, group, vocab_size, bias_shard, ignore_index, label_smoothing, reduction,
                                 sequence_parallel, chunk_rows, checks.Local())


_OP = "vocab_parallel_linear_cross_entropy"
_LOSS = {
    "x": checks.check(_OP, "x, weight_shard", "(N, K) and (per_rank, K) tensors"),
    "target": checks.check(_OP, "target", "an integer tensor of shape (N,) (one class id per row of x)"),
    "device": {arg: checks.device_check(_OP, arg) for arg in ("x", "target", "bias_shard")},
    "reduction": checks.check(_OP, "reduction", "one of none, mean, sum"),
    "label_smoothing": checks.check(_OP, "label_smoothing", "a number in [0, 1]"),
    "ignore_index": checks.check(_OP, "ignore_index", "an int"),
    "chunk_rows": checks.check(_OP, "chunk_rows", "an int of at least 1"),
    "vocab_size": checks.check(_OP, "vocab_size", "a size in [1, per_rank x ranks] (the ranks' slices of weight_shard's rows)"),
    "bias_shard": checks.check(_OP, "bias_shard", "a (per_rank,) tensor (weight_shard's rows)"),
}
_HEAD_X = checks.device_check("VocabParallelLMHead", "x")
_HEAD_TARGET = checks.check("VocabParallelLMHead", "target", "a tensor of x's leading shape (one class id per row of x, as F.cross_entropy)")


def _linear_cross_entropy(x: torch.Tensor, weight_shard: torch.Tensor, target: Optional[torch.Tensor], group: Any,
                          vocab_size: Optional[int], bias_shard: Optional[torch.Tensor], ignore_index: Any, label_smoothing: Any,
                          reduction: Any, sequence_parallel: bool, chunk_rows: Any, local: checks.Local) -> torch.Tensor:
    """:func:`vocab_parallel_linear_cross_entropy` given this rank's verdict so far (``local``: the
    LM head's own checks; ``target`` None where they failed). Every argument check below goes into
    it, so that a rank whose arguments alone are wrong raises with its peers, after the agreement."""
    op = _OP
    ranks = comm.group_size(group)  # (a group without this rank: no peer shares a collective with it)
    per_rank = weight_shard.shape[0] if weight_shard.dim() == 2 else 0
    vocab = per_rank * ranks
    if local.ok and (x.dim() != 2 or weight_shard.dim() != 2 or weight_shard.shape[1] != x.shape[1]):
        local.fail(_LOSS["x"], f"{tuple(x.shape)} and {tuple(weight_shard.shape)}")
    if local.ok and (target.dim() != 1 or target.shape[0] != x.shape[0] or target.is_floating_point() or target.is_complex()
                     or target.dtype == torch.bool):
        local.fail(_LOSS["target"], f"{target.dtype} {tuple(target.shape)}, x of {x.shape[0]} rows",
                   f"an integer tensor of shape ({x.shape[0]},) (one class id per row of x)", f"{target.dtype} {tuple(target.shape)}")
    for arg, t in (("x", x), ("target", target), ("bias_shard", bias_shard)):
        if local.ok:
            local.device(_LOSS["device"][arg], t, weight_shard.device)
    if local.ok and (not isinstance(reduction, str) or reduction not in REDUCTIONS):
        local.fail(_LOSS["reduction"], repr(reduction)[:40])
    if local.ok:
        try:
            label_smoothing = float(label_smoothing)
        except (TypeError, ValueError):
            label_smoothing = math.nan
        if not 0.0 <= label_smoothing <= 1.0:
            local.fail(_LOSS["label_smoothing"], repr(label_smoothing)[:40])
    if local.ok:
        try:
            ignore_index = int(ignore_index)
        except (TypeError, ValueError):
            local.fail(_LOSS["ignore_index"], repr(ignore_index)[:40])
    if chunk_rows is not None:
        local.count(_LOSS["chunk_rows"], chunk_rows, 1)
    if local.ok:
        try:
            vocab = per_rank * ranks if vocab_size is None else int(vocab_size)
        except (TypeError, ValueError):
            vocab = vocab_size
        if not isinstance(vocab, int) or not 0 < vocab <= per_rank * ranks:
            local.fail(_LOSS["vocab_size"], f"{vocab!r} for {ranks} slices of {per_rank} rows"[:56],
                       f"a size in [1, {per_rank * ranks}] ({ranks} slices of {per_rank} rows)", repr(vocab))
    if local.ok and bias_shard is not None and tuple(bias_shard.shape) != (per_rank,):
        local.fail(_LOSS["bias_shard"], f"{tuple(bias_shard.shape)} for {per_rank} rows", f"a ({per_rank},) tensor",
                   f"{tuple(bias_shard.shape)}")
    if not local.ok:  # every rank raises, through the row (nothing else of this rank's is read)
        checks.agree(op, group, checks.row_device(weight_shard.device, x.device), [], local=local)
    dtype = autocast_dtype(x)
    x, w, b = _cast(x, dtype), _cast(weight_shard, dtype), _cast(bias_shard, dtype)
    # the agreement check first: x's dtype differing across ranks is then the same error on every rank (checked
    # locally first, the rank whose x alone differed raised by itself and its peers paired their next call's check
    # with its next call's, out of step from then on)
    _check_loss(x, w, b, target, group, vocab, ignore_index, label_smoothing, reduction, sequence_parallel, local)
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        raise InvalidArgumentError(op, "weight_shard", f"x's dtype {x.dtype} (outside autocast)", str(w.dtype))
    if sequence_parallel:  # (unchecked: the call was checked as a whole above)
        x = comm.gather_from_parallel(x, 0, group, grad_reduce=True, check=False)
        target = hd.all_gather(target.contiguous(), group=group) if ranks > 1 else target
    start = comm.group_rank(group) * per_rank
    real = max(0, min(per_rank, vocab - start))
    chunk = chunk_rows_for(x.shape[0], per_rank, chunk_rows)
    s = _Setup(group, vocab, start, real, ignore_index, label_smoothing, reduction, chunk, not sequence_parallel)
    loss = _VocabParallelLCE.apply(x, w, b, target, s)
    if sequence_parallel and reduction == "none":
        return comm.scatter_to_parallel(loss, 0, group, check=False)  # the backward gathers every rank's row gradients
    return loss


def _check_loss(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor, group: Any, vocab: int,
                ignore_index: int, label_smoothing: float, reduction: str, sequence_parallel: bool, local: checks.Local) -> None:
    """Every target in [0, vocab) or ``ignore_index``, as ``F.cross_entropy`` requires (an
    :class:`IndexError`), and, with the agreement check, the same shapes, dtypes, settings and (unless
    the rows are split along the sequence) targets on every rank."""
    op = "vocab_parallel_linear_cross_entropy"
    bounds = checks.Bounds("target", f"class ids in [0, {vocab}) or ignore_index={ignore_index} (target out of bounds)",
                           checks.out_of_range(target, vocab, ignore_index))
    same_targets = checks.content_code(target) if checks.exchanged(group, x.device) and not sequence_parallel else 0
    checks.agree(op, group, checks.row_device(w.device, x.device), [
        ("x", x), ("target", target), ("weight_shard", w), ("bias_shard", b is not None, "a bias_shard on every rank of the group, or on none"),
        ("target", same_targets, "the same targets on every rank of the group (the rows are whole on every rank "
         "without sequence_parallel: feed the tensor-parallel ranks the same batch)"),
        ("settings", checks.config_code(vocab, ignore_index, label_smoothing, reduction, sequence_parallel),
         "the same vocab_size, ignore_index, label_smoothing, reduction and sequence_parallel on every rank of the group"),
    ], bounds, local)


class VocabParallelLMHead(nn.Module):
    """``nn.Linear(in_features, vocab_size, bias)`` as the LM head, its rows split over ``group``.

    ``forward(x, target)`` gives the cross-entropy loss (:func:`vocab_parallel_linear_cross_entropy`,
    the logits never materialised; x of any leading shape, flattened to rows); ``forward(x)`` gives
    this rank's slice of the logits (..., per_rank) (``gather=True``: all of them, for generation).
    ``weight`` may be shared with a :class:`VocabParallelEmbedding` (tied embeddings: the same slicing).
    """

    def __init__(self, in_features: int, vocab_size: int, group: Any = None, *, bias: bool = False, ignore_index: int = -100,
                 label_smoothing: float = 0.0, reduction: str = "mean", sequence_parallel: bool = False,
                 chunk_rows: Optional[int] = None, device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        checks.count("VocabParallelLMHead", "in_features", in_features, 0)
        checks.count("VocabParallelLMHead", "vocab_size", vocab_size, 1)
        self.in_features, self.vocab_size, self.group = in_features, vocab_size, group
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.sequence_parallel, self.chunk_rows = sequence_parallel, chunk_rows
        self.vocab_start, per_rank, self.vocab_real = vocab_slice(vocab_size, group, "VocabParallelLMHead")
        self.weight = nn.Parameter(torch.empty(per_rank, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(per_rank, device=device, dtype=dtype)) if bias else None
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        with torch.no_grad():
            nn.init.uniform_(self.weight, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, **options: Any) -> "VocabParallelLMHead":
        """This rank's rows of ``linear`` (the same on every rank), copied; options as the constructor's."""
        w = linear.weight
        out = cls(w.shape[1], w.shape[0], group, bias=linear.bias is not None, device=w.device, dtype=w.dtype, **options)
        with torch.no_grad():
            out.weight.copy_(_shard_rows(w.detach(), w.shape[0], group))
            if linear.bias is not None:
                out.bias.copy_(_shard_rows(linear.bias.detach(), w.shape[0], group))
        return out

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None, *, gather: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        local = checks.Local()  # this rank's own checks, carried in its row: every rank raises together
        if target is not None:
            if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(x.shape[:-1]):
                # as F.cross_entropy: one target per row of x (flattening both matched (6,) targets to a (1, 6) x)
                got = f"shape {tuple(target.shape)}" if isinstance(target, torch.Tensor) else f"a {type(target).__name__}"
                local.fail(_HEAD_TARGET, f"{got}, x {tuple(x.shape)}"[:56],
                           f"a tensor of x's leading shape {tuple(x.shape[:-1])} (one class id per row of x, as F.cross_entropy)", got)
            loss = _linear_cross_entropy(
                rows, self.weight, target.reshape(-1) if local.ok else None, self.group, self.vocab_size, self.bias,
                self.ignore_index, self.label_smoothing, self.reduction, self.sequence_parallel, self.chunk_rows, local)
            return loss.reshape(target.shape) if self.reduction == "none" else loss
        local.device(_HEAD_X, x, self.weight.device)
        call = "gather_from_parallel" if self.sequence_parallel else "copy_to_parallel"
        if not local.ok:  # every rank raises, through the row of the collective below
            checks.agree(call, self.group, checks.row_device(self.weight.device, x.device), [], local=local)
        if self.sequence_parallel:
            rows = comm.gather_from_parallel(rows, 0, self.group, grad_reduce=True)
        else:
            rows = comm.copy_to_parallel(rows, self.group)
        dtype = autocast_dtype(rows)
        logits = hal.ops.linear(_cast(rows, dtype), _cast(self.weight, dtype), _cast(self.bias, dtype))
        lead = x.shape[:-1] if not self.sequence_parallel else (-1,)
        if gather:
            logits = comm.gather_from_parallel(logits, 1, self.group, grad_reduce=False)[:, : self.vocab_size]
        return logits.reshape(*lead, logits.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, ids [{self.vocab_start}, "
                f"{self.vocab_start + self.vocab_real}) here, bias={self.bias is not None}")


__all__ = ["VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_linear_cross_entropy", "vocab_slice", "chunk_rows_for"]
