"""FP8 on the H200 (issue 31's targets), every ratio measured in one process with CUDA events,
several repeats interleaved across the variants compared, medians with [min, max] spreads:

(a) scaled GEMM at 8192^3: ``hal.ops.fp8_scaled_mm`` (tensor, row and 128 x 128 block scales) against
    the bfloat16 ``torch.mm`` (target >= 1.7x) and ``torch._scaled_mm`` called directly with the same
    scales (target >= 0.9x), with TFLOP/s and the kernel hal ran;
(b) quantisation (``hal.ops.fp8_quantize`` per tensor, row and block of a bfloat16 8192 x 8192, and
    ``fp8_quantize_transpose`` where it exists; delayed scaling's given-scale cast with its amax from
    a separate ``torch.amax`` or from the cast's own pass, ``fp8_quantize_amax`` and
    ``fp8_quantize_transpose_amax``) against a device copy moving the same bytes (the kernel's one
    read of x and write of the 8-bit values, scales ignored): fraction of the copy's bandwidth
    (target >= 0.85);
(c) a Llama-style training step (bench/models_llama.py's decoder with hal's ops, bfloat16 autocast,
    ``hal.optim.AdamW``) in FP8 (``hal.fp8.convert``, default recipe) against the same model's
    bfloat16 step: step-time ratio (target >= 1.25x) and peak memory (target: no higher), at the
    model table's size (8 layers, d 1024, T 1024, batch 4) and at a size where the GEMMs dominate
    (4 layers, d 4096, SwiGLU 11008, T 2048, batch 2). First each step captured whole as a CUDA graph
    (``hal.graphs.graphed``): eager FP8 adds launches per linear (amax, scale, cast, transposed cast)
    and this host cannot issue them as fast as the GPU runs them (2fba452: eager table step fp8 81 ms
    vs bf16 28 ms, host-bound), so the graphed step is the comparison that decides the 1.25x target;
    then eagerly; last torch.compile + graph at the table's size (``--no-compile`` skips it).

    python benchmarks/fp8.py [--json OUT] [--quick] [--no-compile]
                             [--only gemm,quant,step | step-graph,step-eager,step-compile]

Parts run in the order gemm, quant, step-graph, step-eager, step-compile; the JSON is rewritten
after each part, so a run cut short keeps what finished. About 100 s on an H200 (``--quick``: fewer
repeats, no large model).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from bench.models_llama import OPS, Decoder, LlamaConfig  # noqa: E402

Fn = Callable[[], Any]

STEP_SIZES = {
    "table": LlamaConfig(vocab=32000, dim=1024, layers=8, heads=16, ffn=2816, seq=1024, batch=4),
    "large": LlamaConfig(vocab=32000, dim=4096, layers=4, heads=32, ffn=11008, seq=2048, batch=2),
}


def interleaved(fns: dict[str, Fn], reps: int, inner: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds per call of each function: ``reps`` rounds, each timing ``inner`` calls of every
    function in turn with CUDA events (so drifts of clock and temperature hit all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / inner)
    return {name: {"ms": statistics.median(s), "min": min(s), "max": max(s)} for name, s in samples.items()}


def spread(t: dict[str, float]) -> str:
    return f"{t['ms']:.3f} ms [{t['min']:.3f}, {t['max']:.3f}]"


def ratio_text(num: dict[str, float], den: dict[str, float]) -> str:
    """num/den of medians, with the range from the extremes."""
    return f"{num['ms'] / den['ms']:.2f}x [{num['min'] / den['max']:.2f}, {num['max'] / den['min']:.2f}]"


def kernel_of(op: str, *args: Any) -> str:
    """The backend/kernel hal's dispatcher runs for this call."""
    try:
        d = hal.explain(op, *args)
        return f"{d.backend}/{d.kernel}"
    except Exception as exc:  # noqa: BLE001 - a report line, not a failure
        return f"? ({type(exc).__name__})"


# ---- (a) scaled GEMM ---------------------------------------------------------------------------

