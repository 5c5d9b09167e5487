"""``hal bench``: time each op's chosen kernel against eager PyTorch and torch.compile, as ratios.

    hal bench                       # every op on the best device (cuda if usable, else cpu)
    hal bench --ops layer_norm,softmax --json
    hal bench --backend cpu_ref     # CPU inputs, small sizes, a few seconds
    hal bench --out DIR             # also bench.json, bench.md and the roofline bench.png in DIR
    hal bench --render DIR/bench.json --out DIR   # table and picture again from a saved document
    hal bench --collectives --world-size 2 --device cuda
    hal bench --models                          # whole models (hal_bench.models), every peer
    hal bench --models llama_train,moe_fwd_bwd --model-size cpu --out DIR

On a GPU the inputs are the sizes of issue 5's performance table and the report includes the
fraction of the measured copy bandwidth and matrix rate, each target met or missed, the named
peers (Liger-Kernel where installed, with the reason where it cannot run) and published figures of
peers that cannot run here (quack-kernels). The roofline picture (hal_bench.roofline) needs
matplotlib.

Exit status: 0, 1 when a case or a model variant errored, 2 for bad input (:mod:`hal.cli.usage`:
unknown names, an unusable backend, an output path that cannot be written), checked before anything
is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path

import torch

import hal
from hal.cli import environment
from hal.cli.paths import output_dir, output_file
from hal.cli.usage import EXIT_FAILED, EXIT_USAGE, CommandLineError, at_least, names
from hal.errors import unknown_names as unknown

# The harness (bench/ in the repository, installed as hal_bench) is imported up front, without its
# modules: where it cannot be imported, `hal` lists this command as not available in this
# installation (hal/cli/__init__.py) instead of failing once a run has started.
import hal_bench  # noqa: E402,F401


#: the modes torch.compile accepts (checked here: a bad one would fail every case of a long run)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", metavar="a,b", type=names, help="ops to time (a forward op also selects its backward); 'dispatch' for the dispatch overhead alone")
    parser.add_argument("--backend", metavar="NAME", help="backend to time (its device decides the inputs' device; default: cuda if usable, else the CPU)")
    parser.add_argument("--json", action="store_true", help="print the result document as JSON instead of a table")
    parser.add_argument("--out", metavar="DIR", type=Path, help="also write bench.json, bench.md and bench.png (the roofline, with matplotlib) into DIR")
    parser.add_argument("--plot", metavar="PATH", type=Path, help="write the roofline picture (PNG) to PATH (needs matplotlib)")
    parser.add_argument("--render", metavar="JSON", type=Path, help="measure nothing: render a saved bench.json (the table; with --out/--plot the files)")
    compile_group = parser.add_mutually_exclusive_group()
    compile_group.add_argument("--compile", dest="use_compile", action="store_true", default=None, help="include torch.compile (default on a GPU)")
    compile_group.add_argument("--no-compile", dest="use_compile", action="store_false", help="leave torch.compile out (default on the CPU)")
    parser.add_argument("--compile-mode", metavar="MODE", choices=COMPILE_MODES,
                        help=f"torch.compile mode for every case ({', '.join(COMPILE_MODES)}; default: per case)")
    parser.add_argument("--collectives", action="store_true", help="benchmark hal.dist collectives instead (hal.dist.bench)")
    models = parser.add_argument_group("whole models (with --models)")
    models.add_argument("--models", metavar="a,b", nargs="?", const=[], type=names,
                        help="time whole models instead of ops (all, or those named: resnet50_train, resnet50_infer_fp16, "
                             "resnet50_infer_bf16, llama_train, hf_llama_train, llama_prefill, moe_fwd_bwd, hf_llama1b_train, "
                             "hf_llama1b_t4096_train, hf_llama8b_layers_train, hf_mixtral_train); writes models.json and models.md with --out")
    models.add_argument("--model-size", choices=("full", "cpu", "tiny"), help="model sizes (default: full on a GPU, cpu on the CPU)")
    models.add_argument("--variants", metavar="a,b", type=names,
                        help="only these columns (eager, compile, 'compile max-autotune', hal, hal+compile, liger, liger+compile, eager+graph, "
                             "'compile reduce-overhead', compile+graph, hal+graph, hal+compile+graph, ...)")
    models.add_argument("--no-graphs", dest="graphs", action="store_false", default=None,
                        help="leave out the CUDA-graph variants (eager+graph, compile reduce-overhead, compile+graph, hal+graph, "
                             "hal+compile+graph; measured by default on a GPU)")
    models.add_argument("--no-max-autotune", dest="max_autotune", action="store_false", help="leave out torch.compile max-autotune-no-cudagraphs for inference")
    models.add_argument("--paired-rounds", type=at_least(0), default=5, metavar="N",
                        help="after each model's sweep, time the judged pairs (compile against hal+compile, best peer against best "
                             "hal) again side by side in N alternating rounds (default 5; 0 leaves them out)")
    models.add_argument("--peak-tflops", type=float, metavar="X",
                        help="the device's peak TFLOP/s for MFU (default: the datasheet's dense bfloat16 figure of a known GPU, e.g. 989 for an H100 SXM)")
    models.add_argument("--max-batch", metavar="a,b", nargs="?", const=["eager", "hal"], default=[], type=names,
                        help="after each model's sweep, search the largest batch that fits in device memory for these variants "
                             "(default eager,hal): doubling, then bisecting on out-of-memory, a few steps per try")
    try:
        from hal.dist import bench as dist_bench
    except ImportError:
        return
    group = parser.add_argument_group("collectives (with --collectives)")
    dist_bench.add_arguments(group)  # type: ignore[arg-type]


def _device(backend: str | None) -> torch.device:
    """The device whose inputs the run takes: the backend's (:class:`CommandLineError` where it is not
    installed or not usable), else cuda where a GPU backend is usable, else the CPU."""
    environment.check()
    if backend:
        state = environment.usable_backend(backend, "--backend ")
        return torch.device("cuda", 0) if ("cuda" in state.device_types or "rocm" in state.device_types) else torch.device("cpu")
    usable = {b.name for b in hal.backends() if b.available}
    return torch.device("cuda", 0) if usable & {"cuda", "rocm"} and torch.cuda.is_available() else torch.device("cpu")


def run(args: argparse.Namespace) -> int:
    if args.collectives:
        try:
            from hal.dist.bench import run_collectives_bench
        except ImportError as exc:
            print(f"hal bench --collectives: hal.dist.bench is not available in this installation ({exc})", file=sys.stderr)
            return EXIT_USAGE
        from hal.cli.bench_collectives import check

        check(args)
        return int(run_collectives_bench(args) or 0)
    _check_outputs(args)
    if args.models is not None:
        return run_models(args)
    from hal_bench import report, runner

    if args.render:
        return _render(args)
    device = _device(args.backend)
    _check_ops(args.ops, device)
    progress = (lambda s: print(f"hal bench: {s}", file=sys.stderr, flush=True))
    backend = args.backend or ("cuda" if device.type == "cuda" else "auto")

    def save(doc: dict) -> None:
        """Write the document so far (after every case: a run cut short keeps what finished)."""
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench.json").write_text(report.to_json(doc | {"backend": backend}) + "\n")
            (args.out / "bench.md").write_text(report.to_markdown(doc | {"backend": backend}))

    with hal.use(backend=args.backend) if args.backend else contextlib.nullcontext():
        doc = runner.run(device, args.ops, args.use_compile, args.compile_mode, progress, on_case=save)
    doc["backend"] = backend
    save(doc)
    _pictures(doc, args)
    print(report.to_json(doc) if args.json else report.to_markdown(doc))
    errors = [r for r in doc["results"] if "error" in r]
    return EXIT_FAILED if errors else 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse --out and --plot paths that cannot be written, and --plot without matplotlib, before a
    long run instead of after it."""
    if args.out:
        output_dir(args.out, "--out")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise CommandLineError("--plot: the roofline picture needs matplotlib (pip install matplotlib)")
        output_file(args.plot, "--plot")


