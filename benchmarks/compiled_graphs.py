"""Which hal ops stay opaque ``torch.ops.hal`` nodes inside the compiled graphs of the whole-model
workloads, and which kernels the dispatcher chose for them: the first thing to read when a model
compiled with hal ops is slower than the model compiled without them (an opaque node stops
Inductor from fusing its neighbours and costs a Python call per run).

    python benchmarks/compiled_graphs.py [--models resnet50_train,llama_train] [--size full|cpu|tiny]

The workloads of ``hal bench --models`` are built as there (hal variant) and compiled with
AOTAutograd and no Inductor (the graphs are the ones Inductor would receive); one step runs. Prints,
per model, the hal nodes of the forward and backward graphs by op, and the aten ops by count.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import torch

import hal
from hal_bench import models as bench_models


def _capturing() -> tuple[Any, list[tuple[str, Counter]]]:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: list[tuple[str, Counter]] = []

    def keeper(kind: str) -> Any:
        def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
            graphs.append((kind, Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")))
            return make_boxed_func(gm.forward)
        return keep

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(gm, example_inputs, fw_compiler=keeper("forward"), bw_compiler=keeper("backward"))

    return backend, graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50_train,resnet50_infer_fp16,llama_train,moe_fwd_bwd")
    ap.add_argument("--size", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("full" if device.type == "cuda" else "tiny")
    backend, graphs = _capturing()
    patched = lambda module, mode: module if mode is None else torch.compile(module, backend=backend)  # noqa: E731
    for name in ("models", "models_resnet", "models_llama", "models_moe"):
        mod = __import__(f"hal_bench.{name}", fromlist=["compiled"])
        mod.compiled = patched
    wanted = args.models.split(",")
    for workload in bench_models.all_workloads(size):
        if workload.name not in wanted:
            continue
        torch._dynamo.reset()
        graphs.clear()
        step = workload.make("hal", "default", device, 0)
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"== {workload.name} ({size}): {len(graphs)} graphs")
        for kind, ops in graphs:
            hal_ops = {k: v for k, v in ops.items() if k.startswith("hal.")}
            aten = sum(v for k, v in ops.items() if k.startswith("aten."))
            print(f"  {kind}: {aten} aten calls, hal nodes: {dict(sorted(hal_ops.items())) or 'none'}")
            top = [f"{k.removeprefix('aten.')} {v}" for k, v in ops.most_common(12) if k.startswith("aten.")]
            print(f"    most common aten ops: {', '.join(top)}")


if __name__ == "__main__":
    main()
