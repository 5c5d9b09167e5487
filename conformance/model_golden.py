"""Golden loss curves: the losses of the built-in models' training steps on one device, kept in the
repository (``conformance/golden/<device>/loss_curves.json``) and compared with fresh runs.

``hal conformance --model all --write-golden DIR`` writes ``DIR/loss_curves.json`` from a run
(``conformance/golden/cpu/`` for the CPU, ``conformance/golden/h200/`` for the H200);
``hal conformance --model all --golden FILE`` checks a run against such a file (exit status 1 when
a curve is off or the settings differ). The file holds, per model, the curve of the backend under
test (``loss``) and of the float64 reference run (``reference_loss``), and the settings of the run
(steps, optimizer, learning rate, size, seed, dtype), which a comparison requires to be the same.

Tolerances (relative, per step, against the golden value): :data:`RTOL` for the device's own
curve, :data:`REFERENCE_RTOL` for the float64 reference's. On the project's CPU the float32 curve
of every built-in model stays within 2e-7 of the float64 reference over three steps (the golden
file records both): that gap is float32 rounding. Another machine, a thread count or a oneDNN/MKL
code path (AVX2 or AVX-512) rounds differently, by an amount of that order; 1e-4 leaves a factor
of 500 for it, while a kernel that is wrong by a fraction of a percent moves the loss by more
(linear layers scaled by 1.01 in the tests' tiny MLP move its loss by 2.4e-4 at the first step and
1.3e-3 at the third). The reference
is float64 NumPy: only the summation order of the BLAS library differs between machines, ~1e-15
per operation, so 1e-9 is generous and still catches any change of the reference's math.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import hal

from .model import ModelResult
from .report import git_commit

GOLDEN_DIR = Path(__file__).with_name("golden")
FILE = "loss_curves.json"
RTOL = 1e-4
REFERENCE_RTOL = 1e-9
#: settings that must match between a golden file and the run compared with it
SETTINGS = ("steps", "lr", "optimizer", "size", "seed", "dtype")


def settings_of(result: ModelResult) -> dict[str, Any]:
    s = result.settings
    return {"steps": s.steps, "lr": s.lr, "optimizer": s.optimizer, "size": s.size, "seed": s.seed, "dtype": s.dtype}


def document(results: Sequence[ModelResult]) -> dict[str, Any]:
    """The golden file's content for finished runs (runs that errored are left out)."""
    done = [r for r in results if r.test is not None and r.reference is not None]
    if not done:
        raise ValueError("no model ran to the end: nothing to write as golden curves")
    first = done[0]
    commit, dirty = git_commit()
    from hal.dispatch import DISPATCHER

    state = DISPATCHER.runtime().backends.get(first.backend)
    device = state.devices[0].name if state is not None and state.devices else first.device
    import torch

    return {
        "hal_version": hal.__version__,
        "commit": commit,
        "commit_dirty": dirty,
        "backend": first.backend,
        "device": device,
        "torch_version": torch.__version__,
        "reference": first.settings.reference,
        "settings": settings_of(first),
        "rtol": RTOL,
        "reference_rtol": REFERENCE_RTOL,
        "models": {
            r.name: {"description": r.description, "status": r.status, "loss": r.test.losses,  # type: ignore[union-attr]
                     "reference_loss": r.reference.losses}  # type: ignore[union-attr]
            for r in done
        },
    }


def write(results: Sequence[ModelResult], directory: Path) -> Path:
    """Write ``directory/loss_curves.json`` (created); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILE
    path.write_text(json.dumps(document(results), indent=1) + "\n")
    return path


def load(path: Path) -> dict[str, Any]:
    """A golden file (ValueError naming the problem for a missing or unreadable one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"golden file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"golden file {path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise ValueError(f"golden file {path} has no 'models' (write one with --write-golden DIR)")
    return doc


def _off(got: Sequence[float], want: Sequence[float], rtol: float) -> list[str]:
    if len(got) != len(want):
        return [f"{len(got)} steps, the golden curve has {len(want)}"]
    out = []
    for step, (a, b) in enumerate(zip(got, want)):
        if not (math.isfinite(a) and abs(a - b) <= rtol * max(abs(b), 1e-12)):
            out.append(f"step {step}: {a:.9g}, golden {b:.9g} (relative difference {abs(a - b) / max(abs(b), 1e-12):.2e} > {rtol:g})")
    return out


def compare(doc: dict[str, Any], results: Sequence[ModelResult]) -> list[str]:
    """What differs between runs and a golden file (empty: every curve within its tolerance)."""
    problems = []
    for r in results:
        gold = doc["models"].get(r.name)
        if gold is None:
            problems.append(f"{r.name}: no golden curve (models in the file: {', '.join(doc['models'])})")
            continue
        if r.test is None or r.reference is None:
            problems.append(f"{r.name}: did not run to the end ({r.error or r.skip_reason})")
            continue
        mine, theirs = settings_of(r), doc.get("settings", {})
        differ = [f"{k} {mine[k]!r} (golden {theirs.get(k)!r})" for k in SETTINGS if theirs.get(k) != mine[k]]
        if differ:
            problems.append(f"{r.name}: settings differ from the golden run's: {', '.join(differ)}")
            continue
        problems += [f"{r.name}: loss {p}" for p in _off(r.test.losses, gold["loss"], float(doc.get("rtol", RTOL)))]
        problems += [f"{r.name}: reference loss {p}" for p in _off(r.reference.losses, gold["reference_loss"],
                                                                  float(doc.get("reference_rtol", REFERENCE_RTOL)))]
    return problems