def _check_ops(ops: list[str] | None, device: torch.device) -> None:
    """Refuse --ops names that no benchmark case of this device times (a forward op also selects its
    backward; ``dispatch`` is the dispatch overhead alone), before anything is measured."""
    from hal_bench.cases import all_cases

    if ops:
        known = {"dispatch"} | {c.op.removesuffix(suffix) for c in all_cases(device.type == "cuda") for suffix in ("", "_backward")}
        problem = unknown("op", ops, known)
        if problem:
            raise CommandLineError(f"--ops: {problem}")


def _pictures(doc: dict, args: argparse.Namespace) -> bool:
    """The roofline: to --plot PATH, and to DIR/bench.png with --out (skipped, said, without matplotlib
    or without the measured ceilings a roof needs); whether every picture was drawn."""
    from hal_bench import roofline

    paths = [p for p in (args.plot, args.out / "bench.png" if args.out else None) if p]
    for path in paths:
        try:
            roofline.plot(doc, path)
        except (RuntimeError, ValueError) as exc:  # the table stands without its picture
            print(f"hal bench: no roofline picture: {exc}", file=sys.stderr)
            return False
        print(f"hal bench: roofline written to {path}", file=sys.stderr)
    return True


def _render(args: argparse.Namespace) -> int:
    """``--render JSON``: the Markdown table (and with --out / --plot the files) of a saved document."""
    import json

    from hal_bench import report

    try:
        doc = json.loads(args.render.read_text())
    except (OSError, ValueError) as exc:
        raise CommandLineError(f"--render {args.render}: cannot read it ({exc}); give a bench.json that hal bench wrote") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise CommandLineError(f"--render {args.render}: not a hal bench result document (no 'results' list); give a bench.json that hal bench wrote")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.out.resolve() != args.render.resolve().parent:
            (args.out / "bench.json").write_text(report.to_json(doc) + "\n")
        (args.out / "bench.md").write_text(report.to_markdown(doc))
    drawn = _pictures(doc, args)
    print(report.to_json(doc) if args.json else report.to_markdown(doc))
    return EXIT_USAGE if args.plot and not drawn else 0


