"""Issue 40's levers measured alone at the sizes people train, before they are judged on a step.

Parts (``--parts``, comma-separated; each prints its own table; ``--json OUT`` keeps every figure):

* ``attention``: causal bf16 attention forward + backward at Llama-3.2-1B (d 64) and Llama-3-8B
  (d 128) head shapes with GQA 32/8 (``--attn-shapes``), through each of torch's SDPA backends (GQA
  native where the backend takes ``enable_gqa``, else key/value heads repeated), torch.compile's
  choice, and hal's op (``hal.ops.scaled_dot_product_attention`` the way ``hal.nn.patch`` calls it).
  Flops counted as 4·B·H·T²·d forward (causal: half) and 2.5x that for forward + backward.
* ``lmhead``: the LM head and its loss at vocabulary 128256 (N tokens, d): eager (HF's float32
  upcast of the logits), torch.compile of the same, ``hal.ops.linear_cross_entropy``, and
  Liger-Kernel's fused linear cross-entropy where it imports: time forward + backward and peak memory
  above the inputs.
* ``capture``: a small Hugging Face Llama with GQA and tied embeddings, compiled, its whole step
  captured with ``hal.graphs.graphed``; on failure, the synchronising calls a step makes
  (``torch.cuda.set_sync_debug_mode``) and the traceback.
* ``step``: a Hugging Face ``LlamaForCausalLM`` at Llama-3.2-1B's shape (16 layers, d 2048, GQA 32/8,
  vocab 128256, tied; ``--shape 8b``: Llama-3-8B's layers, ``--layers`` of them) at ``--seq``,
  ``--batch``: ``--step-variants`` among eager, compile, compile+graph (the compiled step, optimizer
  included, captured whole in a CUDA graph), hal (hal.nn.patch + hal.optim.AdamW), hal+compile,
  hal+compile+graph: step time, peak memory, the device time per kernel class and every kernel.
* ``optimize`` (``optimize-no-<lever>``: a lever of ``LEVERS`` switched off): ``hal.optimize`` as a
  user calls it (``--optimize-candidates``; ``--fp8 tensor|delayed|rowwise``: ``fp8=`` the
  ``hal.fp8`` recipe, passed only when given), its candidates timed by itself, then the chosen step's
  time and anatomy.
* ``memory`` (``levers40_memory.py``): each configuration of ``--memory-configs`` at each
  ``--batch`` in a fresh process (limit ``--memory-timeout`` s): hal.optimize with that one
  candidate (``:selective``/``:full``: ``recompute=``; ``+fp8``: ``fp8=``; ``torchao tensorwise``:
  torchao's float8 model, torch compile+graph); ms/step, tokens/s and the peaks of allocated and
  reserved memory over the process's whole life (compile, capture and steady steps), with their
  ratios to ``torch eager``'s at the same batch. An out-of-memory error, a failure or a timeout is a
  row with its error. ``--deadline S``: start no process past S seconds from the script's start.
* ``largest``: per configuration, batches from ``--largest-batches`` ("4,6,8" for all, or
  "torch eager=4,6,8;hal compile+graph:selective=8,12,16": the named ones alone, or with a plain
  list the default of the rest), each in a fresh process, up to the first that fails (out of
  memory): the largest batch that ran, its tokens/s, the ratios to torch eager's.
* ``torchao``: torchao.float8 (``--torchao-recipes tensorwise,rowwise``) on the same model: its
  linears converted by ``convert_to_float8_training`` (not ``lm_head``, not dims off multiples of 16),
  then hal.optimize's untouched-model candidate (``--torchao-modes``, default ``compile+graph``:
  torch.compile of model and loss, bf16 autocast, torch's fused AdamW, the step captured whole),
  beside the bf16 model the same way, in this process: ms/step, tokens/s, peak memory, ratios.

``HAL_LEVERS_CPU=1`` runs the model parts on the CPU (``--shape tiny``, no CUDA figures): a check of
the script, not a measurement.

    python benchmarks/levers40.py --parts attention,lmhead,capture [--json OUT]
    python benchmarks/levers40.py --parts step --batch 2 --step-variants compile+graph,hal+compile+graph
    python benchmarks/levers40.py --parts optimize --optimize-candidates "torch compile+graph,hal compile+graph" --fp8 tensor
    python benchmarks/levers40.py --parts memory --batch 4 --memory-configs "torch eager,hal compile+graph:selective+fp8"
    python benchmarks/levers40.py --parts largest --largest-batches "torch eager=4,6,8;hal compile+graph:selective=8,12,16"
    python benchmarks/levers40.py --parts torchao --shape 8b --layers 6 --seq 4096 --batch 1
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import re
import statistics
import sys
import time
import traceback
import types
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import levers40_memory  # the memory and largest parts (this script's folder is on sys.path when it runs)
except ImportError:  # imported as benchmarks.levers40
    from benchmarks import levers40_memory

STARTED = time.perf_counter()
#: where the model parts run: "cuda", or "cpu" with HAL_LEVERS_CPU=1 (a check of the script, no measurement)
DEVICE = "cpu" if os.environ.get("HAL_LEVERS_CPU") == "1" else "cuda"


def _bench(fn: Callable[[], Any], reps: int = 20, warm: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events, each run on its own; the host clock on the CPU)."""
    for _ in range(warm):
        fn()
    if DEVICE == "cpu":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# --- attention -----------------------------------------------------------------------------------

