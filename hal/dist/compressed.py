"""all_reduce sent in 16 bits (``compressed_fp16``, ``compressed_bf16``), accumulated in fp32.

The tensor is multiplied by a power of two ``s`` and cast to the 16-bit type; an all-to-all hands
each rank one block from every rank (the reduce-scatter phase), which it sums in fp32; the sum is
cast back to 16 bits and all-gathered; each rank multiplies by ``1/s`` (and ``1/n`` for ``avg``)
into the tensor, in its own dtype. Nothing is ever summed in 16 bits.

Pre-scaling so that nothing overflows:

* fp16 (max 65504): the ranks first agree on ``amax``, the largest magnitude anywhere (a one-element
  all-reduce), and take ``s = 2**(15 - e)`` where ``n * amax = m * 2**e``, ``0.5 <= m < 1``. Every
  partial sum of ``n`` scaled values then stays below ``2**15``, and small values use the fp16
  range instead of underflowing. If ``amax`` is not finite (an inf or NaN somewhere) ``s = 1``.
* bf16 has fp32's range: ``s = 2**-(ceil(log2 n) + 1)`` keeps sums away from its maximum, and no
  exchange is needed.

Because ``s`` is a power of two the scaling itself is exact: the error is that of rounding each
input and the fp32 block sum to the 16-bit type (relative ``2**-11`` for fp16, ``2**-8`` for bf16).
Into an fp16 tensor, a result pushed just past 65504 by that rounding alone is saturated to 65504
(an average of values near the maximum must not become inf); a true overflow stays inf.
On the CPU the passes run in chunks into reused buffers, so that no large temporary is allocated
per call (fresh pages cost more than the arithmetic there), and large messages are cut into pieces
that form a pipeline: piece ``p`` is cast while piece ``p-1`` is summed and ``p-2`` unscaled, each
piece's transfers running meanwhile on the engine's threads.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import torch
import torch.distributed as dist

from hal.dist import engine
from hal.dist.algorithms import Algorithm, Call, contiguous
from hal.dist.cost import CostModel
from hal.dist.engine import Steps

#: elements per chunk of the CPU passes (1 MiB of fp32: temporaries stay in cache).
_CHUNK = 1 << 18
#: CPU messages are cut into pieces of about this many input bytes (at most _MAX_PIECES): one
#: piece's transfers run on gloo's threads while this thread casts and sums the next.
_PIECE_BYTES = 8 << 20
_MAX_PIECES = 8
#: n * amax * s stays below 2**_FP16_EXP: sums of n rounded fp16 values stay below 65504.
_FP16_EXP = 15
#: unit roundoff of the wire types
_UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
_FP16_MAX = 65504.0

_workspaces: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
_ws_lock = threading.Lock()


def _buffer(key: tuple[Any, ...], name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused CPU buffer of at least ``numel`` elements (GPU buffers come from torch's caching allocator)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    with _ws_lock:
        bufs = _workspaces.setdefault(key, {})
        found = bufs.get(name)
        if found is None or found.numel() < numel:
            found = bufs[name] = torch.empty(numel, dtype=dtype)
    return found[:numel]


def clear_workspaces() -> None:
    """Free the CPU buffers the compressed algorithms keep between calls (about 1.4x the largest
    message per group and wire type)."""
    with _ws_lock:
        _workspaces.clear()


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, factor: torch.Tensor) -> None:
    """``dst[:] = src * factor`` computed in fp32 (``factor``: a 1-element fp32 tensor), cast to dst's dtype."""
    if src.device.type != "cpu":
        torch.mul(src, factor, out=dst)
        return
    for a in range(0, src.numel(), _CHUNK):
        torch.mul(src[a : a + _CHUNK], factor, out=dst[a : a + _CHUNK])


