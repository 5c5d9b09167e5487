"""The roofline picture of a bench document (a PNG, drawn with matplotlib).

Every case is a numbered point: x its arithmetic intensity (counted flops / counted bytes), y the
rate hal achieved (flops / hal's time), under the roof min(matrix rate, x * copy bandwidth) of the
ceilings measured in the same run. A grey diamond, joined to it, marks the fastest named peer of the
case (Liger-Kernel, cuDNN, ...) doing the same work. The panel beside the plot names each number.

Cases count bytes or flops, not always both, and are placed so that the gap under the roof still
reads as the fraction of the ceiling that limits them:

- bytes only (memory-bound ops: norms, softmax, elementwise, optimizers): drawn in a band left of
  every counted intensity, each at a nominal intensity x, at height x * (bytes / time); their gap
  under the slanted roof is their fraction of the copy bandwidth;
- flops only (GEMMs, attention, training steps): drawn in a band right of the ridge at height
  flops / time; their gap under the flat roof is their fraction of the matrix rate.

Cases that failed, or count neither, are listed under the legend as not placed, never left out.

The roof drawn is the device's (the copy bandwidth measured beyond its last-level cache); each
point's fraction is of the roof at its own footprint, the bandwidth of a copy of its bytes
(``copy_bytes_per_s`` of its row), as the table's "% copy BW" is: a CPU row whose arrays stay in
cache can sit above the drawn roof and still read below 100%.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

from .report import si_rate

#: the two bands sit this factor beyond the counted intensities, and span this factor
BAND_GAP, BAND_SPAN = 4.0, 16.0


@dataclasses.dataclass
class Point:
    index: int
    op: str
    case: str
    kind: str  # "counted", "bytes only" or "flops only"
    x: float  # FLOP per byte (nominal in the two bands)
    y: float  # FLOP/s (x * bytes/s in the bytes-only band)
    fraction: float  # of the roof at x
    peer: Optional[str] = None  # the fastest named peer
    peer_y: Optional[float] = None


@dataclasses.dataclass
class Placement:
    points: list[Point]
    not_placed: list[str]  # "op, case: why"
    bandwidth: float  # bytes/s
    rate: float  # FLOP/s
    bands: dict[str, tuple[float, float]]  # kind -> (x from, x to)


def _fastest_peer(rec: dict[str, Any]) -> tuple[Optional[str], Optional[float]]:
    timed = [(p["us"], k.removeprefix("peer:")) for k, p in rec.get("peers", {}).items() if k.startswith("peer:") and "us" in p]
    if not timed:
        return None, None
    us, name = min(timed)
    return name, us


def _spread(n: int, lo: float, hi: float) -> list[float]:
    if n == 1:
        return [math.sqrt(lo * hi)]
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def place(doc: dict[str, Any]) -> Placement:
    """Where each result goes (no drawing): the points in result order, numbered from 1."""
    ceil = doc.get("ceilings", {})
    bandwidth, rate = float(ceil.get("copy_bytes_per_s") or 0), float(ceil.get("matmul_flops_per_s") or 0)
    if bandwidth <= 0 or rate <= 0:
        raise ValueError("the document has no measured ceilings (copy_bytes_per_s, matmul_flops_per_s): nothing to draw a roof from")
    ridge = rate / bandwidth
    rows, not_placed = [], []
    for r in doc.get("results", []):
        where = f"{r['op']}, {r['case']}"
        if "error" in r or not r.get("hal_us"):
            not_placed.append(f"{where}: {r.get('error', 'not timed')}")
        elif not (r.get("bytes") or r.get("flops")):
            not_placed.append(f"{where}: neither bytes nor flops counted")
        else:
            rows.append(r)
    kind_of = lambda r: "counted" if r.get("bytes") and r.get("flops") else ("bytes only" if r.get("bytes") else "flops only")  # noqa: E731
    counted_x = [r["flops"] / r["bytes"] for r in rows if kind_of(r) == "counted"]
    left_hi = min([ridge] + counted_x) / BAND_GAP
    right_lo = max([ridge] + counted_x) * BAND_GAP
    bands = {"bytes only": (left_hi / BAND_SPAN, left_hi), "flops only": (right_lo, right_lo * BAND_SPAN)}
    nominal = {kind: iter(_spread(sum(kind_of(r) == kind for r in rows), *band)) for kind, band in bands.items()}
    points = []
    for i, r in enumerate(rows, start=1):
        kind, seconds = kind_of(r), r["hal_us"] * 1e-6
        if kind == "counted":
            x, y = r["flops"] / r["bytes"], r["flops"] / seconds
        elif kind == "bytes only":
            x = next(nominal[kind])
            y = x * r["bytes"] / seconds
        else:
            x, y = next(nominal[kind]), r["flops"] / seconds
        peer, peer_us = _fastest_peer(r)
        row_bw = float(r.get("copy_bytes_per_s") or bandwidth)  # the slanted roof at the row's own footprint
        fraction = (y / x) / row_bw if kind == "bytes only" else (y / rate if kind == "flops only" else y / min(rate, x * row_bw))
        points.append(Point(i, r["op"], r["case"], kind, x, y, fraction, peer,
                            None if peer_us is None else y * r["hal_us"] / peer_us))
    return Placement(points, not_placed, bandwidth, rate, bands)


def _rate_text(p: Point, bandwidth: float) -> str:
    if p.kind == "bytes only":
        return f"{p.y / p.x / 1e12:.2f} TB/s" if bandwidth >= 1e11 else f"{p.y / p.x / 1e9:.1f} GB/s"
    return f"{p.y / 1e12:.0f} TFLOP/s" if p.y >= 1e12 else f"{p.y / 1e9:.1f} GFLOP/s"


def plot(doc: dict[str, Any], path: Path) -> Placement:
    """Draw the roofline of ``doc`` into the PNG ``path``; returns where every case was placed."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("the roofline picture needs matplotlib: pip install matplotlib (or hal[test])") from exc
    placed = place(doc)
    pts, bandwidth, rate = placed.points, placed.bandwidth, placed.rate
    fig = Figure(figsize=(21, 11), dpi=110)
    ax = fig.add_axes((0.05, 0.07, 0.52, 0.85))
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [p.x for p in pts] + [v for band in placed.bands.values() for v in band] + [rate / bandwidth]
    x_lo, x_hi = min(xs) / 2, max(xs) * 2
    grid = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(rate, x * bandwidth) for x in grid], color="black", linewidth=1.5)
    ys = [p.y for p in pts] + [p.peer_y for p in pts if p.peer_y] + [rate]
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(min(ys) / 3, rate * 3)
    dev = doc.get("device", {})
    ceil = doc.get("ceilings", {})
    (ax0, ay0), (ax1, ay1) = ax.transData.transform([(x_lo, x_lo * bandwidth), (x_lo * 10, x_lo * 10 * bandwidth)])
    ax.text(x_lo * 1.5, x_lo * 1.5 * bandwidth * 1.6, f"copy {si_rate(bandwidth, 'B/s')} (measured)", fontsize=9,
            rotation=math.degrees(math.atan2(ay1 - ay0, ax1 - ax0)), rotation_mode="anchor")
    ax.text(rate / bandwidth * 1.3, rate * 1.25, f"{ceil.get('matmul_dtype', '')} matmul {si_rate(rate, 'FLOP/s')} (measured)", fontsize=9)
    for kind, (lo, hi) in placed.bands.items():
        ax.axvspan(lo / 1.3, hi * 1.3, color="0.93", zorder=0)
        text = ("bytes counted, no flops: nominal x,\nheight x · bytes/s (gap = fraction of copy)" if kind == "bytes only"
                else "flops counted, no bytes: nominal x,\nheight FLOP/s (gap = fraction of matmul)")
        ax.text(math.sqrt(lo * hi), rate * 2.2, text, fontsize=7, ha="center", va="top", color="0.35")
    for p in pts:
        color = "tab:blue" if p.x < rate / bandwidth else "tab:orange"
        hollow = p.kind != "counted"
        if p.peer_y:
            ax.plot([p.x, p.x], [p.y, p.peer_y], color="0.6", linewidth=0.8, zorder=1)
            ax.scatter([p.x], [p.peer_y], marker="D", s=18, color="0.55", zorder=2)
        ax.scatter([p.x], [p.y], s=34, zorder=3, facecolors="white" if hollow else color, edgecolors=color, linewidths=1.4)
        ax.annotate(str(p.index), (p.x, p.y), xytext=(4, 3 if p.index % 2 else -9), textcoords="offset points", fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, counted)")
    ax.set_ylabel("achieved rate (FLOP/s)")
    ax.grid(True, which="major", color="0.85", linewidth=0.6)
    ax.scatter([], [], s=34, color="tab:blue", label="hal, below the ridge (memory side)")
    ax.scatter([], [], s=34, color="tab:orange", label="hal, beyond the ridge (compute side)")
    ax.scatter([], [], s=34, facecolors="white", edgecolors="0.3", label="hal, one of bytes / flops counted (bands)")
    ax.scatter([], [], marker="D", s=18, color="0.55", label="fastest named peer, same work")
    ax.legend(loc="lower left", bbox_to_anchor=(1.03, 0.0), fontsize=8)
    ax.set_title(f"hal bench roofline: {dev.get('name', dev.get('type'))}, {doc.get('date', '')}, commit {str(doc.get('commit'))[:10]}", fontsize=11)
    lines = ["n  op: case — hal's rate, its fraction of the roof (the fastest named peer's rate / hal's)", ""]
    lines += [f"{p.index:>2} {p.op}: {p.case} — {_rate_text(p, bandwidth)}, {p.fraction:.0%} of the roof"
             + (f" ({p.peer} {p.peer_y / p.y:.2f}× hal's rate)" if p.peer_y else "") for p in pts]
    lines += ["", "not placed:"] + [f"   {n}" for n in placed.not_placed] if placed.not_placed else []
    size = 7.0 if len(lines) <= 60 else max(4.5, 7.0 * 60 / len(lines))
    fig.text(0.59, 0.95, "\n".join(lines), fontsize=size, family="monospace", va="top", ha="left")
    fig.savefig(path, format="png")
    return placed

