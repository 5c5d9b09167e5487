"""cuDNN's graph API on ResNet-50's training convolutions: is a fused conv + batch-norm worth a kernel?

NVIDIA's MLPerf ResNet-50 runs each training convolution as one cuDNN graph: the previous batch
norm's scale, bias and ReLU applied in the convolution's prologue (the normalised activation is
never written), and the batch-norm statistics (per-channel sum and sum of squares) reduced in its
epilogue. This script times that graph (``nvidia-cudnn-frontend``'s Python API) against the same
work done the ways hal and PyTorch do it today, on the stride-1 convolutions of ResNet-50
(batch 64, 224 px, NHWC, bfloat16 or float16), one process, variants interleaved:

* ``eager``: ``relu(x * scale + bias)``, ``conv2d``, then the two per-channel sums (three passes);
* ``compile``: the same function under ``torch.compile`` (Inductor fuses the prologue and the sums
  around cuDNN's convolution);
* ``conv only``: cuDNN's convolution alone, the floor of the unfused ways;
* ``cudnn graph``: prologue + convolution + statistics in one graph.

Each row prints the median time of each (and its spread), the graph's speed-up over the best
other, the bytes the unfused ways move that the graph does not, and the graph's outputs checked
against eager's. The summary weighs each shape by how often ResNet-50 runs it.

    python benchmarks/cudnn_convbn.py [--dtype bfloat16|float16] [--json OUT.json]

Forward only: the MLPerf backward (dgrad with the ReLU and batch-norm gradients fused) is not
measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Callable

import torch

# (name, channels in, channels out, kernel, spatial size, how many of it ResNet-50 runs per forward)
SHAPES = [
    ("s1 1x1 64->64", 64, 64, 1, 56, 1),
    ("s1 3x3 64->64", 64, 64, 3, 56, 3),
    ("s1 1x1 64->256", 64, 256, 1, 56, 3),
    ("s1 1x1 256->64", 256, 64, 1, 56, 2),
    ("s2 3x3 128->128", 128, 128, 3, 28, 3),
    ("s2 1x1 128->512", 128, 512, 1, 28, 4),
    ("s2 1x1 512->128", 512, 128, 1, 28, 3),
    ("s3 3x3 256->256", 256, 256, 3, 14, 5),
    ("s3 1x1 256->1024", 256, 1024, 1, 14, 6),
    ("s3 1x1 1024->256", 1024, 256, 1, 14, 5),
    ("s4 3x3 512->512", 512, 512, 3, 7, 2),
    ("s4 1x1 512->2048", 512, 2048, 1, 7, 3),
    ("s4 1x1 2048->512", 2048, 512, 1, 7, 2),
]
BATCH = 64


def unfused(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, pad: int) -> tuple[torch.Tensor, ...]:
    a = torch.relu(x * scale + bias)
    y = torch.nn.functional.conv2d(a, w, padding=pad)
    yf = y.float()
    return y, yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))


def cudnn_graph(cudnn: Any, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, pad: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Build the prologue + conv + genstats graph for these tensors; return a function running it."""
    kinds = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float32: cudnn.data_type.FLOAT}
    io = kinds[x.dtype]
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    X = g.tensor(name="X", dim=list(x.size()), stride=list(x.stride()), data_type=io)
    W = g.tensor(name="W", dim=list(w.size()), stride=list(w.stride()), data_type=io)
    S = g.tensor(name="S", dim=list(scale.size()), stride=list(scale.stride()), data_type=io)
    B = g.tensor(name="B", dim=list(bias.size()), stride=list(bias.stride()), data_type=io)
    act = g.relu(name="relu", input=g.bias(name="bias", input=g.scale(name="scale", input=X, scale=S), bias=B))
    Y = g.conv_fprop(image=act, weight=W, padding=[pad, pad], stride=[1, 1], dilation=[1, 1])
    Y.set_output(True).set_data_type(io)
    SUM, SQ = g.genstats(name="genstats", input=Y)
    SUM.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    SQ.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    n, _, h, wd = x.shape
    y = torch.empty((n, w.shape[0], h, wd), device=x.device, dtype=x.dtype).to(memory_format=torch.channels_last)
    s = torch.empty(w.shape[0], device=x.device, dtype=torch.float32)
    q = torch.empty_like(s)
    workspace = torch.empty(max(1, g.get_workspace_size()), device=x.device, dtype=torch.uint8)
    pack = {X: x, W: w, S: scale, B: bias, Y: y, SUM: s, SQ: q}

    def run() -> tuple[torch.Tensor, ...]:
        g.execute(pack, workspace)
        return y, s.view(-1), q.view(-1)

    return run