def _unscale_into_fp16(dst: torch.Tensor, src: torch.Tensor, factor: torch.Tensor, slack: float) -> None:
    """``dst[:] = src * factor`` for an fp16 ``dst``, saturating results that pass 65504 by rounding alone.

    The 16-bit transfer rounds each value by up to ``slack`` (relative); an average or sum whose
    exact value fits fp16 may come out just above its maximum and would become inf. Values within
    that margin are set to +-65504; anything beyond it overflows to inf, as the engine's own would.
    """
    step = _CHUNK if src.device.type == "cpu" else src.numel()
    edge = _FP16_MAX * (1 + slack)
    for a in range(0, src.numel(), max(step, 1)):
        r = src[a : a + step].float() * factor
        r = torch.where(r.abs() <= edge, r.clamp(-_FP16_MAX, _FP16_MAX), r)
        dst[a : a + step].copy_(r)


def _sum_blocks(shard: torch.Tensor, acc: torch.Tensor, blocks: torch.Tensor) -> None:
    """``shard[:] = blocks.sum(0)`` accumulated in fp32 (``acc``), rounded once to shard's 16-bit type."""
    if blocks.device.type != "cpu":
        torch.sum(blocks, 0, dtype=torch.float32, out=acc)
        shard.copy_(acc)
        return
    step = max(1, _CHUNK // blocks.shape[0])
    for a in range(0, blocks.shape[1], step):
        torch.sum(blocks[:, a : a + step], 0, dtype=torch.float32, out=acc[a : a + step])
        shard[a : a + step].copy_(acc[a : a + step])


def _amax(flat: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``flat`` as a 1-element fp32 tensor (NaN or inf propagate)."""
    low, high = torch.aminmax(flat)
    return torch.maximum(low.abs(), high.abs()).float().reshape(1)


def fp16_scale_exponent(amax: torch.Tensor, ranks: int) -> torch.Tensor:
    """The exponent ``k`` of the fp16 pre-scale ``2**k`` for the global ``amax`` (see the module doc)."""
    exponent = torch.frexp(amax.double() * ranks)[1]
    k = torch.clamp(_FP16_EXP - exponent, -126, 126)
    return torch.where(torch.isfinite(amax), k, torch.zeros_like(k))


def _pieces(flat: torch.Tensor) -> int:
    """How many pieces a CPU message is cut into, so that transfers overlap the casts and sums."""
    if flat.device.type != "cpu":
        return 1  # GPU engines overlap through streams; one piece keeps kernel launches few
    return max(1, min(_MAX_PIECES, flat.numel() * flat.element_size() // _PIECE_BYTES))


def _factors(k: torch.Tensor, n: int, avg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(2**k, 2**-k, divided by n for avg) as 1-element fp32 tensors: the pre-scale and its inverse."""
    one = torch.ones(1, dtype=torch.float32, device=k.device)
    unscale = torch.ldexp(one, -k)
    return torch.ldexp(one, k), unscale / n if avg else unscale


@functools.lru_cache(maxsize=64)
def _bf16_factors(device: torch.device, n: int, avg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 pre-scale depends on the group size only: made once per device and size."""
    k = torch.tensor([-(math.ceil(math.log2(n)) + 1) if n > 1 else -1], device=device)
    return _factors(k, n, avg)


def _compressed(call: Call, wire: torch.dtype) -> Steps:
    t, gi = call.tensor, call.gi
    n = gi.size
    buf = contiguous(t)
    flat = buf.view(-1)
    total = flat.numel()
    if total == 0:
        return t
    dev = flat.device
    if wire == torch.float16:
        amax = _amax(flat)
        yield dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=gi.group, async_op=True)
        scale, unscale = _factors(fp16_scale_exponent(amax, n), n, call.op == "avg")
    else:
        scale, unscale = _bf16_factors(dev, n, call.op == "avg")

    pieces = _pieces(flat)
    block = -(-total // (n * pieces))  # elements of one rank's block of one piece
    span = n * block  # elements of one piece
    key = (gi.group, dev, wire)
    send = _buffer(key, "send", span * pieces, wire, dev)  # 16-bit input, then the gathered sums
    recv = _buffer(key, "recv", span * pieces, wire, dev)
    shard = _buffer(key, "shard", block * pieces, wire, dev)
    acc = _buffer(key, "acc", block, torch.float32, dev)

    def bounds(p: int) -> tuple[int, int]:  # the elements of the tensor in piece p (the last may be short)
        return min(p * span, total), min((p + 1) * span, total)

    def start(p: int) -> Any:  # scale and cast piece p; start its all-to-all (the reduce-scatter phase)
        lo, hi = bounds(p)
        piece = send[p * span : (p + 1) * span]
        _scaled_copy(piece[: hi - lo], flat[lo:hi], scale)
        piece[hi - lo :].zero_()
        return dist.all_to_all_single(recv[p * span : (p + 1) * span], piece, group=gi.group, async_op=True)

    def reduce(p: int) -> Any:  # sum piece p's received blocks in fp32; start its all-gather
        mine = shard[p * block : (p + 1) * block]
        _sum_blocks(mine, acc, recv[p * span : (p + 1) * span].view(n, block))
        return engine.exchange_all_gather(send[p * span : (p + 1) * span], mine, gi)

    def finish(p: int) -> None:  # unscale the gathered sums into the tensor
        lo, hi = bounds(p)
        if flat.dtype == torch.float16:
            _unscale_into_fp16(flat[lo:hi], send[p * span : p * span + hi - lo], unscale, 4 * _UNIT[wire])
        else:
            _scaled_copy(flat[lo:hi], send[p * span : p * span + hi - lo], unscale)

    started: dict[int, Any] = {}
    gathering: dict[int, Any] = {}
    for p in range(pieces + 2):  # a software pipeline: start p while p-1 is reduced and p-2 finished
        if p < pieces:
            started[p] = start(p)
        if 0 <= p - 1 < pieces:
            yield started.pop(p - 1)
            gathering[p - 1] = reduce(p - 1)
        if 0 <= p - 2 < pieces:
            yield gathering.pop(p - 2)
            finish(p - 2)
    if buf is not t:
        t.copy_(buf)
    return t


def _reasons(call: Call) -> list[str]:
    out = []
    if call.op not in ("sum", "avg"):
        out.append(f"reduces only sum and avg, not {call.op} (a 16-bit {call.op} would round the result)")
    if not call.tensor.is_floating_point():
        out.append(f"sends floating-point values; the tensor is {str(call.tensor.dtype).removeprefix('torch.')}")
    return out


def _cost(exchange: bool) -> Any:
    def cost(call: Call, m: CostModel) -> float:
        n, nodes = call.gi.size, call.gi.node_count
        wire = call.tensor.numel() * 2
        seconds = 2 * m.ring(wire, n, nodes, 1) + m.compute(call.nbytes) + m.launch_us * 1e-6
        if exchange:  # the max-magnitude all-reduce first
            seconds += m.ring(4 * n, n, nodes, 2) + m.launch_us * 1e-6
        return seconds

    return cost


def compressed_fp16(call: Call) -> Steps:
    """Sent in fp16 after a shared power-of-two pre-scale, summed in fp32 (lossy: about 3 decimal digits)."""
    return (yield from _compressed(call, torch.float16))


def compressed_bf16(call: Call) -> Steps:
    """Sent in bf16 (fp32's range, no exchange first), summed in fp32 (lossy: about 2 decimal digits)."""
    return (yield from _compressed(call, torch.bfloat16))


#: this module's algorithms, which :func:`hal.wiring.wire` installs (:func:`hal.dist.algorithms.install`)
ALGORITHMS = (
    Algorithm("compressed_fp16", "all_reduce", compressed_fp16, _reasons, _cost(exchange=True), lossy=True),
    Algorithm("compressed_bf16", "all_reduce", compressed_bf16, _reasons, _cost(exchange=False), lossy=True),
)
