"""On a CUDA device, whole-model training steps with hal (the workloads of ``hal bench --models`` at
their small size): no host synchronisation in a step, and a whole step captured in a CUDA graph
(``torch.cuda.graph``) or compiled with ``torch.compile(mode="reduce-overhead")`` replays what eager
steps compute on the same data.

Skipped without a CUDA device (CI); run on the device machine (benchmarks/models_h200.sh).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hal
from hal_bench.models_llama import CONFIGS as LLAMA, OPS, Decoder, LlamaTrain
from hal_bench.models_moe import MoEForwardBackward
from hal_bench.models_resnet import CONFIGS as RESNET, ResNet, ResNetTrain
from hal_bench.workload import Workload
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = torch.device("cuda")
@pytest.mark.parametrize("cls", [ResNetTrain, LlamaTrain, MoEForwardBackward], ids=["resnet", "llama", "moe"])
def test_hal_step_does_not_synchronise(cls: type[Workload]) -> None:
    step = cls("cpu").make("hal", None, DEV, fresh_seed())
    for _ in range(2):  # compile, tune and cache outside the check
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# --- a whole training step in a CUDA graph -----------------------------------------------------------

Batch = tuple[torch.Tensor, torch.Tensor]


def _resnet(seed: int) -> tuple[nn.Module, Callable[[nn.Module, Batch], torch.Tensor], list[Batch]]:
    cfg = RESNET["cpu"]
    torch.manual_seed(seed)
    model = hal.nn.fuse(ResNet(cfg.layers, cfg.width, cfg.classes).to(DEV).to(memory_format=torch.channels_last), inplace=True)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=gen).to(DEV).contiguous(memory_format=torch.channels_last),
                torch.randint(0, cfg.classes, (cfg.batch,), generator=gen).to(DEV)) for _ in range(4)]
    return model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batches


def _llama(seed: int) -> tuple[nn.Module, Callable[[nn.Module, Batch], torch.Tensor], list[Batch]]:
    cfg = LLAMA["cpu"]
    torch.manual_seed(seed)
    model = Decoder(cfg, OPS["hal"]()).to(DEV)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(DEV) for _ in range(4)]
    return model, lambda m, b: m(b[0], b[1]), [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


BUILDERS = {"resnet": _resnet, "llama": _llama}


@pytest.fixture(autouse=True)
def reproducible_convolutions():
    """cuDNN's deterministic algorithms, IEEE float32: twin models then compute the same steps.

    By default torch lets cuDNN run float32 convolutions in TF32 (about 1e-3 relative) and pick
    algorithms that accumulate in any order; two twins then drift apart by more than the
    comparison allows (AdamW turns a changed sign of a near-zero gradient into a full-size update),
    which says nothing about capture or compilation. hal's own convolutions are IEEE float32 already.
    """
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved


def _twins(name: str, optimizer: Callable[[nn.Module], torch.optim.Optimizer], seed: int) -> tuple:
    (a, loss_fn, batches), (b, _, _) = BUILDERS[name](seed), BUILDERS[name](seed)
    return a, optimizer(a), b, optimizer(b), loss_fn, batches


def _step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable, batch: Batch) -> torch.Tensor:
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    return loss


def _graph_replays_match_eager(name: str, optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
    graphed, g_opt, eager, e_opt, loss_fn, batches = _twins(name, optimizer, fresh_seed())
    static = tuple(t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, autotuning, optimizer state) outside the capture
        for _ in range(2):
            g_opt.zero_grad(set_to_none=True)
            _step(graphed, g_opt, loss_fn, static)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        e_opt.zero_grad(set_to_none=True)
        _step(eager, e_opt, loss_fn, batches[0])
    g_opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _step(graphed, g_opt, loss_fn, static)
    for batch in batches[1:]:
        for s, t in zip(static, batch):
            s.copy_(t)
        graph.replay()
        e_opt.zero_grad(set_to_none=True)
        want = _step(eager, e_opt, loss_fn, batch)
        torch.testing.assert_close(static_loss, want, rtol=1e-3, atol=1e-4)
    for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    for p, q in zip(graphed.buffers(), eager.buffers()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["resnet", "llama"])
def test_training_step_captures_and_replays(name: str) -> None:
    """Forward and backward through hal, torch's capturable AdamW: replays match eager steps."""
    _graph_replays_match_eager(name, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True))


def test_training_step_with_hal_adamw_captures_and_replays() -> None:
    """hal.optim.AdamW keeps its step counts on the device (the fused kernel reads them), so a
    captured step replays with the right bias correction at every step."""
    _graph_replays_match_eager("resnet", lambda m: hal.optim.AdamW(m.parameters(), lr=1e-2))


@pytest.mark.parametrize("name", [
    pytest.param("resnet", marks=pytest.mark.xfail(strict=False, reason=(
        "open bug, measured on the H200 on 2026-12-01 (commit fb35c8b): from the second step under "
        "cudagraph trees the gradient of the first downsample convolution differs from eager's (805 of "
        "1024 elements, up to 10x relative) while the loss agrees to 1e-4; the first step matches. "
        "Since the compiled graph holds torch's ops in place of hal nodes (85cf0c8, 6cb71cf) it passed "
        "in two runs of three on the H200 and failed in one: not strict until the cause is known"))),
    "llama",
])
def test_reduce_overhead_compile_matches_eager(name: str) -> None:
    """torch.compile(mode="reduce-overhead") of the hal model (CUDA graphs through Inductor's
    cudagraph trees), eager optimizer: at every step the loss and the gradients eager computes from
    the same parameters, and no cudagraph skip. Inductor's own kernels for the glue between hal's ops
    (residual adds, pooling, the loss) round differently from eager ones; so that this difference
    does not compound over the steps, the eager twin takes the compiled model's parameters and
    buffers before each step (plain SGD: no optimizer state to carry over)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled_model, c_opt, eager, e_opt, loss_fn, batches = _twins(name, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), fresh_seed())
    compiled = torch.compile(compiled_model, mode="reduce-overhead")
    for i, batch in enumerate(batches + batches):
        with torch.no_grad():
            for q, p in zip(list(eager.parameters()) + list(eager.buffers()), list(compiled_model.parameters()) + list(compiled_model.buffers())):
                q.copy_(p)
        torch.compiler.cudagraph_mark_step_begin()
        c_opt.zero_grad(set_to_none=True)
        e_opt.zero_grad(set_to_none=True)
        got = loss_fn(compiled, batch)
        got.backward()
        want = loss_fn(eager, batch)
        want.backward()
        assert float(got) == pytest.approx(float(want), rel=1e-4, abs=1e-5), f"step {i}"
        for (n, p), q in zip(compiled_model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=n, i=i: f"step {i}, grad of {n}: {m}")
        c_opt.step()
        e_opt.step()
    skips = dict(counters["inductor"])
    assert not {k: v for k, v in skips.items() if "cudagraph_skip" in k}, skips
    torch._dynamo.reset()
