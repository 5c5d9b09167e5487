"""Issue 40's levers measured alone at the sizes people train, before they are judged on a step.

Parts (``--parts``, comma-separated; each prints its own table):

* ``attention``: causal bf16 attention forward + backward at Llama-3.2-1B (d 64) and Llama-3-8B
  (d 128) head shapes with GQA 32/8, through each of torch's SDPA backends (GQA native where the
  backend takes ``enable_gqa``, else key/value heads repeated), torch.compile's choice, and hal's op
  (``hal.ops.scaled_dot_product_attention`` the way ``hal.nn.patch`` calls it). Flops counted as
  4·B·H·T²·d forward (causal: half) and 2.5x that for forward + backward.
* ``lmhead``: the LM head and its loss at vocabulary 128256 (N tokens, d): eager (HF's float32
  upcast of the logits), torch.compile of the same, ``hal.ops.linear_cross_entropy``, and
  Liger-Kernel's fused linear cross-entropy where it imports: time forward + backward and peak memory
  above the inputs.
* ``capture``: a small Hugging Face Llama with GQA and tied embeddings, compiled, its whole step
  captured with ``hal.graphs.graphed``; on failure, the synchronising calls a step makes
  (``torch.cuda.set_sync_debug_mode``) and the traceback.
* ``step``: Llama-3.2-1B's shape (16 layers, d 2048, GQA 32/8, vocab 128256, tied; ``--shape 8b``: Llama-3-8B's layers) at T 2048, batch
  2: ``--step-variants`` among eager, compile, compile+graph (the compiled step, optimizer included,
  captured whole in a CUDA graph), hal (hal.nn.patch + hal.optim.AdamW), hal+compile,
  hal+compile+graph: step time, peak memory, the device time per kernel class and every kernel
  (in the JSON).

* ``optimize`` (``optimize-no-<lever>``: with a lever of ``LEVERS`` switched off): ``hal.optimize``
  as a user calls it, its candidates timed by itself, then the chosen step's time and anatomy.
* ``memory``: one ``hal.optimize`` candidate per configuration (``--memory-configs``, each a
  candidate name with ``:selective`` or ``:full`` for ``recompute=``), each in a fresh model: step
  time and peak device memory, allocated and reserved (a CUDA graph's private pool is reserved, not
  allocated, between replays: the reserved peak after ``empty_cache`` is what the step holds).

    python benchmarks/levers40.py --parts attention,lmhead [--json OUT]
    python benchmarks/levers40.py --parts memory --batch 4 --memory-configs "torch eager,hal compile+graph:selective"
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import traceback
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _bench(fn: Callable[[], Any], reps: int = 20, warm: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events, each run on its own)."""
    for _ in range(warm):
        fn()
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
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").cuda().train()


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


def part_optimize(results: dict, seq: int = 2048, batch: int = 2, layers: int = 16, candidates: Optional[list[str]] = None,
                  without: tuple[str, ...] = ()) -> None:
    """hal.optimize at Llama-3.2-1B's shape, as a user calls it: the model as built and torch's fused
    AdamW; its explain (every candidate's time) and its step time afterwards; ``without``: levers of
    :data:`LEVERS` switched off."""
    import hal
    label = "-".join(("optimize", *(f"no-{lever}" for lever in without)))
    kept = _switched_off(list(without))
    print(f"\n== {label}: hal.optimize on {_shape_name(layers)}, T {seq}, batch {batch}")
    torch.cuda.empty_cache()
    model = hf_llama(layers, *SHAPE[:5], seq, SHAPE[5])
    tokens = torch.randint(0, 128256, (batch, seq), device="cuda")
    t0 = time.perf_counter()
    fast = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), amp=torch.bfloat16, candidates=candidates)
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
    results[label] = {"ms": ms, "peak_gib": peak, "first_s": first, "explain": fast.explain(), "classes": classes, "kernels": kernels}
    for owner, name, value in kept:
        setattr(owner, name, value)
    del fast, model
    torch._dynamo.reset()


