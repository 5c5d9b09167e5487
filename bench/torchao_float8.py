"""torchao.float8 as the FP8 peer of the whole-model rows (issue 40: "torchao float8 (tensorwise and
rowwise) + compile"): the model's linear layers swapped for torchao's ``Float8Linear`` by
``convert_to_float8_training`` with a named recipe, then run as torch's own step (autocast, torch's
fused AdamW, torch.compile of model and loss together, optionally captured whole).

Left in higher precision, as torchao's own training recipes do: the LM head (``lm_head``) and any
linear layer whose dimensions are not multiples of 16 (its FP8 GEMMs need them). A device without
FP8 (CUDA before sm_89) or a torchao that does not import makes the variant not applicable, with the
reason; on the CPU torchao emulates its FP8 GEMMs (a check that the variant runs, not a timing).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from .workload import NotApplicable

#: impl names of the variants: "torchao <recipe>"
PREFIX = "torchao "


def version() -> Optional[str]:
    """The installed torchao's version, or None."""
    try:
        import torchao

        return str(getattr(torchao, "__version__", "?"))
    except Exception:  # noqa: BLE001 - not installed, or not for this torch
        return None


def _converted(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter: whether the module at ``fqn`` becomes a ``Float8Linear``."""
    if fqn.split(".")[-1] == "lm_head":
        return False
    return not isinstance(module, nn.Linear) or (module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(model: nn.Module, recipe: str, device: torch.device) -> int:
    """Swap ``model``'s linear layers for torchao's ``Float8Linear`` with the named ``recipe``
    ("tensorwise", "rowwise"), in place; returns how many. Raises :class:`NotApplicable` where it
    cannot run (module docstring)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as exc:  # noqa: BLE001 - not installed, or built for another torch
        raise NotApplicable(f"torchao.float8 does not import ({type(exc).__name__}: {str(exc)[:160]})") from exc
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise NotApplicable(f"torchao float8 needs FP8 (sm_89 or newer); {torch.cuda.get_device_name(device)} has none")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=_converted)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not converted:
        raise NotApplicable("torchao converted no linear layer (none outside lm_head with dimensions that are multiples of 16)")
    return converted
