"""The rows of ``hal bench --models`` at the sizes people train (issue 40), each fitting one 80 GB GPU
(the H100 is the smaller device of this workplace): Hugging Face ``transformers`` models built from a
configuration (no download) with the shapes of released models, trained with the step of
:class:`hal_bench.models_hf.HFCausalLMTrain` (the loss in the model's forward, bfloat16 autocast,
AdamW; the same implementations and peers: eager, the torch.compile modes, the graphed steps,
Liger-Kernel eager and compiled, hal's steps and ``hal.optimize``).

- ``hf_llama1b_train``: Llama-3.2-1B's shape (d 2048, 16 layers, 32 heads, 8 KV heads of 64, SwiGLU
  8192, vocab 128256, tied embeddings, rope_theta 500000), T 2048, batch 2;
- ``hf_llama1b_t4096_train``: the same model at T 4096, batch 2 (eager's peak at T 2048, batch 2 was
  34.9 GiB on the H100 with 18.4 GiB of parameters, gradients and AdamW state: 8192 tokens take
  about twice the 16.5 GiB of activations, about 52 GiB in all);
- ``hf_llama8b_layers_train``: Llama-3-8B's layer shape (d 4096, 32 heads, 8 KV heads of 128,
  SwiGLU 14336, vocab 128256, untied) with as many layers as fit eagerly at T 4096, batch 1: 15
  (:class:`HFLlama8BLayersTrain`, the estimate and the measurement in its docstring; ``layers`` is a
  parameter);
- ``hf_mixtral_train``: ``MixtralForCausalLM`` at d 2048 (:class:`HFMixtralTrain`).

Every row counts its training flops (:func:`hal_bench.flops.train_flops`) for MFU, and can be
rebuilt at another batch for the largest-batch search (:meth:`HFDecoderTrain.with_batch`).

Sizes: ``full`` as above, for a GPU; ``cpu`` and ``tiny`` the same families (GQA, tying, experts and
top-k kept) at d 128 and d 32, two layers, a small vocabulary, T 128 and T 8 (doubled for the
T 4096 row), batch 2. The models are built on the device they train on (at ``full`` a CPU
initialisation of billions of weights would take longer than the row's steps), from the seed: every
implementation of a row starts from the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from .flops import DecoderShape, FlopCount, train_flops
from .models_hf import HFCausalLMTrain, _transformers
from .workload import FP8_VARIANTS, Variant

#: Llama-3.2-1B
LLAMA_1B = DecoderShape(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True)
#: Llama-3-8B's layers (the number of layers is the workload's)
LLAMA_8B = DecoderShape(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False)
#: a Mixtral at d 2048 (:class:`HFMixtralTrain`)
MIXTRAL_2K = DecoderShape(vocab=32000, dim=2048, layers=6, heads=32, kv_heads=8, ffn=7168, experts=8, top_k=2)
#: the small sizes' dimensions; a family keeps its own heads ratio, tying, experts and top-k
SMALL = {"cpu": dict(vocab=2048, dim=128, layers=2, heads=4, kv_heads=2, ffn=352),
         "tiny": dict(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=48)}
SMALL_SEQ = {"cpu": 128, "tiny": 8}
SMALL_BATCH = 2


class HFDecoderTrain(HFCausalLMTrain):
    """A ``transformers`` decoder of a released model's shape (:data:`full_shape`), trained at
    ``full_seq`` x ``full_batch`` at size full (module docstring for the small sizes)."""

    full_shape: DecoderShape
    full_seq: int = 2048
    full_batch: int = 2
    #: what the row's label calls the model
    title: str = ""
    rope_theta: float = 500000.0
    #: the ``transformers`` classes of the family
    config_name = "LlamaConfig"
    model_name = "LlamaForCausalLM"

    def __init__(self, size: str = "full", lr: float = 1e-3, eps: float = 1e-8, batch: Optional[int] = None,
                 layers: Optional[int] = None) -> None:
        super().__init__(size, lr, eps)
        shape = self.full_shape if size == "full" else dataclasses.replace(self.full_shape, **SMALL[size])
        self.shape = shape if layers is None else dataclasses.replace(shape, layers=layers)
        self.seq = self.full_seq if size == "full" else SMALL_SEQ[size] * self.full_seq // 2048
        self.batch = batch or (self.full_batch if size == "full" else SMALL_BATCH)
        self.vocab = self.shape.vocab

    def hf_config(self) -> Any:
        """The ``transformers`` configuration of :attr:`shape` (no KV cache, no dropout)."""
        s = self.shape
        common = dict(vocab_size=s.vocab, hidden_size=s.dim, intermediate_size=s.ffn, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.hd, max_position_embeddings=self.seq,
                      rms_norm_eps=1e-5, rope_theta=self.rope_theta, tie_word_embeddings=s.tied, use_cache=False, attention_dropout=0.0)
        if s.experts:  # no router auxiliary loss: output_router_logits off, as the configuration defaults
            common.update(num_local_experts=s.experts, num_experts_per_tok=s.top_k, output_router_logits=False)
        return getattr(_transformers(), self.config_name)(**common)

    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        """The model from :meth:`hf_config`, initialised by ``transformers`` from ``seed`` on ``device``,
        SDPA attention, in training mode."""
        torch.manual_seed(seed)
        with torch.device(device):
            model = getattr(_transformers(), self.model_name)._from_config(self.hf_config(), attn_implementation="sdpa")
        return model.train()

    def flops_per_step(self) -> Optional[FlopCount]:
        return train_flops(self.shape, self.batch, self.seq)

    def with_batch(self, batch: int) -> "HFDecoderTrain":
        other = copy.copy(self)
        other.batch = batch
        return other

    def describe(self) -> str:
        s = self.shape
        amp = "bf16 autocast" if self.amp_dtype else "float32"
        moe = f", {s.experts} experts top-{s.top_k}" if s.experts else ""
        return (f"Hugging Face {self.title} training step ({s.layers} layers, d={s.dim}, GQA {s.heads}/{s.kv_heads}, SwiGLU {s.ffn}{moe}, "
                f"vocab {s.vocab}{' tied' if s.tied else ''}, T={self.seq}, batch {self.batch}), loss in the model's forward, {amp}, "
                f"AdamW; hal: hal.nn.patch")


class HFLlama1BTrain(HFDecoderTrain):
    """Llama-3.2-1B's shape at T 2048, batch 2 (1.24 B parameters)."""

    name = "hf_llama1b_train"
    title = "Llama-3.2-1B shape"
    full_shape = LLAMA_1B


