"""The C++ kernels in the CUDA plugin: registered as "cpp" / "cudnn_cpp" below the Triton kernels, the
plugin loading and the kernels rejecting with an actionable reason where CuPy is missing, and a kit
whose runtime cannot run falling back, counted, to the next backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from hal_backend_cpu_ref import plugin as cpu_ref

import hal
import hal_cpp
from hal.plugin import Plugin
from hal_cpp.host import HostRuntime

CPP_OPS = {"batch_norm": "cpp", "batch_norm_backward": "cpp", "fused_adamw_": "cpp", "layer_norm_backward": "cpp",
           "rms_norm_backward": "cpp",
           "fused_conv_bn_relu": "cudnn_cpp", "fused_conv_bn_relu_backward": "cudnn_cpp"}


def test_cuda_plugin_registers_the_cpp_kernels_below_triton() -> None:
    from hal_backend_cuda import plugin

    by_op = {}
    for k in plugin.kernels:
        by_op.setdefault(k.op, {})[k.name] = k
    for op, name in CPP_OPS.items():
        kernels = by_op[op]
        assert name in kernels, f"{op} has no {name} kernel"
        triton = next(k for n, k in kernels.items() if "triton" in n)
        assert kernels[name].priority < triton.priority, f"{op}: {name} should rank below {triton.name} until measured"


def test_without_cupy_the_plugin_loads_and_cpp_kernels_say_why() -> None:
    """CuPy made unimportable in a fresh interpreter (as on a machine without it)."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # import cupy raises ImportError
        import torch, hal
        from hal.plugin import Inputs
        from hal.registry import get_op
        from hal_backend_cuda import plugin
        record = {b.name: b for b in hal.backends()}["cuda"]
        assert record.load_error is None, record.load_error
        x = torch.randn(4, 3, 2, 2)
        decl = get_op("batch_norm")
        inputs = Inputs(decl, (x, None, None, None, None, True, 0.1, 1e-5), "cuda", torch.device("cuda", 0), "float32", "torch", "sm_90")
        k = next(k for k in plugin.kernels if k.op == "batch_norm" and k.name == "cpp")
        print(k.not_supported_reasons(inputs))
        print("cupy" in sys.modules and sys.modules["cupy"] is not None)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    reasons, imported = out.stdout.strip().splitlines()
    assert "cupy is not installed: pip install cupy-cuda12x/13x" in reasons
    assert imported == "False"


def test_importing_the_kit_compiles_nothing_and_imports_no_vendor_package() -> None:
    code = "import sys, hal_cpp, hal_backend_cuda; print(sorted(m for m in ('cupy', 'triton', 'hip') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_runtime_that_cannot_run_falls_back_counted(install_plugins) -> None:
    broken = HostRuntime(compiler="no-such-c++-compiler")
    plugin = Plugin(name="cpp_broken", version="0", summary="kits/cpp without a compiler (test)")
    plugin.define_backend(priority=cpu_ref.backend.priority + 10, device_types=("cpu",))
    hal_cpp.register(plugin, broken)
    install_plugins([cpu_ref, plugin])
    x = torch.randn(4, 3, 5)
    decision = hal.explain("batch_norm", x, None, None, training=True)
    assert decision.backend == "cpu_ref"
    assert "no host C++ compiler (no-such-c++-compiler is not on the PATH" in str(decision)
    y = hal.ops.batch_norm(x, None, None, training=True)
    assert torch.allclose(y, torch.nn.functional.batch_norm(x, None, None, training=True), atol=1e-5)
    counts = [v for (op, backend, _), v in hal.stats().items() if op == "batch_norm" and backend == "cpu_ref"]
    assert counts == [{"calls": 1, "fallbacks": 1}]
