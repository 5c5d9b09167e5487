"""Llama-style decoder workloads: a training step (bfloat16 autocast, AdamW) and prefill (bfloat16
weights, the next-token logits of a prompt).

The decoder is written once against an *ops namespace* (RMSNorm, rotary embedding, SwiGLU, causal
attention, the LM head with its loss), so that every implementation runs the same model with the
same parameters:

- ``torch``: ``F.rms_norm``, the rotation of halves written with torch ops (as Llama's reference
  code), ``F.silu(gate) * up``, ``F.scaled_dot_product_attention``, ``F.linear`` then
  ``F.cross_entropy`` on float32 logits;
- ``hal``: ``hal.ops.rms_norm``, ``rotary_embedding``, ``swiglu``, ``scaled_dot_product_attention``
  and ``linear_cross_entropy`` (the LM head and its loss without the full logits in memory);
- ``liger``: Liger-Kernel's functional kernels (RMSNorm, RoPE, SwiGLU, fused linear
  cross-entropy) with torch's attention, as Liger's patched Llama computes it.

The projections are ``nn.Linear`` in every implementation (cuBLAS through torch). Under autocast the
residual stream stays float32 (the embedding is not an autocast op), the projections run in
bfloat16, and the loss's inputs are cast to bfloat16 as autocast casts ``F.linear``'s.

The training step has one more hal variant, ``hal bf16 weights`` (and its graphed twin): hal's own
mixed-precision recipe instead of autocast, the whole model in bfloat16 (weights, gradients, the
residual stream, as Megatron-LM trains by default) with float32 master weights kept and updated by
hal's fused AdamW. No weight is cast per step (autocast casts every float32 weight to bfloat16 in
the forward and every gradient back to float32 in the backward), and gradients take half the memory.
It is a different recipe, not the same model faster: its losses are compared with eager's, not
required to match them.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .workload import NotApplicable, Step, Variant, Workload, compiled, data_generator


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    ffn: int  # SwiGLU hidden width
    seq: int
    batch: int
    eps: float = 1e-5
    rope_theta: float = 10000.0


CONFIGS = {
    "full": LlamaConfig(vocab=32000, dim=1024, layers=8, heads=16, ffn=2816, seq=1024, batch=4),
    "cpu": LlamaConfig(vocab=2048, dim=128, layers=2, heads=4, ffn=352, seq=128, batch=4),
    "tiny": LlamaConfig(vocab=64, dim=32, layers=2, heads=4, ffn=48, seq=8, batch=2),
}


def _autocast_cast(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype when autocast is on for their device (as autocast casts
    ``F.linear``'s arguments), else unchanged."""
    from hal.nn.modules import autocast_dtype

    dtype = autocast_dtype(ts[0])
    return ts if dtype is None else tuple(t.to(dtype) for t in ts)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _torch_ops() -> Any:
    def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(x, weight).float(), target)

    return types.SimpleNamespace(
        rms_norm=lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
        rotary=lambda q, k, cos, sin: (_rotate_torch(q, cos, sin), _rotate_torch(k, cos, sin)),
        swiglu=lambda gate, up: F.silu(gate) * up,
        attention=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        linear_cross_entropy=linear_cross_entropy,
    )


def _hal_ops() -> Any:
    import hal

    ops = hal.ops
    return types.SimpleNamespace(
        rms_norm=lambda x, w, eps: ops.rms_norm(x, (x.shape[-1],), w, eps),
        rotary=lambda q, k, cos, sin: (ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)),
        swiglu=ops.swiglu,
        attention=lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, None, True),
        linear_cross_entropy=lambda x, w, target: ops.linear_cross_entropy(*_autocast_cast(x, w), target),
    )


def _liger_ops() -> Any:
    try:
        from liger_kernel.transformers import functional as lf
    except Exception as exc:  # noqa: BLE001 - missing, or failing to import (no GPU, no Triton)
        raise NotApplicable(f"Liger-Kernel not installed ({type(exc).__name__}: {exc})"[:200]) from exc

    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Liger takes cos/sin over the whole head dim, (1, T, D), as Hugging Face's Llama builds them
        return lf.liger_rope(q, k, torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None])

    return types.SimpleNamespace(
        rms_norm=lambda x, w, eps: lf.liger_rms_norm(x, w, eps),
        rotary=rotary,
        swiglu=lf.liger_swiglu,
        attention=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        linear_cross_entropy=lambda x, w, target: lf.liger_fused_linear_cross_entropy(*_autocast_cast(x, w), target),
    )


#: implementation name -> builder of its ops namespace
OPS: dict[str, Callable[[], Any]] = {"torch": _torch_ops, "hal": _hal_ops, "liger": _liger_ops}


