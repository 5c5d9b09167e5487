"""The three reports of a conformance run: ``report.json`` (API.md's schema plus extras),
``report.md`` (for people: failures first, each with a reproduction snippet, then the table
op x kernel x dtype) and ``junit.xml`` (one testcase per case, for CI systems).

JSON extras beside the fixed schema: ``seed``, ``mode`` (quick/full), ``reference``, ``poisoning``,
``filters``, ``xfail_files``, ``stale_xfails``, ``cases_per_op``, ``exit_status``, ``strict_xpass``,
``commit_dirty``, ``torch_version``, ``platform``; per result ``id``, ``max_ulp`` (exact ops),
``k`` (the reduction length that widened atol), ``duration_s`` and ``repro``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import platform
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

import hal
from hal.version import source_commit

from .runner import STATUSES, Result, Suite

DTYPE_ORDER = ("float16", "bfloat16", "float32", "float64", "int8", "uint8")


@dataclasses.dataclass
class Run:
    """A finished run: the suite, its results and timing."""

    suite: Suite
    results: list[Result]
    started: datetime.datetime
    duration_s: float
    stale_xfails: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def summary(self) -> dict[str, int]:
        counts = collections.Counter(r.status for r in self.results)
        return {s: counts.get(s, 0) for s in STATUSES}

    @property
    def unexpected(self) -> list[Result]:
        """Results that fail the run: fail and error, and xpass under ``strict_xpass``."""
        return [r for r in self.results if r.unexpected or (self.suite.strict_xpass and r.status == "xpass")]

    @property
    def exit_status(self) -> int:
        return 1 if self.unexpected else 0


def git_commit() -> tuple[Optional[str], Optional[bool]]:
    """(commit, whether the tree had uncommitted changes) of the hal that runs: its checkout's, or
    the one stamped into an installed wheel (:func:`hal.version.source_commit`)."""
    return source_commit()


def to_json(run: Run) -> dict[str, Any]:
    s = run.suite
    info = s.device_info
    commit, dirty = git_commit()
    per_op = collections.Counter(r.op for r in run.results)
    return {
        "hal_version": hal.__version__,
        "commit": commit,
        "backend": s.backend,
        "backend_version": s.state.version,
        "device": {"name": info.name if info else str(s.torch_device), "vendor": info.vendor if info else None, "arch": info.arch if info else None},
        "started": run.started.isoformat(timespec="seconds"),
        "duration_s": round(run.duration_s, 3),
        "results": [r.record() for r in run.results],
        "summary": run.summary,
        "exit_status": run.exit_status,
        "strict_xpass": s.strict_xpass,
        "seed": s.seed,
        "mode": "quick" if s.quick else "full",
        "reference": s.reference_label,
        "poisoning": {"active": s.poison_ok, "method": s.poison_method},
        "filters": {"ops": s.ops, "dtypes": s.dtypes},
        "xfail_files": s.xfails.sources,
        "stale_xfails": run.stale_xfails,
        "cases_per_op": dict(per_op),
        "commit_dirty": dirty,
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "device_index": s.device_index,
        "notes": run.notes,
    }


# --- Markdown ------------------------------------------------------------------------------------


def _cell(results: Sequence[Result]) -> str:
    if not results:
        return "—"
    c = collections.Counter(r.status for r in results)
    ran = len(results) - c["skip"]
    parts = [f"{c['pass']}/{ran}" if ran else "skip"]
    parts += [f"{c[s]} {s}" for s in ("fail", "error", "xpass", "xfail") if c[s]]
    if c["skip"] and ran:
        parts.append(f"{c['skip']} skip")
    mark = "❌ " if any(r.status in ("fail", "error") for r in results) else ""
    return mark + ", ".join(parts)


def _fmt(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.3g}"


def to_markdown(run: Run, doc: dict[str, Any]) -> str:
    s = run.suite
    sm = run.summary
    dev = doc["device"]
    verdict = "PASSED" if run.exit_status == 0 else f"FAILED ({len(run.unexpected)} unexpected)"
    lines = [
        f"# hal conformance: `{s.backend}` on {dev['name']}",
        "",
        f"**{verdict}** — " + ", ".join(f"{sm[k]} {k}" for k in STATUSES),
        "",
        "| | |",
        "| --- | --- |",
        f"| backend | `{s.backend}` {doc['backend_version']} |",
        f"| device | {dev['name']} ({dev['vendor']}, {dev['arch']}), index {s.device_index} |",
        f"| reference | {doc['reference']} |",
        f"| hal | {doc['hal_version']}, commit `{doc['commit'] or 'unknown'}`{' (uncommitted changes)' if doc['commit_dirty'] else ''} |",
        f"| run | {doc['mode']}, seed {s.seed}, started {doc['started']}, {doc['duration_s']:.1f} s, torch {doc['torch_version']} |",
        f"| poisoning | {'active' if s.poison_ok else 'NOT active'}: {s.poison_method} |",
        "",
    ]
    for note in run.notes:
        lines += [f"> {note}", ""]
    if run.stale_xfails:
        lines += ["## Stale xfail entries", "", "These ids match no case of the backend (renamed or removed cases?):", ""]
        lines += [f"- `{i}`" for i in run.stale_xfails] + [""]
    bad = [r for r in run.results if r.status in ("fail", "error", "xpass")]
    lines += [f"## Failures ({len(bad)})", ""]
    if not bad:
        lines += ["None.", ""]
    for r in bad:
        lines += [
            f"### `{r.id}` — {r.status}",
            "",
            f"max_abs_err {_fmt(r.max_abs_err)}, max_rel_err {_fmt(r.max_rel_err)}, atol {_fmt(r.atol)}, rtol {_fmt(r.rtol)}"
            + (f", max_ulp {r.max_ulp}" if r.max_ulp is not None else "")
            + (f", K {r.k}" if r.k else ""),
            "",
            f"{r.reason or ''}",
            "",
        ]
        if r.repro:
            lines += ["```python", r.repro, "```", ""]
    xfails = [r for r in run.results if r.status == "xfail"]
    if xfails:
        lines += [f"## Known failures ({len(xfails)})", ""] + [f"- `{r.id}`: {r.reason}" for r in xfails] + [""]
    skips = collections.defaultdict(list)
    for r in run.results:
        if r.status == "skip":
            skips[r.reason or ""].append(r.id)
    if skips:
        lines += [f"## Skipped ({sum(len(v) for v in skips.values())})", ""]
        for reason, ids in skips.items():
            shown = ", ".join(f"`{i}`" for i in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
            lines.append(f"- {reason}: {shown}")
        lines.append("")
    lines += _table(run.results)
    return "\n".join(lines) + "\n"


def _table(results: Sequence[Result]) -> list[str]:
    rows: dict[tuple[str, str], dict[str, list[Result]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in results:
        rows[(r.op, r.kernel)][r.dtype].append(r)
    dtypes = [d for d in DTYPE_ORDER if any(d in cells for cells in rows.values())]
    dtypes += sorted({d for cells in rows.values() for d in cells} - set(dtypes))
    order = list(dict.fromkeys((r.op, r.kernel) for r in results))
    failing = [k for k in order if any(x.status in ("fail", "error", "xpass") for cell in rows[k].values() for x in cell)]
    lines = [
        "## Results by op, kernel and dtype",
        "",
        "Each cell: cases passed / cases run, then anything else (failing rows first).",
        "",
        "| op | kernel | " + " | ".join(dtypes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in dtypes) + " |",
    ]
    for key in failing + [k for k in order if k not in failing]:
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(_cell(rows[key].get(d, [])) for d in dtypes) + " |")
    return lines + [""]


# --- JUnit XML ------------------------------------------------------------------------------------


def to_junit(run: Run, doc: dict[str, Any]) -> str:
    s = run.suite
    sm = run.summary
    failures = sum(1 for r in run.results if r.status == "fail" or (r.status == "xpass" and s.strict_xpass))
    skipped = sm["skip"] + sm["xfail"]
    suite_el = ET.Element(
        "testsuite",
        name=f"hal.conformance.{s.backend}",
        tests=str(len(run.results)),
        failures=str(failures),
        errors=str(sm["error"]),
        skipped=str(skipped),
        time=f"{run.duration_s:.3f}",
        timestamp=doc["started"],
    )
    props = ET.SubElement(suite_el, "properties")
    for key in ("backend", "backend_version", "commit", "seed", "mode", "reference"):
        ET.SubElement(props, "property", name=key, value=str(doc[key]))
    ET.SubElement(props, "property", name="device", value=str(doc["device"]["name"]))
    for r in run.results:
        tc = ET.SubElement(suite_el, "testcase", classname=f"hal.conformance.{s.backend}.{r.op}", name=r.id, time=f"{r.duration_s:.4f}")
        detail = (r.reason or "") + (f"\n\n{r.repro}" if r.repro else "")
        message = (r.reason or r.status)[:500]
        if r.status == "fail" or (r.status == "xpass" and s.strict_xpass):
            ET.SubElement(tc, "failure", message=message, type=r.status).text = detail
        elif r.status == "error":
            ET.SubElement(tc, "error", message=message, type="error").text = detail
        elif r.status in ("skip", "xfail"):
            ET.SubElement(tc, "skipped", message=f"{r.status}: {message}")
        elif r.status == "xpass":
            ET.SubElement(tc, "system-out").text = f"xpass: {r.reason}"
    root = ET.Element("testsuites", name="hal-conformance", tests=str(len(run.results)), failures=str(failures), errors=str(sm["error"]), skipped=str(skipped), time=f"{run.duration_s:.3f}")
    root.append(suite_el)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write(run: Run, directory: Path) -> dict[str, Path]:
    """Write report.json, report.md and junit.xml into ``directory`` (created); returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    doc = to_json(run)
    paths = {"json": directory / "report.json", "md": directory / "report.md", "junit": directory / "junit.xml"}
    paths["json"].write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    paths["md"].write_text(to_markdown(run, doc))
    paths["junit"].write_text(to_junit(run, doc))
    return paths