def part_memory(results: dict, seq: int, batch: int, layers: int, configs: list[str]) -> None:
    """Each configuration of ``configs`` ("torch eager", "hal compile+graph:selective", ...) as the only
    candidate of hal.optimize on a fresh model: ms/step and peak memory (module docstring)."""
    import hal
    print(f"\n== memory: {_shape_name(layers)}, T {seq}, batch {batch}")
    table = results.setdefault("memory", {})
    for config in configs:
        candidate, _, policy = config.partition(":")
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated() / 2**30
        try:
            model = hf_llama(layers, *SHAPE[:5], seq, SHAPE[5])
            tokens = torch.randint(0, SHAPE[4], (batch, seq), device="cuda")
            t0 = time.perf_counter()
            fast = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), amp=torch.bfloat16,
                                candidates=[candidate], recompute=policy or None)
            for _ in range(3):
                fast(input_ids=tokens, labels=tokens)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ms = _bench(lambda: fast(input_ids=tokens, labels=tokens), reps=8, warm=1)
            allocated = torch.cuda.max_memory_allocated() / 2**30 - base
            reserved = torch.cuda.max_memory_reserved() / 2**30
            loss = float(fast(input_ids=tokens, labels=tokens))
            row = {"ms": ms, "peak_allocated_gib": allocated, "peak_reserved_gib": reserved, "first_s": first, "loss": loss,
                   "tokens_per_s": batch * seq / ms * 1e3}
            print(f"  {config}: {ms:.2f} ms/step, {row['tokens_per_s'] / 1e3:.1f}k tok/s, peak allocated {allocated:.2f} GiB, "
                  f"reserved {reserved:.2f} GiB, first 3 steps {first:.0f} s, loss {loss:.4f}", flush=True)
            del fast, model
        except torch.OutOfMemoryError as exc:
            row = {"error": f"out of memory: {str(exc).splitlines()[0][:200]}"}
            print(f"  {config}: {row['error']}", flush=True)
        table[f"{config} b{batch}"] = row
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="attention,lmhead,capture")
    ap.add_argument("--json")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", default="2", help="an int; for --parts memory, several (2,4)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the decoder's layer shape (SHAPES) for step and optimize")
    ap.add_argument("--optimize-candidates", default="", help="hal.optimize's candidates= (comma separated); all by default")
    ap.add_argument("--step-variants", default="eager,hal,compile,hal+compile")
    ap.add_argument("--memory-configs", default="torch eager,hal compile+graph,hal compile+graph:selective,hal compile+graph:full")
    ap.add_argument("--attn-shapes", default="all", help="all, or indices into ATTN_SHAPES_ALL (0,1)")
    args = ap.parse_args(argv)
    print(torch.__version__, torch.cuda.get_device_name(), "cuDNN", torch.backends.cudnn.version())
    global ATTN_SHAPES, SHAPE
    SHAPE = SHAPES[args.shape]
    if args.attn_shapes != "all":
        ATTN_SHAPES = [ATTN_SHAPES_ALL[int(i)] for i in args.attn_shapes.split(",")]
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            if part == "step":
                part_step(results, args.seq, int(args.batch), args.layers, tuple(args.step_variants.split(",")))
            elif part == "memory":
                for batch in map(int, str(args.batch).split(",")):
                    part_memory(results, args.seq, batch, args.layers, args.memory_configs.split(","))
            elif part.startswith("optimize"):  # optimize, optimize-no-copies, optimize-no-copies-no-realized, ...
                part_optimize(results, args.seq, int(args.batch), args.layers,
                              args.optimize_candidates.split(",") if args.optimize_candidates else None,
                              tuple(part.split("-no-")[1:]))
            else:
                {"attention": part_attention, "lmhead": part_lmhead, "capture": part_capture}[part](results)
        except Exception:  # noqa: BLE001 - the next part still runs
            traceback.print_exc()
        print(f"-- {part}: {time.perf_counter() - t0:.0f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
