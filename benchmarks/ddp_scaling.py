"""Data-parallel scaling: DistributedDataParallel with its default all-reduce, torch's fp16
compression hook and ``hal.dist.comm_hook``, on 1, 2, 4 (8) ranks with the per-rank batch fixed.

    python benchmarks/ddp_scaling.py                                   # gloo, 1 2 4 ranks, size cpu
    python benchmarks/ddp_scaling.py --worlds 1,2,4,8 --models llama
    python benchmarks/ddp_scaling.py --device cuda --worlds 1,2,4,8 --size full   # NCCL, a rank per GPU

The models are the training steps of the whole-model benchmark (``hal bench --models``), built by
its own builders (``hal_bench.models_resnet.build_resnet``, ``hal_bench.models_llama.Decoder`` with
torch's ops) at one of its sizes, with its autocast dtype and torch's fused AdamW; each rank draws
its own batch. Every variant starts from the same parameters. Per world size one group of ranks
runs every model and variant; the variants take turns, one batch of back-to-back steps each per
round, so noise and drift hit them alike. Step time is the median over rounds of the slowest rank's
time per step; throughput counts the items (images, tokens) of all ranks; efficiency is throughput
on N over N x throughput on 1 (per variant), and ``vs ddp`` the variant's throughput over DDP's
default at the same N.

On a CPU the ranks share the machine's cores (one torch thread each): past as many ranks as cores
the ranks queue for the cores, and efficiency is bounded by ``cores / N`` (the ``ceiling`` column),
whatever the communication costs. Such a run measures core oversubscription more than scaling.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hal.dist import launch as launcher

#: the communication variants, in the order of the table
VARIANTS = ("ddp", "torch_fp16", "hal_auto", "hal_fp16")
MODELS = ("resnet", "llama")
#: kept off in every rank on a GPU (this workplace's rule for its H200 machines)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _hook(variant: str) -> Optional[Callable[..., Any]]:
    """The comm hook of a variant (None: DDP's own all-reduce)."""
    import hal.dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "ddp": None,
        "torch_fp16": default_hooks.fp16_compress_hook,
        "hal_auto": hal.dist.comm_hook("auto"),
        "hal_fp16": hal.dist.comm_hook("compressed_fp16"),
    }[variant]


def _workload(name: str, size: str, device: torch.device, seed: int, rank: int) -> dict[str, Any]:
    """Model (built from ``seed``, the same on every rank), this rank's batch and the loss of a forward."""
    if name == "resnet":
        from hal_bench import models_resnet as mr

        w = mr.ResNetTrain(size)
        torch.manual_seed(seed)
        model = mr.build_resnet(w.cfg, size).to(device).to(memory_format=torch.channels_last).train()
        x = mr._images(w.cfg, seed + rank, device)
        y = torch.randint(0, w.cfg.classes, (w.cfg.batch,), generator=torch.Generator().manual_seed(seed + rank)).to(device)
        loss: Callable[[nn.Module], torch.Tensor] = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
    else:
        from hal_bench import models_llama as ml

        w = ml.LlamaTrain(size)
        torch.manual_seed(seed)
        model = ml.Decoder(w.cfg, ml.OPS["torch"]()).to(device)
        tokens = w._tokens(seed + rank, device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss = lambda m: m(inputs, targets)  # noqa: E731
    return {"model": model, "loss": loss, "items": w.items_per_step(), "amp": w.amp_dtype, "lr": w.lr, "eps": w.eps,
            "describe": w.describe()}


class _Trainer:
    """One variant: the DDP-wrapped model, its optimizer and its training step."""

    def __init__(self, work: dict[str, Any], variant: str, device: torch.device) -> None:
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(work["model"], device_ids=ids)
        hook = _hook(variant)
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=work["lr"], eps=work["eps"], fused=True)
        self.loss, self.amp, self.device = work["loss"], work["amp"], device

    def backward(self) -> None:
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
            loss = self.loss(self.ddp)
        loss.backward()

    def step(self) -> None:
        self.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def gradients(self, local: bool) -> list[torch.Tensor]:
        """One backward's gradients: this rank's own (``no_sync``) or the all-reduced average."""
        self.opt.zero_grad(set_to_none=True)
        if local:
            with self.ddp.no_sync():
                self.backward()
        else:
            self.backward()
        grads = [p.grad.detach().cpu().clone() for p in self.ddp.parameters()]
        self.opt.zero_grad(set_to_none=True)
        return grads


