"""What is alive at the peak of a training step's device memory, per variant (``hal_bench.memory_anatomy``).

Each variant of a ``hal bench --models`` workload runs in a fresh process: built, ``--warmup`` steps
(the optimizer's state exists after the first), then one step recorded with
``torch.cuda.memory._record_memory_history`` (Python stacks). The replay gives the peak of allocated
bytes, the blocks alive at it charged to the frame that allocated them and to a phase (forward,
backward, optimizer), and the bytes held before the step (weights, optimizer state). The recorded
peak is checked against ``torch.cuda.max_memory_allocated`` of the same step.

    python benchmarks/memory_anatomy.py --model hf_llama1b_train --impls torch,hal,liger --json OUT

``--impls``: ``torch``, ``hal`` (hal.nn.patch + hal.optim.AdamW), ``liger``, ``hal.optimize`` or any
impl of the workload, with ``+compile`` for torch.compile of the model (``torch+compile``). CUDA only:
on a machine without it the script says so and exits 2.

Why: at Llama-3.2-1B's shape (T 2048, batch 2, an H200, ``1aba61e``) eager ``hal.nn.patch`` peaked at
25.53 GiB against Liger-Kernel's 23.59 (issue 40 asks for no more than Liger's); the peak figure does
not say which tensors make the 1.94 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def _variant(spec: str) -> Any:
    from hal_bench.workload import Variant

    impl, _, mode = spec.partition("+")
    if mode not in ("", "compile"):
        raise SystemExit(f"memory_anatomy: {spec!r}: an impl, optionally with +compile")
    return Variant(spec, impl, "default" if mode else None)


def one(args: argparse.Namespace) -> int:
    """One variant in this process: a JSON line on stdout."""
    import torch

    from hal_bench import memory_anatomy as ma
    from hal_bench.models import all_workloads, build_step

    device = torch.device("cuda")
    workload = next((w for w in all_workloads(args.size) if w.name == args.model), None)
    if workload is None:
        raise SystemExit(f"memory_anatomy: no workload {args.model!r}")
    if args.batch:
        workload = workload.with_batch(args.batch)
    step = build_step(workload, _variant(args.one), device, args.seed)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][device.index or 0]
    anatomy = ma.peak_anatomy(events, held, top=args.top)
    out = ma.as_json(anatomy)
    out.update(variant=args.one, max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved())
    print("ANATOMY " + json.dumps(out), flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hf_llama1b_train")
    ap.add_argument("--impls", default="torch,hal,liger")
    ap.add_argument("--size", default="full")
    ap.add_argument("--batch", type=int, default=0, help="another batch than the workload's")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per variant's process")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args)
    import torch

    if not torch.cuda.is_available():
        print("memory_anatomy: needs a CUDA device (torch.cuda.memory's allocation history)", file=sys.stderr)
        return 2
    from hal_bench import memory_anatomy as ma

    results: dict[str, Any] = {}
    rows = []
    for spec in args.impls.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", spec, *[a for a in (argv or sys.argv[1:]) if a]]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ANATOMY ")), None)
            why = None if line else f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"
        except subprocess.TimeoutExpired:
            line, why = None, f"timed out after {args.timeout:.0f} s"
        if line is None:
            print(f"== {spec}: no result ({why})", flush=True)
            results[spec] = {"error": why}
            continue
        got = json.loads(line[len("ANATOMY "):])
        results[spec] = got
        anatomy = ma.Anatomy(got["peak_bytes"], got["held_before"], got["peak_event"], got["events"],
                             tuple(ma.Site(**s) for s in got["sites"]))
        rows.append((spec, anatomy))
        print("\n".join(ma.format_anatomy(spec, anatomy)))
        print(f"  (torch.cuda.max_memory_allocated of the step: {got['max_allocated'] / 2**30:.2f} GiB, "
              f"reserved {got['max_reserved'] / 2**30:.2f})", flush=True)
    if rows:
        print("\n== side by side (GiB alive at each variant's peak, by the phase that allocated it)")
        print("\n".join(ma.phases_side_by_side(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": args.size, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    raise SystemExit(main())
