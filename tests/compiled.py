"""What tests of torch.compile share: a compiled function together with the code of the graphs
AOTAutograd traces for it, to tell which hal calls stayed opaque ``torch.ops.hal`` nodes."""

from __future__ import annotations

from typing import Any

import torch


def compiled_with_graphs(fn: Any) -> tuple[Any, list[str]]:
    """``fn`` compiled by AOTAutograd without Inductor (fullgraph), and the code of the forward and
    backward graphs it traces (filled in on the first call)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: list[str] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    return torch.compile(fn, fullgraph=True, backend=backend), graphs
