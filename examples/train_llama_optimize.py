"""Train a small Llama-style decoder with one call that makes the step fast: ``hal.optimize``.

    python examples/train_llama_optimize.py                     # 100 steps, measured choice
    python examples/train_llama_optimize.py --dtype bfloat16 --compile off --steps 20

The model is plain PyTorch (token embedding, pre-norm blocks with ``nn.RMSNorm``, rotary causal
attention through ``F.scaled_dot_product_attention``, a SwiGLU MLP written as Llama's
``gate_proj``/``up_proj``/``down_proj``/``act_fn``, an LM head) and the optimizer is
``torch.optim.AdamW``. The training loop is the usual one with its four lines (forward and loss,
backward, step, zero_grad) replaced by ``loss = step(tokens, targets)``:

    step = hal.optimize(model, optimizer, loss_fn=next_token_loss, amp=torch.bfloat16)
    for tokens, targets in batches:
        loss = step(tokens, targets)
    print(step.explain())

``hal.optimize`` builds two variants of the step: your model and AdamW untouched, and hal's
rewrite (``hal.nn.fuse``, or ``hal.nn.patch`` where torch.fx cannot trace the model, with
``hal.optim.AdamW``: the same update, one fused op). On the first batch it measures each variant
in each way to run it (eager, ``torch.compile``, and on a GPU the whole step as a CUDA graph, alone
or with compile) and keeps the fastest, so the step is never slower than your own; ``explain()``
prints each decision with its reason and every candidate's measured time. The data are sequences that follow a fixed
rule (each token determines the next), so the loss falls quickly.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import hal


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, d))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves rotated (as Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MLP(nn.Module):
    """Llama's SwiGLU MLP (the structure hal.nn.patch recognises)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attn, self.mlp = Attention(dim, heads), MLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Embedding, blocks, final RMSNorm, LM head; ``forward(tokens)`` returns the logits."""

    def __init__(self, vocab: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, hidden: int = 176, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.arange(seq, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch_of(batch: int, seq: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences following ``next = (5 * token + 3) % vocab`` from a random start, with 5% noise."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = [start]
    for _ in range(seq):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    seqs = torch.cat(tokens, dim=1)
    noise = torch.rand(seqs.shape, generator=generator) < 0.05
    seqs = torch.where(noise, torch.randint(0, vocab, seqs.shape, generator=generator), seqs)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="autocast dtype (float32: none)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="auto: measured on the first batch")
    parser.add_argument("--graph", choices=("auto", "on", "off"), default="auto", help="whole-step CUDA graph (GPU only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)
    choice = {"auto": None, "on": True, "off": False}

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = Decoder(vocab=args.vocab, seq=args.seq).to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    step = hal.optimize(model, optimizer, loss_fn=next_token_loss, amp=None if args.dtype == "float32" else torch.bfloat16,
                        compile=choice[args.compile], graph=choice[args.graph])

    loss_value, start = float("nan"), time.perf_counter()
    for i in range(1, args.steps + 1):
        tokens, targets = (t.to(args.device) for t in batch_of(args.batch, args.seq, args.vocab, gen))
        loss = step(tokens, targets)  # forward, loss, backward, AdamW step, zero_grad
        if i == 1:
            print(step.explain() + "\n")
        if i % args.log_every == 0 or i == args.steps:
            loss_value = float(loss)  # reading the loss synchronises: only when printing
            print(f"step {i:4d}  loss {loss_value:.4f}  ({time.perf_counter() - start:.1f} s)")
    # checkpoint from step.optimizer (the one that steps: yours, or hal's AdamW where it won) and the model passed in
    state = {"model": model.state_dict(), "optimizer": step.optimizer.state_dict()}
    print(f"\ncheckpoint: {len(state['model'])} model tensors, optimizer state of {len(state['optimizer']['state'])} parameters")
    print(f"the step ran as: {step.report.chosen}")
    return loss_value


if __name__ == "__main__":
    main()
