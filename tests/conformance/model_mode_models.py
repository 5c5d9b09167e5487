"""Small models for ``hal conformance --model`` tests, given as ``module:callable`` (each callable
returns ``(model, batch[, loss_fn])``, as the model mode's documentation asks). ``PLANTED_LINE`` is
the line of the first ``hal.ops.linear`` call, the call site a report must name when that op's
kernel is wrong."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import hal


class TinyMLP(nn.Module):
    """linear -> layer_norm -> linear + GELU -> linear, then cross-entropy: hal calls only."""

    def __init__(self, features: int = 12, hidden: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = hal.ops.linear(x, self.fc1.weight, self.fc1.bias)
        h = hal.ops.layer_norm(h, (h.shape[-1],), self.norm.weight, self.norm.bias)
        h = hal.ops.linear(h, self.fc2.weight, self.fc2.bias, "gelu")
        return hal.ops.cross_entropy(hal.ops.linear(h, self.head.weight, self.head.bias), y)


PLANTED_LINE = next(i for i, line in enumerate(inspect.getsource(TinyMLP.forward).splitlines())
                    if "hal.ops.linear(x" in line) + TinyMLP.forward.__code__.co_firstlineno


def tiny_mlp() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The MLP from seed 0 and a batch of 6 random rows with their classes."""
    torch.manual_seed(0)
    model = TinyMLP()
    gen = torch.Generator().manual_seed(1)
    return model, (torch.randn(6, 12, generator=gen), torch.randint(0, 5, (6,), generator=gen))


def tiny_mlp_with_loss() -> tuple[nn.Module, torch.Tensor, object]:
    """The same model's logits as the output, the loss given as a loss_fn (the three-item form)."""
    model, (x, y) = tiny_mlp()

    class Logits(nn.Module):
        def __init__(self, inner: TinyMLP) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            m = self.inner
            h = hal.ops.linear(x, m.fc1.weight, m.fc1.bias, "relu")
            return hal.ops.linear(hal.ops.linear(h, m.fc2.weight, m.fc2.bias), m.head.weight, m.head.bias)

    return Logits(model), x, lambda out: hal.ops.cross_entropy(out, y.to(out.device))
