"""Training steps of the whole-model benchmark, eager PyTorch against hal with torch's autograd
recording its torch-made kernels (the default) and against hal with its own nodes throughout
(``HAL_TORCH_AUTOGRAD=0``), interleaved in one process: on a machine whose speed drifts, rounds of
the three variants side by side are the fair comparison. For the results table, not a test.

    python benchmarks/autograd_ab.py [resnet50_train,llama_train,moe_fwd_bwd] [--size cpu] [--rounds 6] [--steps 5] [--compile]

Prints, per model, the best step time of each variant over the rounds (ms) and eager / hal. With
``--compile``: torch.compile of the model without hal against torch.compile of the hal model
(whose decisions are made once, as its graphs are traced), interleaved the same way; the
inference workload ``resnet50_infer_fp16`` can be named too.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Optional

import torch

import hal
from hal_bench.models_llama import LlamaTrain
from hal_bench.models_moe import MoEForwardBackward
from hal_bench.models_resnet import ResNetInference, ResNetTrain

WORKLOADS = {"resnet50_train": ResNetTrain, "llama_train": LlamaTrain, "moe_fwd_bwd": MoEForwardBackward,
             "resnet50_infer_fp16": ResNetInference}


def _timed(step: Callable[[], Any], setting: Optional[str], steps: int, device: torch.device) -> float:
    if setting is not None:  # read when decisions are made: drop the cached ones
        os.environ["HAL_TORCH_AUTOGRAD"] = setting
        hal.dispatch.reset()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="?", default=",".join(WORKLOADS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default=None, help="model sizes (default: full on a GPU, cpu on the CPU)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile against hal under torch.compile")
    args = parser.parse_args()
    device = torch.device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "cpu")
    print(f"torch {torch.__version__}, {device}, sizes {size}, best of {args.rounds} rounds of {args.steps} steps")
    for name in args.models.split(","):
        if args.compile:
            _compiled_rounds(name, size, device, args.rounds, args.steps)
            continue
        eager = WORKLOADS[name](size).make("torch", None, device, 0)
        ours = WORKLOADS[name](size).make("hal", None, device, 0)
        best = {"eager": float("inf"), "hal (torch records)": float("inf"), "hal (its own nodes)": float("inf")}
        for _ in range(args.rounds):
            best["eager"] = min(best["eager"], _timed(eager, None, args.steps, device))
            best["hal (torch records)"] = min(best["hal (torch records)"], _timed(ours, "1", args.steps, device))
            best["hal (its own nodes)"] = min(best["hal (its own nodes)"], _timed(ours, "0", args.steps, device))
        os.environ.pop("HAL_TORCH_AUTOGRAD", None)
        hal.dispatch.reset()
        cells = ", ".join(f"{k} {v:.2f} ms" for k, v in best.items())
        ratios = f"eager / hal: {best['eager'] / best['hal (torch records)']:.3f}x (torch records), {best['eager'] / best['hal (its own nodes)']:.3f}x (own nodes)"
        print(f"{name}: {cells}; {ratios}", flush=True)


def _compiled_rounds(name: str, size: str, device: torch.device, rounds: int, steps: int) -> None:
    torch._dynamo.reset()
    steps_of = {"compile": WORKLOADS[name](size).make("torch", "default", device, 0),
                "hal+compile": WORKLOADS[name](size).make("hal", "default", device, 0)}
    best = {k: float("inf") for k in steps_of}
    for _ in range(rounds):
        for k, step in steps_of.items():
            best[k] = min(best[k], _timed(step, None, steps, device))
    cells = ", ".join(f"{k} {v:.2f} ms" for k, v in best.items())
    print(f"{name}: {cells}; compile / hal+compile: {best['compile'] / best['hal+compile']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
