"""The FP8 casts that also write the transpose against copy bandwidth (issue 40: FP8 quantisation
kernels at >= 85% of copy bandwidth): every launch candidate of the CUDA plugin's tables for
hal_triton.fp8's transposed casts (``fp8_transpose_candidates``), the one the autotuner picks, in
one process on one GPU.

    python benchmarks/fp8_transpose_bw.py [--out DIR] [--only tensor,from_amax,amax,rows,blocks]
                                          [--format e4m3fn] [--shapes 4096x4096,4096x14336,14336x4096]

Cases: Llama-3-8B's FP8 casts of bfloat16 arrays (4096, 4096), (4096, 14336) and (14336, 4096) in
the transposed modes: ``tensor`` (fp8_quantize_transpose with current scaling: the amax pass, then
the encode), ``from_amax`` (fp8_quantize_transpose_from_amax: the encode alone, the amax given),
``amax`` (fp8_quantize_transpose_amax: delayed scaling's given scale, the amax reduced by the
cast), ``rows`` (row-wise current scaling: the amax pass per row and column, then the encode, both
on the candidate's tile) and ``blocks`` (128 x 128 blocks: fp8_blocks_kernel, which has one launch:
its row is the reference the issue quotes, 0.71 of copy on 2026-12-07). Per case:

1. Bytes: the fewest the cast must move, x read once and q and q_t written (scales ignored), as
   benchmarks/fp8.py counts them, whatever the passes; 100% is a device-to-device copy moving as
   many bytes (``dst.copy_(src)`` of half of them: ``x.clone()`` of that many bytes without the
   allocation), measured now (hal_bench.ceilings.copy_at).
2. Checks, before any timing: each candidate (the hardware cast where the mode uses it) with every
   output allocation filled with NaN (floats) and the format's NaN code (uint8) first, against the
   emulated cast of today's launch on the same GPU, bit for bit (q, scale, q_t, and scale_t or the
   amax); a candidate that differs is reported FAIL and the exit status is 1.
3. Times: CUDA events around batches of back-to-back calls of the host function (allocations
   included, as the op makes them) after a warm-up that compiles, L2 flushed between batches, the
   median of 5 batches (hal_bench.timing.Timer); today's launch is timed again last, so that the
   spread of one launch measured twice is beside the differences.

The autotuner tunes into a fresh cache directory (HAL_TRITON_CACHE_DIR, or a temporary one), so its
pick is measured now (``tensor`` and ``from_amax`` share a key: the same encode launch); with --out
(default $OUT) the cache file and the full results (JSON) are written there. Needs a CUDA GPU;
refuses without one (exit status 2). Not yet run on a GPU when written: expected under a minute on
an H100 (about 30 Triton compilations, 13 cases of ~10 timings of 0.1 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import bandwidth_run  # this script's folder is on sys.path when it runs
from bandwidth_run import dtype_name, plugin_kernel

#: (M, K) of every case by default: a Llama-3-8B layer's bf16 activations and weights
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
MODES = ("tensor", "from_amax", "amax", "rows", "blocks")
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")


@dataclasses.dataclass
class Row(bandwidth_run.Row):
    """One timed launch of one case, with how many elements differed from the emulated cast."""

    wrong: int = 0


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="write fp8_transpose_bw.json and the autotune cache here (default: $OUT if set)")
    p.add_argument("--only", default=",".join(MODES), help=f"comma-separated modes among {', '.join(MODES)} (default: all)")
    p.add_argument("--format", default="e4m3fn", help="the FP8 format (default e4m3fn)")
    p.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES), help="comma-separated MxK (default: Llama-3-8B's)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.only.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose among {', '.join(MODES)}")
    args.shape_list = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    cases = [functools.partial(run_case, mode, shape, args.format) for shape in args.shape_list for mode in args.modes]
    return bandwidth_run.run("fp8_transpose_bw", DEVICE, cases, table, args.out)


# --- the casts --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cast:
    """One transposed mode: its host function's call with a launch choice, and the op the CUDA plugin
    registers for it (whose first call of a problem tunes)."""

    mode: str
    op: str
    host: Callable[..., tuple]  # host(x, fmt, extra, hw, pick) -> the host function's results
    op_args: Callable[..., tuple]  # op_args(x, fmt, extra) -> the op's arguments
    scale_mode: Optional[int]  # fp8_encode_kernel's SCALE (None: no candidates)
    reduce_amax: bool = False


def casts() -> dict[str, Cast]:
    from hal_triton import fp8 as f8

    e = elementwise
    return {
        "tensor": Cast("tensor", "fp8_quantize_transpose",
                       lambda x, f, a, hw, p: f8.quantize(x, f, "tensor", None, 128, True, hw, **e(x), pick=p),
                       lambda x, f, a: (x, f, "tensor", None, 128), f8.S_TENSOR_AMAX),
        "from_amax": Cast("from_amax", "fp8_quantize_transpose_from_amax",
                          lambda x, f, a, hw, p: f8.quantize_from_amax(x, f, a["amax"], True, hw, **e(x), pick=p),
                          lambda x, f, a: (x, a["amax"], f), f8.S_TENSOR_AMAX),
        "amax": Cast("amax", "fp8_quantize_transpose_amax",
                     lambda x, f, a, hw, p: f8.quantize_amax(x, f, a["scale"], True, hw, **e(x), pick=p),
                     lambda x, f, a: (x, a["scale"], f), f8.S_TENSOR, reduce_amax=True),
        "rows": Cast("rows", "fp8_quantize_transpose",
                     lambda x, f, a, hw, p: f8.quantize(x, f, "row", None, 128, True, hw, **e(x), pick=p),
                     lambda x, f, a: (x, f, "row", None, 128), f8.S_ROW_AMAX),
        "blocks": Cast("blocks", "fp8_quantize_transpose",
                       lambda x, f, a, hw, p: f8.quantize(x, f, "block", None, 128, True, hw, **e(x), pick=p),
                       lambda x, f, a: (x, f, "block", None, 128), None),
    }


def elementwise(x: torch.Tensor) -> dict[str, int]:
    """The CUDA tables' elementwise launch of x, as the plugin's kernels pass it."""
    from hal_backend_cuda.launch import TABLES

    return TABLES.elementwise(x)


def candidates(x: torch.Tensor) -> tuple:
    """The CUDA tables' candidates for x's transposed casts (asked about a meta twin, so that a dry
    run on the CPU sees the GPU's list)."""
    from hal_backend_cuda.launch import TABLES

    twin = torch.empty(x.shape, dtype=x.dtype, device="meta")
    return TABLES.fp8_transpose_candidates(twin, int(x.shape[-2]), int(x.shape[-1]))


def fixed(cfg: Any) -> Callable[[str, Any, int], Any]:
    """A pick that always answers ``cfg``."""
    return lambda key, run, nbytes: cfg


# --- one case ---------------------------------------------------------------------------------------


def run_case(mode: str, shape: tuple[int, int], fmt: str, timer: Any) -> list[Row]:
    """Every launch of one case, checked and timed."""
    from hal_bench.ceilings import copy_at

    cast = casts()[mode]
    m, k = shape
    name = f"{mode} {fmt} {dtype_name(DTYPE)} ({m}, {k})"
    print(name, flush=True)
    x = (torch.randn(shape, device=DEVICE, dtype=torch.float32) * 3.0).to(DTYPE)
    extra = {"amax": x.float().abs().amax(), "scale": torch.tensor(0.01, device=DEVICE)}
    nbytes = (x.element_size() + 2) * x.numel()
    copy = copy_at(DEVICE, nbytes, timer)
    hw = DEVICE.type == "cuda"
    with poisoned(fmt):
        want = cast.host(x, fmt, extra, False, None)  # the emulated cast, today's launch
    cands = candidates(x)

    def measure(launch: str, fn: Callable[[], tuple]) -> Row:
        """fn run once (compiling, tuning), once more on poisoned allocations and checked, then timed."""
        row = Row(name, launch)
        try:
            fn()
            with poisoned(fmt):
                got = fn()
            row.wrong = wrong(got, want)
            row.ok = row.wrong == 0
            t = timer(fn)
        except Exception as exc:  # a launch that fails is reported, the others still run
            row.ok, row.note = False, f"{type(exc).__name__}: {exc}"[:160]
            return row
        return row.timed(t, nbytes, copy)

    if cast.scale_mode is None:  # fp8_blocks_kernel: its one launch, the reference row
        return [measure("its one launch (fp8_blocks_kernel)", lambda: cast.host(x, fmt, extra, hw, None))]
    out = []
    for i, cfg in enumerate(cands):
        out.append(measure(("today " if i == 0 else "") + describe(cfg), lambda cfg=cfg: cast.host(x, fmt, extra, hw, fixed(cfg))))
    picked = measure("autotuned", lambda: plugin_kernel(cast.op)(*cast.op_args(x, fmt, extra)))  # its first call tunes
    picked.launch = f"autotuned: {describe(picked_config(x, fmt, cast, cands))}"
    out.append(picked)
    out.append(measure(f"today again {describe(cands[0])}", lambda: cast.host(x, fmt, extra, hw, fixed(cands[0]))))
    return out


def picked_config(x: torch.Tensor, fmt: str, cast: Cast, cands: tuple) -> Any:
    """The launch the autotuner cached for this problem (today's where it did not tune)."""
    from hal_backend_cuda.launch import TABLES
    from hal_triton import autotune
    from hal_triton import fp8 as f8
    from hal_triton.config import Fp8TransposeConfig

    m, k = int(x.shape[-2]), int(x.shape[-1])
    hw = f8._hw_cast(x.device.type == "cuda", cast.scale_mode, True, 1, k)
    key = f8._transpose_key(x, 1, m, k, fmt, cast.scale_mode, hw, cast.reduce_amax)
    hit = autotune.cache_for(TABLES, x.device).get(key) if x.device.type == "cuda" else None
    return Fp8TransposeConfig(**hit["config"]) if hit else cands[0]


# --- checks -------------------------------------------------------------------------------------------


def poisoned(fmt: str):
    """torch.empty / torch.empty_like fill what they return while inside: uint8 with the format's
    NaN code, floats with NaN (x holds neither: an element a launch leaves unwritten shows as a
    wrong one)."""
    from hal.conformance.poison import filled_empties
    from hal.ops.fp8 import FORMATS

    code = FORMATS[fmt].nan_bits
    return filled_empties(lambda t: t.fill_(code) if t.dtype == torch.uint8 else t.fill_(float("nan")) if t.is_floating_point() else t)


def wrong(got: tuple, want: tuple) -> int:
    """Elements of ``got`` not bit for bit those of ``want`` (codes, scales, amax; NaN equal to NaN)."""
    if len(got) != len(want):
        return -1
    bad = 0
    for g, w in zip(got, want):
        g, w = g.reshape(w.shape), w
        same = (g == w) | (g.isnan() & w.isnan()) if g.is_floating_point() else g == w
        bad += int((~same).sum())
    return bad


# --- report -------------------------------------------------------------------------------------------


def describe(cfg: Any) -> str:
    """A launch in a few characters: rows x columns of a tile, warps."""
    return f"{cfg.block_r}x{cfg.block_c} w{cfg.num_warps}"


def table(rows: list[Row], device: str) -> str:
    lines = [f"FP8 transposed casts on {device}: median of 5 batches; % of a copy moving the same bytes (x read once, q and q_t written), "
             "measured now", f"{'case':<36} {'launch':<36} {'us':>8} {'GB/s':>7} {'% copy':>7} {'spread':>7}  check"]
    for r in rows:
        check = "bit for bit" if r.ok else (f"FAIL: {r.wrong} wrong" if r.wrong else "FAIL")
        note = f"  ({r.note})" if r.note else ""
        lines.append(f"{r.case:<36} {r.launch:<36} {r.us:>8.1f} {r.gbps:>7.0f} {100 * r.copy_fraction:>6.1f}% {100 * r.spread:>6.1f}%  "
                     f"{check}{note}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
