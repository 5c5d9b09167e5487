"""The folded-weights cache of eval conv + BN + ReLU: reused while the parameters are unchanged,
rebuilt when any of them is updated in place or replaced, and always computing what the unfused
chain computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal
from hal_backend_cpu.conv import FOLDED


def _params(rng: np.random.Generator, cin: int = 4, cout: int = 6) -> dict[str, torch.Tensor]:
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    return {
        "conv_weight": t(cout, cin, 3, 3), "conv_bias": t(cout), "bn_weight": t(cout), "bn_bias": t(cout),
        "running_mean": t(cout), "running_var": torch.from_numpy(rng.uniform(0.5, 2.0, cout)).float(),
    }  # fmt: skip


def _unfused(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    y = F.conv2d(x, p["conv_weight"], p["conv_bias"], padding=1)
    return F.relu(F.batch_norm(y, p["running_mean"], p["running_var"], p["bn_weight"], p["bn_bias"], False, 0.1, 1e-5))


def _fused(x: torch.Tensor, p: dict[str, torch.Tensor], kernel: str) -> torch.Tensor:
    with hal.use(backend="cpu", kernel={"fused_conv_bn_relu": kernel}):
        return hal.ops.fused_conv_bn_relu(x, **p, padding=1)


@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_hits_while_unchanged_and_rebuilds_on_every_kind_of_change(kernel: str, rng: np.random.Generator) -> None:
    p = _params(rng)
    x = torch.from_numpy(rng.standard_normal((2, 4, 9, 9))).float()
    FOLDED.clear()
    before = FOLDED.builds
    torch.testing.assert_close(_fused(x, p, kernel), _unfused(x, p), rtol=1e-5, atol=1e-5)
    _fused(x, p, kernel)
    assert FOLDED.builds == before + 1, "the second call with the same parameters must reuse the fold"
    changes = [
        ("running_var", lambda t: t.mul_(1.7)),  # in place: version counter bumped
        ("running_mean", lambda t: t.add_(0.3)),
        ("bn_weight", lambda t: t.neg_()),
        ("conv_weight", lambda t: t.mul_(0.5)),
    ]
    for name, update in changes:
        with torch.no_grad():
            update(p[name])
        torch.testing.assert_close(_fused(x, p, kernel), _unfused(x, p), rtol=1e-5, atol=1e-5, msg=f"stale fold after {name} changed")
    assert FOLDED.builds == before + 1 + len(changes)
    p["bn_bias"] = p["bn_bias"] + 1.0  # a new tensor object
    torch.testing.assert_close(_fused(x, p, kernel), _unfused(x, p), rtol=1e-5, atol=1e-5)
    assert FOLDED.builds == before + 2 + len(changes)


def test_load_state_dict_and_optimizer_step_invalidate(rng: np.random.Generator) -> None:
    conv = torch.nn.Conv2d(4, 6, 3, padding=1)
    bn = torch.nn.BatchNorm2d(6).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.from_numpy(rng.standard_normal(6)))
    x = torch.from_numpy(rng.standard_normal((2, 4, 8, 8))).float()

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        p = {"conv_weight": conv.weight, "conv_bias": conv.bias, "bn_weight": bn.weight, "bn_bias": bn.bias,
             "running_mean": bn.running_mean, "running_var": bn.running_var}  # fmt: skip
        with torch.no_grad():
            return _fused(x, p, "onednn"), F.relu(bn(conv(x)))

    got, want = both()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    other = torch.nn.BatchNorm2d(6)
    with torch.no_grad():
        other.running_var.uniform_(0.2, 3.0)
        other.weight.uniform_(-2, 2)
    bn.load_state_dict(other.state_dict())
    got, want = both()
    # folded (w * gamma / sqrt(var)) against unfolded float32 rounds differently by ~1e-5 once the
    # weights grow; a stale cache would be off by O(1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    opt = torch.optim.SGD(conv.parameters(), lr=0.5)
    conv(x).square().sum().backward()
    opt.step()
    got, want = both()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_numpy_parameters_are_folded_on_every_call(rng: np.random.Generator) -> None:
    """NumPy arrays carry no version counter: an in-place NumPy update must show in the next call."""
    p = {k: v.numpy() for k, v in _params(rng).items()}
    x = rng.standard_normal((1, 4, 7, 7)).astype(np.float32)
    first = hal.ops.fused_conv_bn_relu(x, **p, padding=1)
    p["running_var"] *= 3.0
    second = hal.ops.fused_conv_bn_relu(x, **p, padding=1)
    want = _unfused(torch.from_numpy(x), {k: torch.from_numpy(v) for k, v in p.items()}).numpy()
    np.testing.assert_allclose(second, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(first, second)