def _check_models(args: argparse.Namespace, workloads: list) -> None:
    """Refuse unknown --models, --variants and --max-batch names and a --peak-tflops that is not a
    positive number, before anything is measured."""
    variants = [v.name for w in workloads for v in w.variants(True, True, True)]
    for option, what, given, known in (("--models", "model", args.models, [w.name for w in workloads]),
                                       ("--variants", "variant", args.variants, variants),
                                       ("--max-batch", "variant", args.max_batch, variants)):
        problem = unknown(what, given or (), known)
        if problem:
            raise CommandLineError(f"{option}: {problem}")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < float("inf"):  # NaN fails the comparison too
        raise CommandLineError(f"--peak-tflops {args.peak_tflops}: give the device's peak in TFLOP/s, a positive number")


def run_models(args: argparse.Namespace) -> int:
    """``hal bench --models``: the whole-model table (hal_bench.models), saved after every variant."""
    from hal_bench import models, models_report, report

    device = _device(args.backend)
    _check_models(args, models.all_workloads(args.model_size or ("full" if device.type == "cuda" else "cpu")))

    def save(doc: dict) -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "models.json").write_text(report.to_json(doc) + "\n")
            (args.out / "models.md").write_text(models_report.to_markdown(doc))

    progress = (lambda s: print(f"hal bench --models: {s}", file=sys.stderr, flush=True))
    with hal.use(backend=args.backend) if args.backend else contextlib.nullcontext():
        doc = models.run(device, args.models or None, args.model_size, args.use_compile, args.max_autotune, args.variants,
                         progress=progress, on_result=save, graphs=args.graphs, paired_rounds=args.paired_rounds,
                         peak_tflops=args.peak_tflops, max_batch=args.max_batch)
    save(doc)
    print(report.to_json(doc) if args.json else models_report.to_markdown(doc))
    failed = [r for row in doc["models"] for r in row["variants"] if "error" in r]
    return EXIT_FAILED if failed else 0
