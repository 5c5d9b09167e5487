"""Every Triton kernel of the CUDA plugin, run by the Triton interpreter on CPU tensors and compared
with cpu_ref: the tests in tests/cuda/interpreted, run in a subprocess with TRITON_INTERPRET=1 (the
interpreter mode is fixed when Triton loads a kernel, and this process compiles kernels for real in
test_aot.py). The subprocess starts when collection ends (see conftest.py)."""

from __future__ import annotations

import subprocess


def test_triton_kernels_in_the_interpreter_match_cpu_ref(interpreter_run: subprocess.Popen) -> None:
    out, _ = interpreter_run.communicate(timeout=900)
    print(out[-20000:])
    assert interpreter_run.returncode == 0, "interpreted kernel tests failed (output above)"
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
