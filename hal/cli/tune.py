"""``hal tune``: measure the kernel choices of whole steps ahead of time, into the device's cache.

    hal tune                                 # every built-in model of `hal bench --models`, this device
    hal tune llama_train resnet50_train      # some of them
    hal tune mypkg.train:make_step           # a callable returning a step (no arguments) or (step, args)
    hal tune --export DIR                    # also write the device's measurements as a seed file

Each step runs once with measured choice on (:func:`hal.tuning.tune`), eagerly and, on a GPU, again
inside :func:`hal.graphs.device_bound` (the choices of steps replayed from a CUDA graph). A second run
finds everything cached and measures nothing: what later processes pay.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

import hal


#: what each context's measurements are made under
_SCOPES = {"eager": contextlib.nullcontext, "graph": lambda: hal.graphs.device_bound(), "compiled": lambda: hal.tuning.for_compile()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="built-in models of `hal bench --models` (resnet50_train, llama_train, ...; default all) or "
                             "module:callable returning a step or (step, args)")
    parser.add_argument("--model-size", choices=("full", "cpu", "tiny"), help="built-in model sizes (default: full on a GPU, cpu on the CPU)")
    parser.add_argument("--contexts", default=None, metavar="a,b",
                        help="eager, graph (device time, for CUDA-graph replays), compiled (opaque kernels against torch.compile "
                             "of torch's ops, for compiled steps; one compilation per call); default: eager and graph on a GPU, "
                             "eager on the CPU")
    parser.add_argument("--export", metavar="DIR", type=Path, help="write this device's measurements to DIR/<device>.json (a plugin's seed file)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda", 0) if torch.cuda.is_available() and any(
        b.available and set(b.device_types) & {"cuda", "rocm"} for b in hal.backends()) else torch.device("cpu")
    contexts = [c.strip() for c in (args.contexts or ("eager,graph" if device.type == "cuda" else "eager")).split(",") if c.strip()]
    unknown = set(contexts) - set(_SCOPES)
    if unknown:
        print(f"hal tune: unknown context(s) {', '.join(sorted(unknown))}; use {', '.join(_SCOPES)}", file=sys.stderr)
        return 2
    try:
        steps = _steps(args.models, args.model_size or ("full" if device.type == "cuda" else "cpu"), device)
    except (ValueError, ImportError, AttributeError) as exc:
        print(f"hal tune: {exc}", file=sys.stderr)
        return 2
    try:
        from hal_bench.workload import NotApplicable
    except ImportError:  # the model zoo is not installed: only module:callable steps, which raise as they do
        NotApplicable = ()  # type: ignore[assignment,misc]
    rows: list[dict[str, Any]] = []
    for name, make in steps:
        try:
            step, step_args = make()
        except NotApplicable as exc:  # a built-in model this machine cannot build (transformers missing, say)
            print(f"hal tune: {name} skipped: {exc}", file=sys.stderr)
            continue
        for context in contexts:
            with _SCOPES[context]():
                report = hal.tuning.tune(step, *step_args)
            rows.append({"model": name, "context": context, "calls_measured": len(report.measurements),
                         "measuring_s": round(report.measuring_seconds, 3), "step_s": round(report.seconds, 3),
                         "measurements": report.rows()})
            if not args.json:
                print(f"{name} [{context}]: {report}")
    if args.export is not None:
        path = _export(args.export, device)
        if not args.json:
            print(f"hal tune: wrote {path}")
    if args.json:
        print(json.dumps({"device": str(device), "rows": rows}, indent=1))
    return 0


def _steps(names: list[str], size: str, device: torch.device) -> list[tuple[str, Callable[[], tuple[Callable[..., Any], tuple]]]]:
    """(name, make) for each model asked for: ``make()`` builds the step and its arguments."""
    custom = [n for n in names if ":" in n]
    builtin = [n for n in names if ":" not in n]
    out: list[tuple[str, Callable[[], tuple[Callable[..., Any], tuple]]]] = [(n, _user_step(n)) for n in custom]
    if builtin or not custom:
        from hal_bench.models import all_workloads

        workloads = {w.name: w for w in all_workloads(size)}
        missing = [n for n in builtin if n not in workloads]
        if missing:
            raise ValueError(f"no built-in model named {', '.join(missing)}; built-in: {', '.join(workloads)}")
        for name in builtin or list(workloads):
            w = workloads[name]
            out.append((name, lambda w=w: (w.make("hal", None, device, 0), ())))
    return out


def _user_step(spec: str) -> Callable[[], tuple[Callable[..., Any], tuple]]:
    module_name, _, attr = spec.partition(":")

    def make() -> tuple[Callable[..., Any], tuple]:
        made = getattr(importlib.import_module(module_name), attr)()
        if isinstance(made, tuple):
            step, args = made
            return step, tuple(args)
        return made, ()

    return make


def _export(directory: Path, device: torch.device) -> Path:
    """Write the device's measured choices as a seed file of its tune cache."""
    from hal.dispatch import DISPATCHER
    from hal.dispatch.measure import cache_for, device_slug

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{device_slug(device)}.json"
    cache_for(device, DISPATCHER.runtime()).export(path)
    return path
