"""The whole-model table: targets of issue 11 judged per model, and the Markdown rendering of a
``hal bench --models`` document (the JSON is the document itself: ``report.to_json``)."""

from __future__ import annotations

from typing import Any, Optional

from .report import _us, _x

#: model -> the speed-up hal must reach over the faster of eager and torch.compile (on a GPU)
SPEED_GOALS = {"resnet50_train": 1.3, "llama_train": 1.2, "resnet50_infer_fp16": 1.2, "resnet50_infer_bf16": 1.2, "moe_fwd_bwd": 1.3}
#: model -> hal's peak memory as a fraction of eager's, at most (on a GPU)
MEMORY_GOALS = {"llama_train": 0.8}
#: hal's host time per step as a multiple of eager's, at most (on a GPU)
HOST_GOAL = 1.2

COLUMNS = ("eager", "compile", "compile max-autotune", "hal", "hal+compile", "liger", "eager+graph", "compile reduce-overhead", "hal+graph")
#: the peers of the speed goals: eager PyTorch and torch.compile without CUDA graphs (the issue's)
UNGRAPHED_PEERS = ("eager", "compile", "compile max-autotune")


def _target(name: str, goal: float, value: Optional[float], at_most: bool = False) -> dict[str, Any]:
    met = None if value is None else (value <= goal if at_most else value >= goal)
    return {"target": name, "goal": goal, "at_most": at_most, "value": value, "met": met}


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def judge(row: dict[str, Any], gpu: bool) -> list[dict[str, Any]]:
    """The issue's targets for one model row: on a GPU the speed-up over the fastest of eager and
    torch.compile (either mode measured), peak memory and host time against eager's; everywhere hal
    against eager and hal under torch.compile against torch.compile."""
    v = {r["variant"]: r for r in row["variants"]}
    hal_us = v.get("hal", {}).get("step_us")
    out = []
    if gpu and row["model"] in SPEED_GOALS:
        peers = [v[n]["step_us"] for n in UNGRAPHED_PEERS if v.get(n, {}).get("step_us")]
        fastest = min(peers) if peers else None
        out.append(_target("hal vs the fastest of eager and torch.compile", SPEED_GOALS[row["model"]], _div(fastest, hal_us)))
        if "hal+graph" in v:
            out.append(_target("hal+graph vs the fastest of eager and torch.compile", SPEED_GOALS[row["model"]],
                               _div(fastest, v["hal+graph"].get("step_us"))))
    if "hal+graph" in v:
        out.append(_target("hal+graph vs the fastest graphed peer (eager+graph, compile reduce-overhead)", 1.0,
                           v["hal+graph"].get("ratio_vs_graphed")))
    if gpu and row["model"] in MEMORY_GOALS:
        out.append(_target("hal peak memory / eager's", MEMORY_GOALS[row["model"]],
                           _div(v.get("hal", {}).get("peak_bytes"), v.get("eager", {}).get("peak_bytes")), at_most=True))
    if gpu:
        out.append(_target("hal host time per step / eager's", HOST_GOAL, _div(v.get("hal", {}).get("host_us"), v.get("eager", {}).get("host_us")), at_most=True))
    out.append(_target("hal vs eager", 1.0, v.get("eager", {}).get("ratio")))
    out.append(_target("hal+compile vs torch.compile", 1.0, v.get("hal+compile", {}).get("ratio_vs_compile")))
    return out


