"""Train a small Llama-style mixture-of-experts decoder with data x tensor x pipeline x expert parallelism.

    torchrun --standalone --nproc-per-node 8 examples/train_parallel_llama.py              # dp 2 x tp 2 x pp 2
    torchrun --standalone --nproc-per-node 4 examples/train_parallel_llama.py --dp 1 --tp 2 --pp 2
    python examples/train_parallel_llama.py                                               # the same model on one process

CPU processes on gloo. The ranks form a
``DeviceMesh`` (pp, dp, tp); global rank = (pp_index * dp + dp_index) * tp + tp_index.

* tensor parallelism (``tp``): the attention's q/k/v projections column-parallel and o row-parallel
  (``hal.parallel.parallelize`` with a plan), the embedding and the LM head + cross-entropy
  vocabulary-parallel (``VocabParallelEmbedding``, ``VocabParallelLMHead``: no rank holds all logits);
* expert parallelism: each block's MLP is an ``ExpertParallelMoE`` (top-2 of 8 SwiGLU experts)
  whose experts are spread over the dp x tp ranks of its pipeline stage; the tensor-parallel ranks
  hold the same activations, so each routes its half of the sequence (``scatter_to_parallel``) and
  gathers the outputs back (``gather_from_parallel``);
* pipeline parallelism (``pp``): the decoder cut into stages (``PipelineParallel``, 1F1B by default),
  the MoE's auxiliary load-balancing loss attached to its output's gradient (``aux_loss_coef``),
  since the loss is computed on the last stage;
* data parallelism (``dp``): each replica its own sequences; the dense gradients averaged over the
  data-parallel group, the routers' summed over the expert-parallel group (each rank saw its tokens
  only), the experts' divided by dp (the exchange already summed every replica's tokens).

Every collective goes through ``hal.dist``; the local compute is hal's ops (RMSNorm, rotary, SDPA,
the grouped-GEMM experts, the fused LM head + loss). The printed loss (the cross-entropy, averaged
over replicas) follows the one-process run of the same model on the same data step by step:
``tests/parallel/test_example_parallel_llama.py`` checks 20 steps of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import hal
import hal.dist as hd
from hal.parallel import comm
from hal.parallel.expert import ExpertParallelMoE
from hal.parallel.pipeline import PipelineParallel


@dataclasses.dataclass
class Config:
    dp: int = 2
    tp: int = 2
    pp: int = 2
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 4
    ffn: int = 32
    experts: int = 8
    top_k: int = 2
    seq: int = 8
    batch: int = 4  # sequences per data-parallel replica and step
    microbatches: int = 2
    schedule: str = "1f1b"
    steps: int = 20
    lr: float = 1e-2
    aux: float = 0.01  # weight of the load-balancing loss
    dtype: str = "float32"
    seed: int = 0
    overlap_chunks: int = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# --- the model ------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm block: rotary causal attention, then a mixture of SwiGLU experts; hal ops throughout."""

    def __init__(self, cfg: Config, layer: int, ep_group: Any, tp_group: Any) -> None:
        super().__init__()
        d, dt = cfg.dim, cfg.torch_dtype
        self.head_dim, self.eps, self.tp_group = d // cfg.heads, 1e-5, tp_group
        self.attn_norm = nn.Parameter(torch.ones(d, dtype=dt))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False, dtype=dt) for _ in range(4))
        self.mlp_norm = nn.Parameter(torch.ones(d, dtype=dt))
        # the tensor-parallel ranks each route half of the sequence: each rank's share of the aux loss is halved
        coef = cfg.aux / (1 if tp_group is None else comm.group_size(tp_group))
        self.moe = ExpertParallelMoE(d, cfg.ffn, cfg.experts, cfg.top_k, group=ep_group, aux_loss_coef=coef,
                                     overlap_chunks=cfg.overlap_chunks, seed=cfg.seed * 1000 + layer, dtype=dt)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = hal.ops.rms_norm(x, (d,), self.attn_norm, self.eps)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = hal.ops.rotary_embedding(q, cos, sin), hal.ops.rotary_embedding(k, cos, sin)
        a = hal.ops.scaled_dot_product_attention(q, k, v, None, True)  # this rank's heads
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = hal.ops.rms_norm(x, (d,), self.mlp_norm, self.eps)
        if self.tp_group is not None:
            h = comm.scatter_to_parallel(h, 1, self.tp_group)
        y = self.moe(h)
        if self.tp_group is not None:
            y = comm.gather_from_parallel(y, 1, self.tp_group, grad_reduce=False)
        return x + y


