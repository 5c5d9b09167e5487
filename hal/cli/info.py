"""``hal info``: versions, plugins with status and reason, devices, and the op x backend coverage."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from typing import Any

import hal
from hal.dispatch import DISPATCHER


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def _versions() -> dict[str, Any]:
    import numpy
    import torch

    out: dict[str, Any] = {
        "hal": hal.__version__,
        "plugin_api": hal.API_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def coverage() -> dict[str, dict[str, dict[str, Any]]]:
    """op -> backend -> {"status": "kernel" | "composite" | "missing", "kernels": [names]}."""
    rt = DISPATCHER.runtime()
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for decl in hal.list_ops():
        row = {}
        for b in rt.backends:
            names = [k.name for k in rt.kernels(decl.name, b)]
            status = "kernel" if names else ("composite" if decl.fallback_composite else "missing")
            row[b] = {"status": status, "kernels": names}
        table[decl.name] = row
    return table


def collect() -> dict[str, Any]:
    rt = DISPATCHER.runtime()
    plugins = []
    for lp in rt.plugins:
        status = "disabled" if lp.disabled else ("failed" if lp.error else "loaded")
        plugins.append(
            {
                "name": lp.name,
                "distribution": lp.distribution,
                "version": lp.version,
                "status": status,
                "error": str(lp.error) if lp.error else None,
                "kernels": len(lp.plugin.kernels) if lp.plugin else 0,
            }
        )
    return {
        "versions": _versions(),
        "plugins": plugins,
        "backends": [b.as_dict() for b in hal.backends()],
        "coverage": coverage(),
    }


def _text(info: dict[str, Any]) -> str:
    lines = ["hal " + info["versions"]["hal"] + f" (plugin API {info['versions']['plugin_api']})", ""]
    lines.append("versions:")
    for k, v in info["versions"].items():
        if k not in ("hal", "plugin_api"):
            lines.append(f"  {k:<11} {v if v is not None else '-'}")
    lines += ["", "plugins:"]
    if not info["plugins"]:
        lines.append("  none installed: pip install ./backends/cpu_ref (the NumPy reference)")
    for p in info["plugins"]:
        dist = f"{p['distribution']} {p['version']}" if p["distribution"] else (p["version"] or "")
        lines.append(f"  {p['name']:<10} {p['status']:<9} {dist}  ({p['kernels']} kernels)")
        if p["error"]:
            lines.append(f"             error: {p['error']}")
    lines += ["", "backends:"]
    for b in info["backends"]:
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        lines.append(f"  {b['name']:<10} priority {b['priority']}  devices {','.join(b['device_types']) or '-'}  {state}")
        for d in b["devices"]:
            mem = f", {d['memory_bytes'] / 2**30:.0f} GiB" if d.get("memory_bytes") else ""
            lines.append(f"             [{d['index']}] {d['name']} ({d['vendor']}, {d['arch']}{mem})")
        for note in b.get("notes", ()):
            lines.append(f"             note: {note}")
    cov = info["coverage"]
    names = [b["name"] for b in info["backends"] if b["priority"] is not None]
    lines += ["", "coverage (kernel names / composite / missing):"]
    table = {}
    for op, row in cov.items():
        cells = []
        for n in names:
            cell = row.get(n, {"status": "missing", "kernels": []})
            cells.append(",".join(cell["kernels"]) if cell["status"] == "kernel" else cell["status"])
        table[op] = cells
    width = max(len(op) for op in cov) + 2
    widths = [max([len(n)] + [len(cells[i]) for cells in table.values()]) + 2 for i, n in enumerate(names)]
    lines.append(("  " + "op".ljust(width) + "".join(n.ljust(w) for n, w in zip(names, widths))).rstrip())
    for op, cells in table.items():
        lines.append("  " + op.ljust(width) + "".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(_text(info))
    return 0
