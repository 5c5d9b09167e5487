"""scale_shift_act's layouts on the CPU backend: numbers are one channel (1, 1, N) over all of x
(not N one-element channels, which was 53x slower than torch's ReLU at ResNet's sizes); numbers and
per-channel planes run torch's kernels, which measured faster than the numba pass there, feature-wise
rows run the numba pass; an identity affine is torch's activation kernel."""

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
def test_a_number_affine_with_relu_is_torchs_and_matches(scale: float, shift: float, rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((4, 16, 33, 31), dtype=np.float32))  # odd sizes
    d = hal.explain("scale_shift_act", x, scale, shift, "relu")
    assert d.kernel == "torch", d
    numba = next(c for c in d.candidates if c.kernel == "numba")
    assert numba.reasons == ["numbers or per-channel planes: torch's kernels are faster (the numba pass fuses feature-wise rows)"], d
    out = hal.ops.scale_shift_act(x, scale, shift, "relu")
    torch.testing.assert_close(out, torch.relu(x * scale + shift), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_feature_wise_affine_over_rows_is_the_numba_pass(dtype: type, rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((37, 96)).astype(dtype))
    scale, shift = torch.from_numpy(rng.random(96).astype(dtype) + 0.5), torch.from_numpy(rng.standard_normal(96).astype(dtype))
    assert hal.explain("scale_shift_act", x, scale, shift, "relu").kernel == "numba"
    out = hal.ops.scale_shift_act(x, scale, shift, "relu")
    torch.testing.assert_close(out, torch.relu(x * scale + shift), rtol=1e-6, atol=1e-6)
    planes = torch.from_numpy(rng.standard_normal((2, 3, 9, 9)).astype(dtype))
    per_channel = torch.from_numpy(rng.random((1, 3, 1, 1)).astype(dtype))
    assert hal.explain("scale_shift_act", planes, per_channel, per_channel, "relu").kernel == "torch"


def test_an_identity_affine_is_torchs_activation(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((4, 16, 33, 31), dtype=np.float32))
    d = hal.explain("scale_shift_act", x, 1.0, 0.0, "relu")
    assert d.kernel == "torch", d
    assert any("identity affine" in r for c in d.candidates for r in c.reasons), d
    torch.testing.assert_close(hal.ops.scale_shift_act(x, 1.0, 0.0, "relu"), torch.relu(x), rtol=0, atol=0)
