"""rotary_embedding on the CPU backend: eagerly hal's node (its backward op is one rotation, faster
than torch's recorded ops there); inside torch.compile graphs torch's ops, which Inductor compiles
with their neighbours (an opaque node cost about twice the host time of Inductor's code)."""

from __future__ import annotations

import numpy as np
import torch

import hal
from tests.compiled import compiled_with_graphs


def test_rotary_is_hals_node_eagerly_and_torchs_ops_in_compiled_graphs(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((2, 8, 4, 16))).requires_grad_(True)
    cos, sin = (torch.from_numpy(rng.standard_normal((8, 1, 8))) for _ in range(2))
    d = hal.explain("rotary_embedding", x, cos, sin)
    assert (d.backend, d.kernel, d.autograd_by) == ("cpu", "torch", "hal"), d
    assert d.compiled is not None and d.compiled.traceable, d
    compiled, graphs = compiled_with_graphs(lambda t: hal.ops.rotary_embedding(t, cos, sin))
    g = torch.from_numpy(rng.standard_normal(x.shape))
    y = compiled(x)
    y.backward(g)
    assert len(graphs) == 2 and all("hal.rotary_embedding" not in code for code in graphs), graphs
    xr = x.detach().requires_grad_(True)
    ref = hal.ops.rotary_embedding(xr, cos, sin)  # eagerly: hal's node and backward op
    ref.backward(g)
    torch.testing.assert_close((y, x.grad), (ref, xr.grad))
