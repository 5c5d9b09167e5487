"""scale_shift_act with number parameters on the CPU backend: the numba kernel sees x as one
channel (1, 1, N) whose chunks run in parallel (not N one-element channels, which was 53x slower
than torch's ReLU at ResNet's sizes), and an identity affine is torch's activation kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hal_backend_cpu._layout import channel_split

import hal


def test_numbers_are_one_channel_over_all_of_x() -> None:
    x = np.empty((8, 3, 5, 7), dtype=np.float32)
    assert channel_split(x, 2.0, 1.0) == (1, 1, 8 * 3 * 5 * 7)
    assert channel_split(x, np.ones((1, 3, 1, 1), np.float32), 0.5) == (8, 3, 35)


@pytest.mark.parametrize("scale,shift", [(2.0, -0.25), (-1.5, 0.0), (1.0, 0.5)])
def test_a_number_affine_with_relu_matches_torch(scale: float, shift: float, rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((4, 16, 33, 31), dtype=np.float32))  # odd sizes: chunks that do not divide
    assert hal.explain("scale_shift_act", x, scale, shift, "relu").kernel == "numba"
    out = hal.ops.scale_shift_act(x, scale, shift, "relu")
    torch.testing.assert_close(out, torch.relu(x * scale + shift), rtol=1e-6, atol=1e-6)


def test_an_identity_affine_is_torchs_activation(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((4, 16, 33, 31), dtype=np.float32))
    d = hal.explain("scale_shift_act", x, 1.0, 0.0, "relu")
    assert d.kernel == "torch", d
    assert any("identity affine" in r for c in d.candidates for r in c.reasons), d
    torch.testing.assert_close(hal.ops.scale_shift_act(x, 1.0, 0.0, "relu"), torch.relu(x), rtol=0, atol=0)