def gemm(size: int, reps: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(size, size, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(size, size, device=dev, generator=g, dtype=torch.bfloat16) / 16
    flops = 2.0 * size**3
    fns: dict[str, Fn] = {"bf16 torch.mm": lambda: torch.mm(x, w.t())}
    kernels: dict[str, str] = {}
    e4m3 = torch.float8_e4m3fn
    for gran in ("tensor", "row", "block"):
        qa, sa = hal.ops.fp8_quantize(x, "e4m3fn", gran)
        qb, sb = hal.ops.fp8_quantize(w, "e4m3fn", gran)
        args = (qa, qb, sa, sb, None, "e4m3fn", "e4m3fn", "bfloat16", 128)
        fns[f"hal fp8 {gran}"] = lambda args=args: hal.ops.fp8_scaled_mm(*args)
        kernels[f"hal fp8 {gran}"] = kernel_of("fp8_scaled_mm", *args)
        if gran == "tensor":
            fns["torch._scaled_mm tensor"] = lambda qa=qa, qb=qb, sa=sa, sb=sb: torch._scaled_mm(
                qa.view(e4m3), qb.view(e4m3).t(), sa, sb, out_dtype=torch.bfloat16)
        elif gran == "row":
            fns["torch._scaled_mm row"] = lambda qa=qa, qb=qb, sa=sa, sb=sb: torch._scaled_mm(
                qa.view(e4m3), qb.view(e4m3).t(), sa, sb.reshape(1, -1), out_dtype=torch.bfloat16)
        else:
            sa1 = sa.repeat_interleave(128, 0)[:size].t().contiguous().t()  # 1 x 128 (outer-dim-major), 128 x 128
            fns["torch._scaled_mm block"] = lambda qa=qa, qb=qb, sa1=sa1, sb=sb: torch._scaled_mm(
                qa.view(e4m3), qb.view(e4m3).t(), sa1, sb.t(), out_dtype=torch.bfloat16)
    usable = {}
    for name, fn in fns.items():  # a build that lacks a variant says so and the rest is measured
        try:
            fn()
            torch.cuda.synchronize()
            usable[name] = fn
        except Exception as exc:  # noqa: BLE001
            kernels[name] = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    times = interleaved(usable, reps, inner=10)
    for name, t in times.items():
        t["tflops"] = flops / (t["ms"] * 1e-3) / 1e12
    out: dict[str, Any] = {"size": size, "times": times, "kernels": kernels, "ratios": {}}
    bf16 = times.get("bf16 torch.mm")
    print(f"(a) scaled GEMM {size}^3, bfloat16 result")
    for name, t in times.items():
        print(f"    {name:24s} {spread(t)}  {t['tflops']:.0f} TFLOP/s  {kernels.get(name, '')}")
    for gran in ("tensor", "row", "block"):
        h = times.get(f"hal fp8 {gran}")
        ts = times.get(f"torch._scaled_mm {gran}")
        if h and bf16:
            r = bf16["ms"] / h["ms"]
            out["ratios"][f"{gran} vs bf16"] = r
            print(f"    hal fp8 {gran} vs bf16 mm: {ratio_text(bf16, h)} (target >= 1.7: {'met' if r >= 1.7 else 'missed'})")
        if h and ts:
            r = ts["ms"] / h["ms"]
            out["ratios"][f"{gran} vs _scaled_mm"] = r
            print(f"    hal fp8 {gran} vs torch._scaled_mm: {ratio_text(ts, h)} (target >= 0.9: {'met' if r >= 0.9 else 'missed'})")
    for name in [n for n in kernels if n not in times]:
        print(f"    {name}: {kernels[name]}")
    return out


# ---- (b) quantisation --------------------------------------------------------------------------

def quant(size: int, reps: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    n = x.numel()
    cases: dict[str, tuple[Fn, int]] = {}
    for gran in ("tensor", "row", "block"):
        cases[f"fp8_quantize {gran}"] = (lambda gran=gran: hal.ops.fp8_quantize(x, "e4m3fn", gran), 2 * n + n)
    qt = getattr(hal.ops, "fp8_quantize_transpose", None)
    if qt is not None:
        for gran in ("tensor", "row", "block"):
            cases[f"fp8_quantize_transpose {gran}"] = (lambda gran=gran: qt(x, "e4m3fn", gran, None, 128), 2 * n + 2 * n)
    # delayed scaling: the given-scale cast, the amax from a second read (the recipe before) or
    # reduced in the cast's own pass (fp8_quantize_amax); the bytes are one read either way
    scale = torch.tensor(0.01, device=dev)
    cases["delayed: given scale + torch.amax"] = (lambda: (hal.ops.fp8_quantize(x, "e4m3fn", "tensor", scale),
                                                          torch.amax(x.abs()).float()), 2 * n + n)
    cases["delayed transposed: given scale + torch.amax"] = (lambda: (hal.ops.fp8_quantize_transpose(x, "e4m3fn", "tensor", scale),
                                                                     torch.amax(x.abs()).float()), 2 * n + 2 * n)
    qa, qta = getattr(hal.ops, "fp8_quantize_amax", None), getattr(hal.ops, "fp8_quantize_transpose_amax", None)
    if qa is not None and qta is not None:
        cases["delayed: fp8_quantize_amax"] = (lambda: qa(x, scale, "e4m3fn"), 2 * n + n)
        cases["delayed transposed: fp8_quantize_transpose_amax"] = (lambda: qta(x, scale, "e4m3fn"), 2 * n + 2 * n)
    out: dict[str, Any] = {"size": size, "results": {}}
    print(f"(b) quantisation of a bfloat16 {size} x {size} to e4m3fn, against a copy of the same bytes")
    for name, (fn, traffic) in cases.items():
        src = torch.empty(traffic // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        try:
            t = interleaved({"kernel": fn, "copy": lambda src=src, dst=dst: dst.copy_(src)}, reps, inner=10)
        except Exception as exc:  # noqa: BLE001
            print(f"    {name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            continue
        k, c = t["kernel"], t["copy"]
        frac = c["ms"] / k["ms"]
        gbs = traffic / (k["ms"] * 1e-3) / 1e9
        out["results"][name] = {"kernel": k, "copy": c, "bytes": traffic, "GB/s": gbs, "fraction_of_copy": frac}
        print(f"    {name:50s} {spread(k)} {gbs:6.0f} GB/s; copy {spread(c)}; {frac:.2f} of copy "
              f"(target >= 0.85: {'met' if frac >= 0.85 else 'missed'})")
        del src, dst
    return out


# ---- (c) training step -------------------------------------------------------------------------

class Trainer:
    """One model's training step (bfloat16 autocast, hal.optim.AdamW), FP8 when converted; the
    model compiled (torch.compile) and the whole step captured as a CUDA graph on request."""

    def __init__(self, cfg: LlamaConfig, fp8: bool, compile_model: bool, graph: bool = False, seed: int = 0,
                 device: torch.device = torch.device("cuda")) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.model = Decoder(cfg, OPS["hal"]()).to(device)
        if fp8:
            hal.fp8.convert(self.model)
        self.opt = hal.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.forward = torch.compile(self.model, fullgraph=True) if compile_model else self.model
        g = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
        self.inputs, self.targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        # graphed: 2 eager warm-up calls, the 3rd captures, later calls replay (hal.graphs)
        self.run = hal.graphs.graphed(self.train_step) if graph else self.train_step

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward, optimizer step; gradients dropped after (set_to_none)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.forward(inputs, targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def step(self) -> torch.Tensor:
        return self.run(self.inputs, self.targets)


def built_with_peak(cfg: LlamaConfig, fp8: bool, compile_model: bool, graph: bool) -> tuple[Trainer, float]:
    """A trainer, warmed up (graphed: captured), and the peak GiB it allocated: its parameters,
    optimizer state and the step's activations (a graph's private pool included; whatever was
    allocated before it, another idle trainer, is left out)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = Trainer(cfg, fp8, compile_model, graph)
    for _ in range(3):
        t.step()
    torch.cuda.synchronize()
    if graph and t.run.captured() == 0:
        raise RuntimeError(f"the step was not captured: {t.run.explain()}")
    return t, (torch.cuda.max_memory_allocated() - base) / 2**30


#: the step variants, in the order they run: (part, label, compiled, graphed)
STEP_MODES = {"step-graph": ("graphed", False, True), "step-eager": ("eager", False, False),
              "step-compile": ("compiled + graphed", True, True)}


def training(name: str, cfg: LlamaConfig, mode: str, reps: int) -> dict[str, Any]:
    label, compile_model, graph = STEP_MODES[mode]
    started = time.perf_counter()
    trainers, mem = {}, {}
    try:
        for v in ("bf16", "fp8"):
            trainers[v], mem[v] = built_with_peak(cfg, v == "fp8", compile_model, graph)
        times = interleaved({v: t.step for v, t in trainers.items()}, reps, inner=2, warmup=1)
    finally:
        trainers.clear()
        if compile_model:
            torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    r = times["bf16"]["ms"] / times["fp8"]["ms"]
    tokens = cfg.batch * cfg.seq
    print(f"(c) training step, {name}, {label}: {cfg.layers} layers, d {cfg.dim}, SwiGLU {cfg.ffn}, T {cfg.seq}, batch {cfg.batch}")
    for v in ("bf16", "fp8"):
        print(f"    {v:5s} {spread(times[v])}  {tokens / times[v]['ms'] * 1e3:,.0f} tokens/s  peak {mem[v]:.2f} GiB")
    print(f"    fp8 vs bf16 step: {ratio_text(times['bf16'], times['fp8'])} (target >= 1.25: {'met' if r >= 1.25 else 'missed'}); "
          f"peak memory fp8/bf16 {mem['fp8'] / mem['bf16']:.3f} (target <= 1: {'met' if mem['fp8'] <= mem['bf16'] else 'missed'}); "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return {"mode": label, "config": dataclasses.asdict(cfg), "compiled": compile_model, "graphed": graph, "times": times,
            "peak_gib": mem, "speedup": r, "seconds": time.perf_counter() - started}


def step_plan(parts: set[str], quick: bool, no_compile: bool) -> list[tuple[str, str]]:
    """(size, mode) pairs to run, graphed first: the graphed comparison decides the target."""
    plan = []
    for mode in STEP_MODES:
        if mode not in parts and "step" not in parts:
            continue
        if mode == "step-compile":
            if not no_compile:
                plan.append(("table", mode))
            continue
        plan += [("table", mode)] + ([] if quick else [("large", mode)])
    return plan


def save(path: Optional[Path], result: dict[str, Any], started: float) -> None:
    """Write what has finished so far (after each part: a run cut short keeps it)."""
    result["seconds"] = time.perf_counter() - started
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="fewer repeats, no large model")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile + graph step")
    p.add_argument("--only", default="gemm,quant,step",
                   help="comma-separated parts: gemm, quant, step (all of step-graph, step-eager, step-compile)")
    args = p.parse_args(argv)
    parts = set(args.only.split(","))
    unknown = parts - {"gemm", "quant", "step", *STEP_MODES}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}: choose from gemm, quant, step, {', '.join(STEP_MODES)}")
    if not torch.cuda.is_available():
        print("benchmarks/fp8.py needs a CUDA device", file=sys.stderr)
        return 2
    reps = 4 if args.quick else 6
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "capability": list(torch.cuda.get_device_capability())}
    started = time.perf_counter()
    if "gemm" in parts:
        result["gemm"] = gemm(8192, reps)
        save(args.json, result, started)
    if "quant" in parts:
        result["quant"] = quant(8192, reps)
        save(args.json, result, started)
    result["step"] = []
    for name, mode in step_plan(parts, args.quick, args.no_compile):
        try:
            result["step"].append({"size": name, **training(name, STEP_SIZES[name], mode, reps)})
        except Exception as exc:  # noqa: BLE001 - one failing variant does not lose the others
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(f"(c) training step, {name}, {STEP_MODES[mode][0]}: failed: {msg}", flush=True)
            result["step"].append({"size": name, "mode": STEP_MODES[mode][0], "error": msg})
            gc.collect()
            torch.cuda.empty_cache()
        save(args.json, result, started)
    save(args.json, result, started)
    print(f"total {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
