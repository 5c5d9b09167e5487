"""Tensor and sequence parallelism on paper: flops, bytes moved and communication time per step.

For each layer of :mod:`hal.parallel.tensor` and each strategy (tensor parallelism ``tp``; with
sequence parallelism ``tp+sp``; with the chunked all-gather overlapped with the GEMM
``tp+sp+overlap``), :func:`layer_costs` counts one training step of one layer on one rank:

- flops: the GEMMs (2·M·K·N per product; the backward's two products are twice the forward's) and
  attention's two batched products (causal: half the score matrix), divided over the group;
- collectives: each with its message size, the bytes one rank sends (ring algorithms: all-gather
  and reduce-scatter ``(p-1)/p`` of the message, all-reduce twice that), and its time on a link by
  the alpha-beta model ``steps · latency + bytes sent / bandwidth`` (as :mod:`hal.dist.cost`);
- overlap: the compute each collective could hide behind (``hideable_s``: what the strategy
  allows), whether this implementation hides it (``overlapped``), and the time left exposed.

Links: NVLink as the issue states it for the H200 (900 GB/s per GPU; hal.dist's measured NCCL
bus bandwidth between two H200 was about 300 GB/s), and InfiniBand at 50 GB/s per GPU (a 400 Gb/s
NIC each). Compute time is flops at ``flops_per_s`` (default the H200's dense bf16 peak, 989
TFLOP/s): a lower bound, so the exposed times are upper bounds. Pass your own :class:`Link` and rate.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from hal.errors import InvalidArgumentError

__all__ = ["Link", "NVLINK_H200", "INFINIBAND", "LINKS", "Comm", "LayerCost", "layer_costs", "costs", "format_table"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One GPU's link: bandwidth in GB/s (1e9 bytes/s) per direction and the latency of one step."""

    name: str
    gbps: float
    latency_us: float


NVLINK_H200 = Link("NVLink (H200)", 900.0, 3.0)
INFINIBAND = Link("InfiniBand", 50.0, 5.0)
LINKS = (NVLINK_H200, INFINIBAND)
H200_BF16_FLOPS = 989e12

_PHASES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective of a layer's step on a group of ``ranks``."""

    what: str  # e.g. "all-gather x (sequence)"
    collective: str  # all_gather | reduce_scatter | all_reduce
    phase: str  # forward | backward
    message_bytes: float  # the whole (gathered / reduced) tensor
    ranks: int
    hideable_flops: float = 0.0  # compute of this rank the collective could run beside
    overlapped: bool = False  # whether hal.parallel runs it beside that compute
    chunks: int = 1  # overlapped in this many pieces (pipelined with the compute)
    note: str = ""

    @property
    def bytes_sent(self) -> float:
        """Bytes one rank sends (ring algorithm)."""
        p = self.ranks
        return 0.0 if p <= 1 else _PHASES[self.collective] * (p - 1) / p * self.message_bytes

    def seconds(self, link: Link) -> float:
        p = self.ranks
        if p <= 1:
            return 0.0
        steps = _PHASES[self.collective] * (p - 1)
        return steps * link.latency_us * 1e-6 + self.bytes_sent / (link.gbps * 1e9)

    def exposed(self, link: Link, flops_per_s: float, allowed: bool = False) -> float:
        """Seconds of this collective not hidden behind compute: here (``allowed`` False) or at best."""
        c, g = self.seconds(link), self.hideable_flops / flops_per_s
        if allowed:
            return max(0.0, c - g)
        if not self.overlapped:
            return c
        k = max(1, self.chunks)
        if k == 1:  # runs beside the compute as one piece
            return max(0.0, c - g)
        # k pieces: the first transfer alone, then each transfer beside the previous piece's compute
        pipelined = c / k + (k - 1) * max(c / k, g / k) + g / k
        return max(0.0, pipelined - g)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One step (forward and backward) of one layer on one rank."""

    layer: str
    strategy: str
    ranks: int
    forward_flops: float
    backward_flops: float
    comms: tuple[Comm, ...]

    @property
    def bytes_sent(self) -> float:
        return sum(c.bytes_sent for c in self.comms)

    def comm_seconds(self, link: Link) -> float:
        return sum(c.seconds(link) for c in self.comms)

    def compute_seconds(self, flops_per_s: float = H200_BF16_FLOPS) -> float:
        return (self.forward_flops + self.backward_flops) / flops_per_s

    def exposed_seconds(self, link: Link, flops_per_s: float = H200_BF16_FLOPS, allowed: bool = False) -> float:
        return sum(c.exposed(link, flops_per_s, allowed) for c in self.comms)

    def as_dict(self, links: Sequence[Link] = LINKS, flops_per_s: float = H200_BF16_FLOPS) -> dict[str, Any]:
        """Everything as plain data (times in seconds, per link name)."""
        return {
            "layer": self.layer, "strategy": self.strategy, "ranks": self.ranks,
            "forward_flops": self.forward_flops, "backward_flops": self.backward_flops,
            "compute_s": self.compute_seconds(flops_per_s), "bytes_sent": self.bytes_sent,
            "comm_s": {k.name: self.comm_seconds(k) for k in links},
            "exposed_s": {k.name: self.exposed_seconds(k, flops_per_s) for k in links},
            "exposed_at_best_s": {k.name: self.exposed_seconds(k, flops_per_s, allowed=True) for k in links},
            "comms": [dict(dataclasses.asdict(c), bytes_sent=c.bytes_sent, seconds={k.name: c.seconds(k) for k in links},
                           hideable_s=c.hideable_flops / flops_per_s) for c in self.comms],
        }


STRATEGIES = ("tp", "tp+sp", "tp+sp+overlap")


def _column(name: str, tokens: int, k: int, n_total: int, p: int, b: int, strategy: str, chunks: int,
            act: bool) -> tuple[float, float, list[Comm]]:
    """Column-parallel GEMMs of one input (k features) into n_total outputs (summed over the layers
    sharing the input): flops and the input's collectives."""
    fwd = 2.0 * tokens * k * n_total / p
    wgrad = fwd
    x_bytes = tokens * k * b
    over = strategy == "tp+sp+overlap"
    if strategy == "tp":
        comms = [Comm(f"all-reduce grad {name} input", "all_reduce", "backward", x_bytes, p, wgrad, False,
                      note="could run beside the weight-gradient GEMM (not done here)")]
    else:
        comms = [
            Comm(f"all-gather {name} input (sequence)", "all_gather", "forward", x_bytes, p, fwd, over, chunks if over else 1,
                 note="chunked: each piece multiplied while the next travels" if over else "could be chunked beside the GEMM"),
            Comm(f"reduce-scatter grad {name} input", "reduce_scatter", "backward", x_bytes, p, wgrad, over and not act,
                 note="beside the weight-gradient GEMM" + (" (not with a fused activation)" if act else "")),
        ]
    return fwd, 2 * fwd, comms