class HFLlama1BT4096Train(HFLlama1BTrain):
    """Llama-3.2-1B's shape at T 4096, batch 2 (module docstring: about 52 GiB for eager)."""

    name = "hf_llama1b_t4096_train"
    full_seq = 4096


class HFLlama8BLayersTrain(HFDecoderTrain):
    """Llama-3-8B's layers at T 4096, batch 1, as many as fit eagerly on an 80 GB H100 with float32
    weights, gradients and AdamW's two moments (16 B a parameter).

    The estimate (GiB = 2^30 B). A layer has 218.1 M parameters (q and o 4096 x 4096, k and v 4096
    x 1024, gate, up and down 3 x 4096 x 14336, two norms); the embedding and the untied LM head
    1050.7 M. Weights and moments (12 B) stay all along: 11.74 GiB + 2.44 GiB a layer. The forward
    keeps, per layer and token, about 62 x d bytes of activations (the float32 residual stream and
    both norms' float32 intermediates, the bfloat16 inputs of the seven projections, q and k rotated
    in float32, attention's output, gate, up and SiLU's output at 14336 wide): 0.97 GiB a layer at
    4096 tokens, plus autocast's bfloat16 copies of the weights it saves (2 B a parameter, 0.41 GiB
    a layer). The LM head at vocabulary 128256 holds its bfloat16 weight, the logits in bfloat16
    and float32, log-softmax's float32 output, their gradients and the head's float32 gradient:
    about 8 GiB at the start of the backward. The peak is there: 11.74 + 8 + L x (2.44 + 0.97 +
    0.41) = 19.7 + 3.82 L GiB (at the end of the backward all gradients are held but the
    activations are gone: 15.7 + 3.25 L, lower). The H100 80GB HBM3 has 79.18 GiB; less the CUDA
    context and the allocator's fragmentation, about 76 usable: L <= 14.7 by the estimate.

    Measured (H100 80GB HBM3, torch 2.11, eager, ``torch.cuda.max_memory_allocated``): 64.0 GiB at
    12 layers, 71.5 at 14, 75.3 at 15 (76.9 GiB reserved): 3.77 GiB a layer, 18.8 GiB besides
    (the estimate: 3.82 and 19.7). 16 layers would need about 79.1 GiB: 15 is the most that fits
    (4.32 B parameters), the default. The peers that hold more than eager (a captured graph's pool,
    a compiled step's buffers) may not fit beside it: their rows say so.
    ``layers`` chooses another count.
    """

    name = "hf_llama8b_layers_train"
    title = "Llama-3-8B layer shape"
    full_shape = dataclasses.replace(LLAMA_8B, layers=15)
    full_seq = 4096
    full_batch = 1

    def extra_variants(self) -> list[Variant]:
        """The FP8 variants too (issue 40's FP8 targets are set on this row)."""
        return [*super().extra_variants(), *FP8_VARIANTS]


class HFMixtralTrain(HFDecoderTrain):
    """``MixtralForCausalLM`` at d 2048: 6 layers of 8 SwiGLU experts (7168 wide: Mixtral-8x7B's 3.5 x d),
    top-2 routing, GQA 32/8, T 2048, batch 2, vocabulary 32000 (Mixtral's own tokenizer's: the rows
    of Llama's shape already carry a 128k LM head, this one is about the experts), untied, no router
    auxiliary loss (``output_router_logits`` off, as the configuration defaults). The experts run as
    ``transformers`` chooses by default (``torch._grouped_mm`` where this torch can dispatch it, else
    its loop over experts); Liger-Kernel's peer is ``apply_liger_kernel_to_mixtral`` (its RMSNorm,
    RoPE, the experts' SwiGLU and the fused linear cross-entropy). 2.31 B parameters (363 M a layer):
    34.4 GiB of weights, gradients and AdamW state; eager's peak measured 35.0 GiB (H100, torch 2.11:
    at the start of the backward the gradients are not yet held, the activations of 4096 tokens
    are), which leaves room for the larger batches of the search."""

    name = "hf_mixtral_train"
    title = "MixtralForCausalLM"
    full_shape = MIXTRAL_2K
    liger_patch = "apply_liger_kernel_to_mixtral"
    rope_theta = 1e6
    config_name = "MixtralConfig"
    model_name = "MixtralForCausalLM"


#: the rows of this module, in the order of the table
WORKLOADS = (HFLlama1BTrain, HFLlama1BT4096Train, HFLlama8BLayersTrain, HFMixtralTrain)
