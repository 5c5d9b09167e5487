"""examples/train_cnn.py runs (a short version): fused model, scaler, AdamW, autocast, kernel stats."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_cnn.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_cnn", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra", [[], ["--dtype", "float16", "--master-weights"]], ids=["bf16-autocast", "fp16-master-weights"])
def test_example_trains_briefly(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    loss = _load().main(["--steps", "3", "--batch", "8", "--size", "8", "--log-every", "1", *extra])
    out = capsys.readouterr().out
    assert math.isfinite(loss)
    assert out.count("loss ") >= 3
    # the fused modules sit beside the convolutions and linears they borrow (hal.nn.fuse keeps the state_dict keys)
    assert "stem.0_fused (FusedConvBNReLU2d)" in out and "block1.conv1_fused (FusedConvBNReLU2d)" in out and "fc1_fused (FusedLinearAct)" in out
    assert "block1.conv2_fused (FusedConvBNAddReLU2d)" in out and "block2.conv2_fused (FusedConvBNAddReLU2d)" in out
    assert "eval accuracy" in out
    # the training decomposition's conv2d and batch_norm are torch's kernels on the CPU backend, so
    # torch's autograd records them: their backward runs as torch's, not as hal backward ops; except
    # float16 convolutions, which compute in float32 (torch's float16 CPU convolution rounds its
    # partial sums): hal's node keeps the float16 inputs and its conv2d_backward computes in float32
    for op in ("conv2d", "batch_norm", "fused_adamw_", "amp_unscale_", "linear", "fused_conv_bn_relu", "fused_conv_bn_add_relu"):
        assert op in out, f"{op} missing from the printed kernel table:\n{out}"
    assert ("conv2d_backward" in out) == ("float16" in extra), out
    assert "batch_norm_backward" not in out
    assert "loss scaler: 3 steps" in out
