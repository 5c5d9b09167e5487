"""The three reports of ``hal conformance --model``: ``model-report.json``, ``model-report.md`` and
``model-junit.xml`` (one test case per model), written beside the op suite's reports without
replacing them.

``model-report.json``::

    {"hal_version", "commit", "commit_dirty", "mode": "model", "backend", "backend_version",
     "device": {"name", "vendor", "arch"}, "reference": {"backend", "dtype", "device"},
     "settings": {"steps", "lr", "optimizer", "size", "seed", "tune", "dtype"}, "torch_version", "platform",
     "started", "duration_s", "summary": {"pass", "fail", "error", "skip"}, "exit_status",
     "models": [{"model", "description", "status", "error", "skip_reason", "duration_s", "device",
                 "loss", "reference_loss", "loss_max_rel_diff", "calls", "checks", "failing_checks",
                 "mismatch", "first_divergence", "culprit", "confirmation", "call_table"}]}

``first_divergence`` is the first check past its budget (call index, step, kind, component,
op, backend, kernel, route, call site and stack, module, arguments, budget used, errors, atol,
rtol, K, inherited error, message); ``culprit`` the op and kernel the bisection names;
``call_table`` one row per call with the largest budget its results and gradients used, and the
largest part of the op's tolerance its kernel's own error took.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import platform
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

import hal
from hal.dispatch import DISPATCHER

from .model import ModelResult, calls_table, loss_gap
from .report import git_commit

STATUSES = ("pass", "fail", "error", "skip")
FILES = {"json": "model-report.json", "md": "model-report.md", "junit": "model-junit.xml"}
#: calls listed per model in the Markdown report (all of them are in the JSON)
MARKDOWN_CALLS = 120


def _num(v: Optional[float]) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else float(v)


def _nums(values: Optional[Sequence[float]]) -> Optional[list[Optional[float]]]:
    """Losses for JSON: a NaN or infinite loss (a run that blew up) becomes null."""
    return None if values is None else [_num(v) for v in values]


def _first(r: ModelResult) -> Optional[dict[str, Any]]:
    if r.first is None or r.call is None:
        return None
    c, call = r.first, r.call
    return {
        **c.record(), "step": call.step, "phase": call.phase, "op": call.op, "backend": call.backend, "kernel": call.kernel,
        "route": call.route, "site": call.site.record() if call.site else None, "stack": [s.record() for s in call.stack],
        "module": call.module, "args": call.shapes(), "inner": [k.record() for k in call.inner],
    }


def model_json(r: ModelResult) -> dict[str, Any]:
    """One model's part of the JSON report."""
    checks = r.comparison.checks if r.comparison else []
    return {
        "model": r.name,
        "description": r.description,
        "status": r.status,
        "error": r.error,
        "skip_reason": r.skip_reason,
        "duration_s": round(r.duration_s, 3),
        "device": r.device,
        "reference_device": r.reference_device,
        "loss": _nums(r.test.losses) if r.test else None,
        "reference_loss": _nums(r.reference.losses) if r.reference else None,
        "loss_max_rel_diff": _num(loss_gap(r)),
        "calls": len(r.test.calls) if r.test else 0,
        "checks": len(checks),
        "failing_checks": sum(not c.ok for c in checks),
        "mismatch": r.comparison.mismatch if r.comparison else None,
        "first_divergence": _first(r),
        "culprit": None if r.culprit is None else {
            "op": r.culprit.op, "backend": r.culprit.backend, "kernel": r.culprit.kernel, "phase": r.culprit.phase,
            "route": r.culprit.route, "path": list(r.culprit.path),
            "site": r.call.site.record() if r.call is not None and r.call.site else None},
        "confirmation": None if r.confirmation is None else {
            "confirmed": r.confirmation.confirmed, "forced": [list(p) for p in r.confirmation.forced], "reason": r.confirmation.reason,
            "trials": [{"forced": t.forced, "vanished": t.vanished, "first_after": t.first_after}
                       for t in r.confirmation.trials]},
        "call_table": calls_table(r),
    }