def _row(name: str, tokens: int, k: int, n: int, p: int, b: int, strategy: str) -> tuple[float, float, list[Comm]]:
    fwd = 2.0 * tokens * k * n / p
    y_bytes = tokens * n * b
    if strategy == "tp":
        comms = [Comm(f"all-reduce {name} output", "all_reduce", "forward", y_bytes, p, fwd, False,
                      note="needs the GEMM's result: hideable only by pipelining the GEMM in chunks (not done here)")]
    else:
        comms = [
            Comm(f"reduce-scatter {name} output (sequence)", "reduce_scatter", "forward", y_bytes, p, fwd, False,
                 note="hideable only by pipelining the GEMM in chunks (not done here)"),
            Comm(f"all-gather grad {name} output", "all_gather", "backward", y_bytes, p, fwd, False,
                 note="hideable behind the input-gradient GEMM in chunks (not done here)"),
        ]
    return fwd, 2 * fwd, comms


def _norm(tokens: int, d: int, p: int, b: int, strategy: str) -> tuple[float, float, list[Comm]]:
    share = p if strategy != "tp" else 1
    fwd = 5.0 * tokens * d / share
    comms = [] if strategy == "tp" else [Comm("all-reduce grad norm weight", "all_reduce", "backward", d * 4, p, 0.0, False,
                                              note="one small message per norm")]
    return fwd, 2 * fwd, comms