def _bytes(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _cell(rec: Optional[dict[str, Any]]) -> str:
    """One summary cell: time and ratio to hal (peer time / hal time; for hal+compile, torch.compile's
    time / its time), or why there is none."""
    if rec is None:
        return "-"
    if "skipped" in rec:
        return f"n/a ({rec['skipped']})"
    if "error" in rec:
        return f"error ({rec['error']})"
    text = _us(rec["step_us"])
    if rec["variant"] == "hal":
        return f"**{text}**"
    if rec["variant"] == "hal+compile":  # its peer is torch.compile: compile time / hal+compile time
        return text + (f" ({_x(rec['ratio_vs_compile'])} vs compile)" if rec.get("ratio_vs_compile") is not None else "")
    if rec["variant"] == "hal+graph":  # its peers are the other graphed steps: the fastest one's time / its time
        return text + (f" ({_x(rec['ratio_vs_graphed'])} vs the fastest graphed peer)" if rec.get("ratio_vs_graphed") is not None else "")
    return text + (f" ({_x(rec['ratio'])})" if rec.get("ratio") is not None else "")


def _check(rec: dict[str, Any], kind: str) -> str:
    if kind == "infer":
        return "-" if rec.get("rel_err") is None else f"rel err {rec['rel_err']:.2e}"
    return "-" if rec.get("loss") is None else f"{rec['loss_first']:.4f} → {rec['loss']:.4f}"


def to_markdown(doc: dict[str, Any]) -> str:
    dev = doc.get("device", {})
    comp = doc.get("compile", {})
    lines = [
        f"# hal bench --models: {dev.get('name', dev.get('type'))}",
        "",
        f"- date {doc.get('date')}, commit `{doc.get('commit')}`" + (" (working tree dirty)" if doc.get("dirty") else ""),
        f"- hal {doc.get('hal_version')}, torch {doc.get('torch')}, triton {doc.get('triton')}, python {doc.get('python')}, "
        f"Liger-Kernel {doc.get('liger') or 'not installed'}",
        f"- sizes `{doc.get('size')}`, seed {doc.get('seed')}, torch.compile {'on' if comp.get('enabled') else 'off'}"
        + (", max-autotune-no-cudagraphs for inference" if comp.get("enabled") and comp.get("max_autotune") else ""),
        "",
        "Step time: median over batches of back-to-back steps (CUDA events on a GPU, the host clock on the CPU), after the "
        f"{doc.get('steps')} steps of the loss trajectory (compilation and autotuning happen there). Ratios are peer time / hal time: above "
        "1× hal is faster (hal+compile: torch.compile time / hal+compile time; hal+graph: the faster of eager+graph and compile "
        "reduce-overhead / hal+graph). The +graph variants capture the whole step once as a CUDA graph (`hal.graphs.graphed`) and "
        "replay it; compile reduce-overhead is torch.compile's CUDA-graph mode over the model (the optimizer step stays eager). Host time: host clock from the call of a step to its return on an idle device (synchronised "
        f"before and after, outside the clock); on the CPU the step time is all host time. Check: loss at step 1 → step {doc.get('steps')} "
        "from the same seed and data; for inference, the relative error of the output against the eager model in float32.",
        "",
        "| model | " + " | ".join(COLUMNS) + " | other peers |",
        "| --- |" + " --- |" * (len(COLUMNS) + 1),
    ]
    for row in doc.get("models", []):
        v = {r["variant"]: r for r in row["variants"]}
        others = "; ".join(f"{n}: {_cell(r)}" for n, r in v.items() if n not in COLUMNS) or "-"
        lines.append(f"| {row['describe']} | " + " | ".join(_cell(v.get(c)) for c in COLUMNS) + f" | {others} |")
    lines += ["", "## Every variant", "",
              "| model | variant | step | throughput | peak memory | host time / step | syncs / step | first step | check |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in doc.get("models", []):
        for r in row["variants"]:
            if "step_us" not in r:
                lines.append(f"| {row['model']} | {r['variant']} | {_cell(r)} | | | | | | |")
                continue
            host = _us(r.get("host_us")) + (" (≥ 90% of the step: host-bound, or waiting on a full launch queue)" if _host_bound(r) else "")
            lines.append(
                f"| {row['model']} | {r['variant']} | {_us(r['step_us'])} | {r['throughput']:,.0f} {row['unit']}/s | "
                f"{_bytes(r.get('peak_bytes'))} | {host} | {'-' if r.get('syncs') is None else r['syncs']} | "
                f"{r['first_step_s']:.1f} s | {_check(r, row['kind'])} |")
    graphs = [(row["model"], r) for row in doc.get("models", []) for r in row["variants"] if r.get("graph")]
    if graphs:
        lines += ["", "## CUDA graphs (hal.graphs: what each +graph variant captured)", ""]
        lines += [f"- {model} {r['variant']}: " + "; ".join(s.strip() for s in r["graph"].splitlines()[1:]) for model, r in graphs]
    lines += ["", "## Targets (issue 11)", "", "| model | target | goal | measured | |", "| --- | --- | --- | --- | --- |"]
    for row in doc.get("models", []):
        for t in row.get("targets", []):
            goal = f"{'≤' if t['at_most'] else '≥'} {t['goal']:.2f}{'' if 'memory' in t['target'] else '×'}"
            verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
            lines.append(f"| {row['model']} | {t['target']} | {goal} | {_x(t['value'])} | {verdict} |")
    return "\n".join(lines) + "\n"


def _host_bound(rec: dict[str, Any]) -> bool:
    """The host time reached 90% of the step time: the host is the bottleneck, or it waited for the
    device on a full launch queue (the two look alike from the host clock)."""
    return rec.get("host_us") is not None and rec["host_us"] >= 0.9 * rec["step_us"]
