"""The whole-model table: targets of issues 11 and 28 judged per model, and the Markdown rendering of
a ``hal bench --models`` document (the JSON is the document itself: ``report.to_json``).

Issue 11 compares ``hal`` with the faster of eager and torch.compile; issue 28 compares the best hal
step (the fastest of hal, hal+compile, hal+graph, hal+compile+graph) with the best peer (the fastest
of every other variant: eager, the torch.compile modes, the graphed peers, Liger-Kernel, a
workload's own), and for the decoders the best hal step's peak memory with eager's; issue 40 sets
the same two targets on its rows at the sizes people train (:mod:`hal_bench.models_big`). All are
GPU targets; on the CPU the comparison is shown, not judged. The sections after the main table add
each row's model flops and MFU and, with ``--max-batch``, the largest batch."""

from __future__ import annotations

from typing import Any, Optional

from .models_paired import paired_ratio
from .report import _us, _x

#: model -> the speed-up hal must reach over the faster of eager and torch.compile (on a GPU)
SPEED_GOALS = {"resnet50_train": 1.3, "llama_train": 1.2, "resnet50_infer_fp16": 1.2, "resnet50_infer_bf16": 1.2, "moe_fwd_bwd": 1.3}
#: model -> hal's peak memory as a fraction of eager's, at most (on a GPU)
MEMORY_GOALS = {"llama_train": 0.8}
#: hal's host time per step as a multiple of eager's, at most (on a GPU)
HOST_GOAL = 1.2
#: issue 28: model -> the speed-up the best hal step must reach over the best peer (on a GPU)
BEST_SPEED_GOALS = {"resnet50_train": 1.2, "llama_train": 1.2, "hf_llama_train": 1.2, "moe_fwd_bwd": 1.3,
                    "resnet50_infer_fp16": 1.2, "resnet50_infer_bf16": 1.2, "llama_prefill": 1.2}
#: issue 40's rows at the sizes people train: 1.2x on the Llama-1B and 8B-layer rows, 1.0x on every row
BEST_SPEED_GOALS.update({"hf_llama1b_train": 1.2, "hf_llama1b_t4096_train": 1.2, "hf_llama8b_layers_train": 1.2, "hf_mixtral_train": 1.0})
#: issue 28: model -> the best hal step's peak memory as a fraction of eager's, at most (on a GPU); issue 40: 0.6 on its LLM rows
BEST_MEMORY_GOALS = {"llama_train": 0.6, "hf_llama_train": 0.6, "hf_llama1b_train": 0.6, "hf_llama1b_t4096_train": 0.6,
                     "hf_llama8b_layers_train": 0.6, "hf_mixtral_train": 0.6}
#: issue 40's FP8 targets: model -> (the fastest FP8 hal step over the best bf16 peer, over the fastest FP8 peer: torchao float8)
FP8_GOALS = {"hf_llama8b_layers_train": (1.3, 1.1)}
FP8_VS_BF16_TARGET = "FP8 hal vs the best bf16 peer (issue 40)"
FP8_VS_FP8_TARGET = "FP8 hal vs the best FP8 peer, torchao float8 (issue 40)"
BEST_SPEED_TARGET = "best hal vs best peer (issue 28)"
BEST_MEMORY_TARGET = "best hal's peak memory / eager's (issue 28)"

COLUMNS = ("eager", "compile", "compile max-autotune", "hal", "hal+compile", "liger", "liger+compile", "eager+graph", "compile reduce-overhead",
           "compile+graph", "hal+graph", "hal+compile+graph")
#: the peers of the speed goals: eager PyTorch and torch.compile without CUDA graphs (the issue's)
UNGRAPHED_PEERS = ("eager", "compile", "compile max-autotune")


def _target(name: str, goal: float, value: Optional[float], at_most: bool = False, side_by_side: bool = False) -> dict[str, Any]:
    met = None if value is None else (value <= goal if at_most else value >= goal)
    return {"target": name, "goal": goal, "at_most": at_most, "value": value, "met": met, "side_by_side": side_by_side}