class Block(nn.Module):
    """Pre-norm decoder block: RMSNorm, causal self-attention with rotary embeddings, residual;
    RMSNorm, SwiGLU MLP, residual."""

    def __init__(self, cfg: LlamaConfig, ops: Any) -> None:
        super().__init__()
        self.ops, self.heads, self.eps = ops, cfg.heads, cfg.eps
        d = cfg.dim
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_proj, self.up_proj = nn.Linear(d, cfg.ffn, bias=False), nn.Linear(d, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        b, t, d = x.shape
        h = ops.rms_norm(x, self.attn_norm, self.eps)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = ops.rotary(q, k, cos.to(q.dtype), sin.to(q.dtype))
        a = ops.attention(q, k, v)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = ops.rms_norm(x, self.mlp_norm, self.eps)
        return x + self.down_proj(ops.swiglu(self.gate_proj(h), self.up_proj(h)))


class Decoder(nn.Module):
    """Token embedding, decoder blocks, final RMSNorm, LM head (untied). ``forward(tokens, targets)``
    returns the mean next-token cross-entropy; :meth:`next_logits` the logits of the last position."""

    def __init__(self, cfg: LlamaConfig, ops: Any) -> None:
        super().__init__()
        self.ops, self.eps = ops, cfg.eps
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        half = cfg.dim // cfg.heads // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (T, D/2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for p in self.parameters():  # small normal initialisation, as Llama's (std 0.02)
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 if p is not self.embed.weight else 1.0)
        for blk in self.blocks:
            nn.init.normal_(blk.o_proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))
            nn.init.normal_(blk.down_proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t])
        return self.ops.rms_norm(x, self.norm, self.eps)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.hidden(tokens)
        return self.ops.linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1))

    def next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(tokens)[:, -1])


class _Prefill(nn.Module):
    """The decoder's :meth:`Decoder.next_logits` as a module's forward (what torch.compile wraps)."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder.next_logits(tokens)


class _LlamaWorkload(Workload):
    unit = "tokens"

    def __init__(self, size: str = "full") -> None:
        super().__init__(size)
        self.cfg = CONFIGS[size]

    def items_per_step(self) -> int:
        return self.cfg.batch * self.cfg.seq

    def _shape(self) -> str:
        c = self.cfg
        return f"{c.layers} layers, d={c.dim}, {c.heads} heads, SwiGLU {c.ffn}, T={c.seq}, batch {c.batch}, vocab {c.vocab}"

    def _decoder(self, impl: str, device: torch.device, seed: int) -> Decoder:
        if impl not in OPS:
            raise NotApplicable(f"no {impl} variant")
        ops = OPS[impl]()
        torch.manual_seed(seed)
        return Decoder(self.cfg, ops).to(device)

    def _tokens(self, seed: int, device: torch.device) -> torch.Tensor:
        c = self.cfg
        return torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=data_generator(seed)).to(device)


#: the training step's variant on hal's own mixed-precision recipe (see the module's docstring)
BF16_WEIGHTS = "hal bf16 weights"
BF16_WEIGHTS_IMPL = "hal_bf16_weights"


class LlamaTrain(_LlamaWorkload):
    """Training step: loss under autocast (bfloat16; float32 at size tiny), backward, AdamW (hal's
    for hal, torch's fused one for the others), gradients set to None."""

    name = "llama_train"
    kind = "train"

    def __init__(self, size: str = "full", lr: float = 1e-3, eps: float = 1e-8) -> None:
        super().__init__(size)
        self.amp_dtype = None if size == "tiny" else torch.bfloat16
        self.lr, self.eps = lr, eps

    def describe(self) -> str:
        amp = "bf16 autocast" if self.amp_dtype else "float32"
        return f"Llama-style decoder training step ({self._shape()}), {amp}, AdamW"

    def extra_variants(self) -> list[Variant]:
        return [Variant(BF16_WEIGHTS, BF16_WEIGHTS_IMPL), Variant(BF16_WEIGHTS + "+graph", BF16_WEIGHTS_IMPL, graph=True)]

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        bf16_weights = impl == BF16_WEIGHTS_IMPL
        model = self._decoder("hal" if bf16_weights else impl, device, seed)
        if bf16_weights:
            model.to(torch.bfloat16)
        if impl == "hal" or bf16_weights:
            import hal

            opt: torch.optim.Optimizer = hal.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps, master_weights=bf16_weights)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps, fused=True)
        tokens = self._tokens(seed, device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        forward = compiled(model, compile_mode)
        amp = None if bf16_weights else self.amp_dtype

        def step() -> torch.Tensor:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = forward(inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Step(step, model, opt)


class LlamaPrefill(_LlamaWorkload):
    """Prefill: the prompt through the decoder in bfloat16 weights (float32 at size tiny),
    ``torch.inference_mode``; the output is the next-token logits of each sequence."""

    name = "llama_prefill"
    kind = "infer"

    def __init__(self, size: str = "full") -> None:
        super().__init__(size)
        self.dtype = torch.float32 if size == "tiny" else torch.bfloat16

    def describe(self) -> str:
        return f"Llama-style decoder prefill ({self._shape()}), {str(self.dtype).removeprefix('torch.')}"

    def reference(self, device: torch.device, seed: int) -> torch.Tensor:
        model = self._decoder("torch", device, seed)
        with torch.inference_mode():
            return model.next_logits(self._tokens(seed, device)[:, :-1]).float()

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        model = self._decoder(impl, device, seed).to(self.dtype).eval()
        forward = compiled(_Prefill(model), compile_mode)
        tokens = self._tokens(seed, device)[:, :-1].contiguous()

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return forward(tokens)

        return Step(step, model)
