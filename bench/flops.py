"""The training flops of a decoder step, for the model FLOP utilisation (MFU) of ``hal bench --models``.

What is counted, per training step of ``batch`` sequences of ``seq`` tokens (``N = batch * seq``):

- **matrix products with weights**: ``6 * P * N``, ``P`` the weights that take part in a product
  for each token: per layer the query, key, value and output projections (``d * (2 * h * hd + 2 *
  kv * hd)``), the MLP's gate, up and down projections (``3 * d * f``; a mixture of experts counts
  its router ``d * E`` and the ``top_k`` experts a token goes to, ``top_k * 3 * d * f``), and the LM
  head ``d * V`` (counted whether or not it is tied to the embedding). 2 flops per multiply-add in
  the forward, 4 in the backward (the gradients of the input and of the weight): 6 in all;
- **attention's two products** (scores ``Q K^T`` and ``P V``): ``4 * N * seq * h * hd`` forward per
  layer over the whole ``seq x seq`` square, three times that for forward + backward: ``12 * L * N
  * seq * h * hd``; a causal mask leaves half the square, so :attr:`FlopCount.attention` is half
  of it, ``6 * L * N * seq * h * hd``.

Not counted: the embedding lookup (a gather), norms, rotary embeddings, activations, softmax, the
loss and the optimizer (elementwise work, a few flops per element against the products' ``d``),
and any recomputation a kernel does (flash attention's backward recomputes the scores): MFU counts
the model's flops, not the hardware's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

#: dense bfloat16 tensor-core peaks in TFLOP/s by datasheet, matched against the device's name
#: (torch.cuda.get_device_name); the first match wins, so the more specific names come first
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("A100", 312.0),
)


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The shape of a decoder-only language model (Llama, Mistral, Mixtral)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # SwiGLU hidden width (of one expert)
    head_dim: Optional[int] = None  # default dim // heads
    tied: bool = False  # the LM head shares the embedding's weight
    experts: int = 0  # 0: a dense MLP
    top_k: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads

    def layer_params(self) -> int:
        """Parameters of one decoder layer (both norms included)."""
        attention = self.dim * (2 * self.heads * self.hd + 2 * self.kv_heads * self.hd)
        mlp = 3 * self.dim * self.ffn * max(self.experts, 1) + self.dim * self.experts
        return attention + mlp + 2 * self.dim

    def params(self) -> int:
        """Every parameter: the layers, the embedding, the LM head unless tied, the final norm."""
        return self.layers * self.layer_params() + self.vocab * self.dim * (1 if self.tied else 2) + self.dim

    def matmul_params_per_token(self) -> int:
        """``P`` of the module docstring: the weights in a product for each token."""
        attention = self.dim * (2 * self.heads * self.hd + 2 * self.kv_heads * self.hd)
        mlp = 3 * self.dim * self.ffn * (self.top_k if self.experts else 1) + self.dim * self.experts
        return self.layers * (attention + mlp) + self.dim * self.vocab


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """A training step's flops (module docstring): ``matmul`` + ``attention`` (causal) = ``total``."""

    matmul: int
    attention: int
    attention_full: int  # the same products over the whole square (what an unmasked kernel computes)

    @property
    def total(self) -> int:
        return self.matmul + self.attention

    def formula(self) -> str:
        return ("6 x weights in products x tokens + 6 x layers x tokens x T x heads x head_dim "
                "(attention's 12 x L x N x T x d halved for causal)")


def train_flops(shape: DecoderShape, batch: int, seq: int) -> FlopCount:
    """The flops of one training step (forward, backward) of ``shape`` on ``batch`` sequences of
    ``seq`` tokens, as the module docstring counts them."""
    tokens = batch * seq
    full = 12 * shape.layers * tokens * seq * shape.heads * shape.hd
    return FlopCount(matmul=6 * shape.matmul_params_per_token() * tokens, attention=full // 2, attention_full=full)


def peak_tflops(device: torch.device) -> Optional[float]:
    """The device's dense bfloat16 peak (TFLOP/s) by datasheet, or None where it is not known (the
    CPU; an unlisted GPU: pass the peak with ``hal bench --models --peak-tflops``)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def mfu(flops: int, step_us: float, peak: float) -> float:
    """Model FLOP utilisation: ``flops`` per step over the step time, as a fraction of ``peak`` TFLOP/s."""
    return flops / (step_us * 1e-6) / (peak * 1e12)