def layer_costs(layer: str, *, batch: int, seq: int, hidden: int, tp: int, strategy: str = "tp", heads: int = 0,
                kv_heads: Optional[int] = None, ffn: int = 0, in_features: Optional[int] = None,
                out_features: Optional[int] = None, act: bool = False, dtype_bytes: int = 2, chunks: int = 2) -> LayerCost:
    """One training step of one layer on one rank of a ``tp``-rank group, for ``strategy`` in
    ``tp``, ``tp+sp``, ``tp+sp+overlap``. ``layer``: ``column`` / ``row`` (``in_features`` ->
    ``out_features``), ``norm``, ``attention`` (``heads``, ``kv_heads``), ``mlp`` (``ffn``), ``block``
    (norm, attention, norm, MLP)."""
    if strategy not in STRATEGIES:
        raise InvalidArgumentError("hal.parallel.cost.layer_costs", "strategy", f"one of {', '.join(STRATEGIES)}", repr(strategy))
    tokens, p, b, d = batch * seq, tp, dtype_bytes, hidden
    parts: list[tuple[float, float, list[Comm]]] = []
    if layer == "column":
        parts.append(_column("column", tokens, in_features or d, out_features or d, p, b, strategy, chunks, act))
    elif layer == "row":
        parts.append(_row("row", tokens, in_features or d, out_features or d, p, b, strategy))
    elif layer == "norm":
        parts.append(_norm(tokens, d, p, b, strategy))
    elif layer in ("attention", "block"):
        if not heads:
            raise InvalidArgumentError("hal.parallel.cost.layer_costs", "heads", "the number of attention heads", repr(heads))
        hd, kv = d // heads, kv_heads or heads
        if layer == "block":
            parts.append(_norm(tokens, d, p, b, strategy))
        parts.append(_column("qkv", tokens, d, (heads + 2 * kv) * hd, p, b, strategy, chunks, False))
        core = 2.0 * 2.0 * batch * heads * seq * seq * hd / 2 / p  # QK^T and PV, causal half
        parts.append((core, 2.5 * core, []))  # the backward: 4 products and the softmax's recomputation
        parts.append(_row("o_proj", tokens, heads * hd, d, p, b, strategy))
        if layer == "block":
            parts.append(_norm(tokens, d, p, b, strategy))
            parts.append(_column("gate/up", tokens, d, 2 * ffn, p, b, strategy, chunks, False))
            parts.append(_row("down", tokens, ffn, d, p, b, strategy))
    elif layer == "mlp":
        parts.append(_column("gate/up", tokens, d, 2 * ffn, p, b, strategy, chunks, False))
        parts.append(_row("down", tokens, ffn, d, p, b, strategy))
    else:
        raise InvalidArgumentError("hal.parallel.cost.layer_costs", "layer", "column, row, norm, attention, mlp or block", repr(layer))
    comms = tuple(c for _, _, cs in parts for c in cs)
    return LayerCost(layer, strategy, p, sum(f for f, _, _ in parts), sum(g for _, g, _ in parts), comms)


def costs(*, batch: int, seq: int, hidden: int, heads: int, ffn: int, tp: int, kv_heads: Optional[int] = None,
          layers: Sequence[str] = ("column", "row", "norm", "attention", "mlp", "block"), strategies: Sequence[str] = STRATEGIES,
          dtype_bytes: int = 2, chunks: int = 2, links: Sequence[Link] = LINKS,
          flops_per_s: float = H200_BF16_FLOPS) -> list[dict[str, Any]]:
    """:meth:`LayerCost.as_dict` of every (layer, strategy) of a Llama-style block's shape: the
    column and row layers are ``hidden -> ffn`` and ``ffn -> hidden``."""
    out = []
    for layer in layers:
        for strategy in strategies:
            lc = layer_costs(layer, batch=batch, seq=seq, hidden=hidden, tp=tp, strategy=strategy, heads=heads, kv_heads=kv_heads,
                             ffn=ffn, in_features=ffn if layer == "row" else hidden,
                             out_features=hidden if layer == "row" else ffn, dtype_bytes=dtype_bytes, chunks=chunks)
            out.append(lc.as_dict(links, flops_per_s))
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`costs`' rows: per rank and step, times in ms."""
    links = list(rows[0]["comm_s"]) if rows else []
    short = {name: name.split()[0] for name in links}
    head = ["layer", "strategy", "GFLOP", "compute", "MB sent"]
    for name in links:
        head += [f"comm {short[name]}", f"exposed {short[name]}", f"best {short[name]}"]
    lines = [head]
    for r in rows:
        line = [r["layer"], r["strategy"], f"{(r['forward_flops'] + r['backward_flops']) / 1e9:.2f}",
                f"{r['compute_s'] * 1e3:.3f}", f"{r['bytes_sent'] / 1e6:.2f}"]
        for name in links:
            line += [f"{r['comm_s'][name] * 1e3:.3f}", f"{r['exposed_s'][name] * 1e3:.3f}", f"{r['exposed_at_best_s'][name] * 1e3:.3f}"]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in lines]
    return "\n".join(text[:1] + ["-" * len(text[0])] + text[1:]) + (
        "\n(ms per rank and step; exposed: communication not hidden by compute here; best: at most hidden by what "
        "the strategy allows)")


if __name__ == "__main__":  # python -m hal.parallel.cost: the Llama-style block of bench's "full" size on 8 ranks
    print(format_table(costs(batch=4, seq=1024, hidden=1024, heads=16, ffn=2816, tp=8)))
