"""Hugging Face Llama workload: a training step of ``transformers``' ``LlamaForCausalLM`` (bfloat16
autocast, AdamW), the model built from a configuration (no download) with the sizes of the
hand-written decoder (:data:`hal_bench.models_llama.CONFIGS`: 8 layers, d=1024, 16 heads, T=1024,
batch 4 at size ``full``), SDPA attention, untied LM head.

The labels go to the model (``model(input_ids=tokens, labels=tokens).loss``): the loss is computed by
the model's forward, as a Hugging Face training loop computes it, which is what lets a patched LM
head compute the loss without the full logits. The implementations:

- ``torch``: the model as ``transformers`` builds it, ``torch.optim.AdamW(fused=True)`` (the peers'
  optimizer in every workload);
- ``hal``: ``hal.nn.patch(model)`` (hal's modules swapped in by structure, whatever it recognises in
  this model) and ``hal.optim.AdamW``;
- ``hal.optimize``: the model as built and ``torch.optim.AdamW(fused=True)`` handed to
  ``hal.optimize(model, optimizer, amp=...)``, the one call that rewrites, compiles and captures as
  its measurements on the first call decide (the measuring is inside the variant's warm-up);
- ``liger``: Liger-Kernel's Llama patch applied to this model instance
  (``apply_liger_kernel_to_llama(model=...)``: its RMSNorm, SwiGLU MLP, RoPE and the fused linear
  cross-entropy forward), ``torch.optim.AdamW(fused=True)``.

Liger's patch also rebinds names of the ``modeling_llama`` module, process-wide (the rotary function
the attention calls, the RMSNorm and MLP classes models are built from, in some versions the class's
forward). Those would change every model built or run after it, the other variants' included: here
they are put back as soon as the patch returns, the forward bound to the instance instead, and the
module's names the patch changed are set only while the Liger step's forward runs.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from . import liger
from .models_llama import CONFIGS, LlamaConfig
from .workload import HAL_OPTIMIZE, NotApplicable, Step, Variant, Workload, compiled, data_generator

IMPLS = ("torch", "hal", "liger", "hal.optimize")


def _transformers() -> Any:
    try:
        import transformers
    except Exception as exc:  # noqa: BLE001 - missing, or failing to import
        raise NotApplicable(f"transformers not installed ({type(exc).__name__}: {exc})"[:200]) from exc
    return transformers


def hf_config(cfg: LlamaConfig) -> Any:
    """The ``transformers.LlamaConfig`` of the hand-written decoder's sizes (multi-head attention,
    untied LM head, no KV cache, no dropout)."""
    tf = _transformers()
    return tf.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
                          num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq,
                          rms_norm_eps=cfg.eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False, use_cache=False,
                          attention_dropout=0.0)


def build_model(cfg: LlamaConfig, seed: int) -> nn.Module:
    """``LlamaForCausalLM`` from :func:`hf_config`, its weights initialised by ``transformers`` from
    ``seed`` (on the CPU: the same weights on every device), SDPA attention, in training mode."""
    tf = _transformers()
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM._from_config(hf_config(cfg), attn_implementation="sdpa")
    return model.train()


@contextlib.contextmanager
def _module_names(module: types.ModuleType, names: dict[str, Any]) -> Iterator[None]:
    """``module``'s ``names`` set to the given objects for the duration, then put back."""
    missing = object()
    saved = {n: getattr(module, n, missing) for n in names}
    for n, v in names.items():
        setattr(module, n, v)
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is missing:
                delattr(module, n)
            else:
                setattr(module, n, v)