def _pair_target(row: dict[str, Any], name: str, goal: float, peer: Optional[str], hal: Optional[str], in_turn: Optional[float]) -> dict[str, Any]:
    """A ratio target judged on the pair's side-by-side ratio where it was timed so
    (:mod:`hal_bench.models_paired`), else on the sweep's ratio ``in_turn``."""
    paired = paired_ratio(row, peer, hal)
    return _target(name, goal, in_turn if paired is None else paired, side_by_side=paired is not None)


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
    for name in ("hal+graph", "hal+compile+graph"):
        if name in v:
            out.append(_target(f"{name} vs the fastest graphed peer (eager+graph, compile reduce-overhead, compile+graph)", 1.0,
                               v[name].get("ratio_vs_graphed")))
    if gpu and row["model"] in MEMORY_GOALS:
        out.append(_target("hal peak memory / eager's", MEMORY_GOALS[row["model"]],
                           _div(v.get("hal", {}).get("peak_bytes"), v.get("eager", {}).get("peak_bytes")), at_most=True))
    if gpu:
        out.append(_target("hal host time per step / eager's", HOST_GOAL, _div(v.get("hal", {}).get("host_us"), v.get("eager", {}).get("host_us")), at_most=True))
    best = row.get("best") or {}
    if gpu and row["model"] in BEST_SPEED_GOALS:
        out.append(_pair_target(row, BEST_SPEED_TARGET, BEST_SPEED_GOALS[row["model"]], _name(best.get("peer")), _name(best.get("hal")),
                                best.get("ratio")))
    if gpu and row["model"] in BEST_MEMORY_GOALS:
        out.append(_target(BEST_MEMORY_TARGET, BEST_MEMORY_GOALS[row["model"]], best.get("peak_vs_eager"), at_most=True))
    if gpu and row["model"] in FP8_GOALS and best.get("fp8"):
        versus_bf16, versus_fp8 = FP8_GOALS[row["model"]]
        out.append(_target(FP8_VS_BF16_TARGET, versus_bf16, best["fp8"].get("vs_bf16_peer")))
        out.append(_target(FP8_VS_FP8_TARGET, versus_fp8, best["fp8"].get("vs_fp8_peer")))
    out.append(_target("hal vs eager", 1.0, v.get("eager", {}).get("ratio")))
    out.append(_pair_target(row, "hal+compile vs torch.compile", 1.0, "compile", "hal+compile", v.get("hal+compile", {}).get("ratio_vs_compile")))
    return out


def _name(brief: Optional[dict[str, Any]]) -> Optional[str]:
    return brief["variant"] if brief else None