def run_rank(rank: int, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Inside one rank: every model and variant of ``cfg``; returns times, and gradients with ``record``.

    ``cfg``: models, variants, size, device, seed, warmup, steps, rounds, record. Times are the
    slowest rank's seconds per step, one per round; ``record`` adds, per model, this rank's local
    gradients of the first batch and each variant's all-reduced ones (before any optimizer step).
    """
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {"models": {}}
    for name in cfg["models"]:
        works = {v: _workload(name, cfg["size"], device, cfg["seed"], rank) for v in cfg["variants"]}
        trainers = {v: _Trainer(work, v, device) for v, work in works.items()}
        first = works[cfg["variants"][0]]
        entry: dict[str, Any] = {"describe": first["describe"], "items": first["items"], "times": {v: [] for v in trainers}}
        if cfg["record"]:
            entry["local"] = trainers[cfg["variants"][0]].gradients(local=True)
            entry["grads"] = {v: t.gradients(local=False) for v, t in trainers.items()}
        for t in trainers.values():
            for _ in range(cfg["warmup"]):  # the first steps build DDP's buckets and the optimizer state
                t.step()
        for _ in range(cfg["rounds"]):
            for v, t in trainers.items():  # one batch of each variant in turn
                sync()
                dist.barrier()
                started = time.perf_counter()
                for _ in range(cfg["steps"]):
                    t.step()
                sync()
                entry["times"][v].append((time.perf_counter() - started) / cfg["steps"])
        for v, ts in entry["times"].items():  # the slowest rank's time of each round
            slowest = torch.tensor(ts, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            entry["times"][v] = slowest.tolist()
        out["models"][name] = entry
    return out


def measure(world: int, cfg: dict[str, Any], timeout_s: float = 1800.0) -> list[dict[str, Any]]:
    """Start ``world`` ranks running :func:`run_rank`; every rank's result (raises if one failed)."""
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    env = NO_MULTICAST if backend == "nccl" else {}
    results = launcher.launch(run_rank, world, (cfg,), backend=backend, timeout_s=timeout_s, env=env, threads=cfg["threads"])
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError("\n".join(f"rank {r.rank}: {r.message}\n{r.traceback}" for r in failed))
    return [r.value for r in results]


def table(per_world: dict[int, dict[str, Any]], cfg: dict[str, Any], cores: int) -> str:
    """The printed table: per model, per variant and world size, step time, throughput, efficiency."""
    lines = []
    for name in cfg["models"]:
        first = per_world[min(per_world)]["models"][name]
        lines += ["", f"## {name}: {first['describe']}; {first['items']} items per rank and step"]
        lines.append(f"{'variant':<11} {'ranks':>5} {'step(ms)':>9} {'spread(ms)':>13} {'items/s':>10} {'efficiency':>10} {'vs ddp':>7} {'ceiling':>8}")
        base = {v: None for v in cfg["variants"]}
        for v in cfg["variants"]:
            for world in sorted(per_world):
                entry = per_world[world]["models"][name]
                ts = entry["times"][v]
                t, t_ddp = statistics.median(ts), statistics.median(entry["times"]["ddp"]) if "ddp" in entry["times"] else None
                rate = world * entry["items"] / t
                if world == 1:
                    base[v] = rate
                eff = f"{rate / (world * base[v]):>10.3f}" if base[v] else f"{'-':>10}"
                vs = f"{t_ddp / t:>7.3f}" if t_ddp else f"{'-':>7}"
                ceiling = min(1.0, cores / world) if cfg["device"] == "cpu" else 1.0
                lines.append(
                    f"{v:<11} {world:>5} {t * 1e3:>9.1f} {min(ts) * 1e3:>6.1f}-{max(ts) * 1e3:<6.1f} {rate:>10.1f} {eff} {vs} {ceiling:>8.2f}"
                )
    return "\n".join(lines)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in _csv(s)], default=[1, 2, 4], help="rank counts (default 1,2,4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL, a rank per GPU")
    parser.add_argument("--models", type=_csv, default=list(MODELS), help="resnet,llama")
    parser.add_argument("--variants", type=_csv, default=list(VARIANTS), help=",".join(VARIANTS) + " (ddp is the baseline)")
    parser.add_argument("--size", choices=("full", "cpu", "tiny"), default=None, help="model size (default: full on cuda, cpu on the CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed batch")
    parser.add_argument("--rounds", type=int, default=3, help="timed batches per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for bad, known in ((set(args.models) - set(MODELS), MODELS), (set(args.variants) - set(VARIANTS), VARIANTS)):
        if bad:
            parser.error(f"unknown {', '.join(sorted(bad))}; choose from {', '.join(known)}")
    if "ddp" not in args.variants:
        args.variants.insert(0, "ddp")
    cfg = {
        "models": args.models, "variants": args.variants, "size": args.size or ("full" if args.device == "cuda" else "cpu"),
        "device": args.device, "seed": args.seed, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
        "threads": args.threads, "record": False,
    }
    if args.device == "cuda" and torch.cuda.device_count() < max(args.worlds):
        parser.error(f"--worlds up to {max(args.worlds)} needs as many GPUs; torch sees {torch.cuda.device_count()}")
    launcher.PRELOAD.append("torch._dynamo")  # DDP imports it: once in the fork server, not per rank
    cores = os.cpu_count() or 1
    engine = "NCCL" if args.device == "cuda" else "gloo"
    print(f"# DDP scaling on {engine} ({args.device}), torch {torch.__version__}, {cores} CPU cores, "
          f"{args.threads} torch thread(s) per rank, size {cfg['size']}; step = median of {args.rounds} rounds "
          f"of {args.steps} steps, slowest rank")
    if args.device == "cpu":
        print(f"# the ranks share {cores} cores: from {cores + 1} ranks on they queue for them, and efficiency "
              "cannot exceed the ceiling column (cores / ranks): this measures core oversubscription, not the network")
    per_world = {}
    for world in args.worlds:
        started = time.monotonic()
        per_world[world] = measure(world, cfg)[0]
        print(f"# {world} rank(s): {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print(table(per_world, cfg, cores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
