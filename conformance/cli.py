"""``hal conformance``: run every (op, kernel, dtype, case) of a backend against the reference.

Exit status: 0 when nothing failed unexpectedly, 1 when a case failed or errored (and for an xpass
with ``--strict-xpass``: by default an xpass, a known failure that now passes, is reported but does
not fail the run, since GPU results can be marginal from one driver to the next), 2 for a usage
problem (unknown op, backend not usable). Stale xfail ids are warned about on stderr and listed in
the reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hal.cli.paths import output_dir
from hal.cli.usage import at_least, names, run_command
from hal.errors import HalError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", metavar="NAME", help="backend to check (default: the best usable backend: cuda or rocm where a GPU is usable, else the highest-priority CPU backend: cpu, or cpu_ref where cpu is not installed)")
    parser.add_argument("--device", metavar="N", type=int, default=0, help="device index of the backend (default 0)")
    parser.add_argument("--ops", metavar="a,b", type=names, help="ops to check, comma separated; shell patterns allowed (conv2d*)")
    parser.add_argument("--dtypes", metavar="a,b", type=names, help="dtypes to check, comma separated (float16,bfloat16,float32,float64,int8,uint8)")
    parser.add_argument("--report-dir", metavar="DIR", type=Path, default=Path("hal-conformance"), help="where report.json, report.md and junit.xml go (default ./hal-conformance)")
    parser.add_argument("--quick", action="store_true", help="a few cases per (op, kernel, dtype) instead of all of them")
    parser.add_argument("--seed", metavar="S", type=int, default=0, help="seed of the case data (default 0; reports record it)")
    parser.add_argument("--world-size", metavar="N", type=at_least(1), default=1, help="also run the collective cases on N processes, 2 or more (hal.conformance.collectives; default 1: none)")
    parser.add_argument("--xfail", metavar="FILE", help="an xfail file to use besides conformance/xfail/<backend>.txt")
    parser.add_argument("--tolerances", metavar="FILE", help="a tolerance override file (lines 'op dtype atol rtol')")
    parser.add_argument("--strict-xpass", action="store_true", help="fail the run when a listed known failure passes")
    parser.add_argument("--no-poison", action="store_true", help="do not poison output allocations (to see whether a failure depends on it)")
    parser.add_argument("--jobs", metavar="N", type=at_least(1), help="run the cases in N worker processes, whole ops each (default: 1 for a CPU backend, up to 8 for a GPU backend, whose run is bound by kernel compilation on the host)")
    parser.add_argument("--list", action="store_true", help="print the case ids that would run, and exit")
    from .model_cli import add_arguments as add_model_arguments

    add_model_arguments(parser)


class Progress:
    """A tqdm bar on stderr when tqdm is installed, else a plain counter every few percent."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.bad = total, 0, 0
        self._next_plain = 0
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True, mininterval=0.5)
        except ImportError:
            self._bar = None

    def __call__(self, result: Any) -> None:
        self.done += 1
        self.bad += result.status in ("fail", "error")
        if self._bar is not None:
            self._bar.set_postfix_str(f"failed {self.bad}  {result.op}", refresh=False)
            self._bar.update(1)
        elif self.done >= self._next_plain or self.done == self.total:
            print(f"[{self.done}/{self.total}] failed {self.bad}  {result.op}", file=sys.stderr, flush=True)
            self._next_plain = self.done + max(1, self.total // 20)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def plugin_problem(backend: Optional[str]) -> Optional[str]:
    """Why the plugin of a named backend is installed but serves nothing (disabled, or it failed to
    load), else None; the suite itself reports a backend that is not installed or not usable."""
    from hal.dispatch import DISPATCHER

    for lp in DISPATCHER.runtime().plugins:
        if backend is not None and lp.name == backend and lp.plugin is None:
            why = "it is disabled by HAL_DISABLE_PLUGINS" if lp.disabled else str(lp.error)
            return f"backend {backend!r} is installed but its plugin does not serve it: {why}"
    return None


def full_report_in(directory: Path) -> Optional[str]:
    """A description of the full run whose report.json is in ``directory`` (None when there is
    none: no file, an unreadable one, or a quick run's)."""
    try:
        doc = json.loads((directory / "report.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("mode") != "full":
        return None
    return f"a full run of backend {doc.get('backend', '?')} started {doc.get('started', '?')}"


def run(args: argparse.Namespace) -> int:
    from . import model_cli

    if getattr(args, "model", None):  # the model mode: hal.conformance.model
        return model_cli.run(args)
    extra = model_cli.misplaced(args)
    if extra:
        print(f"hal conformance: {', '.join(extra)} only apply with --model NAME", file=sys.stderr)
        return 2
    from . import report
    from .parallel import run_parallel
    from .runner import Suite, run_collectives

    settings = dict(
        backend=args.backend,
        device=args.device,
        seed=args.seed,
        quick=args.quick,
        ops=args.ops,
        dtypes=args.dtypes,
        xfail_file=args.xfail,
        tolerance_file=args.tolerances,
        poison=not args.no_poison,
        strict_xpass=args.strict_xpass,
    )
    full = full_report_in(args.report_dir) if args.quick and not args.list else None
    if full is not None:
        print(
            f"hal conformance: --quick would replace the report of {full} in {args.report_dir}; write the quick "
            f"run elsewhere with --report-dir DIR (or move {args.report_dir / 'report.json'} away first)",
            file=sys.stderr,
        )
        return 2
    problem = plugin_problem(args.backend)
    if problem:
        print(f"hal conformance: {problem}", file=sys.stderr)
        return 2
    try:
        suite = Suite(**settings)
    except (HalError, ValueError, FileNotFoundError) as exc:
        print(f"hal conformance: {exc}", file=sys.stderr)
        return 2
    plan = suite.plan()
    if args.jobs is None:
        args.jobs = 1 if suite.torch_device.type == "cpu" else max(1, min(8, (os.cpu_count() or 1) // 2))
    if args.list:
        for p in plan:
            print(p.id)
        return 0
    output_dir(args.report_dir, "--report-dir")
    if not suite.poison_ok:
        print(f"hal conformance: warning: output poisoning is not active ({suite.poison_method})", file=sys.stderr)
    dev = suite.device_info.name if suite.device_info else suite.torch_device
    print(f"hal conformance: {suite.backend} on {dev}: {len(plan)} cases ({'quick' if args.quick else 'full'}, seed {args.seed}{f', {args.jobs} processes' if args.jobs > 1 else ''}), reference {suite.reference_label}", file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    bar = Progress(len(plan))
    try:
        if args.jobs > 1:
            results = run_parallel(suite, settings | {"backend": suite.backend}, plan, args.jobs, progress=bar)
        else:
            results = suite.run(plan, progress=bar)
    finally:
        bar.close()
    notes: list[str] = []
    collective_ids = None
    if args.world_size > 1:
        print(f"hal conformance: collective cases on {args.world_size} processes ...", file=sys.stderr, flush=True)
        extra, notes = run_collectives(suite, args.world_size)
        results += extra
        collective_ids = None if args.quick else [r.id for r in extra]
    stale = suite.stale_xfails(collective_ids)
    for i in stale:
        print(f"hal conformance: warning: xfail entry {i} matches no case of backend {suite.backend} (stale)", file=sys.stderr)
    run_ = report.Run(suite, results, started, time.perf_counter() - t0, stale, notes)
    paths = report.write(run_, args.report_dir)
    for note in notes:
        print(f"hal conformance: {note}", file=sys.stderr)
    sm = run_.summary
    print(", ".join(f"{sm[k]} {k}" for k in sm) + f" in {run_.duration_s:.1f} s", file=sys.stderr)
    for r in run_.unexpected[:20]:
        print(f"  {r}", file=sys.stderr)
    if len(run_.unexpected) > 20:
        print(f"  ... and {len(run_.unexpected) - 20} more", file=sys.stderr)
    print(f"reports: {paths['md']}, {paths['json']}, {paths['junit']}", file=sys.stderr)
    return run_.exit_status


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hal conformance", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command("hal conformance", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