def _bytes(n: Optional[int], cpu: bool = False) -> str:
    if n is None:
        return "n/a (CPU)" if cpu else "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


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
    if rec["variant"] in ("hal+graph", "hal+compile+graph"):  # its peers are the graphed steps: the fastest one's time / its time
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
        f"Liger-Kernel {doc.get('liger') or 'not installed'}, torchao {doc.get('torchao') or 'not installed'}",
        f"- sizes `{doc.get('size')}`, seed {doc.get('seed')}, torch.compile {'on' if comp.get('enabled') else 'off'}"
        + (", max-autotune-no-cudagraphs for inference" if comp.get("enabled") and comp.get("max_autotune") else ""),
        "",
        "Step time: median over batches of back-to-back steps (CUDA events on a GPU, the host clock on the CPU), after the "
        f"{doc.get('steps')} steps of the loss trajectory (compilation and autotuning happen there). Ratios are peer time / hal time: above "
        "1× hal is faster (hal+compile: torch.compile time / hal+compile time; hal+graph and hal+compile+graph: the fastest of "
        "eager+graph, compile reduce-overhead and compile+graph / theirs). The +graph variants capture the whole step (the optimizer "
        "step included) once as a CUDA graph (`hal.graphs.graphed`) and replay it; compile+graph and hal+compile+graph do so over the "
        "model compiled by torch.compile in its default mode; compile reduce-overhead is torch.compile's CUDA-graph mode over the "
        "model (the optimizer step stays eager). Peak memory: `torch.cuda.max_memory_allocated` during the variant's steps less what "
        "was allocated before it was built (n/a on the CPU). Host time: host clock from the call of a step to its return on an idle device (synchronised "
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
    lines += best_lines(doc)
    lines += fp8_lines(doc)
    lines += paired_lines(doc)
    lines += flops_lines(doc)
    lines += max_batch_lines(doc)
    cpu = dev.get("type") == "cpu"
    lines += ["", "## Every variant", "",
              "| model | variant | step | throughput | model TFLOP/s (MFU) | peak memory | peak / eager's | host time / step | syncs / step | first step | check |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in doc.get("models", []):
        eager_peak = next((r.get("peak_bytes") for r in row["variants"] if r["variant"] == "eager"), None)
        for r in row["variants"]:
            if "step_us" not in r:
                lines.append(f"| {row['model']} | {r['variant']} | {_cell(r)} | | | | | | | | |")
                continue
            host = _us(r.get("host_us")) + (" (≥ 90% of the step: host-bound, or waiting on a full launch queue)" if _host_bound(r) else "")
            lines.append(
                f"| {row['model']} | {r['variant']} | {_us(r['step_us'])} | {r['throughput']:,.0f} {row['unit']}/s | {_tflops(r)} | "
                f"{_bytes(r.get('peak_bytes'), cpu)} | {_x(_div(r.get('peak_bytes'), eager_peak))} | {host} | {'-' if r.get('syncs') is None else r['syncs']} | "
                f"{r['first_step_s']:.1f} s | {_check(r, row['kind'])} |")
    graphs = [(row["model"], r) for row in doc.get("models", []) for r in row["variants"] if r.get("graph")]
    if graphs:
        lines += ["", "## CUDA graphs (hal.graphs: what each +graph variant captured)", ""]
        lines += [f"- {model} {r['variant']}: " + "; ".join(s.strip() for s in r["graph"].splitlines()[1:]) for model, r in graphs]
    lines += ["", "## Targets (issues 11 and 28)", "", "| model | target | goal | measured | |", "| --- | --- | --- | --- | --- |"]
    for row in doc.get("models", []):
        for t in row.get("targets", []):
            goal = f"{'≤' if t['at_most'] else '≥'} {t['goal']:.2f}{'' if 'memory' in t['target'] else '×'}"
            verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
            measured = _x(t["value"]) + (" (side by side)" if t.get("side_by_side") else "")
            lines.append(f"| {row['model']} | {t['target']} | {goal} | {measured} | {verdict} |")
    return "\n".join(lines) + "\n"


def best_lines(doc: dict[str, Any]) -> list[str]:
    """The section of issue 28: per model the best peer, the best hal step, their ratio, the best hal
    step's peak memory over eager's, each against its goal (judged on a GPU only)."""
    gpu = doc.get("device", {}).get("type") not in (None, "cpu")
    lines = ["", "## Best hal vs best peer (issue 28)", "",
             "Best peer: the fastest variant that is not a hal step (eager, torch.compile in any mode, the graphed peers, Liger-Kernel, "
             "a workload's own); best hal: the fastest of hal, hal+compile, hal+graph and hal+compile+graph. Ratio: best peer time / "
             "best hal time, side by side where the pair was timed so (next section), in turn (the sweep) otherwise. Peak memory: a +graph variant's covers the whole variant (its graph's memory is taken at the capture), the "
             "others' their timed steps. The goals are GPU targets" + ("." if gpu else ": not judged on this CPU run."),
             "", "| model | best peer | best hal | best peer / best hal | goal | best hal's peak / eager's | goal | |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in doc.get("models", []):
        best = row.get("best") or {}
        named = lambda b: "-" if not b else f"{b['variant']} {_us(b['step_us'])}"  # noqa: E731
        targets = {t["target"]: t for t in row.get("targets", [])}
        speed, memory = BEST_SPEED_GOALS.get(row["model"]), BEST_MEMORY_GOALS.get(row["model"])
        verdicts = [t["met"] for n in (BEST_SPEED_TARGET, BEST_MEMORY_TARGET) if (t := targets.get(n))]
        verdict = ("not judged (CPU)" if not gpu else "n/a" if not verdicts or None in verdicts
                   else "met" if all(verdicts) else "**missed**")
        paired = paired_ratio(row, _name(best.get("peer")), _name(best.get("hal")))
        ratio = _x(best.get("ratio")) if paired is None else f"{_x(paired)} side by side ({_x(best.get('ratio'))} in turn)"
        lines.append(f"| {row['model']} | {named(best.get('peer'))} | {named(best.get('hal'))} | {ratio} | "
                     f"{'-' if speed is None else f'≥ {speed:.2f}×'} | {_x(best.get('peak_vs_eager'))} | "
                     f"{'-' if memory is None else f'≤ {memory:.2f}×'} | {verdict} |")
    return lines


def fp8_lines(doc: dict[str, Any]) -> list[str]:
    """Issue 40's FP8 comparison, for the rows that have FP8 variants: the fastest FP8 hal step
    against the best bf16 peer (the previous section's) and the fastest FP8 peer (torchao float8)."""
    rows = [row for row in doc.get("models", []) if (row.get("best") or {}).get("fp8")]
    if not rows:
        return []
    lines = ["", "## FP8 (issue 40)", "",
             "FP8 hal: the fastest of hal's FP8 steps (hal.optimize with fp8=hal.fp8.CurrentScaling()); FP8 peer: the fastest of "
             "torchao.float8's recipes (compiled, tensorwise also captured whole). Ratios: the peer's time / FP8 hal's.",
             "", "| model | FP8 hal | best bf16 peer / FP8 hal | goal | FP8 peer | FP8 peer / FP8 hal | goal |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        fp8, goals = row["best"]["fp8"], FP8_GOALS.get(row["model"])
        named = lambda b: "-" if not b else f"{b['variant']} {_us(b['step_us'])}"  # noqa: E731
        goal = lambda i: "-" if goals is None else f"≥ {goals[i]:.2f}×"  # noqa: E731
        lines.append(f"| {row['model']} | {named(fp8.get('hal'))} | {_x(fp8.get('vs_bf16_peer'))} | {goal(0)} | "
                     f"{named(fp8.get('peer'))} | {_x(fp8.get('vs_fp8_peer'))} | {goal(1)} |")
    return lines


def paired_lines(doc: dict[str, Any]) -> list[str]:
    """The judged pairs of each row timed side by side (:mod:`hal_bench.models_paired`), next to the
    ratio the sweep measured in turn."""
    rows = [row for row in doc.get("models", []) if row.get("paired")]
    if not rows:
        return []
    lines = ["", "## Side by side", "",
             "The judged pairs, (compile, hal+compile) and (best peer, best hal), built again after the sweep, all alive at once, and "
             "timed in alternating rounds (the order rotating); step: the median over the rounds; ratio: the median of the rounds' "
             "ratios (peer / hal), with their range. In turn: the same ratio from the sweep, where each variant ran after the previous "
             "one was freed.", "",
             "| model | peer | hal | peer step | hal step | peer / hal | range over rounds | in turn |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        paired = row["paired"]
        if "error" in paired:
            lines.append(f"| {row['model']} | | | | | error ({paired['error']}) | | |")
            continue
        swept = {r["variant"]: r.get("step_us") for r in row["variants"]}
        for p in paired["pairs"]:
            lo, hi = p["ratio_range"]
            lines.append(f"| {row['model']} | {p['peer']} | {p['hal']} | {_us(p['peer_us'])} | {_us(p['hal_us'])} | {_x(p['ratio'])} | "
                         f"{_x(lo)}-{_x(hi)} over {paired['rounds']} | {_x(_div(swept.get(p['peer']), swept.get(p['hal'])))} |")
    return lines


def _tflops(rec: dict[str, Any]) -> str:
    """A variant's model TFLOP/s and its MFU ("-" where the row counts no flops)."""
    if rec.get("tflops") is None:
        return "-"
    return f"{rec['tflops']:.1f}" + (f" ({100 * rec['mfu']:.1f}%)" if rec.get("mfu") is not None else "")


def flops_lines(doc: dict[str, Any]) -> list[str]:
    """What each row counts as its training flops (:mod:`hal_bench.flops`) and the peak MFU is taken against."""
    rows = [row for row in doc.get("models", []) if row.get("flops")]
    if not rows:
        return []
    peak = doc.get("peak_tflops")
    lines = ["", "## Model flops and MFU", "",
             "Model TFLOP/s: the row's training flops per step over the step time; MFU: that over the device's peak, "
             + (f"{peak:g} TFLOP/s (dense bfloat16; `--peak-tflops` to change it)." if peak else
                "not computed: no peak known for this device (`--peak-tflops` gives one)."),
             "", "| model | flops per step | weight products | attention (causal) | counted as |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        f = row["flops"]
        lines.append(f"| {row['model']} | {f['per_step'] / 1e12:.3f} T | {f['matmul'] / 1e12:.3f} T | {f['attention'] / 1e12:.3f} T | {f['counted']} |")
    return lines


def max_batch_lines(doc: dict[str, Any]) -> list[str]:
    """The largest batch each searched variant fits (``--max-batch``), with the tries that found it."""
    rows = [row for row in doc.get("models", []) if row.get("max_batch")]
    if not rows:
        return []
    lines = ["", "## Largest batch", "",
             "Batch 1, 2, 4, ... until a try of a few whole steps runs out of device memory, then bisection (each try built afresh, "
             "everything freed between tries).", "",
             "| model | variant | largest batch | smallest out of memory | tries (batch: fitted) |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        for name, found in row["max_batch"].items():
            if "largest" not in found:
                lines.append(f"| {row['model']} | {name} | n/a ({found.get('skipped') or found.get('error')}) | | |")
                continue
            oom = found["smallest_oom"]
            tries = ", ".join(f"{b}: {'yes' if ok else 'no'}" for b, ok in found["tries"])
            lines.append(f"| {row['model']} | {name} | {found['largest']} | {'none up to the limit' if oom is None else oom} | {tries} |")
    return lines


def _host_bound(rec: dict[str, Any]) -> bool:
    """The host time reached 90% of the step time: the host is the bottleneck, or it waited for the
    device on a full launch queue (the two look alike from the host clock)."""
    return rec.get("host_us") is not None and rec["host_us"] >= 0.9 * rec["step_us"]
