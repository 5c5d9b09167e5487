"""The entry's path under ``torch.autocast`` (the plan :func:`hal.dispatch.autocast.planner` makes
for a key holding the autocast state): the arguments the op's rule names are cast as torch casts
them (float64 left alone), the kernel runs with autocast off for the call's device, autocast is on
again afterwards (also when the kernel raises), and a call whose device has autocast off goes on as
without autocast. Probed with a plugin whose kernels record what they were given
(tests/core/test_entry_cache.py: each autocast state gets its own plan)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hal
from hal.plugin import Plugin

SEEN: list[Any] = []


def _plugin() -> Plugin:
    p = Plugin("autocast_probe", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",), array_api="torch")

    @p.kernel("linear", name="probe")
    def linear(x, weight, bias, act):
        SEEN.append((x.dtype, weight.dtype, None if bias is None else bias.dtype, act, torch.is_autocast_enabled("cpu")))
        if act == "sigmoid":
            raise RuntimeError("probe raised")
        return x @ weight.t()

    @p.kernel("softmax", name="probe")
    def softmax(x, dim):
        SEEN.append((x.dtype, dim, torch.is_autocast_enabled("cpu")))
        return x

    return p


@pytest.fixture
def probe(install_plugins):
    install_plugins([_plugin()])
    SEEN.clear()


def test_the_rule_casts_its_arguments_and_the_kernel_runs_with_autocast_off(probe: None) -> None:
    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hal.ops.linear(x, w, b, "relu")
        assert torch.is_autocast_enabled("cpu")  # on again after the call
        hal.ops.linear(x.double(), w.double(), None)  # float64 stays float64, as torch leaves it
    assert SEEN == [(torch.bfloat16, torch.bfloat16, torch.bfloat16, "relu", False),
                    (torch.float64, torch.float64, None, "none", False)]
    assert out.dtype == torch.bfloat16


def test_autocast_is_on_again_when_the_kernel_raises(probe: None) -> None:
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="probe raised"):
            hal.ops.linear(x, w, None, "sigmoid")
        assert torch.is_autocast_enabled("cpu")


def test_an_op_on_no_list_there_is_not_cast_but_runs_with_autocast_off(probe: None) -> None:
    x = torch.randn(2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hal.ops.softmax(x, -1) is x  # softmax's rule is CUDA's alone
    hal.ops.softmax(x, -1)
    assert SEEN == [(torch.float32, 1, False), (torch.float32, 1, False)]


def test_autocast_off_for_the_call_s_device_leaves_the_call_alone(probe: None) -> None:
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        hal.ops.linear(x, w, None)
    assert SEEN == [(torch.float32, torch.float32, None, "none", False)]