class Decoder(nn.Module):
    """Embedding, blocks, final RMSNorm, LM head; ``forward(tokens, targets)`` is the mean cross-entropy."""

    def __init__(self, cfg: Config, ep_group: Any = None, tp_group: Any = None) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)  # the dense weights: the same full model on every rank, then sharded
        d, dt = cfg.dim, cfg.torch_dtype
        self.eps = 1e-5
        self.embed = nn.Embedding(cfg.vocab, d, dtype=dt)
        self.blocks = nn.ModuleList(Block(cfg, i, ep_group, tp_group) for i in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(d, dtype=dt))
        self.lm_head = nn.Linear(d, cfg.vocab, bias=False, dtype=dt)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2 and "moe" not in name:
                    nn.init.normal_(p, std=0.5 if p is self.embed.weight else d**-0.5)
        half = d // cfg.heads // 2
        inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.seq, dtype=torch.float64)[:, None] * inv[None]
        self.register_buffer("cos", angles.cos().to(dt), persistent=False)
        self.register_buffer("sin", angles.sin().to(dt), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t])
        h = hal.ops.rms_norm(x, (x.shape[-1],), self.norm, self.eps).reshape(-1, x.shape[-1])
        return hal.ops.linear_cross_entropy(h, self.lm_head.weight, targets.reshape(-1))


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's sequences of every replica (dp * batch rows): each token fixes the next one
    (``next = (5 * token + 3) % vocab``), starting from random tokens, so the loss can fall."""
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    start = torch.randint(0, cfg.vocab, (cfg.dp * cfg.batch, 1), generator=g)
    seqs = [start]
    for _ in range(cfg.seq):
        seqs.append((5 * seqs[-1] + 3) % cfg.vocab)
    full = torch.cat(seqs, 1)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()


# --- one process ----------------------------------------------------------------------------------


def train_one_process(cfg: Config, log: bool = True) -> list[float]:
    """The reference: the whole model, every replica's sequences, the same microbatches accumulated."""
    model = Decoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    per = cfg.batch // cfg.microbatches
    losses = []
    for step in range(cfg.steps):
        tokens, targets = batch(cfg, step)
        opt.zero_grad()
        total = 0.0
        for m in range(cfg.microbatches):  # microbatch m: rows m of every replica, as the pipeline splits them
            rows = torch.cat([torch.arange(r * cfg.batch + m * per, r * cfg.batch + (m + 1) * per) for r in range(cfg.dp)])
            loss = model(tokens[rows], targets[rows])
            loss.backward()
            total += float(loss.detach()) / cfg.microbatches
        for p in model.parameters():  # the mean over microbatches, as the pipeline schedules scale gradients
            p.grad /= cfg.microbatches  # (after accumulating: the attached aux-loss gradients are scaled too)
        opt.step()
        losses.append(total)
        if log:
            print(f"step {step:3d}  loss {total:.6f}", flush=True)
    return losses


# --- data x tensor x pipeline x expert parallel ---------------------------------------------------