def _tune() -> str:
    from hal import config

    return "off" if config.tune_mode() == "off" else "cached"


def summary(results: Sequence[ModelResult]) -> dict[str, int]:
    counts = collections.Counter(r.status for r in results)
    return {s: counts.get(s, 0) for s in STATUSES}


def exit_status(results: Sequence[ModelResult]) -> int:
    """0 when a model passed and every other passed or was skipped, else 1."""
    return 0 if any(r.status == "pass" for r in results) and all(r.status in ("pass", "skip") for r in results) else 1


def to_json(results: Sequence[ModelResult], started: datetime.datetime, duration_s: float) -> dict[str, Any]:
    commit, dirty = git_commit()
    first = next((r for r in results if r.status != "skip"), results[0] if results else None)
    backend = first.backend if first else None
    state = DISPATCHER.runtime().backends.get(backend) if backend else None
    info = None
    if state is not None and state.devices and first is not None:
        info = state.devices[min(first.settings.device, len(state.devices) - 1)]
    s = first.settings if first else None
    return {
        "hal_version": hal.__version__,
        "commit": commit,
        "commit_dirty": dirty,
        "mode": "model",
        "backend": backend,
        "backend_version": state.version if state is not None else None,
        "device": {"name": info.name if info else (first.device if first else None), "vendor": info.vendor if info else None,
                   "arch": info.arch if info else None},
        "reference": {"backend": s.reference if s else None, "dtype": "float64", "device": first.reference_device if first else None},
        "settings": None if s is None else {"steps": s.steps, "lr": s.lr, "optimizer": s.optimizer, "size": s.size, "seed": s.seed,
                                            "tune": s.tune or _tune(), "dtype": s.dtype},
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round(duration_s, 3),
        "summary": summary(results),
        "exit_status": exit_status(results),
        "models": [model_json(r) for r in results],
    }


# --- Markdown ------------------------------------------------------------------------------------


def _g(v: Optional[float], digits: int = 3) -> str:
    return "—" if v is None else (str(v) if not math.isfinite(v) else f"{v:.{digits}g}")


def _module(name: Optional[str]) -> str:
    """A module's name in the model ("" is the model itself)."""
    return "—" if name is None else (f"`{name}`" if name else "the model")


def _where(site: Optional[dict[str, Any]]) -> str:
    if not site:
        return "—"
    return f"`{site['file']}:{site['line']}` in `{site['function']}`"


