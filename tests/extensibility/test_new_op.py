"""An op declared outside hal (tests/extensibility/new_op_module.py: a declaration, its kernels,
its cases; nothing in hal/) gets everything hal gives its own ops: ``hal.ops.<name>``,
``torch.ops.hal.<name>`` with a fake kernel that passes torch's opcheck, autograd through its
backward op, torch.compile(fullgraph=True), explain and stats, and conformance cases that the
suite runs against the reference."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import torch, hal
    from hal import dispatch
    from hal.runtime import Runtime
    import hal_backend_cpu_ref
    from tests.extensibility import new_op_module as m

    dispatch.install(Runtime.from_plugins([hal_backend_cpu_ref.plugin, m.plugin]))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    y = hal.ops.cube_scale(x, 1.5)                       # hal.ops.<name>
    assert torch.allclose(y, 1.5 * x**3)
    d = hal.explain("cube_scale", x, 1.5)
    assert d.route == "autograd" and (d.backend, d.kernel) == ("cubes", "torch"), d
    hal.reset_stats()
    y = hal.ops.cube_scale(x, 1.5)
    y.sum().backward()                                   # autograd through cube_scale_backward
    assert torch.allclose(x.grad, 4.5 * x.detach() ** 2)
    assert sorted(hal.stats()) == sorted(d.kernels_run()), (hal.stats(), d.kernels_run())

    op = torch.ops.hal.cube_scale.default                # torch.ops.hal.<name>, fake kernel, autograd
    torch.library.opcheck(op, (x.detach(), 2.0), test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    f = torch.compile(lambda t: hal.ops.cube_scale(t, 2.0).sum(), fullgraph=True, backend="aot_eager")
    xc = x.detach().clone().requires_grad_(True)
    f(xc).backward()
    assert torch.allclose(xc.grad, 6.0 * xc.detach() ** 2)

    from hal.conformance.runner import Suite             # conformance cases, against cpu_ref
    suite = Suite(backend="cubes", ops=["cube_scale*"])
    results = suite.run(suite.plan())
    statuses = {r.id: r.status for r in results}
    assert statuses and set(statuses.values()) == {"pass"}, statuses
    print("ok", len(statuses), "conformance cases passed")
    """
)


def test_an_op_declared_outside_hal_gets_everything() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "conformance cases passed" in out.stdout
