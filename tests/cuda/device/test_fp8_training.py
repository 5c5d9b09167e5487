"""On a CUDA device with FP8 (sm_89+): the cuBLASLt fp8_scaled_mm kernel against cpu_ref for each
granularity and format pair it takes, what the dispatcher runs for each, the FP8 recipes in a
training step with no host synchronisation, captured in a CUDA graph whose replays compute what
eager steps compute (delayed scaling's history and scales updated on the device, in place), under
torch.compile, and with hal.optim.AdamW's float32 masters.

Skipped without a CUDA device with FP8 (CI); run on the device machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hal
from tests.cuda._support import assert_close, fresh_seed

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and not getattr(torch.version, "hip", None)
pytestmark = pytest.mark.skipif(not FP8_GPU, reason="needs an NVIDIA GPU with FP8 (sm_89 or newer)")
HOPPER = FP8_GPU and torch.cuda.get_device_capability()[0] == 9


def operands(gen: torch.Generator, m: int, k: int, n: int, fa: str, fb: str, granularity: str):
    """Quantised random operands (quantised on the CPU by cpu_ref's twin, the eager backend) and a
    bias; b scaled by 1 / sqrt(K) so that results are of unit size, as fp8_scaled_mm's tolerance
    (an absolute error of the hardware's FP8 accumulation) assumes."""
    a = torch.randn(m, k, generator=gen) * 4
    b = torch.randn(n, k, generator=gen) / (4 * k**0.5)
    with hal.use(backend="eager"):
        qa, sa = hal.ops.fp8_quantize(a, fa, granularity)
        qb, sb = hal.ops.fp8_quantize(b, fb, granularity)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return [t.cuda() for t in (qa, qb, sa, sb, bias)]


CASES = [("tensor", "e4m3fn", "e4m3fn"), ("tensor", "e4m3fn", "e5m2"), ("tensor", "e5m2", "e4m3fn"),
         ("row", "e4m3fn", "e4m3fn"), ("row", "e5m2", "e4m3fn"), ("block", "e4m3fn", "e4m3fn"), ("block", "e5m2", "e4m3fn")]


@pytest.mark.parametrize("granularity,fa,fb", CASES)
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_cublaslt_kernel_against_cpu_ref(granularity, fa, fb, out_dtype):
    """The cuBLASLt kernel where its check takes the call (else the check's reason is printed and
    the dispatcher's choice is tested instead), M ragged, bias in the epilogue or after."""
    from hal_backend_cuda import fp8 as cuda_fp8

    gen = torch.Generator().manual_seed(fresh_seed())
    qa, qb, sa, sb, bias = operands(gen, 200, 512, 384, fa, fb, granularity)
    args = (qa, qb, sa, sb, bias, fa, fb, out_dtype, 128)
    with hal.use(backend="cpu_ref"):  # float64 arithmetic on the exact 8-bit values and float32 scales
        want = hal.ops.fp8_scaled_mm(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in args[:5]], *args[5:7], "float32", 128).double()
    print(hal.explain("fp8_scaled_mm", *args))
    out = cuda_fp8.fp8_scaled_mm_cublaslt(*args) if _takes(args) else hal.ops.fp8_scaled_mm(*args)
    assert out.dtype == getattr(torch, out_dtype)
    assert_close("fp8_scaled_mm", out.cpu(), want, args)
    assert_close("fp8_scaled_mm", hal.ops.fp8_scaled_mm(*args).cpu(), want, args)


def _takes(args) -> bool:
    from hal_backend_cuda import fp8 as cuda_fp8
    from hal.plugin import Inputs
    from hal.registry import get_op

    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    inputs = Inputs(op=get_op("fp8_scaled_mm"), args=args, device_kind="cuda", device=args[0].device, dtype="uint8",
                    array_type="torch", arch=arch)
    reasons = cuda_fp8.cublaslt_check(inputs)
    print("cublaslt check:", reasons or "takes it")
    return not reasons


def test_cublaslt_takes_tensor_scales_and_hopper_takes_row_scales():
    gen = torch.Generator().manual_seed(fresh_seed())
    qa, qb, sa, sb, _ = operands(gen, 256, 256, 256, "e4m3fn", "e4m3fn", "tensor")
    assert _takes((qa, qb, sa, sb, None, "e4m3fn", "e4m3fn", "bfloat16", 128))
    if HOPPER:
        qa, qb, sa, sb, _ = operands(gen, 256, 256, 256, "e4m3fn", "e4m3fn", "row")
        assert _takes((qa, qb, sa, sb, None, "e4m3fn", "e4m3fn", "bfloat16", 128))


def model(seed: int, recipe) -> nn.Module:
    return hal.fp8.convert(_plain(seed), recipe)


def data(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 128, generator=g) / 16
    out = []
    for i in range(n):
        x = torch.randn(128, 256, generator=g) * (1 + i % 4)  # moving amaxes: the delayed history matters
        out.append((x.cuda(), torch.tanh(x @ w).cuda()))
    return out


def step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = (net(x).float() - y).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("recipe", [hal.fp8.DelayedScaling(history=4), hal.fp8.CurrentScaling(), hal.fp8.RowwiseScaling()],
                         ids=["delayed", "tensor", "row"])
def test_training_step_has_no_host_synchronisation(recipe):
    net = model(1, recipe)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    batches = data(2, 3)
    for x, y in batches[:2]:  # probe, compile and tune outside the check
        opt.zero_grad(set_to_none=True)
        step(net, opt, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.zero_grad(set_to_none=True)
        step(net, opt, *batches[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_delayed_scaling_in_a_cuda_graph_matches_eager_steps():
    """fwd + bwd + SGD of a converted model captured once and replayed on new batches: losses,
    parameters and every amax history and scale as in eager steps; the state keeps its storage."""
    recipe = hal.fp8.DelayedScaling(history=4)
    graphed, eager = model(3, recipe), model(3, recipe)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    batches = data(4, 9)
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (probes, tuning, compilation) on the first three batches
        for x, y in batches[:3]:
            static_x.copy_(x)
            static_y.copy_(y)
            opt_g.zero_grad(set_to_none=True)
            step(graphed, opt_g, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    for x, y in batches[:3]:
        opt_e.zero_grad(set_to_none=True)
        step(eager, opt_e, x, y)
    ptrs = {n: b.data_ptr() for n, b in graphed.named_buffers()}
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(graphed, opt_g, static_x, static_y)
    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        opt_e.zero_grad(set_to_none=True)
        want = step(eager, opt_e, x, y)
        torch.testing.assert_close(static_loss, want, rtol=2e-2, atol=1e-4)
    assert {n: b.data_ptr() for n, b in graphed.named_buffers()} == ptrs
    for (name, b), c in zip(eager.named_buffers(), graphed.buffers()):
        torch.testing.assert_close(c, b, rtol=2e-2, atol=1e-6, msg=name)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=2e-2, atol=2e-3, msg=name)
    assert all(float(b.min()) > 0 for n, b in graphed.named_buffers() if n.endswith("amax_history"))


def test_compiled_fp8_model_matches_eager():
    recipe = hal.fp8.DelayedScaling(history=4)
    eager = model(5, recipe)
    compiled_net = copy.deepcopy(eager)
    compiled = torch.compile(compiled_net, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled_net.parameters(), lr=0.05)
    for x, y in data(6, 4):
        opt_e.zero_grad(set_to_none=True)
        opt_c.zero_grad(set_to_none=True)
        want = step(eager, opt_e, x, y)
        got = step(compiled, opt_c, x, y)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)
    for (name, b), c in zip(eager.named_buffers(), compiled_net.buffers()):
        torch.testing.assert_close(c, b, rtol=2e-2, atol=1e-6, msg=name)


def _adamw_losses(recipe, steps: int) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    """Losses of the bfloat16 model of seed 7 (converted to FP8 under ``recipe``, or not when None)
    trained by hal.optim.AdamW with float32 masters on the batches of seed 8."""
    net = model(7, recipe).to(torch.bfloat16) if recipe is not None else _plain(7).to(torch.bfloat16)
    opt = hal.optim.AdamW(net.parameters(), lr=2e-3, master_weights=True)
    losses = []
    for x, y in data(8, steps):
        opt.zero_grad(set_to_none=True)
        loss = (net(x.to(torch.bfloat16)).float() - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, net, opt


def _plain(seed: int) -> nn.Module:
    """model(seed, ...) before conversion: the same initial weights, plain nn.Linear layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(),
                         nn.Linear(256, 128)).cuda()


def test_hal_adamw_masters_train_a_converted_bfloat16_model():
    """FP8 (current scaling, cuBLASLt GEMMs with e5m2 gradients) tracks the same bfloat16 model
    trained without FP8, step by step, and both learn. The batches' scale cycles with period 4 (x
    times 1..4), so the loss does too: learning is judged on means over whole periods (the first and
    last 8 steps), never on windows of different phases (the old first-5 / last-5 check compared
    different phases and failed on the H200 although its losses equal the CPU run's to 3 digits). On
    the CPU FP8 and bfloat16 agree to < 1% at every step and 40 steps take the period mean from
    0.616 to 0.495 (0.80x)."""
    steps = 40
    fp8, net, opt = _adamw_losses(hal.fp8.CurrentScaling(), steps)
    bf16, _, _ = _adamw_losses(None, steps)
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in net.parameters())
    worst = max(abs(f - b) / b for f, b in zip(fp8, bf16))
    assert worst < 0.03, (worst, fp8, bf16)
    for losses in (fp8, bf16):
        assert sum(losses[-8:]) < 0.88 * sum(losses[:8]), losses
