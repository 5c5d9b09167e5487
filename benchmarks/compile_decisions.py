"""Which kernel each hal call of a model's compiled step takes, and where it was decided: on fake
tensors while torch.compile traced (its ops joined the graph, or it stayed an opaque node) or on
real tensors when an opaque node ran. For explaining a compiled step's time (issue 28).

    python benchmarks/compile_decisions.py MODEL [--graph] [--json OUT]

``--graph``: the step is wrapped in ``hal.graphs.graphed`` as the ``hal+compile+graph`` variant is
(its warm-up calls, where torch.compile traces, run inside ``hal.graphs.device_bound``).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any

import torch

from hal.dispatch import DISPATCHER
from hal_bench.models import all_workloads, with_graphs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--size", default="full")
    ap.add_argument("--json")
    args = ap.parse_args()
    seen: collections.Counter = collections.Counter()
    original = DISPATCHER.decide

    def spy(decl: Any, call_args: Any, choice: Any, *a: Any, **k: Any) -> Any:
        decided = original(decl, call_args, choice, *a, **k)
        first = next((x for x in call_args if isinstance(x, torch.Tensor)), None)
        fake = type(first).__name__ if first is not None else "-"
        route = getattr(decided, "route", None)
        label = route.label if route is not None else "none"
        reason = (getattr(route, "reason", "") or "")[:90] if route is not None else ""
        seen[(decl.name, fake, f"device_bound={choice.device_bound}", f"for_graph={getattr(choice, 'for_graph', None)}", label, reason)] += 1
        return decided

    DISPATCHER.decide = spy
    workload = {w.name: w for w in all_workloads(args.size)}[args.model]
    step = workload.make("hal", "default", torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0)
    if args.graph:
        step = with_graphs(step)
    for _ in range(4):
        step.run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rows = [{"op": k[0], "tensors": k[1], "device_bound": k[2], "for_graph": k[3], "route": k[4], "reason": k[5], "calls": n} for k, n in sorted(seen.items())]
    for r in rows:
        print(f"{r['calls']:5d}  {r['op']:34s} {r['tensors']:12s} {r['device_bound']:18s} {r['for_graph']:15s} {r['route']:40s} {r['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
