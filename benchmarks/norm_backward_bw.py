"""The layer_norm / rms_norm backward against copy bandwidth (issue 40, "backward kernels below the
limit"): every launch candidate of the CUDA plugin's tables, the one the autotuner picks, torch
eager and torch.compile of the same backward, in one process on one GPU.

    python benchmarks/norm_backward_bw.py [--out DIR] [--compile headline|all|none] [--only layer|rms]

Cases: layer_norm and rms_norm backward with a weight at (32768, 4096), (16384, 8192) and
(8192, 2048) bfloat16, and (16384, 4096) float32. Per case:

1. Bytes: the fewest the backward must move, x and grad_out read, grad_x written, the weight read
   and grad_weight (and grad_bias) written once; the partial rows of the persistent kernel are
   not counted (they are overhead the fraction shows). 100% is a device-to-device copy moving as
   many bytes, measured now (hal_bench.ceilings.copy_at).
2. Checks, before any timing: each candidate and the picked launch, with every buffer the call
   allocates filled with NaN first, against torch's autograd in float64 on fresh random inputs:
   relative error ||got - ref|| / ||ref|| per gradient (bfloat16 within 1e-2, float32 2e-5).
3. Times: CUDA events around batches of back-to-back runs after a warm-up (L2 flushed between
   batches), the median of 5 batches (hal_bench.timing.Timer); the default launch is timed again
   last, so that the spread of one launch measured twice is in the table beside the differences.

The autotuner tunes into a fresh cache directory (HAL_TRITON_CACHE_DIR, or a temporary one), so
its pick is measured now; with --out the cache file and the full results (JSON) are written there.
Eager and compile time ``torch.autograd.grad`` of F.layer_norm / F.rms_norm's output (the backward
of the eager forward and of its torch.compile, as ``hal bench``'s columns), which reads the
forward's saved statistics instead of recomputing them; torch.compile by default at the issue's
shape only (its compilations are most of the run). Needs a CUDA GPU; refuses without one. Not
yet run on a GPU when written: expected well under a minute on an H100 (about 40 Triton
compilations of the candidates, two Inductor compilations, 8 cases of ~10 timings of 0.1 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

import bandwidth_run  # this script's folder is on sys.path when it runs
from bandwidth_run import dtype_name, plugin_kernel

#: ((rows, row length), dtype) of every case
SHAPES = (((32768, 4096), torch.bfloat16), ((16384, 8192), torch.bfloat16), ((8192, 2048), torch.bfloat16),
          ((16384, 4096), torch.float32))
#: relative error allowed per dtype
REL = {torch.bfloat16: 1e-2, torch.float32: 2e-5}
DEVICE = torch.device("cuda")


@dataclasses.dataclass
class Row(bandwidth_run.Row):
    """One timed launch of one case, with the relative error of each gradient."""

    rel_err: dict[str, float] = dataclasses.field(default_factory=dict)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="write norm_backward_bw.json and the autotune cache here (default: $OUT if set)")
    p.add_argument("--compile", choices=("headline", "all", "none"), default="headline",
                   help="cases with a torch.compile row: the (32768, 4096) bfloat16 case of each op (default: issue 40's comparison), "
                        "every case (each compiles afresh: several seconds a case), or none")
    p.add_argument("--only", choices=("layer", "rms"), help="one of the two ops")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    def compile_too(shape: tuple[int, int], dtype: torch.dtype) -> bool:
        return args.compile == "all" or (args.compile == "headline" and (shape, dtype) == SHAPES[0])

    cases = [functools.partial(run_case, rms, shape, dtype, compile_too(shape, dtype))
             for rms in (False, True) if args.only in (None, "rms" if rms else "layer") for shape, dtype in SHAPES]
    return bandwidth_run.run("norm_backward_bw", DEVICE, cases, table, args.out)


# --- one case ---------------------------------------------------------------------------------------


def run_case(rms: bool, shape: tuple[int, int], dtype: torch.dtype, compile_too: bool, timer: Any) -> list[Row]:
    """Every launch of one case, checked and timed."""
    from hal_backend_cuda._device import sm_count
    from hal_backend_cuda.launch import TABLES
    from hal_bench.ceilings import copy_at
    from hal_triton import norm

    m, n = shape
    name = f"{'rms' if rms else 'layer'}_norm_backward {dtype_name(dtype)} ({m}, {n})"
    print(name, flush=True)
    eps = 1e-6 if rms else 1e-5
    x = randn((m, n), dtype, shift=1.0, scale=2.0)
    g = randn((m, n), dtype)
    w = randn((n,), dtype)
    nbytes = (3 * m * n + (3 if rms else 4) * n) * x.element_size()
    copy = copy_at(DEVICE, nbytes, timer)
    ref = reference(g, x, w, eps, rms)
    units = sm_count(DEVICE)

    def measure(launch: str, fn: Callable[[], tuple]) -> Row:
        """fn run once (compiling, tuning), once more on NaN-filled allocations and checked, then timed."""
        row = Row(name, launch)
        try:
            fn()
            with nan_allocations():
                got = fn()
            row.rel_err = {k: rel_err(a, b) for k, a, b in zip(("dx", "dw", "db"), got, ref) if b is not None}
            row.ok = all(e <= REL[dtype] for e in row.rel_err.values())
            t = timer(fn)
        except Exception as exc:  # a launch that fails is reported, the others still run
            row.ok, row.note = False, f"{type(exc).__name__}: {exc}"[:160]
            return row
        return row.timed(t, nbytes, copy)

    out = []
    candidates = TABLES.norm_backward_candidates(x, n)
    launches = [functools.partial(norm.norm_backward, g, x, n, w, eps, rms, **vars(c)) for c in candidates]
    for i, (cand, launch) in enumerate(zip(candidates, launches)):
        out.append(measure(("default " if i == 0 else "") + describe(cand, units), launch))
    op = "rms_norm_backward" if rms else "layer_norm_backward"
    picked = measure("autotuned", functools.partial(plugin_kernel(op), g, x, (n,), w, eps))  # its first call tunes
    picked.launch = f"autotuned: {describe(picked_config(x, n, rms, candidates), units)}"
    out.append(picked)
    eager, compiled = autograd_columns(g, x, w, eps, rms, compile_too)
    out.append(measure("torch eager", eager))
    if isinstance(compiled, str):  # torch's failure, not the case's: noted, the exit status unchanged
        out.append(Row(name, "torch.compile", note=compiled))
    elif compiled is not None:
        out.append(measure("torch.compile", compiled))
    out.append(measure(f"default again {describe(candidates[0], units)}", launches[0]))
    return out


def picked_config(x: torch.Tensor, n: int, rms: bool, candidates: tuple) -> Any:
    """The launch the autotuner cached for this problem (the default where it did not tune)."""
    from hal_backend_cuda.launch import TABLES
    from hal_triton import autotune
    from hal_triton.config import NormBwdConfig
    from hal_triton.kernels.norm import _backward_key

    hit = autotune.cache_for(TABLES, x.device).get(_backward_key(x, n, True, rms)) if x.device.type == "cuda" else None
    return NormBwdConfig.from_dict(hit["config"]) if hit else candidates[0]


def autograd_columns(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, rms: bool,
                     compile_too: bool) -> tuple[Callable[[], tuple], Union[Callable[[], tuple], str, None]]:
    """torch's backward of the eager forward and of its torch.compile: callables returning
    (grad_x, grad_weight[, grad_bias]) by ``torch.autograd.grad`` on graphs built once; in place
    of the second, why torch.compile failed (None without ``compile_too``)."""
    n = x.shape[-1]
    b = torch.zeros_like(w)

    def forward(x_: torch.Tensor, w_: torch.Tensor, b_: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x_, (n,), w_, eps) if rms else F.layer_norm(x_, (n,), w_, b_, eps)

    def grads_of(fn: Callable[..., torch.Tensor]) -> Callable[[], tuple]:
        leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
        with torch.enable_grad():
            y = fn(*leaves)
        wrt = leaves[:2] if rms else leaves
        return lambda: torch.autograd.grad(y, wrt, g, retain_graph=True)

    compiled: Union[Callable[[], tuple], str, None] = None
    if compile_too:
        torch._dynamo.reset()  # each case compiles afresh (no recompile limit across cases)
        try:
            compiled = grads_of(torch.compile(forward, dynamic=False))
        except Exception as exc:
            compiled = f"torch.compile failed: {type(exc).__name__}: {exc}"[:160]
    return grads_of(forward), compiled


# --- checks -------------------------------------------------------------------------------------------


def randn(shape: tuple[int, ...], dtype: torch.dtype, shift: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEVICE, dtype=torch.float32) * scale + shift).to(dtype)


def reference(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, rms: bool) -> tuple:
    """(grad_x, grad_weight, grad_bias or None) by torch's autograd in float64."""
    n = x.shape[-1]
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    b64 = torch.zeros_like(w64, requires_grad=True)
    with torch.enable_grad():
        y = F.rms_norm(x64, (n,), w64, eps) if rms else F.layer_norm(x64, (n,), w64, b64, eps)
        grads = torch.autograd.grad(y, (x64, w64) if rms else (x64, w64, b64), g.double())
    return grads if not rms else (*grads, None)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.detach().double().reshape(want.shape), want.detach().double()
    return float((g - w).norm() / w.norm().clamp_min(1e-300))


