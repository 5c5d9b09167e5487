"""Renderings of a benchmark document: JSON (the document itself) and a Markdown table."""

from __future__ import annotations

import json
from typing import Any, Optional


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, default=str)


def _us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f} ms" if v >= 10000 else f"{v:.1f} µs"


def _spread(v: Optional[float]) -> str:
    return "" if v is None else f" ±{100 * v:.0f}%"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _peer(rec: dict[str, Any], name: str) -> str:
    p = rec.get("peers", {}).get(name)
    if p is None:
        return "-"
    if "skipped" in p:
        return _cell(p["skipped"])
    if "error" in p:
        return "error"
    return f"{_us(p['us'])} ({_x(p['ratio'])})" + (" †" if p.get("per_run") else "")


def _others(rec: dict[str, Any]) -> str:
    peers = rec.get("peers", {})
    cells = [f"{k[5:]}{': ' if 'skipped' in p else ' '}{_peer(rec, k)}" for k, p in peers.items() if k.startswith("peer:")]
    cells += [f"{name}: published, not measured here (below)" for name in dict.fromkeys(p["peer"] for p in rec.get("published", []))]
    return "; ".join(cells) or "-"


def to_markdown(doc: dict[str, Any]) -> str:
    """A results table (ratios are peer time / hal time: above 1× hal is faster) and the targets."""
    dev = doc.get("device", {})
    ceil = doc.get("ceilings", {})
    lines = [
        f"# hal bench: {dev.get('name', dev.get('type'))}",
        "",
        f"- date {doc.get('date')}, commit `{doc.get('commit')}`" + (" (working tree dirty)" if doc.get("dirty") else ""),
        f"- hal {doc.get('hal_version')}, torch {doc.get('torch')}, triton {doc.get('triton')}, python {doc.get('python')}",
        f"- measured ceilings: copy {si_rate(ceil.get('copy_bytes_per_s', 0), 'B/s')} (bytes read + written), "
        f"{ceil.get('matmul_dtype')} matmul {si_rate(ceil.get('matmul_flops_per_s', 0), 'FLOP/s')} "
        f"({'x'.join(map(str, ceil.get('matmul_shape', [])))})",
        f"- torch.compile: {doc.get('compile', {}).get('mode') if doc.get('compile', {}).get('enabled') else 'not run'}; "
        f"Liger-Kernel {doc.get('liger') or 'not installed'}" + (f"; the run took {doc['wall_s']:.0f} s" if doc.get("wall_s") is not None else ""),
        "",
        "Times: on the GPU the median over 5 batches of back-to-back runs timed with CUDA events (host clock on the CPU); ratios are peer time / hal time. "
        "† the median of single runs, each timed with events after its overwritten inputs were restored (outside the timing). "
        "Training rows (train fwd+bwd) time forward and backward through autograd per run in every column. "
        "hal's time shows its spread (± the interquartile range over the median); ⚠ marks a noisy row (a spread above 10%: its ratios are "
        "not reliable, see below). % copy BW: the case's bytes (read + written) per second over those of a copy of the same footprint "
        "timed on this device, so that a row whose arrays stay in a cache is measured against the cache (on the CPU) and a row beyond "
        "it against DRAM/HBM.",
        "",
        "| op | case | dtype | kernel | hal | eager | torch.compile | other peers | % copy BW | % matmul rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc.get("results", []):
        if "error" in r:
            lines.append(f"| {r['op']} | {r['case']} | {r['dtype']} | {r.get('kernel', '-')} | error: {r['error']} | | | | | |")
            continue
        others = _others(r)
        mark = " ⚠" if r.get("noisy") else ""
        lines.append(
            f"| {r['op']} | {r['case']}{mark} | {r['dtype']} | {r.get('kernel', '-')} | {_us(r.get('hal_us'))}{_spread(r.get('hal_spread'))} | {_peer(r, 'eager')} | "
            f"{_peer(r, 'compile')} | {others} | {_pct(r.get('bw_fraction'))} | {_pct(r.get('rate_fraction'))} |"
        )
    noisy = [r for r in doc.get("results", []) if r.get("noisy")]
    if noisy:
        lines += ["", f"## Noisy rows ({len(noisy)})", "",
                  "Timings whose samples scatter by more than 10% of their median (another process, frequency scaling, a "
                  "cold cache): rerun these on an idle machine before reading their ratios.", ""]
        lines += [f"- {r['op']}, {r['case']}: {', '.join(r['noisy'])}" for r in noisy]
    targets = [(r, t) for r in doc.get("results", []) for t in r.get("targets", [])]
    if targets:
        lines += ["", "## Targets (issues 5 and 13)", "", "| op | case | target | goal | measured | |", "| --- | --- | --- | --- | --- | --- |"]
        for r, t in targets:
            value = t["value"]
            shown = _pct(value) if t["target"] in ("bw", "rate") else _x(value)
            goal = _pct(t["goal"]) if t["target"] in ("bw", "rate") else f"≥ {t['goal']:.2f}×"
            verdict = (f"n/a ({_cell(t['reason'])})" if t.get("reason") else "n/a") if t["met"] is None else ("met" if t["met"] else "**missed**")
            lines.append(f"| {r['op']} | {r['case']} | {t['target']} | {goal} | {shown} | {verdict} |")
    notes = [(r, p) for r in doc.get("results", []) for p in r.get("published", [])]
    if notes:
        lines += ["", "## Published figures (published, not measured here)", "",
                  "Peers that cannot run in this run, with the figures their authors publish for the same op; never judged as targets.", "",
                  "| op | case | peer | published figure | measured on | source |", "| --- | --- | --- | --- | --- | --- |"]
        for r, p in notes:
            lines.append(f"| {r['op']} | {r['case']} | {p['peer']} | {p['figure'] or 'no published figure found'} | {_cell(p['setting'])} | {p['source']} |")
    d = doc.get("dispatch_overhead")
    if d and "error" not in d:
        lines += ["", f"Dispatch overhead ({d['kernel']}, host time per call): hal.ops {d['hal_call_us']:.2f} µs, "
                  f"kernel called directly {d['direct_call_us']:.2f} µs, overhead {d['overhead_us']:.2f} µs "
                  f"(target ≤ {d['target_us']:.0f} µs: {'met' if d['met'] else 'missed'})."]
    return "\n".join(lines) + "\n"


def si_rate(per_s: float, unit: str) -> str:
    """A rate with a prefix that keeps three significant digits (GB/s on a CPU, TB/s on a GPU)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {prefix}{unit}"
    return f"{per_s:.3g} {unit}"
