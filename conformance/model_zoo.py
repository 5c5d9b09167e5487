"""The models ``hal conformance --model`` trains: built-in ones by name, or a user's ``module:callable``.

A model case is what one training step needs: the module, the batch it is called with and the loss
of its output. A ``module:callable`` names a function taking no arguments that returns ``(model,
batch)`` or ``(model, batch, loss_fn)``:

- ``model``: an ``nn.Module`` on the CPU, in training mode, deterministic (no dropout: both runs
  must compute the same function). Apply ``hal.nn.fuse`` / ``hal.nn.patch`` inside the callable;
- ``batch``: a tensor (``model(batch)``), a tuple or list (``model(*batch)``) or a dict
  (``model(**batch)``); float tensors are cast to the reference's dtype for the reference run;
- ``loss_fn(output) -> scalar tensor`` (optional): without it, the output itself when it is a
  0-d tensor, else its ``.loss`` (a Hugging Face ``ModelOutput`` given labels). Tensors it holds
  itself (targets) it moves to the output's device (``labels.to(output.device)``): the runs may
  be on two devices.

The built-in models, each at size ``tiny`` (tests, a second per step) or ``cpu`` (larger):

- ``cnn``: a ResNet of bottleneck blocks (``hal_bench``'s, channels_last) after ``hal.nn.fuse``:
  conv -> batch-norm -> ReLU as ``fused_conv_bn_relu``, a block's tail as
  ``fused_conv_bn_add_relu``, the downsample as ``conv2d`` + ``batch_norm``; loss
  ``hal.ops.cross_entropy``;
- ``llama``: ``hal_bench``'s Llama-style decoder on hal's ops (``rms_norm``, ``rotary_embedding``,
  ``scaled_dot_product_attention``, ``swiglu``, ``linear_cross_entropy``);
- ``hf_llama``: ``transformers``' ``LlamaForCausalLM`` built from a ``LlamaConfig`` of the same
  sizes (no download) after ``hal.nn.patch``; the loss from the model given labels.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

SIZES = ("tiny", "cpu")


@dataclasses.dataclass
class ModelCase:
    """One model to train: module, batch and loss (see the module docstring)."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None
    description: str = ""


def _cnn(size: str, seed: int) -> ModelCase:
    import hal
    from hal_bench.models_resnet import CONFIGS, ResNet

    cfg = CONFIGS[size]
    torch.manual_seed(seed)
    model = hal.nn.fuse(ResNet(cfg.layers, cfg.width, cfg.classes).to(memory_format=torch.channels_last).train())
    gen = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=gen).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
    return ModelCase("cnn", model, images, lambda logits: hal.ops.cross_entropy(logits, labels.to(logits.device)),
                     f"ResNet{list(cfg.layers)} width {cfg.width}, {cfg.image}x{cfg.image} channels_last, batch {cfg.batch}, "
                     "hal.nn.fuse, hal.ops.cross_entropy")


def _llama(size: str, seed: int) -> ModelCase:
    from hal_bench.models_llama import CONFIGS, OPS, Decoder

    cfg = CONFIGS[size]
    torch.manual_seed(seed)
    model = Decoder(cfg, OPS["hal"]()).train()
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed + 1))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return ModelCase("llama", model, batch, None,
                     f"Llama-style decoder on hal.ops ({cfg.layers} layers, d={cfg.dim}, {cfg.heads} heads, T={cfg.seq}, "
                     f"batch {cfg.batch}, vocab {cfg.vocab})")


def _hf_llama(size: str, seed: int) -> ModelCase:
    import hal
    from hal_bench.models_hf import build_model
    from hal_bench.models_llama import CONFIGS
    from hal_bench.workload import NotApplicable

    cfg = CONFIGS[size]
    try:
        model = build_model(cfg, seed)
    except NotApplicable as exc:
        raise ValueError(f"model hf_llama needs transformers: {exc} (pip install transformers)") from None
    hal.nn.patch(model)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(seed + 1))
    return ModelCase("hf_llama", model, {"input_ids": tokens, "labels": tokens}, None,
                     f"transformers LlamaForCausalLM from a LlamaConfig ({cfg.layers} layers, d={cfg.dim}, {cfg.heads} heads, "
                     f"T={cfg.seq}, batch {cfg.batch}, vocab {cfg.vocab}), SDPA attention, hal.nn.patch")


#: built-in model name -> builder (size, seed)
BUILTIN: dict[str, Callable[[str, int], ModelCase]] = {"cnn": _cnn, "llama": _llama, "hf_llama": _hf_llama}
#: built-in model name -> the package it needs beyond hal's own dependencies
REQUIRES = {"hf_llama": "transformers"}


def unavailable(name: str) -> Optional[str]:
    """Why built-in model ``name`` cannot run here (a package it needs does not import), else None:
    ``--model all`` skips such a model with this reason."""
    package = REQUIRES.get(name)
    if package is None:
        return None
    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - missing, or failing to import
        return f"needs {package}, which does not import here ({type(exc).__name__}: {exc}); pip install {package} to run it"
    return None


def names(text: str) -> list[str]:
    """The model names of a ``--model`` argument: a comma-separated list of built-in names and
    ``module:callable`` specs, ``all`` for every built-in model."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        out += list(BUILTIN) if part == "all" else [part]
    return out


def build(name: str, size: str = "tiny", seed: int = 0) -> ModelCase:
    """The model case of a built-in name or of a ``module:callable`` (ValueError saying what is
    wrong otherwise)."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: one of {', '.join(SIZES)}")
    if ":" not in name:
        if name not in BUILTIN:
            raise ValueError(f"no built-in model {name!r}; built-in models: {', '.join(BUILTIN)}, or give module:callable")
        return BUILTIN[name](size, seed)
    return from_callable(name)


def from_callable(spec: str) -> ModelCase:
    """Import ``module:callable`` (attributes may be dotted; the working directory is searched first,
    as ``python -m`` does) and call it (module docstring)."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: modules of the working directory
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model {spec}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {spec}: {attr} is a {type(target).__name__}, not a callable returning (model, batch[, loss_fn])")
    got = target()
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        raise ValueError(f"--model {spec}: the callable returned {type(got).__name__}; return (model, batch) or (model, batch, loss_fn)")
    model, batch = got[0], got[1]
    loss_fn = got[2] if len(got) == 3 else None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec}: the first item returned is a {type(model).__name__}, not an nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"--model {spec}: the third item returned (loss_fn) is a {type(loss_fn).__name__}, not a callable")
    return ModelCase(spec, model.train(), batch, loss_fn, f"{type(model).__name__} from {spec}")


def call(case: ModelCase, model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of one forward of ``model`` on ``batch`` (module docstring)."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if case.loss_fn is not None:
        out = case.loss_fn(out)
    elif not (isinstance(out, torch.Tensor) and out.dim() == 0):
        out = getattr(out, "loss", None)
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        raise ValueError(f"model {case.name}: its output is not a loss (a 0-d tensor, or an output with .loss); "
                         "return (model, batch, loss_fn) from the callable")
    return out


def converted(batch: Any, device: torch.device, dtype: Optional[torch.dtype]) -> Any:
    """``batch`` on ``device`` with its float tensors in ``dtype`` (None: their own), structure kept."""
    if isinstance(batch, torch.Tensor):
        cast = dtype if (dtype is not None and batch.is_floating_point()) else batch.dtype
        return batch.detach().to(device=device, dtype=cast, copy=True)
    if isinstance(batch, dict):
        return {k: converted(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(converted(v, device, dtype) for v in batch)
    return batch
