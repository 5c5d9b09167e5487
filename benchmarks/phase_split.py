"""Where the host time of a Llama training step goes, phase by phase: the forward call, the backward
call and the optimizer step, timed on the host without synchronising, next to the step's wall time
(the step is host-bound where the phases' sum is close to it).

Each model (torch's ops or hal's, under torch.compile's default mode or eager) runs with each
optimizer (torch's fused AdamW, hal's), so the optimizer's share of a difference between the
torch.compile and hal+compile columns of ``hal bench --models`` shows apart from the model's. The
variants alternate round by round in one process (the device host's speed drifts between calls).

    python benchmarks/phase_split.py [--size full] [--rounds 5] [--steps 10] [--eager] [--device cuda] [--profile 20]

``--profile N``: after the timed rounds, cProfile N steps of each variant and print the functions
with the most host time of their own, and the share of the step spent under ``hal``'s code.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import hal
from hal_bench.models_llama import LlamaTrain
from hal_bench.timing import print_host_profile
from hal_bench.workload import compiled

PHASES = ("forward", "backward", "optimizer")


def make_variant(workload: LlamaTrain, impl: str, optimizer: str, mode: str | None, device: torch.device) -> Callable[[], dict[str, float]]:
    """One training step of ``impl``'s model with ``optimizer``'s AdamW, returning each phase's host
    seconds."""
    model = workload._decoder(impl, device, 0)
    params = list(model.parameters())
    if optimizer == "hal":
        opt: torch.optim.Optimizer = hal.optim.AdamW(params, lr=workload.lr, eps=workload.eps)
    else:
        opt = torch.optim.AdamW(params, lr=workload.lr, eps=workload.eps, fused=True)
    tokens = workload._tokens(0, device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    forward = compiled(model, mode)
    amp = workload.amp_dtype

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):  # as LlamaTrain's step
            loss = forward(inputs, targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--device", default="cuda", help="cuda; cpu (with --size cpu) checks the script")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile N steps of each variant")
    args = parser.parse_args()
    device = torch.device(args.device)
    mode = None if args.eager else "default"
    workload = LlamaTrain(args.size)
    variants = {(impl, opt): make_variant(workload, impl, opt, mode, device) for impl in ("torch", "hal") for opt in ("torch", "hal")}
    for step in variants.values():  # compile, tune, allocate
        for _ in range(3):
            step()
    host: dict[tuple, list[dict[str, float]]] = {k: [] for k in variants}
    step_ms: dict[tuple, list[float]] = {k: [] for k in variants}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.rounds):
        for key, step in variants.items():
            sync()
            t0 = time.perf_counter()
            phases = [step() for _ in range(args.steps)]
            sync()
            step_ms[key].append((time.perf_counter() - t0) / args.steps * 1e3)
            host[key].append({p: statistics.median(ph[p] for ph in phases) for p in PHASES})
    label = "eager" if args.eager else "torch.compile"
    print(f"Llama training step ({workload.describe()}), model under {label}; medians over {args.rounds} alternating rounds of {args.steps} steps")
    print(f"{'model':>6} {'AdamW':>6} | " + " ".join(f"{p + ' ms':>13}" for p in PHASES) + f" | {'host ms':>8} {'step ms':>8}")
    for key in variants:
        per_phase = {p: statistics.median(r[p] for r in host[key]) * 1e3 for p in PHASES}
        total = sum(per_phase.values())
        print(f"{key[0]:>6} {key[1]:>6} | " + " ".join(f"{per_phase[p]:13.2f}" for p in PHASES)
              + f" | {total:8.2f} {statistics.median(step_ms[key]):8.2f}")
    for key, step in variants.items():
        if args.profile:
            print_host_profile(f"{key[0]} model, {key[1]} AdamW", step, args.profile, sync)


if __name__ == "__main__":
    main()
