"""hal.nn.weight_copies on a CUDA device: the weight gradient leaves cuBLAS in float32
(``torch.mm(..., out_dtype=torch.float32)``), the rest is autocast's to the bit; compiled and
captured in a CUDA graph, the step reads copies the optimizer step wrote.

Skipped without a CUDA device (CI); run on the device machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hal.graphs
from hal.nn.weight_copies import WeightCopies

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(layer: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(gy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def test_weight_gradient_is_the_float32_accumulator_the_rest_bit_exact() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(256, 384).cuda()
    model = nn.Sequential(nn.Linear(256, 384)).cuda()
    model.load_state_dict({"0." + k: v for k, v in plain.state_dict().items()})
    copies = WeightCopies(model, torch.bfloat16)
    x, gy = torch.randn(4, 96, 256, device="cuda"), torch.randn(4, 96, 384, device="cuda")
    want = _run(plain, x, gy)
    with copies.active():
        got = _run(model[0], x, gy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # float32 weight gradient against autocast's bfloat16-rounded one: within bfloat16's half ulp
    exact = (gy.to(torch.bfloat16).reshape(-1, 384).double().t() @ x.to(torch.bfloat16).reshape(-1, 256).double())
    assert got[2].dtype == torch.float32
    assert (got[2].double() - exact).abs().max() <= (want[2].double() - exact).abs().max()
    torch.testing.assert_close(got[2], want[2], rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(got[3], want[3], rtol=2 ** -7, atol=1e-2)


def test_compiled_step_in_a_cuda_graph_reads_fresh_copies() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).cuda()
    reference = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).cuda()
    reference.load_state_dict(model.state_dict())
    copies = WeightCopies(model, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    x = torch.randn(64, 128, device="cuda")
    forward = torch.compile(lambda m, x: m(x).float().square().mean())

    def step() -> torch.Tensor:
        with copies.active():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(model, x)
            loss.backward()
            opt.step()
            copies.write()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    graphed = hal.graphs.graphed(step)
    losses = [float(graphed()) for _ in range(6)]
    want = []
    for _ in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = reference(x).float().square().mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        want.append(float(loss))
    assert graphed.captured()
    assert losses == pytest.approx(want, rel=1e-2)
    for m in (model[0], model[2]):
        assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))
