"""The checks of scripts/check_install.sh, run by the python of a venv where hal and its backends were
installed from their wheels (not editable), from a folder outside the checkout:

- hal is the venv's (``hal.__file__`` in its site-packages; nothing on ``sys.path`` in the checkout);
- every module the hal distributions installed imports (their RECORD lists them);
- ``hal info``, ``hal conformance --backend cpu --quick`` and ``hal conformance --model cnn`` succeed,
  and their reports carry hal's version and the commit the wheels were built from;
- ``python -m hal.cli.docs --check`` says that it needs a source checkout (exit 2);
- the out-of-tree backend template (examples/backend_template, installed from its wheel as a third
  party's backend would be) passes ``hal conformance --backend template``: every case of its kernels
  passes against cpu_ref, none is skipped;
- a few steps of each example in the checkout's examples/, copied here first.

The imports and the commands run in one lane, the template and the examples in another, the two
lanes at once.

    python check_installed.py --source CHECKOUT --commit SHA
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

#: the ops the backend template (examples/backend_template) has a kernel for
TEMPLATE_OPS = ("swiglu", "softmax", "rms_norm", "rms_norm_backward")

#: the arguments that make each example a few steps long (an example missing here fails the check)
EXAMPLE_ARGS = {
    "train_cnn.py": ["--steps", "3", "--batch", "8", "--size", "8", "--log-every", "1"],
    "train_llama_optimize.py": ["--steps", "3", "--compile", "off", "--log-every", "1"],
    "train_parallel_llama.py": ["--steps", "3"],
}


class CheckFailed(Exception):
    """A check that did not hold, with what was seen."""


def _log(text: str) -> None:
    print(f"check_installed: {text}", flush=True)


def run(*cmd: str, expect: int = 0, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cmd`` with the venv's executables; CheckFailed with its output unless it exits ``expect``."""
    start = time.monotonic()
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    _log(f"{' '.join(Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd))}: exit {done.returncode} "
         f"({time.monotonic() - start:.0f} s)")
    if done.returncode != expect:
        raise CheckFailed(f"{' '.join(cmd)} exited {done.returncode}, not {expect}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def check_where_hal_is(source: Path) -> None:
    import hal

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(hal.__file__).resolve()
    if site not in where.parents or Path(sys.prefix).resolve() not in site.parents:
        raise CheckFailed(f"hal imported from {where}, not from this venv's site-packages {site}")
    resolved = [Path(p or ".").resolve() for p in sys.path]
    inside = [str(p) for p in resolved if p == source or source in p.parents]
    if inside:
        raise CheckFailed(f"sys.path reaches into the checkout: {inside}")
    _log(f"hal {hal.__version__} from {where.parent}")


def installed_modules() -> list[str]:
    """Every module the hal distributions installed (``__main__`` modules run a program: left out)."""
    modules = []
    for dist in importlib.metadata.distributions():
        if not dist.metadata["Name"].startswith("hal"):
            continue
        for f in dist.files or []:
            path = str(f)
            if path.endswith(".py") and ".dist-info/" not in path and not path.endswith("__main__.py"):
                name = path[:-3].replace("/", ".")
                modules.append(name[: -len(".__init__")] if name.endswith(".__init__") else name)
    return sorted(modules)


def check_imports() -> None:
    modules = installed_modules()
    for must in ("hal.fast", "hal.parallel", "hal.fp8", "hal.ops", "hal.conformance", "hal_bench", "hal_torch.table", "hal_backend_cpu._nb"):
        if must not in modules:
            raise CheckFailed(f"the installed distributions have no module {must}")
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is listed
            failed[name] = f"{type(exc).__name__}: {exc}"
    if failed:
        raise CheckFailed("modules that do not import:\n" + "\n".join(f"  {k}: {v}" for k, v in failed.items()))
    import hal

    hal.optimize, hal.parallel, hal.fp8  # noqa: B018 - the attributes the issue found missing
    _log(f"{len(modules)} installed modules import")


def check_report(path: Path, commit: str) -> None:
    """A conformance report (op suite's or model mode's) names this hal's version and commit."""
    import hal

    doc = json.loads(path.read_text())
    if doc["hal_version"] != hal.__version__ or doc["commit"] != commit:
        raise CheckFailed(f"{path}: hal {doc['hal_version']} commit {doc['commit']}, not {hal.__version__} commit {commit}")


def check_commands(bin_dir: Path, work: Path, commit: str) -> None:
    hal = str(bin_dir / "hal")
    info = run(hal, "info").stdout
    unloaded = [name for name in ("cpu_ref", "eager", "cpu", "cuda", "rocm", "template") if not re.search(rf"^  {name} +loaded ", info, re.M)]
    if unloaded:
        raise CheckFailed(f"hal info does not show the plugins of {unloaded} loaded:\n{info[:3000]}")
    run(hal, "conformance", "--backend", "cpu", "--quick", "--report-dir", str(work / "quick"))
    check_report(work / "quick" / "report.json", commit)
    run(hal, "conformance", "--model", "cnn", "--report-dir", str(work / "model"))
    check_report(work / "model" / "model-report.json", commit)
    docs = run(sys.executable, "-m", "hal.cli.docs", "--check", expect=2)
    if "not from a source checkout" not in docs.stderr:
        raise CheckFailed(f"python -m hal.cli.docs --check outside a checkout said:\n{docs.stderr}")


def check_template(bin_dir: Path, work: Path, commit: str) -> None:
    """``hal conformance --backend template`` passes, and its report shows each of the template's
    kernels run on its cases and passing: a kernel that declined its cases (skip) fails the check."""
    run(str(bin_dir / "hal"), "conformance", "--backend", "template", "--report-dir", str(work / "template"))
    report = work / "template" / "report.json"
    check_report(report, commit)
    results = [r for r in json.loads(report.read_text())["results"] if r["op"] in TEMPLATE_OPS]
    missing = sorted(set(TEMPLATE_OPS) - {r["op"] for r in results if r["status"] == "pass"})
    not_passed = [f"  {r['op']}[{r['kernel']},{r['dtype']},{r['case']}]: {r['status']} {r['reason'] or ''}"
                  for r in results if r["status"] != "pass"]
    if missing or not_passed:
        raise CheckFailed(f"{report}: ops of the template without a passing case: {missing or 'none'}; "
                          f"cases that did not pass ({len(not_passed)}):\n" + "\n".join(not_passed[:20]))
    _log(f"backend template: {len(results)} cases of {', '.join(TEMPLATE_OPS)} passed")


def check_examples(source: Path, work: Path) -> None:
    examples = sorted((source / "examples").glob("*.py"))
    unknown = [p.name for p in examples if p.name not in EXAMPLE_ARGS]
    if unknown:
        raise CheckFailed(f"examples without few-step arguments in scripts/check_installed.py's EXAMPLE_ARGS: {unknown}")
    for example in examples:
        copy = work / example.name
        shutil.copy(example, copy)
        out = run(sys.executable, str(copy), *EXAMPLE_ARGS[example.name]).stdout
        if "loss" not in out:
            raise CheckFailed(f"{example.name} printed no loss:\n{out[-3000:]}")


def _in_turn(checks: Sequence[Callable[[], None]]) -> None:
    """Each check, one after the other (CheckFailed from the first that fails)."""
    for check in checks:
        check()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the checkout the wheels were built from (for its examples)")
    parser.add_argument("--commit", required=True, help="the commit the wheels were built from")
    args = parser.parse_args(argv)
    source, work = args.source.resolve(), Path.cwd()
    if work == source or source in work.parents:
        print(f"check_installed: run it outside the checkout {source}", file=sys.stderr)
        return 2
    bin_dir = Path(sys.executable).parent
    # two lanes of checks at once (about 50 s each): most of each is waiting on the commands it runs
    lanes: list[list[Callable[[], None]]] = [
        [check_imports, functools.partial(check_commands, bin_dir, work, args.commit)],
        [functools.partial(check_template, bin_dir, work, args.commit), functools.partial(check_examples, source, work)],
    ]
    try:
        check_where_hal_is(source)
        with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
            for lane in [pool.submit(_in_turn, checks) for checks in lanes]:
                lane.result()
    except CheckFailed as exc:
        print(f"check_installed: FAILED: {exc}", file=sys.stderr)
        return 1
    _log("the installed hal passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