def time_ms(fn: Callable[[], Any], reps: int = 20) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    try:
        import cudnn
    except Exception as exc:  # the wheel travels in .whl/ (nvidia-cudnn-frontend)
        print(f"cudnn frontend unavailable: {exc!r}")
        return 1
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    print(f"cudnn frontend {getattr(cudnn, '__version__', '?')}, cuDNN backend {cudnn.backend_version()}, torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.dtype}")
    compiled = torch.compile(unfused, dynamic=False)
    rows = []
    for name, cin, cout, k, hw, count in SHAPES:
        g = torch.Generator(device=dev).manual_seed(hash(name) % 1000)
        x = torch.randn(BATCH, cin, hw, hw, device=dev, generator=g).to(dtype).to(memory_format=torch.channels_last)
        w = (torch.randn(cout, cin, k, k, device=dev, generator=g) / (cin * k * k) ** 0.5).to(dtype).to(memory_format=torch.channels_last)
        scale = (torch.rand(1, cin, 1, 1, device=dev, generator=g) + 0.5).to(dtype).to(memory_format=torch.channels_last)
        bias = (torch.randn(1, cin, 1, 1, device=dev, generator=g) * 0.1).to(dtype).to(memory_format=torch.channels_last)
        pad = k // 2
        a_pre = torch.relu(x * scale + bias)
        variants: dict[str, Callable[[], Any]] = {
            "eager": lambda: unfused(x, w, scale, bias, pad),
            "compile": lambda: compiled(x, w, scale, bias, pad),
            "conv only": lambda: torch.nn.functional.conv2d(a_pre, w, padding=pad),
        }
        row: dict[str, Any] = {"shape": name, "count": count, "cin": cin, "cout": cout, "k": k, "hw": hw}
        try:
            variants["cudnn graph"] = cudnn_graph(cudnn, x, w, scale, bias, pad)
            y, s, q = variants["cudnn graph"]()
            ry, rs, rq = unfused(x, w, scale, bias, pad)
            torch.cuda.synchronize()
            row["max_rel_err_y"] = float(((y.float() - ry.float()).abs().max() / ry.float().abs().max()).item())
            row["max_rel_err_sum"] = float(((s - rs).abs().max() / rq.abs().max().sqrt().clamp_min(1)).item())
            row["max_rel_err_sqsum"] = float(((q - rq).abs().max() / rq.abs().max()).item())
        except Exception as exc:
            row["cudnn_error"] = f"{type(exc).__name__}: {exc}"[:300]
        for fn in variants.values():  # warm up: compile, cuDNN's benchmark choice, plans
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):  # interleaved rounds
            for v, fn in variants.items():
                times[v] += time_ms(fn, 10)
        row["ms"] = {v: statistics.median(t) for v, t in times.items()}
        row["spread"] = {v: (min(t), max(t)) for v, t in times.items()}
        e = 2  # bytes per element of the activations
        act = BATCH * cin * hw * hw * e
        out = BATCH * cout * hw * hw * e
        row["unfused_extra_mb"] = (2 * act + out) / 1e6  # the prologue's write and re-read, the sums' read of y
        row["gflop"] = 2 * BATCH * cout * cin * k * k * hw * hw / 1e9
        rows.append(row)
        ms = row["ms"]
        best_other = min(ms[v] for v in ("eager", "compile"))
        graph = ms.get("cudnn graph")
        speed = f"{best_other / graph:.2f}x" if graph else row.get("cudnn_error", "n/a")
        print(f"{name:18s} x{count}  " + "  ".join(f"{v} {t:.3f}" for v, t in ms.items()) + f"  | graph vs best unfused {speed}"
              + (f"  err y {row.get('max_rel_err_y', float('nan')):.1e} sq {row.get('max_rel_err_sqsum', float('nan')):.1e}" if graph else ""), flush=True)
    total = {v: sum(r["ms"].get(v, float("nan")) * r["count"] for r in rows) for v in ("eager", "compile", "conv only", "cudnn graph")}
    print("per ResNet-50 forward (stride-1 convs, weighted by count), ms: " + "  ".join(f"{v} {t:.2f}" for v, t in total.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "total_ms": total}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
