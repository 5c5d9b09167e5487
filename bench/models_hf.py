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
  ``hal.optimize fp8`` the same with ``fp8=hal.fp8.CurrentScaling()`` (the decoder layers' linear
  layers in FP8);
- ``torchao tensorwise`` / ``torchao rowwise``: torchao.float8's recipe on the model's linear layers
  (:mod:`hal_bench.torchao_float8`), then torch's own step (the FP8 peer, compiled);
- ``liger``: Liger-Kernel's Llama patch applied to this model instance
  (``apply_liger_kernel_to_llama(model=...)``: its RMSNorm, SwiGLU MLP, RoPE and the fused linear
  cross-entropy forward), ``torch.optim.AdamW(fused=True)``; ``liger+compile`` is the same patched
  model under torch.compile (default mode; the loss is in the forward, so it is compiled too).

The step is :class:`HFCausalLMTrain`'s, which the larger rows of :mod:`hal_bench.models_big`
(Llama-3.2-1B's and Llama-3-8B's shapes, a Mixtral) share with this one.

Liger's patch also rebinds names of the ``modeling_llama`` module, process-wide (the rotary function
the attention calls, the RMSNorm and MLP classes models are built from, in some versions the class's
forward). Those would change every model built or run after it, the other variants' included: here
they are put back as soon as the patch returns, the forward bound to the instance instead, and the
module's names the patch changed are set only while the Liger step's forward runs.
"""

from __future__ import annotations

import abc
import contextlib
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from . import liger, torchao_float8
from .models_llama import CONFIGS, LlamaConfig
from .workload import HAL_OPTIMIZE, LIGER_COMPILE, NotApplicable, Step, Variant, Workload, compiled, data_generator

IMPLS = ("torch", "hal", "liger", "hal.optimize", "hal.optimize fp8", "torchao tensorwise", "torchao rowwise")


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


def apply_liger(model: nn.Module, device: torch.device, patch: str = "apply_liger_kernel_to_llama"
                ) -> Callable[[], contextlib.AbstractContextManager]:
    """Liger-Kernel's patch for the model's family (``liger_kernel.transformers.<patch>``, given the
    instance) applied to ``model`` alone (module docstring); returns the context the Liger step's
    forward runs in (the module-level names the patch set). NotApplicable where Liger-Kernel does
    not import, lacks the patch, or there is no GPU for its Triton kernels."""
    if device.type != "cuda":
        raise NotApplicable(f"Liger-Kernel's Triton kernels need a GPU (this run is on {device.type})")
    reason = liger.import_reason("liger_kernel.transformers")
    if reason is not None:
        raise NotApplicable(reason)
    import liger_kernel.transformers as liger_transformers

    apply = getattr(liger_transformers, patch, None)
    if apply is None:
        raise NotApplicable(f"Liger-Kernel {liger.version()} has no {patch}")
    return isolated_patch(lambda m: apply(model=m), model)


def isolated_patch(apply: Callable[[nn.Module], Any], model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """``apply(model)``, a patch of a ``transformers`` model family that may rebind names of the
    family's modeling module (``modeling_llama``, ``modeling_mixtral``: the module of the model's
    class) and the model class's ``forward``, confined to ``model``: the module's names are put back
    at once (returned: a context that sets them again, for the model's forward to run in), a patched
    class forward is put back and bound to this instance instead."""
    cls = type(model)
    modeling = sys.modules[cls.__module__]
    before, class_forward = dict(vars(modeling)), cls.__dict__.get("forward")
    absent = object()
    try:
        apply(model)
    finally:
        changed = {n: v for n, v in vars(modeling).items() if before.get(n, absent) is not v}
        for n in changed:  # back as they were for every other model
            if n in before:
                setattr(modeling, n, before[n])
            else:
                delattr(modeling, n)
        patched_forward = cls.__dict__.get("forward")
        if patched_forward is not class_forward:  # a version that patches the class: this instance only
            setattr(cls, "forward", class_forward)
            if "forward" not in vars(model):
                model.forward = types.MethodType(patched_forward, model)
    return lambda: _module_names(modeling, changed)


class HFCausalLMTrain(Workload):
    """Training step of a ``transformers`` causal LM built from a configuration: the loss from the
    model's forward (labels given) under autocast (bfloat16; float32 at size tiny), backward, AdamW
    (hal's for hal, torch's fused one for the others), gradients set to None. A family's workload
    gives :meth:`build_model`, ``batch``, ``seq`` and ``vocab``, and names its Liger-Kernel patch."""

    kind = "train"
    unit = "tokens"
    #: the function of ``liger_kernel.transformers`` that patches this family
    liger_patch = "apply_liger_kernel_to_llama"
    batch: int
    seq: int
    vocab: int

    def __init__(self, size: str = "full", lr: float = 1e-3, eps: float = 1e-8) -> None:
        super().__init__(size)
        self.amp_dtype: Optional[torch.dtype] = None if size == "tiny" else torch.bfloat16
        self.lr, self.eps = lr, eps
        #: further keyword arguments of hal.optimize in the hal.optimize column (none: it measures every
        #: candidate; the CPU test of the column passes compile=False, its compiled candidates being
        #: tests/training/test_optimize.py's)
        self.optimize_options: dict[str, Any] = {}

    @abc.abstractmethod
    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        """The model on ``device``, its weights drawn from ``seed``, in training mode."""

    def items_per_step(self) -> int:
        return self.batch * self.seq

    def extra_variants(self) -> list[Variant]:
        return [LIGER_COMPILE, HAL_OPTIMIZE]

    def tokens(self, seed: int, device: torch.device) -> torch.Tensor:
        """The batch of token ids (inputs and labels: the model shifts the labels itself)."""
        return torch.randint(0, self.vocab, (self.batch, self.seq), generator=data_generator(seed)).to(device)

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        if impl not in IMPLS:
            raise NotApplicable(f"no {impl} variant")
        model = self.build_model(seed, device)
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if impl == "hal":
            import hal

            hal.nn.patch(model)
            opt: torch.optim.Optimizer = hal.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps)
        else:
            if impl == "liger":
                forward_context = apply_liger(model, device, self.liger_patch)
            elif impl.startswith(torchao_float8.PREFIX):
                torchao_float8.convert(model, impl.removeprefix(torchao_float8.PREFIX), device)
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps, fused=True)
        tokens = self.tokens(seed, device)
        amp = self.amp_dtype
        if impl.startswith("hal.optimize"):
            import hal

            fp8 = {"fp8": hal.fp8.CurrentScaling()} if impl.endswith(" fp8") else {}
            fast = hal.optimize(model, opt, amp=amp, **fp8, **self.optimize_options)
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


class HFLlamaTrain(HFCausalLMTrain):
    """The Hugging Face Llama at the hand-written decoder's sizes (module docstring), built on the CPU
    (the same weights on every device), then moved."""

    name = "hf_llama_train"

    def __init__(self, size: str = "full", lr: float = 1e-3, eps: float = 1e-8) -> None:
        super().__init__(size, lr, eps)
        self.cfg = CONFIGS[size]
        self.batch, self.seq, self.vocab = self.cfg.batch, self.cfg.seq, self.cfg.vocab

    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        return build_model(self.cfg, seed).to(device)

    def describe(self) -> str:
        c = self.cfg
        amp = "bf16 autocast" if self.amp_dtype else "float32"
        return (f"Hugging Face LlamaForCausalLM training step ({c.layers} layers, d={c.dim}, {c.heads} heads, SwiGLU {c.ffn}, "
                f"T={c.seq}, batch {c.batch}, vocab {c.vocab}), loss in the model's forward, {amp}, AdamW; hal: hal.nn.patch")
