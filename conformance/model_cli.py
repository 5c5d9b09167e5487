"""``hal conformance --model``: the command line of the model mode (:mod:`hal.conformance.model`).

Exit status: 0 when every model passed (and matched the golden curves given with ``--golden``), 1
when a model diverged, errored or left its golden curve, 2 for a usage problem (an unknown model,
a backend or reference that is not usable, an unreadable golden file). ``--model all`` skips a
built-in model whose package does not import here (transformers for ``hf_llama``), with the reason
in the reports; named on its own, such a model is an error.
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
import time
from pathlib import Path
from typing import Optional

from hal.cli.paths import output_dir

#: the options of the model mode that are :class:`~hal.conformance.model.Settings` fields (None when
#: not given: the field's default), then the others
SETTINGS = ("reference", "steps", "size", "lr", "optimizer", "dtype")
MODEL_ONLY = SETTINGS + ("write_golden", "golden")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model mode's options (``hal conformance --help`` lists them in a group)."""
    from .model import OPTIMIZERS, Settings
    from .model_zoo import BUILTIN, SIZES

    d = Settings()
    g = parser.add_argument_group("model mode", "a model's training steps compared call by call with the reference (docs/api.md)")
    g.add_argument("--model", metavar="NAME|module:callable",
                   help=f"check a model instead of the op cases: built-in {', '.join(BUILTIN)} (comma separated, or all), or "
                        "module:callable returning (model, batch[, loss_fn])")
    g.add_argument("--reference", metavar="BACKEND", help=f"backend of the reference run, in float64 (default {d.reference})")
    g.add_argument("--steps", metavar="N", type=int, help=f"training steps of each run (default {d.steps})")
    g.add_argument("--size", choices=SIZES, help=f"size of the built-in models (default {d.size})")
    g.add_argument("--lr", metavar="LR", type=float, help=f"learning rate (default {d.lr})")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the model and its float inputs to this dtype for the run under test (default: as built, float32 for the built-in models)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="torch.optim.SGD (default) or hal.optim.AdamW (its fused_adamw_ calls are checked too)")
    g.add_argument("--no-bisect", action="store_true", help="report the first call past its budget without confirming it by forced re-runs")
    g.add_argument("--write-golden", metavar="DIR", type=Path, help="also write the loss curves as DIR/loss_curves.json (conformance/golden/<device>/)")
    g.add_argument("--golden", metavar="FILE", type=Path, help="also compare the loss curves with a golden file (loss_curves.json)")


def misplaced(args: argparse.Namespace) -> list[str]:
    """Model-mode options given without --model."""
    return [f"--{name.replace('_', '-')}" for name in MODEL_ONLY if getattr(args, name, None) is not None] + (
        ["--no-bisect"] if getattr(args, "no_bisect", False) else [])


def run(args: argparse.Namespace) -> int:
    from . import model_golden, model_report
    from .model import ModelResult, Settings, check_model
    from .model_zoo import names, unavailable

    given = {k: getattr(args, k) for k in SETTINGS if getattr(args, k, None) is not None}
    if given.get("steps", 1) < 1:
        print(f"hal conformance: --steps {given['steps']}: give 1 or more", file=sys.stderr)
        return 2
    if not 0 <= given.get("lr", 0.0) < math.inf:  # NaN fails the comparison too
        print(f"hal conformance: --lr {given['lr']}: give a finite learning rate, 0 or more", file=sys.stderr)
        return 2
    golden = None
    if args.golden is not None:
        try:
            golden = model_golden.load(args.golden)
        except ValueError as exc:
            print(f"hal conformance: {exc}", file=sys.stderr)
            return 2
    models = names(args.model)
    named = {part.strip() for part in args.model.split(",")}
    if not models:
        print("hal conformance: --model: give a model name, all, or module:callable", file=sys.stderr)
        return 2
    output_dir(args.report_dir, "--report-dir")
    if args.write_golden is not None:
        output_dir(args.write_golden, "--write-golden")
    settings = Settings(backend=args.backend, device=args.device, seed=args.seed, bisect=not args.no_bisect, **given)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    results = []
    for name in models:
        reason = unavailable(name) if "all" in named and name not in named else None
        if reason is not None:  # a model of `all` this machine lacks a package for: skipped, not failed
            r = ModelResult(name, "", "skip", settings, settings.backend or "?", "?", "?", skip_reason=reason)
            print(f"  {r.summary_line}", file=sys.stderr, flush=True)
            results.append(r)
            continue
        r = check_model(name, settings, log=lambda text: print(f"hal conformance: {text}", file=sys.stderr, flush=True))
        usage = _usage_error(r.error) if r.status == "error" and r.test is None else None
        if usage:
            print(f"hal conformance: {usage}", file=sys.stderr)
            return 2
        print(f"  {r.summary_line}", file=sys.stderr, flush=True)
        results.append(r)
    paths = model_report.write(results, args.report_dir, started, time.perf_counter() - t0)
    status = model_report.exit_status(results)
    if args.write_golden is not None:
        path = model_golden.write(results, args.write_golden)
        print(f"golden loss curves: {path}", file=sys.stderr)
    if golden is not None:
        problems = model_golden.compare(golden, results)
        for p in problems:
            print(f"hal conformance: golden {args.golden}: {p}", file=sys.stderr)
        if problems:
            status = 1
        else:
            print(f"hal conformance: loss curves within the golden file {args.golden}", file=sys.stderr)
    print(f"reports: {paths['md']}, {paths['json']}, {paths['junit']}", file=sys.stderr)
    return status


#: how check_model records an error: "Type: message (at file:line)"
_RECORDED = re.compile(r"(\w+): (.*?)(?: \(at [^()]*:\d+\))?", re.S)


def _usage_error(error: Optional[str]) -> Optional[str]:
    """The message of a model that could not start for a reason the user gave (an unknown model or
    backend, a module:callable that cannot be used), without the exception type and code location
    that check_model records; None for any other error."""
    match = _RECORDED.fullmatch(error or "")
    if match is None:
        return None
    kind, message = match.groups()
    if kind == "BackendUnavailableError" or (kind == "ValueError" and message.startswith(("no built-in model", "--model"))):
        return message
    return None