ATTN_SHAPES_ALL = [  # B, H, Hkv, T, d
    (2, 32, 8, 2048, 64), (2, 32, 8, 4096, 64), (1, 32, 8, 8192, 64),
    (2, 32, 8, 2048, 128), (1, 32, 8, 4096, 128), (1, 32, 8, 8192, 128),
]


ATTN_SHAPES = ATTN_SHAPES_ALL


def _attention_variants(q, k, v) -> dict[str, Callable[[], torch.Tensor]]:
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1).detach().requires_grad_(), v.repeat_interleave(g, 1).detach().requires_grad_()

    def forced(backend, gqa: bool):
        def run():
            with sdpa_kernel([backend]):
                if gqa:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        return run

    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), dynamic=False)

    def compiled_cudnn_fn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)

    compiled_cudnn = torch.compile(compiled_cudnn_fn, dynamic=False)

    def hal_like():  # hal.nn.patch's call: q grouped (B, Hkv, G, T, d) against k, v (B, Hkv, 1, T, d)
        import hal
        b, h, t, d = q.shape
        out = hal.ops.scaled_dot_product_attention(q.reshape(b, h // g, g, t, d), k.unsqueeze(2), v.unsqueeze(2), None, True, d ** -0.5)
        return out.reshape(b, h, t, d)

    return {
        "flash gqa": forced(SDPBackend.FLASH_ATTENTION, True),
        "flash repeated": forced(SDPBackend.FLASH_ATTENTION, False),
        "cudnn gqa": forced(SDPBackend.CUDNN_ATTENTION, True),
        "cudnn repeated": forced(SDPBackend.CUDNN_ATTENTION, False),
        "efficient gqa": forced(SDPBackend.EFFICIENT_ATTENTION, True),
        "default gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "compile gqa": lambda: compiled(q, k, v),
        "compile cudnn repeated": lambda: compiled_cudnn(q, k, v),
        "hal op": hal_like,
    }


def part_attention(results: dict) -> None:
    print("\n== attention: causal bf16, forward + backward (ms), TFLOP/s; forward alone")
    for b, h, hkv, t, d in ATTN_SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
        fwd_flops = 4 * b * h * t * t * d / 2
        ref = None
        row = {}
        for name, fn in _attention_variants(q, k, v).items():
            try:
                out = fn()
                out.backward(dout)
                err = 0.0 if ref is None else float((out.float() - ref).abs().max())
                if ref is None:
                    ref = out.detach().float()

                def fb():
                    q.grad = k.grad = v.grad = None
                    fn().backward(dout)

                with torch.no_grad():
                    tf = _bench(fn)
                tfb = _bench(fb)
                row[name] = {"fwd_bwd_ms": tfb, "fwd_ms": tf, "tflops": 3.5 * fwd_flops / tfb / 1e9, "max_err_vs_first": err}
                print(f"  B{b} H{h}/{hkv} T{t} d{d}  {name:24s} {tfb:7.3f} ms  {3.5 * fwd_flops / tfb / 1e9:6.0f} TFLOP/s   fwd {tf:6.3f} ms   err {err:.3g}")
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"  B{b} H{h}/{hkv} T{t} d{d}  {name:24s} error {type(exc).__name__}: {str(exc)[:160]}")
        results.setdefault("attention", {})[f"B{b} H{h}/{hkv} T{t} d{d}"] = row


# --- LM head + loss ------------------------------------------------------------------------------

def part_lmhead(results: dict, n: int = 4096, d: int = 2048, vocab: int = 128256) -> None:
    print(f"\n== LM head + loss: N {n}, d {d}, vocab {vocab}, bf16: forward + backward (ms), peak memory above the inputs (GiB)")
    torch.manual_seed(0)
    x = (torch.randn(n, d, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda")

    def eager():
        return F.cross_entropy((x @ w.t()).float(), y)

    compiled = torch.compile(lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y))
    variants: dict[str, Callable[[], torch.Tensor]] = {"eager (fp32 logits)": eager, "compile": lambda: compiled(x, w, y)}
    try:
        import hal
        variants["hal linear_cross_entropy"] = lambda: hal.ops.linear_cross_entropy(x, w, y)
    except Exception as exc:  # noqa: BLE001
        print("  hal:", exc)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        lce = LigerFusedLinearCrossEntropyLoss()
        variants["liger fused LCE"] = lambda: lce(w, x, y)
    except Exception as exc:  # noqa: BLE001
        print("  liger:", type(exc).__name__, exc)
    ref = None
    for name, fn in variants.items():
        try:
            x.grad = w.grad = None
            loss = fn()
            loss.backward()
            gx = x.grad.float()
            err = (0.0, 0.0) if ref is None else (float((loss.float() - ref[0]).abs()), float((gx - ref[1]).abs().max()))
            if ref is None:
                ref = (loss.detach().float(), gx)

            def fb():
                x.grad = w.grad = None
                fn().backward()

            t = _bench(fb, reps=10)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fb()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            flops = 6 * n * d * vocab
            results.setdefault("lmhead", {})[name] = {"ms": t, "peak_gib": peak, "tflops": flops / t / 1e9, "err": err}
            print(f"  {name:26s} {t:7.3f} ms  {flops / t / 1e9:5.0f} TFLOP/s  peak +{peak:5.2f} GiB  err(loss, grad x) {err}")
        except Exception as exc:  # noqa: BLE001
            results.setdefault("lmhead", {})[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"  {name:26s} error {type(exc).__name__}: {str(exc)[:300]}")


# --- Hugging Face models ---------------------------------------------------------------------------

#: the decoder shapes of ``--shape``: (d, heads, kv heads, ffn, vocab, tied embeddings)
SHAPES = {
    "1b": (2048, 32, 8, 8192, 128256, True),  # Llama-3.2-1B (16 layers)
    "8b": (4096, 32, 8, 14336, 128256, False),  # Llama-3-8B's layers (32 in the model; as many as fit here)
    "tiny": (64, 4, 2, 128, 512, True),  # for checking the script (HAL_LEVERS_CPU=1)
}
SHAPE = SHAPES["1b"]


def _shape_name(layers: int) -> str:
    d, h, kv, ffn, vocab, tied = SHAPE
    return f"HF Llama, {layers} layers, d {d}, ffn {ffn}, GQA {h}/{kv}, vocab {vocab}, {'tied' if tied else 'untied'}"


def hf_llama(layers: int, dim: int, heads: int, kv: int, ffn: int, vocab: int, seq: int, tied: bool, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                                   rope_theta=500000.0, tie_word_embeddings=tied, use_cache=False, attention_dropout=0.0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(DEVICE).train()


def _train_step(model, opt, tokens, compiled_forward=None):
    forward = compiled_forward if compiled_forward is not None else model

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def part_capture(results: dict) -> None:
    import hal
    print("\n== capture: small HF Llama (GQA 8/2, tied, vocab 128256), compiled, whole step graphed")
    for label, patch in (("torch", False), ("hal.nn.patch", True)):
        model = hf_llama(2, 512, 8, 2, 1408, 128256, 512, True)
        if patch:
            hal.nn.patch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
        tokens = torch.randint(0, 128256, (2, 512), device="cuda")
        step = _train_step(model, opt, tokens, torch.compile(model))
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            import warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            torch.cuda.set_sync_debug_mode(0)
            syncs = sorted({str(w.message)[:200] for w in caught})
            print(f"  {label}: syncs in an eager-compiled step: {len(caught)}", *syncs[:5], sep="\n    ")
            graphed = hal.graphs.graphed(step)
            for _ in range(5):
                graphed()
            torch.cuda.synchronize()
            print(f"  {label}: graphed step ran; loss {float(graphed()):.4f}")
            results.setdefault("capture", {})[label] = "ok"
        except Exception as exc:  # noqa: BLE001
            torch.cuda.set_sync_debug_mode(0)
            tb = traceback.format_exc()
            print(f"  {label}: FAILED {type(exc).__name__}: {str(exc)[:400]}\n{tb[-3000:]}")
            results.setdefault("capture", {})[label] = tb[-3000:]
    print("\n== capture: hal.optimize on the same model (its explain)")
    model = hf_llama(2, 512, 8, 2, 1408, 128256, 512, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 128256, (2, 512), device="cuda")
    try:
        fast = hal.optimize(model, opt, amp=torch.bfloat16)
        for _ in range(3):
            fast(input_ids=tokens, labels=tokens)
        print(fast.explain())
        results.setdefault("capture", {})["optimize"] = fast.explain()
    except Exception as exc:  # noqa: BLE001
        print("  hal.optimize FAILED", traceback.format_exc()[-3000:])


KERNEL_CLASSES = [
    ("attention", re.compile(r"flash|fmha|cudnn|sdpa|attention|_attn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|xmma|cutlass|sm90_|wgmma|matmul|ampere", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("loss/lmhead", re.compile(r"cross_entropy|nll|log_softmax|lce|logsumexp", re.I)),
    ("triton", re.compile(r"^triton_|triton", re.I)),
]


def _kernel_classes(prof) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.key
        cls = next((c for c, rx in KERNEL_CLASSES if rx.search(name)), "other")
        out[cls] += evt.self_device_time_total / 1e3
    return dict(out)


def _top_kernels(prof, n=12) -> list[tuple[str, float, int]]:
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(rows, key=lambda r: -r[1])[:n]


def _anatomy(step: Callable[[], Any], steps: int = 3) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Device milliseconds per step by kernel class, and every kernel (name, ms, launches) per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    classes = {k: v / steps for k, v in _kernel_classes(prof).items()}
    return classes, [(k[:160], t / steps, c // steps) for k, t, c in _top_kernels(prof, n=400)]


def part_step(results: dict, seq: int = 2048, batch: int = 2, layers: int = 16,
              variants: tuple[str, ...] = ("eager", "hal", "compile", "hal+compile")) -> None:
    import hal
    print(f"\n== step: {_shape_name(layers)}, T {seq}, batch {batch}")
    for label in variants:
        torch.cuda.empty_cache()
        model = hf_llama(layers, *SHAPE[:5], seq, SHAPE[5])
        graph = label.endswith("+graph")
        if label.startswith("hal"):
            hal.nn.patch(model)
            opt = hal.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graph)
        tokens = torch.randint(0, 128256, (batch, seq), device="cuda")
        t0 = time.perf_counter()
        step = _train_step(model, opt, tokens, torch.compile(model) if "compile" in label else None)
        for _ in range(3):
            step()
        if graph:  # the compiled step (forward, backward, optimizer) captured whole and replayed
            step = hal.graphs.graphed(step)
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        ms = _bench(step, reps=10, warm=2)
        peak = torch.cuda.max_memory_allocated() / 2**30
        classes, kernels = _anatomy(step)
        top = kernels[:12]
        results.setdefault("step", {})[label] = {"ms": ms, "peak_gib": peak, "first_s": first, "classes": classes, "top": top, "kernels": kernels}
        print(f"  {label}: {ms:.2f} ms/step, peak {peak:.1f} GiB, first 3 steps {first:.0f} s; device ms by class:",
              ", ".join(f"{k} {v:.2f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1])))
        for k, t, c in top:
            print(f"     {t:7.3f} ms x{c:4d}  {k}")
        del model, opt, step
        torch._dynamo.reset()


#: hal.optimize's levers a part named ``optimize-no-<lever>`` switches off (several: optimize-no-a-no-b),
#: each by putting its function back to the identity, for the A/B of that lever in one process
LEVERS = {
    "copies": ("hal.fast.step", "OptimizedStep._weight_copies", staticmethod(lambda *a, **k: None)),  # hal.nn.weight_copies
    "realized": ("hal.nn.patch_hf", "realized", lambda x: x),  # the rotary angles written once (hal.nn.realized)
}


def _switched_off(levers: list[str]) -> list[tuple[Any, str, Any]]:
    """Switch ``levers`` off; returns what to put back."""
    import importlib
    kept = []
    for lever in levers:
        module, path, off = LEVERS[lever]
        owner: Any = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        kept.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, off)
    return kept


#: ``--fp8`` names: the hal.fp8 recipe each makes (its defaults)
FP8_RECIPES = {"tensor": "CurrentScaling", "delayed": "DelayedScaling", "rowwise": "RowwiseScaling"}


def fp8_kwargs(name: Optional[str]) -> dict[str, Any]:
    """``{"fp8": recipe}`` for hal.optimize (``--fp8 name``), or nothing where no name is given."""
    if not name:
        return {}
    import hal
    import hal.fp8
    if "fp8" not in inspect.signature(hal.optimize).parameters:
        raise RuntimeError(f"--fp8 {name}: this hal's hal.optimize (hal {getattr(hal, '__version__', '?')}) takes no fp8=; run without --fp8")
    return {"fp8": getattr(hal.fp8, FP8_RECIPES[name])()}


def part_optimize(results: dict, seq: int = 2048, batch: int = 2, layers: int = 16, candidates: Optional[list[str]] = None,
                  without: tuple[str, ...] = (), fp8: Optional[str] = None) -> None:
    """hal.optimize at Llama-3.2-1B's shape, as a user calls it: the model as built and torch's fused
    AdamW; its explain (every candidate's time) and its step time afterwards; ``without``: levers of
    :data:`LEVERS` switched off; ``fp8``: a name of :data:`FP8_RECIPES` for ``fp8=``."""
    import hal
    label = "-".join(("optimize", *(f"no-{lever}" for lever in without))) + (f" fp8={fp8}" if fp8 else "")
    extra = fp8_kwargs(fp8)
    kept = _switched_off(list(without))
    print(f"\n== {label}: hal.optimize on {_shape_name(layers)}, T {seq}, batch {batch}"
          + (f", fp8={extra['fp8']!r}" if extra else ""))
    torch.cuda.empty_cache()
    model = hf_llama(layers, *SHAPE[:5], seq, SHAPE[5])
    tokens = torch.randint(0, SHAPE[4], (batch, seq), device="cuda")
    t0 = time.perf_counter()
    fast = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), amp=torch.bfloat16, candidates=candidates,
                        **extra)
    for _ in range(2):
        fast(input_ids=tokens, labels=tokens)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    ms = _bench(lambda: fast(input_ids=tokens, labels=tokens), reps=10, warm=2)
    peak = torch.cuda.max_memory_allocated() / 2**30
    classes, kernels = _anatomy(lambda: fast(input_ids=tokens, labels=tokens))
    print(fast.explain())
    print(f"  hal.optimize: {ms:.2f} ms/step, peak {peak:.1f} GiB, first 2 calls {first:.0f} s; device ms by class:",
          ", ".join(f"{k} {v:.2f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1])))
    for k, t, c in kernels[:12]:
        print(f"     {t:7.3f} ms x{c:4d}  {k[:90]}")
    results[label] = {"ms": ms, "peak_gib": peak, "first_s": first, "explain": fast.explain(), "classes": classes, "kernels": kernels,
                      "fp8": repr(extra["fp8"]) if extra else None}
    for owner, name, value in kept:
        setattr(owner, name, value)
    del fast, model
    torch._dynamo.reset()


# --- torchao float8 ---------------------------------------------------------------------------------

def torchao_convert(model: torch.nn.Module, recipe: str) -> int:
    """Convert ``model``'s linears to torchao's Float8Linear (``recipe``: "tensorwise" or "rowwise"),
    all but ``lm_head`` and those whose dims are not multiples of 16 (torchao's float8 GEMMs need
    them); returns how many. On the CPU (``HAL_LEVERS_CPU=1``) torchao emulates the FP8 GEMMs."""
    import dataclasses
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if DEVICE == "cpu":
        config = dataclasses.replace(config, emulate=True)

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        if fqn.split(".")[-1] == "lm_head":
            return False
        return not isinstance(module, torch.nn.Linear) or (module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def part_torchao(results: dict, seq: int, batch: int, layers: int, recipes: list[str], modes: list[str],
                 save: Callable[[], None] = lambda: None) -> None:
    """torchao.float8's recipes against the bf16 model, each a fresh model run by hal.optimize's
    untouched-model candidate ``torch <mode>`` (module docstring); in this process, one after another,
    the peaks reset after the previous one is freed (``base``: what it left allocated)."""
    try:
        import torchao
        import torchao.float8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, or not for this torch
        print(f"\n== torchao: skipped: torchao.float8 does not import ({type(exc).__name__}: {str(exc)[:200]}); "
              "install a torchao wheel for this torch (pip install --no-deps .whl/torchao-*.whl)")
        results["torchao"] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        return
    import hal
    version = getattr(torchao, "__version__", "?")
    print(f"\n== torchao {version} float8 against bf16: {_shape_name(layers)}, T {seq}, batch {batch}; hal.optimize's "
          "torch candidate on the (converted) model: bf16 autocast, torch's fused AdamW")
    table = results.setdefault("torchao", {"version": version})
    for mode in modes:
        base_row: dict = {}
        for recipe in ["bf16", *recipes]:
            name = f"{recipe} torch {mode}"
            gc.collect()
            torch._dynamo.reset()
            cuda = DEVICE == "cuda"
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
            row: dict[str, Any] = {"recipe": recipe, "mode": mode, "base_gib": base}
            try:
                t0 = time.perf_counter()
                model = hf_llama(layers, *SHAPE[:5], seq, SHAPE[5])
                row["converted"] = torchao_convert(model, recipe) if recipe != "bf16" else 0
                tokens = torch.randint(0, SHAPE[4], (batch, seq), device=DEVICE)
                fast = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), amp=torch.bfloat16,
                                    candidates=[f"torch {mode}"], rewrite="none", replace_optimizer=False)
                for _ in range(4):
                    fast(input_ids=tokens, labels=tokens)
                row["first_s"] = time.perf_counter() - t0
                ms = _bench(lambda: fast(input_ids=tokens, labels=tokens), reps=10, warm=2)
                row.update(ms=ms, tokens_per_s=batch * seq / ms * 1e3, loss=float(fast(input_ids=tokens, labels=tokens)))
                graph = getattr(fast, "_graph", None)
                if "graph" in mode:
                    row["captured"] = bool(graph is not None and graph.captured())
                    if not row["captured"] and graph is not None:
                        row["graph"] = graph.explain().splitlines()[-1].strip()
                alloc = torch.cuda.max_memory_allocated() / 2**30 - base if cuda else 0.0
                res = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
                row.update(peak_allocated_gib=alloc, peak_reserved_gib=res)
                if recipe == "bf16":
                    base_row = row
                elif base_row.get("ms") and cuda:
                    row.update(speedup_vs_bf16=base_row["ms"] / ms, reserved_vs_bf16=res / base_row["peak_reserved_gib"],
                               allocated_vs_bf16=alloc / base_row["peak_allocated_gib"])
                print(f"  {name:34s} {ms:8.2f} ms/step, {row['tokens_per_s'] / 1e3:6.1f}k tok/s, peak allocated {alloc:6.2f} GiB "
                      f"(above {base:.2f} left before), reserved {res:6.2f} GiB, {row['converted']} float8 linears, "
                      f"first 4 steps {row['first_s']:.0f} s, loss {row['loss']:.4f}"
                      + ("" if row.get("captured", True) else f", NOT captured ({row.get('graph')})")
                      + (f"; {row['speedup_vs_bf16']:.3f}x bf16's speed, {row['reserved_vs_bf16']:.2f}x its reserved and "
                         f"{row['allocated_vs_bf16']:.2f}x its allocated peak" if "speedup_vs_bf16" in row else ""), flush=True)
            except Exception as exc:  # noqa: BLE001 - the next recipe still runs
                message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                row["error"] = f"{type(exc).__name__}: {message}"[:400]
                row["traceback"] = traceback.format_exc()[-3000:]
                print(f"  {name:34s} error {row['error']}\n{row['traceback'][-1500:]}", flush=True)
            table[name] = row
            save()
            model = fast = tokens = None
    gc.collect()
    torch._dynamo.reset()


# --- memory and largest (levers40_memory.py) --------------------------------------------------------

def _memory_setup(args: argparse.Namespace) -> types.SimpleNamespace:
    """What a ``--memory-one`` child needs of this script (levers40_memory.measure_one)."""
    return types.SimpleNamespace(device=DEVICE, vocab=SHAPE[4], shape=f"{_shape_name(args.layers)}, T {args.seq}",
                                 build=lambda: hf_llama(args.layers, *SHAPE[:5], args.seq, SHAPE[5]),
                                 bench=lambda fn, reps, warm: _bench(fn, reps=reps, warm=warm),
                                 torchao_convert=torchao_convert, fp8_kwargs=fp8_kwargs)


def _memory_runner(args: argparse.Namespace, save: Callable[[], None]) -> levers40_memory.Runner:
    def command(config: str, batch: int) -> list[str]:
        return [sys.executable, os.path.abspath(__file__), "--memory-one", config, "--batch", str(batch), "--seq", str(args.seq),
                "--layers", str(args.layers), "--shape", args.shape, *(["--fp8", args.fp8] if args.fp8 else [])]
    return levers40_memory.Runner(command, args.memory_timeout, STARTED + args.deadline if args.deadline else None, save)


#: parts that run each configuration in a child process (the parent then touches no GPU)
CHILD_PARTS = ("memory", "largest")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="attention,lmhead,capture")
    ap.add_argument("--json")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", default="2", help="an int; for --parts memory, several (2,4)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the decoder's layer shape (SHAPES)")
    ap.add_argument("--optimize-candidates", default="", help="hal.optimize's candidates= (comma separated); all by default")
    ap.add_argument("--fp8", choices=sorted(FP8_RECIPES), help="optimize: hal.optimize(fp8=) this hal.fp8 recipe; memory: the recipe of +fp8")
    ap.add_argument("--step-variants", default="eager,hal,compile,hal+compile")
    ap.add_argument("--memory-configs", default="torch eager,hal compile+graph,hal compile+graph:selective,hal compile+graph:full",
                    help="comma separated: a hal.optimize candidate[:selective|:full][+fp8[=tensor|delayed|rowwise]], or 'torchao <recipe>'")
    ap.add_argument("--memory-timeout", type=float, default=150.0, help="seconds per (configuration, batch) process")
    ap.add_argument("--largest-batches", default=",".join(map(str, levers40_memory.DEFAULT_LARGEST)),
                    help="'4,6,8' for every configuration, or 'torch eager=4,6,8;hal compile+graph:selective=8,12,16'")
    ap.add_argument("--deadline", type=float, default=0.0, help="memory, largest: start no process past this many seconds (0: none)")
    ap.add_argument("--torchao-recipes", default="tensorwise,rowwise")
    ap.add_argument("--torchao-modes", default="compile+graph", help="hal.optimize's torch candidates (eager, compile, graph, compile+graph)")
    ap.add_argument("--attn-shapes", default="all", help="all, or indices into ATTN_SHAPES_ALL (0,1)")
    ap.add_argument("--memory-one", help=argparse.SUPPRESS)  # the child of memory and largest: one configuration, one JSON row
    args = ap.parse_args(argv)
    global ATTN_SHAPES, SHAPE
    SHAPE = SHAPES[args.shape]
    if args.memory_one:  # prints its row and exits the process
        levers40_memory.child_main(args.memory_one, int(args.batch), args.seq, _memory_setup(args), args.fp8)
    parts = args.parts.split(",")
    configs = [c.strip() for c in args.memory_configs.split(",") if c.strip()]
    for config in configs:  # a misspelt configuration fails here, not after the device time of the ones before it
        levers40_memory.parse_config(config, args.fp8)
    if "largest" in parts:
        plan = levers40_memory.parse_largest(args.largest_batches, configs)
    if args.attn_shapes != "all":
        ATTN_SHAPES = [ATTN_SHAPES_ALL[int(i)] for i in args.attn_shapes.split(",")]
    results: dict = {"torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv}
    if DEVICE == "cuda" and not all(p in CHILD_PARTS for p in parts):  # the children alone hold the GPU otherwise
        results["device"] = torch.cuda.get_device_name()
        print(torch.__version__, results["device"], "cuDNN", torch.backends.cudnn.version())
    else:
        print(torch.__version__, f"on {DEVICE}" if DEVICE != "cuda" else "(the device: in each configuration's process)")

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    describe = f"{_shape_name(args.layers)}, T {args.seq}"
    for part in parts:
        t0 = time.perf_counter()
        try:
            if part == "step":
                part_step(results, args.seq, int(args.batch), args.layers, tuple(args.step_variants.split(",")))
            elif part in CHILD_PARTS:
                if DEVICE == "cuda" and torch.cuda.is_initialized():
                    gc.collect()
                    torch.cuda.empty_cache()  # what the parts before left cached
                runner = _memory_runner(args, save)
                if part == "memory":
                    levers40_memory.part_memory(results, configs, levers40_memory.parse_batches(args.batch), runner, describe)
                else:
                    levers40_memory.part_largest(results, plan, runner, describe)
            elif part == "torchao":
                part_torchao(results, args.seq, int(args.batch), args.layers, [r for r in args.torchao_recipes.split(",") if r],
                             args.torchao_modes.split(","), save)
            elif part.startswith("optimize"):  # optimize, optimize-no-copies, optimize-no-copies-no-realized, ...
                part_optimize(results, args.seq, int(args.batch), args.layers,
                              args.optimize_candidates.split(",") if args.optimize_candidates else None,
                              tuple(part.split("-no-")[1:]), args.fp8)
            else:
                {"attention": part_attention, "lmhead": part_lmhead, "capture": part_capture}[part](results)
        except Exception:  # noqa: BLE001 - the next part still runs
            traceback.print_exc()
        print(f"-- {part}: {time.perf_counter() - t0:.0f} s", flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
