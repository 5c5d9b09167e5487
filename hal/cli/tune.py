"""``hal tune``: measure the kernel choices of whole steps ahead of time, into the device's cache.

    hal tune                                 # every built-in model of `hal bench --models`, this device
    hal tune llama_train resnet50_train      # some of them
    hal tune mypkg.train:make_step           # a callable returning a step (no arguments) or (step, args)
    hal tune --export DIR                    # also write the device's measurements as a seed file

Each step runs once with measured choice on (:func:`hal.tuning.tune`), eagerly and, on a GPU, again
inside :func:`hal.graphs.device_bound` (the choices of steps replayed from a CUDA graph). A second run
finds everything cached and measures nothing: what later processes pay.

Exit status: 0, or 2 for bad input (:mod:`hal.cli.usage`): an unknown model or context, a
``module:callable`` that cannot be imported, is not callable, returns no step or raises, an
``--export`` folder that cannot be written (checked before anything is measured).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import hal
from hal.cli import environment
from hal.cli.paths import output_dir
from hal.cli.usage import CommandLineError, names
from hal.errors import unknown_names as unknown


#: what each context's measurements are made under
_SCOPES = {"eager": contextlib.nullcontext, "graph": lambda: hal.graphs.device_bound(), "compiled": lambda: hal.tuning.for_compile()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="built-in models of `hal bench --models` (resnet50_train, llama_train, ...; default all) or "
                             "module:callable returning a step or (step, args)")
    parser.add_argument("--model-size", choices=("full", "cpu", "tiny"), help="built-in model sizes (default: full on a GPU, cpu on the CPU)")
    parser.add_argument("--contexts", default=None, metavar="a,b", type=names,
                        help="eager, graph (device time, for CUDA-graph replays), compiled (opaque kernels against torch.compile "
                             "of torch's ops, for compiled steps; one compilation per call); default: eager and graph on a GPU, "
                             "eager on the CPU")
    parser.add_argument("--export", metavar="DIR", type=Path, help="write this device's measurements to DIR/<device>.json (a plugin's seed file)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda", 0) if torch.cuda.is_available() and any(
        b.available and set(b.device_types) & {"cuda", "rocm"} for b in hal.backends()) else torch.device("cpu")
    contexts = args.contexts or (["eager", "graph"] if device.type == "cuda" else ["eager"])
    problem = unknown("context", contexts, _SCOPES)
    if problem:
        raise CommandLineError(f"--contexts: {problem}")
    environment.check()
    steps = _steps(args.models, args.model_size or ("full" if device.type == "cuda" else "cpu"), device)
    if args.export is not None:
        output_dir(args.export, "--export")
    try:
        from hal_bench.workload import NotApplicable
    except ImportError:  # the model zoo is not installed: only module:callable steps, which raise as they do
        NotApplicable = ()  # type: ignore[assignment,misc]
    rows: list[dict[str, Any]] = []
    for name, make in steps:
        try:
            with _user_code(name):
                step, step_args = make()
        except NotApplicable as exc:  # a built-in model this machine cannot build (transformers missing, say)
            print(f"hal tune: {name} skipped: {exc}", file=sys.stderr)
            continue
        for context in contexts:
            with _SCOPES[context](), _user_code(name):
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


def _steps(models: list[str], size: str, device: torch.device) -> list[tuple[str, Callable[[], tuple[Callable[..., Any], tuple]]]]:
    """(name, make) for each model asked for: ``make()`` builds the step and its arguments."""
    custom = [n for n in models if ":" in n]
    builtin = [n for n in models if ":" not in n]
    out: list[tuple[str, Callable[[], tuple[Callable[..., Any], tuple]]]] = [(n, _user_step(n)) for n in custom]
    if builtin or not custom:
        from hal_bench.models import all_workloads

        workloads = {w.name: w for w in all_workloads(size)}
        problem = unknown("model", builtin, workloads)
        if problem:
            raise CommandLineError(f"{problem}; or give module:callable")
        for name in builtin or list(workloads):
            w = workloads[name]
            out.append((name, lambda w=w: (w.make("hal", None, device, 0), ())))
    return out


def _user_step(spec: str) -> Callable[[], tuple[Callable[..., Any], tuple]]:
    """``make`` of a ``module:callable`` step (attributes may be dotted), the module imported and the
    callable found now, before anything is measured; ``make()`` checks what the callable returns."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CommandLineError(f"{spec}: give module:callable, for example mypkg.train:make_step")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: modules of the working directory
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandLineError(f"{spec}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise CommandLineError(f"{spec}: {target.__name__!r} has no attribute {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise CommandLineError(f"{spec}: {attr} is not callable ({_kind(target)}); give a callable returning a step or (step, args)")

    def make() -> tuple[Callable[..., Any], tuple]:
        made = target()
        step, args = made if isinstance(made, tuple) and len(made) == 2 else (made, ())
        if not callable(step) or not isinstance(args, (tuple, list)):
            raise CommandLineError(f"{spec} returned {_kind(made)}; return a step (a callable) or (step, args) with args a tuple")
        return step, tuple(args)

    return make


def _kind(value: Any) -> str:
    """``value`` described for a message: its type, and the types inside a tuple."""
    if isinstance(value, tuple):
        return f"a tuple of ({', '.join(type(v).__name__ for v in value)})"
    return f"a value of type {type(value).__name__}"


@contextlib.contextmanager
def _user_code(name: str) -> Iterator[None]:
    """An exception from the user's ``module:callable`` step (building or running it) as one line
    naming the step; a built-in model's exception is hal's own and keeps its traceback."""
    try:
        yield
    except CommandLineError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's code raises
        if ":" not in name:
            raise
        raise CommandLineError(f"{name} raised {type(exc).__name__}: {exc} (run it in Python to see where)") from None


def _export(directory: Path, device: torch.device) -> Path:
    """Write the device's measured choices as a seed file of its tune cache."""
    from hal.dispatch import DISPATCHER
    from hal.dispatch.measure import cache_for, device_slug

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{device_slug(device)}.json"
    cache_for(device, DISPATCHER.runtime()).export(path)
    return path
