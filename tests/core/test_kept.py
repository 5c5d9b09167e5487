"""hal.integration.kept: a forward's values reach the backward of the same unchanged input only."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hal.integration import kept as kept_module
from hal.integration.kept import KeptForBackward, param_state


@pytest.fixture(autouse=True)
def armed():
    """As inside hal's autograd node, where forward kernels keep (each test but the last)."""
    previous = kept_module.arm(True)
    yield
    kept_module.arm(previous)


def test_taken_once_by_the_same_tensor_in_the_same_state():
    kept = KeptForBackward()
    x, y = torch.randn(3), torch.randn(3)
    kept.keep(x, ("eps", 1e-5), "stats")
    assert kept.take(y, ("eps", 1e-5)) is None  # another tensor
    assert x in kept
    assert kept.take(x, ("eps", 1e-3)) is None  # another state: a miss, and the entry is gone
    kept.keep(x, ("eps", 1e-5), "stats")
    assert kept.take(x, ("eps", 1e-5)) == "stats"
    assert kept.take(x, ("eps", 1e-5)) is None  # taken


def test_an_in_place_change_or_a_changed_parameter_is_a_miss():
    kept = KeptForBackward()
    x, w = torch.randn(4), torch.randn(4)
    kept.keep(x, param_state(w, None), 1)
    x.add_(1.0)
    assert kept.take(x, param_state(w, None)) is None
    kept.keep(x, param_state(w, None), 2)
    w.mul_(2.0)
    assert kept.take(x, param_state(w, None)) is None
    kept.keep(x, param_state(w, None), 3)
    assert kept.take(x, param_state(torch.randn(4), None)) is None  # a replaced parameter


def test_entries_hold_their_tensor_weakly_go_with_it_and_are_bounded():
    kept = KeptForBackward(size=4)
    x = torch.randn(1000)
    value = torch.randn(1000)
    gone = weakref.ref(value)
    kept.keep(x, (), value)
    del x, value
    gc.collect()
    assert not kept._entries and gone() is None  # the entry and the value it held went with x
    live = [torch.randn(2) for _ in range(10)]
    for i, t in enumerate(live):
        kept.keep(t, (), i)
    assert len(kept._entries) == 4
    assert kept.take(live[0], ()) is None and kept.take(live[-1], ()) == 9  # the oldest went first


def test_nothing_is_kept_for_a_result_torch_autograd_recorded():
    kept = KeptForBackward()
    x = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    kept.keep(x, "s", "stats", out=x * w)  # recorded: torch's node saved what its backward needs
    assert x not in kept
    kept.keep(x, "s", "stats", out=(x * w).detach())
    assert kept.take(x, "s") == "stats"


def test_nothing_is_kept_outside_hals_autograd_node(armed):
    """Unarmed (inference, or a call torch's autograd records), a forward has no backward op to come."""
    kept = KeptForBackward()
    x = torch.randn(3)
    kept_module.arm(False)
    kept.keep(x, "s", "stats")
    assert x not in kept
    kept_module.arm(True)
    kept.keep(x, "s", "stats")
    assert x in kept


def test_a_backward_follows_hals_node_on_inputs_that_take_gradients(armed):
    """Work for the backward (linear_cross_entropy's gradients in its forward) only where hal's node
    runs the forward and an input requires grad: an opaque compiled node arms every call, on inputs
    that do not."""
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    kept_module.arm(True)
    assert kept_module.backward_follows(x, w, None)
    assert not kept_module.backward_follows(x, None, w.detach())
    kept_module.arm(False)
    assert not kept_module.backward_follows(x, w)
