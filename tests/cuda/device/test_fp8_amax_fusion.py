"""On a GPU with FP8: the amax of an FP8 linear's input reduced by the op that writes it (issue 40,
FP8 lever "quantisation fused into its producers").

- rms_norm_amax / swiglu_amax (Triton): y bit for bit the plain Triton kernel's, the amax exactly
  torch's ``y.float().abs().amax()`` of that y (NaN, inf), at odd shapes and Llama-3-8B's
  ((4096, 4096) norm, (4096, 14336) SwiGLU), outputs poisoned first; the dispatcher runs them.
- fp8_quantize_(transpose_)from_amax with the hardware cast: bit for bit fp8_quantize's current
  scaling (the amax reduced by the cast) given x's amax, and cpu_ref's for other amaxes; the norm ->
  cast chain captured in a CUDA graph and replayed on new values.
- A patched Hugging Face Llama with ``fp8=hal.fp8.CurrentScaling()`` under bf16 autocast: one
  training step's loss and gradients with the fusion equal the step without it bit for bit (the
  plain ops forced onto the same Triton kernels), and match under torch.compile to bf16 rounding.

Skipped without a CUDA device; run on the device machine:
``pytest -q tests/cuda/device/test_fp8_amax_fusion.py``.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tests.cuda._support import fresh_seed
from tests.cuda.device._fp8 import DEV, kern, poison

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from hal_backend_cpu_ref import fp8 as ref

import hal  # noqa: E402


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEV)


def assert_amax(got: torch.Tensor, y: torch.Tensor, what: str) -> None:
    want = y.float().abs().amax() if y.numel() else torch.zeros((), device=y.device)
    assert got.dtype == torch.float32 and got.shape == (), what
    if bool(want.isnan()):
        assert bool(got.isnan()), f"{what}: amax {float(got)}, want NaN"
    else:
        assert int(got.view(torch.int32)) == int(want.view(torch.int32)), f"{what}: amax {float(got)!r}, want {float(want)!r}"


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.is_floating_point():
        got, want = got.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]), want.view(
            {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()])
    bad = int((got != want).sum())
    assert bad == 0, f"{what}: {bad} of {got.numel()} differ"


# --- the producers ------------------------------------------------------------------------------


NORM_CASES = [((4096, 4096), torch.bfloat16), ((3, 300, 520), torch.float16), ((257, 1000), torch.float32), ((7, 20000), torch.bfloat16),
              ((33, 64), torch.float64)]


def test_rms_norm_amax_on_the_gpu(gen: torch.Generator) -> None:
    for shape, dtype in NORM_CASES:
        n = shape[-1]
        x = randn(gen, *shape, dtype=dtype, scale=3.0)
        w = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(DEV)
        for special in (None, math.nan, math.inf, -1e4):
            xs = x.clone()
            if special is not None:
                xs.view(-1)[int(torch.randint(0, xs.numel(), (), generator=gen))] = special
            poison()
            y, amax = kern("rms_norm_amax")(xs, (n,), w, 1e-6)
            y0 = kern("rms_norm")(xs, (n,), w, 1e-6)
            torch.cuda.synchronize()
            assert_same(y, y0, f"{shape} {dtype} {special}: y")
            assert_amax(amax, y, f"{shape} {dtype} {special}")


SWIGLU_CASES = [((4096, 14336), torch.bfloat16), ((3, 300, 520), torch.float16), ((1001,), torch.float32)]


def test_swiglu_amax_on_the_gpu(gen: torch.Generator) -> None:
    for shape, dtype in SWIGLU_CASES:
        gate, up = randn(gen, *shape, dtype=dtype, scale=4.0), randn(gen, *shape, dtype=dtype)
        for special in (None, math.nan, math.inf):
            g = gate.clone()
            if special is not None:
                g.view(-1)[int(torch.randint(0, g.numel(), (), generator=gen))] = special
            poison()
            y, amax = kern("swiglu_amax")(g, up)
            torch.cuda.synchronize()
            assert_same(y, kern("swiglu")(g, up), f"{shape} {dtype} {special}: y")
            assert_amax(amax, y, f"{shape} {dtype} {special}")
    packed = randn(gen, 64, 2 * 2816, dtype=torch.bfloat16, scale=3.0)  # the halves of a packed gate-and-up projection
    y, amax = kern("swiglu_amax")(*packed.chunk(2, dim=-1))
    assert_amax(amax, y, "packed halves")


def test_the_dispatcher_runs_the_triton_kernels_at_the_8b_shapes(gen: torch.Generator) -> None:
    x = randn(gen, 4096, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16, device=DEV)
    g = randn(gen, 4096, 14336, dtype=torch.bfloat16)
    for op, args in (("rms_norm_amax", (x, (4096,), w, 1e-5)), ("swiglu_amax", (g, g)),
                     ("fp8_quantize_transpose_from_amax", (x, x.float().abs().amax(), "e4m3fn"))):
        d = hal.explain(op, *args)
        assert d.kernel == "triton", str(d)


# --- the cast given the amax ---------------------------------------------------------------------


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_cast_given_the_amax_is_current_scaling_on_the_hardware(fmts: list[str], gen: torch.Generator, transpose: bool) -> None:
    op = "fp8_quantize_transpose_from_amax" if transpose else "fp8_quantize_from_amax"
    plain = "fp8_quantize_transpose" if transpose else "fp8_quantize"
    for fmt in fmts:
        for shape, dtype in (((4096, 4096), torch.bfloat16), ((512, 2048), torch.float32), ((257, 1000), torch.float16)):
            x = (torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp(2 * torch.randn(shape, generator=gen, dtype=torch.float64)))
            x = x.to(dtype).to(DEV)
            amax = x.float().abs().amax()
            poison()
            got = kern(op)(x, amax, fmt)
            want = kern(plain)(x, fmt, "tensor", None, 128)
            torch.cuda.synchronize()
            for g, w, what in zip(got, want, ("q", "scale", "q_t")):
                assert_same(g, w, f"{fmt} {shape} {dtype} {what}")
            for given in (3.0 * float(amax), 0.25 * float(amax), 0.0):
                a = torch.tensor(given, dtype=torch.float32, device=DEV)
                got = kern(op)(x, a, fmt)
                fn = ref.fp8_quantize_transpose_from_amax if transpose else ref.fp8_quantize_from_amax
                with np.errstate(all="ignore"):
                    want = fn(x.float().cpu().numpy(), a.cpu().numpy(), fmt)
                for g, w, what in zip(got, want, ("q", "scale", "q_t")):
                    assert_same(g.cpu(), torch.from_numpy(np.asarray(w)), f"{fmt} amax {given} {what}")


def test_the_norm_and_cast_chain_runs_in_a_cuda_graph(fmts: list[str], gen: torch.Generator) -> None:
    """rms_norm_amax zeroes and reduces its word on the device, the cast reads it there: captured
    once, replayed on new values, the codes are those of the current-scaling cast of the new y."""
    fmt = fmts[0]
    x = randn(gen, 1024, 4096, dtype=torch.bfloat16)
    w = torch.rand(4096, generator=gen).add(0.5).to(torch.bfloat16).to(DEV)

    def chain() -> tuple:
        y, amax = kern("rms_norm_amax")(x, (4096,), w, 1e-5)
        return (y, amax, *kern("fp8_quantize_transpose_from_amax")(y, amax, fmt))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for _ in range(2):
        x.copy_(randn(gen, 1024, 4096, dtype=torch.bfloat16, scale=float(torch.rand((), generator=gen) * 50 + 0.1)))
        graph.replay()
        torch.cuda.synchronize()
        y, amax, q, s, qt = outs
        assert_amax(amax, y, "replayed amax")
        want = kern("fp8_quantize_transpose")(y, fmt, "tensor", None, 128)
        for g, w_, what in zip((q, s, qt), want, ("q", "scale", "q_t")):
            assert_same(g, w_, f"replayed {what}")


# --- the patched model ----------------------------------------------------------------------------


def _llama(seed: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(DEV)


def _step(model: torch.nn.Module, ids: torch.Tensor, call=None) -> tuple:
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cuda", torch.bfloat16):
        loss = (call if call is not None else model)(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_patched_llama_trains_bit_for_bit_as_without_the_fusion(fmts: list[str]) -> None:
    if "e4m3fn" not in fmts:
        pytest.skip("CurrentScaling's default format e4m3fn is not this GPU's")
    import hal.fp8
    from hal.nn import patch_hf_amax

    seed = fresh_seed()
    model = _llama(seed)
    hal.nn.patch(model, fp8=hal.fp8.CurrentScaling())
    assert all(isinstance(layer, patch_hf_amax._AmaxDecoderLayer) for layer in model.model.layers)
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        layer.__class__ = type(layer).__mro__[2]
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(seed)).to(DEV)
    # the plain ops on the Triton kernels the fused ones run (at these sizes torch's kernels rank first)
    with hal.use(kernel={"rms_norm": "triton", "swiglu": "triton"}):
        hal.reset_stats()
        fused = _step(model, ids)
        ran = {op for (op, _, k), c in hal.stats().items() if c["calls"]}
        assert {"rms_norm_amax", "swiglu_amax", "fp8_quantize_transpose_from_amax"} <= ran, ran
        unfused = _step(plain, ids)
    assert torch.equal(fused[0], unfused[0]), (float(fused[0]), float(unfused[0]))
    for name, g in fused[1].items():
        assert torch.equal(g, unfused[1][name]), name
    # compiled (the hal ops' decisions under torch.compile): with and without the fusion, to bf16 rounding
    compiled = []
    for m in (model, plain):
        torch._dynamo.reset()
        compiled.append(_step(m, ids, torch.compile(m)))
    torch._dynamo.reset()
    torch.testing.assert_close(compiled[0][0], compiled[1][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled[0][0], fused[0], rtol=2e-2, atol=2e-2)