def apply_liger(model: nn.Module, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """Liger-Kernel's Llama patch applied to ``model`` alone (module docstring); returns the context
    the Liger step's forward runs in (the module-level names the patch set). NotApplicable where
    Liger-Kernel does not import or there is no GPU for its Triton kernels."""
    if device.type != "cuda":
        raise NotApplicable(f"Liger-Kernel's Triton kernels need a GPU (this run is on {device.type})")
    reason = liger.import_reason("liger_kernel.transformers")
    if reason is not None:
        raise NotApplicable(reason)
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    return isolated_patch(lambda m: apply_liger_kernel_to_llama(model=m), model)


def isolated_patch(apply: Callable[[nn.Module], Any], model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """``apply(model)``, a patch of ``transformers``' Llama that may rebind names of the
    ``modeling_llama`` module and the model class's ``forward``, confined to ``model``: the module's
    names are put back at once (returned: a context that sets them again, for the model's forward to
    run in), a patched class forward is put back and bound to this instance instead."""
    from transformers.models.llama import modeling_llama

    cls = type(model)
    before, class_forward = dict(vars(modeling_llama)), cls.__dict__.get("forward")
    absent = object()
    try:
        apply(model)
    finally:
        changed = {n: v for n, v in vars(modeling_llama).items() if before.get(n, absent) is not v}
        for n in changed:  # back as they were for every other model
            if n in before:
                setattr(modeling_llama, n, before[n])
            else:
                delattr(modeling_llama, n)
        patched_forward = cls.__dict__.get("forward")
        if patched_forward is not class_forward:  # a version that patches the class: this instance only
            setattr(cls, "forward", class_forward)
            if "forward" not in vars(model):
                model.forward = types.MethodType(patched_forward, model)
    return lambda: _module_names(modeling_llama, changed)


class HFLlamaTrain(Workload):
    """Training step of ``transformers.LlamaForCausalLM``: the loss from the model's forward (labels
    given) under autocast (bfloat16; float32 at size tiny), backward, AdamW (hal's for hal, torch's
    fused one for the others), gradients set to None."""

    name = "hf_llama_train"
    kind = "train"
    unit = "tokens"

    def __init__(self, size: str = "full", lr: float = 1e-3, eps: float = 1e-8) -> None:
        super().__init__(size)
        self.cfg = CONFIGS[size]
        self.amp_dtype: Optional[torch.dtype] = None if size == "tiny" else torch.bfloat16
        self.lr, self.eps = lr, eps

    def items_per_step(self) -> int:
        return self.cfg.batch * self.cfg.seq

    def describe(self) -> str:
        c = self.cfg
        amp = "bf16 autocast" if self.amp_dtype else "float32"
        return (f"Hugging Face LlamaForCausalLM training step ({c.layers} layers, d={c.dim}, {c.heads} heads, SwiGLU {c.ffn}, "
                f"T={c.seq}, batch {c.batch}, vocab {c.vocab}), loss in the model's forward, {amp}, AdamW; hal: hal.nn.patch")

    def extra_variants(self) -> list[Variant]:
        return [HAL_OPTIMIZE]

    def tokens(self, seed: int, device: torch.device) -> torch.Tensor:
        """The batch of token ids (inputs and labels: the model shifts the labels itself)."""
        c = self.cfg
        return torch.randint(0, c.vocab, (c.batch, c.seq), generator=data_generator(seed)).to(device)

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        if impl not in IMPLS:
            raise NotApplicable(f"no {impl} variant")
        model = build_model(self.cfg, seed).to(device)
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if impl == "hal":
            import hal

            hal.nn.patch(model)
            opt: torch.optim.Optimizer = hal.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps)
        else:
            if impl == "liger":
                forward_context = apply_liger(model, device)
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps, fused=True)
        tokens = self.tokens(seed, device)
        amp = self.amp_dtype
        if impl == "hal.optimize":
            import hal

            fast = hal.optimize(model, opt, amp=amp)
            return Step(lambda: fast(input_ids=tokens, labels=tokens), model, fast.optimizer)
        forward = compiled(model, compile_mode)

        def step() -> torch.Tensor:
            with forward_context(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = forward(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Step(step, model, opt)
