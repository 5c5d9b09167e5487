"""Gradient reduction overlapped with the backward, or not: step time of DDP and FSDP on hal's collectives.

    python benchmarks/data_overlap.py                         # 2 gloo ranks on this CPU
    python benchmarks/data_overlap.py --world 4 --layers 12 --width 1024 --json out.json

Four variants of one model (a stack of ``hal.nn.Linear`` blocks with GELU epilogues, the same on every
rank, each rank its own batch), from :mod:`hal.parallel.data`:

* ``ddp_overlap``: DDP buckets reduced asynchronously by ``hal.dist.comm_hook`` while the backward runs;
* ``ddp_serial``: the same buckets, each reduced before the backward goes on (``overlap=False``);
* ``fsdp_blocks``: ``fully_shard`` per block (reduce-scatter as the backward leaves each block);
* ``fsdp_root``: one FSDP unit (one all-gather, one reduce-scatter after the whole backward).

The variants take turns, ``--steps`` back-to-back steps each per round, so drift hits them alike.
Step time is the median over rounds of the slowest rank's time per step. ``overlap gain`` is the
serial variant's step time over the overlapped one's. On a CPU the ranks share the cores (one torch
thread each, gloo's threads beside them), so the gain says what overlap buys there, not on a GPU;
FSDP on a CPU waits for each collective where it issues it (no side streams), so its two variants
differ in the number and size of collectives only. The GPU variant (NCCL, one rank per GPU) runs
the same code with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from hal.dist import launch as launcher

VARIANTS = ("ddp_overlap", "ddp_serial", "fsdp_blocks", "fsdp_root")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        import hal

        self.up = hal.nn.Linear(width, width, act="gelu")
        self.down = hal.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.up(x))


class Stack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return x


def _wrap(variant: str, model: nn.Module, bucket_mb: float) -> nn.Module:
    from hal.parallel import data

    if variant.startswith("ddp"):
        return data.data_parallel(model, overlap=variant == "ddp_overlap", bucket_cap_mb=bucket_mb)
    return data.fully_shard_model(model, overlap=variant == "fsdp_blocks")


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every variant's time per step on this rank, per round (seconds), and its last loss."""
    import torch.distributed as dist

    import hal.dist as hd

    device = torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg["seed"])
    base = Stack(cfg["layers"], cfg["width"]).to(device)
    g = torch.Generator(device="cpu").manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
    models = {v: _wrap(v, copy.deepcopy(base), cfg["bucket_mb"]) for v in cfg["variants"]}
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in models.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(v: str) -> float:
        loss = models[v](x).square().mean()
        opts[v].zero_grad()
        loss.backward()
        opts[v].step()
        return loss.detach()

    losses = {}
    for v in cfg["variants"]:
        for _ in range(cfg["warmup"]):
            losses[v] = float(step(v))
    times: dict[str, list[float]] = {v: [] for v in cfg["variants"]}
    for _ in range(cfg["rounds"]):
        for v in cfg["variants"]:
            dist.barrier()
            sync()
            started = time.perf_counter()
            for _ in range(cfg["steps"]):
                last = step(v)
            sync()
            mine = torch.tensor([(time.perf_counter() - started) / cfg["steps"]], dtype=torch.float64, device=device)
            hd.all_reduce(mine, op="max")  # the slowest rank sets the step time
            times[v].append(float(mine))
            losses[v] = float(last)
    return {"times": times, "loss": losses}


def measure(world: int, cfg: dict[str, Any], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    launcher.PRELOAD.append("torch._dynamo")
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    env = NO_MULTICAST if backend == "nccl" else {}
    results = launcher.launch(rank_main, world, (cfg,), backend=backend, timeout_s=timeout_s, env=env, threads=cfg.get("threads", 1))
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    if bad:
        raise RuntimeError("\n".join(bad))
    return [r.value for r in results]


def table(result: dict[str, Any], cfg: dict[str, Any], world: int) -> str:
    med = {v: statistics.median(result["times"][v]) for v in cfg["variants"]}
    params = cfg["layers"] * 2 * (cfg["width"] ** 2 + cfg["width"])
    lines = [f"{world} {cfg['device']} ranks, {cfg['layers']} blocks of width {cfg['width']} ({params * 4 / 2**20:.1f} MiB of float32 "
             f"gradients), batch {cfg['batch']} per rank, DDP buckets of {cfg['bucket_mb']} MiB; median of {cfg['rounds']} rounds",
             f"{'variant':<12} {'ms/step':>9}  {'overlap gain':>12}"]
    pairs = {"ddp_overlap": "ddp_serial", "fsdp_blocks": "fsdp_root"}
    for v in cfg["variants"]:
        partner = pairs.get(v)
        gain = f"{med[partner] / med[v]:.2f}x" if partner in med else ""
        lines.append(f"{v:<12} {med[v] * 1e3:>9.2f}  {gain:>12}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the per-round times here")
    a = p.parse_args(argv)
    cfg = {"device": a.device, "layers": a.layers, "width": a.width, "batch": a.batch, "bucket_mb": a.bucket_mb, "steps": a.steps,
           "rounds": a.rounds, "warmup": a.warmup, "threads": a.threads, "seed": a.seed,
           "variants": [v for v in a.variants.split(",") if v]}
    unknown = set(cfg["variants"]) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    results = measure(a.world, cfg)
    print(table(results[0], cfg, a.world))
    print(f"(this machine: {os.cpu_count()} CPUs, torch {torch.__version__})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "world": a.world, "rank0": results[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
