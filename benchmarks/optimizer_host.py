"""Host time of one optimizer step with loss scaling, hal against torch, on ResNet-50's parameters.

hal: ``hal.amp.DynamicLossScaler`` + ``hal.optim.AdamW`` (``unscale_``, ``step``, ``update``);
torch: ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``, the same three calls. The
parameters have the shapes of torchvision's ResNet-50 (161 tensors, 25.6 M values, float32, as
under autocast), with fresh random gradients. The host time is the clock from the first call to
the return of the last (nothing synchronises in between: on a GPU the step is only queued), the
median of many steps taken in interleaved rounds (hal's, torch's, hal's ...: a host whose speed
drifts, as the H200's does from call to call, drifts for both); on a GPU each side also runs one step under
``torch.cuda.set_sync_debug_mode("error")`` (a synchronisation would raise) and counts the
host-to-device copies of a step with torch.profiler.

    python benchmarks/optimizer_host.py [--device cuda] [--steps 50] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import hal


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50 (conv weights, batch-norm weights and biases, fc)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            width, cout = planes, planes * 4
            shapes += [(width, cin, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,), (cout, width, 1, 1), (cout,), (cout,)]
            if b == 0:
                shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
            cin = cout
    return shapes + [(1000, 2048), (1000,)]


def make(device: torch.device) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in resnet50_shapes()]
    for p in params:
        p.grad = torch.randn_like(p) * 1024.0  # scaled gradients
    return params


def hal_step(params: list[torch.nn.Parameter]) -> Callable[[], Any]:
    opt = hal.optim.AdamW(params, lr=1e-3)
    scaler = hal.amp.DynamicLossScaler(init_scale=1024.0)
    scaler.scale(params[0].sum())  # the scale lives on the params' device from here

    def step() -> None:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    return step


def torch_step(params: list[torch.nn.Parameter]) -> Callable[[], Any]:
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(params[0].device.type, init_scale=1024.0)
    scaler.scale(params[0].sum())

    def step() -> None:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    return step


def host_ms(step: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    """The host time of each of ``steps`` steps, in ms (the device drained before each)."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def h2d_copies(step: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "HtoD" in e.key)


def no_sync(step: Callable[[], Any]) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "none"
    except RuntimeError as exc:
        return f"synchronises: {str(exc).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of steps/rounds steps per side")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of hal's steps (where its host time goes)")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = resnet50_shapes()
    print(f"ResNet-50 parameters: {len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f} M values, {device}")
    names = ("hal (DynamicLossScaler + hal.optim.AdamW)", "torch (GradScaler + AdamW(fused=True))")
    steps = {name: build(make(device)) for name, build in zip(names, (hal_step, torch_step))}
    for step in steps.values():
        for _ in range(5):  # compile, tune, build tables
            step()
    # interleaved rounds: a host whose speed drifts within the run drifts for both sides alike
    times: dict[str, list[float]] = {name: [] for name in names}
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name] += host_ms(step, device, per_round)
    for name, step in steps.items():
        extra = ""
        if device.type == "cuda":
            extra = f", host-to-device copies per step: {h2d_copies(step)}, host synchronisation: {no_sync(step)}"
        print(f"{name}: host {statistics.median(times[name]):.3f} ms per step (median of {len(times[name])}){extra}", flush=True)
    hal_ms, torch_ms = (statistics.median(t) for t in times.values())
    print(f"ratio torch / hal host time: {torch_ms / hal_ms:.2f}x ({args.rounds} interleaved rounds)")
    if args.profile:
        _profile(hal_step(make(device)), args.steps)


def _profile(step: Callable[[], Any], steps: int) -> None:
    import cProfile
    import pstats

    for _ in range(5):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    print(f"-- cProfile of {steps} hal steps, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