def _model_markdown(m: dict[str, Any]) -> list[str]:
    lines = [f"## `{m['model']}` — {m['status'].upper()}", "", m["description"] or "", ""]
    if m["error"]:
        return lines + [f"Error: `{m['error']}`", ""]
    if m["skip_reason"]:
        return lines + [f"Skipped: {m['skip_reason']}", ""]
    f = m["first_divergence"]
    if m["mismatch"]:
        lines += [f"**The runs' calls part**: {m['mismatch']}", ""]
    if f is not None:
        c = m["culprit"] or {"op": f["op"], "backend": f["backend"], "kernel": f["kernel"], "phase": "forward"}
        lines += [
            f"**Diverging op `{c['op']}`, kernel `{c['backend']}/{c['kernel']}` ({c['phase']}), called at {_where(f['site'])}**"
            + (f", module {_module(f['module'])}" if f["module"] is not None else ""),
            "",
            f"- first past its budget: call #{f['index']} `{f['op']}` (step {f['step']}, {f['phase']}; route {f['route']}; {f['args']}), "
            f"{f['kind']} `{f['component']}` at {_g(f['used']) if f['used'] is not None else 'infinitely (NaN, infinity or shape)'}x its budget (atol {_g(f['atol'])}, rtol {_g(f['rtol'])}, K {f['k']}, "
            f"inherited error {_g(f['inherited'])}; the kernel's own error {_g(f['own'])}x the op's tolerance)",
            f"- {f['message']}",
        ]
        if f["site"] and f["site"].get("code"):
            lines.append(f"- source: `{f['site']['code']}`")
        for s in f["stack"]:
            lines.append(f"- called from {_where(s)}" + (f": `{s['code']}`" if s.get("code") else ""))
        if f["inner"]:
            lines.append("- inside it: " + ", ".join(f"`{k['op']}` {k['backend']}/{k['kernel']} ({k['phase']})" for k in f["inner"]))
        conf = m["confirmation"]
        if conf is not None:
            lines += [f"- **{'confirmed' if conf['confirmed'] else 'not confirmed'}**: {conf['reason']}", "",
                      "| forced to the reference | divergence gone | first past its budget then |", "| --- | --- | --- |"]
            for t in conf["trials"]:
                forced = ", ".join("#" + ".".join(str(i) for i in p) for p in t["forced"])
                lines.append(f"| {forced} | {'yes' if t['vanished'] else 'no'} | {t['first_after'] or 'none'} |")
        lines.append("")
    lines += ["### Loss curves", "", "| step | under test | reference (float64) | relative difference |", "| --- | --- | --- | --- |"]
    for i, (a, b) in enumerate(zip(m["loss"] or [], m["reference_loss"] or [])):
        gap = f"{abs(a - b) / max(abs(b), 1e-12):.2e}" if a is not None and b is not None else "—"
        lines.append(f"| {i} | {_g(a, 8)} | {_g(b, 10)} | {gap} |")
    rows = m["call_table"]
    lines += ["", f"### Calls ({len(rows)}{f', the first {MARKDOWN_CALLS} shown' if len(rows) > MARKDOWN_CALLS else ''})", "",
              "Budget used: the largest error against the reference run over its budget (1 = at the budget; it nears 1 where the "
              "error a call inherited dominates). Own error: the largest error the call's kernel added, against the reference op on the "
              "same inputs, over the op's tolerance.", "",
              "| # | step | op | kernel | route | call site | module | budget used: results / gradients | own error: results / gradients |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows[:MARKDOWN_CALLS]:
        mark = "❌ " if (row["used_output"] or 0) > 1 or (row["used_gradient"] or 0) > 1 else ""
        lines.append(f"| {mark}{row['index']} | {row['step']} | {row['op']} | {row['backend']}/{row['kernel']}{' (forced)' if row['forced'] else ''} "
                     f"| {row['route']} | {row['site'] or '—'} | {_module(row['module'])} | {_g(row['used_output'])} / {_g(row['used_gradient'])} "
                     f"| {_g(row['own_output'])} / {_g(row['own_gradient'])} |")
    return lines + [""]


def to_markdown(doc: dict[str, Any]) -> str:
    sm = doc["summary"]
    n = len(doc["models"])
    verdict = "PASSED" if doc["exit_status"] == 0 else f"FAILED ({sm['fail'] + sm['error']} of {n} models)"
    dev, ref, st = doc["device"], doc["reference"], doc["settings"] or {}
    lines = [
        f"# hal conformance --model: `{doc['backend']}` on {dev['name']}", "",
        f"**{verdict}** — " + ", ".join(f"{sm[k]} {k}" for k in STATUSES), "",
        "| | |", "| --- | --- |",
        f"| backend | `{doc['backend']}` {doc['backend_version']} |",
        f"| device | {dev['name']} ({dev['vendor']}, {dev['arch']}) |",
        f"| reference | `{ref['backend']}` in {ref['dtype']} on {ref['device']} |",
        f"| steps | {st.get('steps')} ({st.get('optimizer')}, lr {st.get('lr')}), size {st.get('size')}, seed {st.get('seed')}, "
        f"dtype {st.get('dtype') or 'as built'}, HAL_TUNE {st.get('tune')} |",
        f"| hal | {doc['hal_version']}, commit `{doc['commit'] or 'unknown'}`{' (uncommitted changes)' if doc['commit_dirty'] else ''} |",
        f"| run | started {doc['started']}, {doc['duration_s']:.1f} s, torch {doc['torch_version']} |",
        "",
        "Each call's results and gradients are compared with the reference run's within the op's declared tolerance "
        "(widened by its reduction length, scaled by the result's magnitude) plus the error the call inherited; "
        "the first call past its budget is re-run forced to the reference to confirm it.",
        "",
        "| model | status | calls | checks failing | diverging op and kernel | call site | last loss (test / reference) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in doc["models"]:
        c, f = m["culprit"], m["first_divergence"]
        what = f"`{c['op']}` {c['backend']}/{c['kernel']}" if c else (m["mismatch"] or m["error"] or m["skip_reason"] or "—")
        loss = f"{_g(m['loss'][-1], 6)} / {_g(m['reference_loss'][-1], 6)}" if m["loss"] and m["reference_loss"] else "—"
        lines.append(f"| `{m['model']}` | {m['status']} | {m['calls']} | {m['failing_checks']} of {m['checks']} | {what} "
                     f"| {_where(f['site']) if f else '—'} | {loss} |")
    lines.append("")
    for m in doc["models"]:
        lines += _model_markdown(m)
    return "\n".join(lines) + "\n"


# --- JUnit XML ------------------------------------------------------------------------------------


def to_junit(results: Sequence[ModelResult], doc: dict[str, Any]) -> str:
    sm = doc["summary"]
    suite = ET.Element("testsuite", name=f"hal.conformance.model.{doc['backend']}", tests=str(len(results)), failures=str(sm["fail"]),
                       errors=str(sm["error"]), skipped=str(sm["skip"]), time=f"{doc['duration_s']:.3f}", timestamp=doc["started"])
    props = ET.SubElement(suite, "properties")
    for key in ("backend", "backend_version", "commit"):
        ET.SubElement(props, "property", name=key, value=str(doc[key]))
    ET.SubElement(props, "property", name="reference", value=f"{doc['reference']['backend']} float64")
    ET.SubElement(props, "property", name="device", value=str(doc["device"]["name"]))
    for r, m in zip(results, doc["models"]):
        tc = ET.SubElement(suite, "testcase", classname=f"hal.conformance.model.{doc['backend']}", name=r.name, time=f"{r.duration_s:.3f}")
        if r.status == "fail":
            f = m["first_divergence"]
            detail = "\n".join(x for x in (r.summary_line, f["message"] if f else m["mismatch"] or "",
                                           m["confirmation"]["reason"] if m["confirmation"] else "") if x)
            ET.SubElement(tc, "failure", message=r.summary_line[:500], type="divergence").text = detail
        elif r.status == "error":
            ET.SubElement(tc, "error", message=(r.error or "error")[:500], type="error").text = r.error
        elif r.status == "skip":
            ET.SubElement(tc, "skipped", message=(r.skip_reason or "skipped")[:500])
        losses = ", ".join(f"{_g(a, 8)}/{_g(b, 8)}" for a, b in zip(m["loss"] or [], m["reference_loss"] or []))
        ET.SubElement(tc, "system-out").text = f"loss per step (test/reference): {losses}"
    root = ET.Element("testsuites", name="hal-conformance-model", tests=str(len(results)), failures=str(sm["fail"]), errors=str(sm["error"]),
                      skipped=str(sm["skip"]), time=f"{doc['duration_s']:.3f}")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write(results: Sequence[ModelResult], directory: Path, started: datetime.datetime, duration_s: float) -> dict[str, Path]:
    """Write the three reports into ``directory`` (created); returns their paths by kind."""
    directory.mkdir(parents=True, exist_ok=True)
    doc = to_json(results, started, duration_s)
    paths = {kind: directory / name for kind, name in FILES.items()}
    paths["json"].write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    paths["md"].write_text(to_markdown(doc))
    paths["junit"].write_text(to_junit(results, doc))
    return paths