def _groups(cfg: Config, world: int) -> tuple[Any, Any, Any, Any, tuple[int, int, int]]:
    """(pp, dp, tp, ep) process groups of this rank and its (pp, dp, tp) coordinates."""
    from torch.distributed.device_mesh import init_device_mesh

    if world != cfg.dp * cfg.tp * cfg.pp:
        raise hal.InvalidArgumentError("train_parallel_llama", "world size", f"dp x tp x pp = {cfg.dp * cfg.tp * cfg.pp} processes", str(world))
    mesh = init_device_mesh("cpu", (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    coords = (rank // (cfg.dp * cfg.tp), rank // cfg.tp % cfg.dp, rank % cfg.tp)
    ep = None
    for p in range(cfg.pp):  # the experts of a stage live on its dp x tp ranks; every rank creates every group
        g = dist.new_group(list(range(p * cfg.dp * cfg.tp, (p + 1) * cfg.dp * cfg.tp)))
        ep = g if p == coords[0] else ep
    return mesh.get_group("pp"), mesh.get_group("dp"), mesh.get_group("tp"), ep, coords


def parallel_model(cfg: Config, tp_group: Any, ep_group: Any) -> Decoder:
    """The decoder with its attention, embedding and LM head split over ``tp_group`` and its
    experts over ``ep_group``."""
    from hal.parallel import ColwiseParallel, RowwiseParallel, VocabParallelEmbedding, VocabParallelLMHead, parallelize

    model = Decoder(cfg, ep_group, tp_group if cfg.tp > 1 else None)
    if cfg.tp > 1:
        plan = {f"blocks.*.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan["blocks.*.o_proj"] = RowwiseParallel()
        parallelize(model, tp_group, plan)
        model.embed = VocabParallelEmbedding.from_embedding(model.embed, tp_group)
        model.lm_head = VocabParallelLMHead.from_linear(model.lm_head, tp_group)
    return model


def _sync_gradients(params: list[nn.Parameter], model: Decoder, cfg: Config, dp_group: Any, ep_group: Any) -> None:
    """Data parallelism's reduction, one flat all-reduce per kind of parameter."""
    routers = {id(b.moe.router) for b in model.blocks}
    experts = {id(p) for b in model.blocks for p in b.moe.expert_parameters()}
    dense = [p for p in params if id(p) not in routers and id(p) not in experts]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)

    def flat_reduce(ps: list[nn.Parameter], group: Any, op: str, scale: float) -> None:
        if not ps:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        if comm.group_size(group) > 1:
            hd.all_reduce(flat, op=op, group=group)
        flat *= scale
        for p, g in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p))

    flat_reduce(dense, dp_group, "avg", 1.0)
    flat_reduce([p for p in params if id(p) in routers], ep_group, "sum", 1.0 / cfg.dp)
    for p in params:
        if id(p) in experts:
            p.grad /= cfg.dp


def train_parallel(cfg: Config, log: bool = True) -> list[float]:
    """This rank's part of the parallel run (a process group must exist); the loss of every step."""
    world = dist.get_world_size()
    pp_group, dp_group, tp_group, ep_group, (pp_i, dp_i, tp_i) = _groups(cfg, world)
    model = parallel_model(cfg, tp_group, ep_group)
    per = cfg.batch // cfg.microbatches
    act = torch.empty(per, cfg.seq, cfg.dim, dtype=cfg.torch_dtype, device="meta")
    pipe = PipelineParallel(model, pp_group, microbatch=torch.zeros(per, cfg.seq, dtype=torch.int64), n_microbatches=cfg.microbatches,
                            schedule=cfg.schedule, activation=act)
    params = pipe.parameters()
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        started = time.monotonic()
        tokens, targets = batch(cfg, step)
        mine = slice(dp_i * cfg.batch, (dp_i + 1) * cfg.batch)
        opt.zero_grad()
        loss = pipe.step(tokens[mine], target=targets[mine])
        _sync_gradients(params, model, cfg, dp_group, ep_group)
        opt.step()
        # the replicas' mean loss, from the last stage's ranks (tp rank 0 of each replica) to all
        report = torch.zeros((), dtype=torch.float64)
        if loss is not None and tp_i == 0:
            report += float(loss) / cfg.dp
        hd.all_reduce(report)
        losses.append(float(report))
        if log and dist.get_rank() == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}  ({time.monotonic() - started:.2f} s)", flush=True)
    return losses


def train_rank(rank: int, world: int, options: dict[str, Any]) -> list[float]:
    """Entry for ``hal.dist.launch`` (the tests): the process group exists; ``options`` are Config fields."""
    return train_parallel(Config(**options), log=False)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Config):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--out", help="write the loss curve here as JSON (rank 0)")
    args = parser.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    # hal's CPU kernels in numba keep a thread pool per process; with one process per core they
    # would oversubscribe the cores (numba reads this when it is first used, after this line)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    if world == 1:
        print(f"one process: the whole model, {cfg.dp} replicas' sequences, {cfg.microbatches} microbatches", flush=True)
        losses = train_one_process(cfg)
        first = True
    else:
        dist.init_process_group("gloo")
        first = dist.get_rank() == 0
        if first:
            print(f"{world} processes: dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} ({cfg.schedule}), experts over dp x tp", flush=True)
        losses = train_parallel(cfg)
        dist.destroy_process_group()
    if first:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"config": dataclasses.asdict(cfg), "losses": losses}, fh)


if __name__ == "__main__":
    main()
