"""Mixtral-style mixture-of-experts layer: forward + backward in bfloat16 (float32 at size tiny).

Top-2 routing as Mixtral's: router logits, softmax in float32, the two largest probabilities
renormalised to sum to one. The token copies are sorted by expert (a stable argsort) and counted per
expert without a host synchronisation; each expert is a SwiGLU MLP (one ``(d, 2f)`` gate-and-up
weight, one ``(f, d)`` down weight), and the outputs are weighted and summed back per token. The
routing is the same torch code in every implementation; the experts differ:

- ``torch`` (eager's peer, as Mixtral's reference code runs): the counts read on the host (one
  synchronisation), one matrix product per expert over its slice of tokens;
- ``hal``: two ``hal.ops.grouped_gemm`` calls around ``hal.ops.swiglu``, the group sizes on the
  device;
- ``grouped_mm``: ``torch._grouped_mm`` (torch's own grouped GEMM, offsets on the device), where this
  torch has it.

Liger-Kernel has no MoE kernel (its Mixtral patch replaces the norms, RoPE, the experts' SwiGLU and the
loss, not the expert GEMMs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .workload import NotApplicable, Step, Variant, Workload, compiled, data_generator

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    tokens: int
    dim: int
    ffn: int
    experts: int
    top_k: int = 2


CONFIGS = {
    "full": MoEConfig(tokens=4096, dim=4096, ffn=14336, experts=8),
    "cpu": MoEConfig(tokens=512, dim=128, ffn=256, experts=8),
    "tiny": MoEConfig(tokens=24, dim=16, ffn=24, experts=4),
}


def experts_loop(xs: torch.Tensor, sizes: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One matrix product per expert over its rows (the counts read on the host)."""
    outs = []
    for e, chunk in enumerate(xs.split(sizes.tolist())):
        gate, up = (chunk @ w_gate_up[e]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w_down[e])
    return torch.cat(outs)


def experts_hal(xs: torch.Tensor, sizes: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    import hal

    gate, up = hal.ops.grouped_gemm(xs, w_gate_up, sizes).chunk(2, dim=-1)
    return hal.ops.grouped_gemm(hal.ops.swiglu(gate, up), w_down, sizes)


def experts_grouped_mm(xs: torch.Tensor, sizes: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    offsets = sizes.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(xs, w_gate_up, offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_down, offs=offsets)


EXPERTS: dict[str, Experts] = {"torch": experts_loop, "hal": experts_hal, "grouped_mm": experts_grouped_mm}


class MoELayer(nn.Module):
    """Router, top-k routing, experts (``experts(x_sorted, sizes, w_gate_up, w_down)``), weighted sum."""

    def __init__(self, cfg: MoEConfig, experts: Experts) -> None:
        super().__init__()
        self.cfg, self.experts = cfg, experts
        d, f, e = cfg.dim, cfg.ffn, cfg.experts
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(e, d, 2 * f) * d**-0.5)
        self.w_down = nn.Parameter(torch.randn(e, f, d) * f**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.cfg.top_k
        probs = F.softmax(self.router(x).float(), dim=-1)
        weight, expert = probs.topk(k, dim=-1)
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        flat = expert.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        sizes = torch.zeros(self.cfg.experts, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        h = self.experts(x[token], sizes, self.w_gate_up, self.w_down)
        return x.new_zeros(x.shape).index_add(0, token, h * weight.reshape(-1)[order, None])


class MoEForwardBackward(Workload):
    """Forward and backward of the layer (gradients of the parameters and of the input), the loss a
    fixed random projection of the output; no optimizer."""

    name = "moe_fwd_bwd"
    kind = "fwd_bwd"
    unit = "tokens"

    def __init__(self, size: str = "full") -> None:
        super().__init__(size)
        self.cfg = CONFIGS[size]
        self.dtype = torch.float32 if size == "tiny" else torch.bfloat16

    def describe(self) -> str:
        c = self.cfg
        return (f"Mixtral-style MoE layer forward + backward ({c.experts} experts, top-{c.top_k}, d={c.dim}, SwiGLU {c.ffn}, "
                f"{c.tokens} tokens), {str(self.dtype).removeprefix('torch.')}")

    def items_per_step(self) -> int:
        return self.cfg.tokens

    def extra_variants(self) -> list[Variant]:
        return [Variant("torch._grouped_mm", "grouped_mm")]

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        if impl not in EXPERTS:
            raise NotApplicable("Liger-Kernel has no grouped GEMM for the experts" if impl == "liger" else f"no {impl} variant")
        if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            raise NotApplicable(f"torch {torch.__version__} has no torch._grouped_mm")
        torch.manual_seed(seed)
        layer = MoELayer(self.cfg, EXPERTS[impl]).to(device=device, dtype=self.dtype)
        gen = data_generator(seed)
        x = torch.randn(self.cfg.tokens, self.cfg.dim, generator=gen).to(device=device, dtype=self.dtype).requires_grad_(True)
        probe = torch.randn(self.cfg.tokens, self.cfg.dim, generator=gen).to(device)
        forward = compiled(layer, compile_mode)

        def step() -> torch.Tensor:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            loss = (forward(x).float() * probe).mean()
            loss.backward()
            return loss.detach()

        return Step(step, layer)