def nan_allocations():
    """torch.empty / torch.empty_like fill what they return with NaN while inside, so that an
    element a kernel leaves unwritten fails the check."""
    from hal.conformance.poison import filled_empties

    return filled_empties(lambda t: t.fill_(float("nan")) if t.is_floating_point() else t)


# --- report -------------------------------------------------------------------------------------------


def describe(cfg: Any, units: int) -> str:
    """A launch in a few characters: rows a block, warps, programs per SM, prefetch, options."""
    per_sm = cfg.programs / units
    opts = "".join(f" {k}={v}" for k, v in cfg.options)
    return f"m{cfg.block_m} w{cfg.num_warps} {per_sm:g}/SM{' prefetch' if cfg.prefetch else ''}{opts}"


def table(rows: list[Row], device: str) -> str:
    lines = [f"norm backward on {device}: median of 5 batches; % of a copy moving the same bytes, measured now",
             f"{'case':<42} {'launch':<44} {'us':>8} {'GB/s':>7} {'% copy':>7} {'spread':>7}  rel err"]
    for r in rows:
        errs = " ".join(f"{k}={v:.1e}" for k, v in r.rel_err.items())
        flag = ("" if r.ok else "  FAIL") + (f"  ({r.note})" if r.note else "")
        lines.append(f"{r.case:<42} {r.launch:<44} {r.us:>8.1f} {r.gbps:>7.0f} {100 * r.copy_fraction:>6.1f}% {100 * r.spread:>6.1f}%  {errs}{flag}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
