"""Routing as data (issue 42 item 4): a kernel's registration says which contexts it serves (eager,
CUDA-graph replays, torch.compile graphs, training) and its priority in each; the dispatcher decides
each call in one context and ranks by that table; ``hal.explain`` names the context and prints every
candidate's table. Registrations with ``priority`` / ``graph_priority`` keep meaning what they meant.
The Triton kit's registrations are compared with its routing table recorded before they were split
into one file per op family (tests/core/data/triton_kit_routing.json, recorded at 8a097f8)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hal
import hal.graphs
from hal.plugin import CONTEXTS, Archs, Inputs, Plugin, Routing
from hal.errors import PluginError

RAN: list[str] = []


def _softmax(name: str) -> Any:
    def softmax(x, dim):  # noqa: ANN001 - exactly the op's parameters
        RAN.append(name)
        return F.softmax(x, dim)

    return softmax


def _routed_plugin() -> Plugin:
    """softmax three times: ``plain`` first in eager calls, ``trains`` first with autograd,
    ``graphs_only`` serving compiled graphs and nothing else."""
    p = Plugin("routed", "0.1.0", summary="test: kernels serving different contexts")
    p.define_backend(priority=500, device_types=("cpu",))
    p.kernel("softmax", name="plain", contexts={"eager": 30, "training": 5, "graph": 10})(_softmax("plain"))
    p.kernel("softmax", name="trains", contexts={"eager": 20, "training": 40, "graph": 20})(_softmax("trains"))
    p.kernel("softmax", name="graphs_only", contexts={"compiled": 50})(_softmax("graphs_only"))
    p.kernel("softmax_backward", name="torch", priority=1)(lambda grad_out, out, dim: out * (grad_out - (grad_out * out).sum(dim, keepdim=True)))
    return p


@pytest.fixture
def routed(install_plugins) -> None:  # noqa: ANN001
    import hal_backend_cpu_ref

    install_plugins([hal_backend_cpu_ref.plugin, _routed_plugin()])
    RAN.clear()


def test_registration_states_contexts_and_priorities_as_data() -> None:
    p = Plugin("t", "0.1.0")
    p.define_backend(priority=1, device_types=("cpu",))
    p.kernel("softmax", name="a", contexts={"eager": 3, "compiled": 7})(_softmax("a"))
    p.kernel("softmax", name="b", priority=4, graph_priority=9)(_softmax("b"))
    p.kernel("softmax", name="c")(_softmax("c"))
    a, b, c = p.kernels
    assert a.routing == Routing((("compiled", 7), ("eager", 3))) and a.routing.priority("training") is None
    assert str(a.routing) == "compiled 7, eager 3" and a.priority == 3
    assert b.routing == Routing.of({"graph": 9, "compiled": 4, "training": 4, "eager": 4})
    assert (b.priority, b.graph_priority) == (4, 9)
    assert str(c.routing) == "0 in every context" and set(c.routing.contexts) == set(CONTEXTS)


@pytest.mark.parametrize("options, words", [
    ({"contexts": {"eager": 1, "jit": 2}}, "contexts must map some of graph, compiled, training, eager"),
    ({"contexts": {}}, "contexts must map some of"),
    ({"contexts": {"eager": 1.5}}, "priority is an int"),
    ({"contexts": {"eager": 1}, "priority": 3}, "either contexts or priority"),
])
def test_a_bad_routing_is_refused_at_registration(options: dict, words: str) -> None:
    p = Plugin("t", "0.1.0")
    with pytest.raises(PluginError, match="kernel 'k' of op softmax") as info:
        p.kernel("softmax", name="k", **options)
    assert words in str(info.value)


def test_the_call_s_context_picks_the_priority_that_ranks(routed: None) -> None:
    x = torch.randn(3, 5, dtype=torch.float64)
    hal.ops.softmax(x, 1)
    hal.ops.softmax(x.clone().requires_grad_(True), 1).sum().backward()
    with hal.graphs.device_bound():
        hal.ops.softmax(x, 1)
    assert RAN == ["plain", "trains", "trains"]


def test_a_kernel_serving_no_such_calls_is_a_candidate_with_the_reason(routed: None) -> None:
    x = torch.randn(3, 5, dtype=torch.float64)
    d = hal.explain("softmax", x, 1)
    assert d.kernel == "plain" and d.context == "eager"
    reasons = {c.kernel: c.reasons for c in d.candidates if c.backend == "routed"}
    assert reasons["graphs_only"] == ["serves no eager calls (its contexts: compiled 50)"]
    text = str(d)
    assert "context: eager (no autograd, no graph): kernels ranked by their eager priority" in text
    assert "-> routed/plain  (graph 10, training 5, eager 30)" in text
    trained = hal.explain("softmax", x.clone().requires_grad_(True), 1)
    assert trained.kernel == "trains" and trained.context == "training"
    with hal.use(kernel={"softmax": "graphs_only"}), pytest.raises(hal.UnsupportedError, match="serves no eager calls"):
        hal.ops.softmax(x, 1)


def test_a_traced_call_is_decided_in_the_compiled_context(routed: None) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.config import choice_for
    from hal.dispatch import DISPATCHER
    from hal.registry import get_op

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(3, 5, dtype=torch.float64))
        decided = DISPATCHER.decide(get_op("softmax"), (fake, 1), choice_for("softmax", None), may_measure=False)
    assert decided.selection.context == "compiled" and decided.route is not None and decided.route.kernel == "graphs_only"


# --- the Triton kit: one registration file per op family, the routing of before --------------------


RECORDED = Path(__file__).parent / "data" / "triton_kit_routing.json"


def _kit_plugin() -> Plugin:
    """The kit registered on a plugin of its own, with launch tables and vendor calls that are never
    called (registering runs none of them, and imports no Triton)."""
    from hal_triton.kernels import VendorLibs, register
    from hal_triton.tables import LaunchTables

    def unused(*args: Any) -> Any:
        raise AssertionError("registration calls no vendor library and asks no launch table")

    tables = type("Tables", (LaunchTables,), {m: unused for m in LaunchTables.__abstractmethods__})()
    plugin = Plugin("kit", "1.0")
    plugin.define_backend(priority=1, device_types=("cuda",))
    register(plugin, tables, archs=Archs(lambda arch: True, "any"), vendor=VendorLibs("cudnn", unused, unused, "cublas", unused, unused))
    return plugin


def _reasons_on_cases(kernel: Any) -> dict[str, Any]:
    """The kernel's rejection reasons on the quick conformance cases of its op, per dtype (CPU
    tensors seen as on an sm_90 device), but Triton's absence (recorded where it is installed)."""
    from hal_triton import unavailable_reason

    from hal.conformance.cases import cases_for, draw_call
    from hal.dispatch import prepare
    from hal.registry import get_op

    decl = get_op(kernel.op)
    out: dict[str, Any] = {}
    for dtype in sorted(kernel.dtypes or decl.dtypes):
        for spec in cases_for(kernel.op, dtype, quick=True):
            given = draw_call(kernel.op, dtype, spec, 0, "cpu").args
            p = prepare(decl, tuple(given.get(q.name, q.default) for q in decl.params)).inputs
            reasons = kernel.not_supported_reasons(Inputs(decl, p.args, "cuda", p.device, p.dtype, "torch", "sm_90"))
            out[f"{dtype}/{spec.name}"] = [r for r in reasons if r != unavailable_reason()]
    return out


def test_the_triton_kit_routes_as_before_the_split() -> None:
    recorded = {(r["op"], r["name"]): r for r in json.loads(RECORDED.read_text())["kernels"]}
    kernels = {(k.op, k.name): k for k in _kit_plugin().kernels}
    assert sorted(kernels) == sorted(recorded)
    for key, k in kernels.items():
        want = recorded[key]
        assert dict(k.routing.priorities) == want["contexts"], key
        assert (sorted(k.dtypes) if k.dtypes is not None else None) == want["dtypes"], key
        assert _reasons_on_cases(k) == want["reasons"], key


def test_the_triton_kit_has_one_registration_file_per_kernel_family() -> None:
    """The registration files are found (not listed), one per family, each beside its kernels."""
    import hal_triton
    from hal_triton.kernels import FAMILIES, REGISTRATIONS

    assert [m.__name__.rsplit(".", 1)[1] for m in REGISTRATIONS] == list(FAMILIES) == sorted(FAMILIES)
    kit_dir = Path(hal_triton.__file__).parent
    assert sorted(p.stem for p in (kit_dir / "kernels").glob("*.py")) == sorted([*FAMILIES, "__init__", "kit"])
    assert all((kit_dir / f"{family}.py").is_file() for family in FAMILIES)


@pytest.mark.parametrize("options, argument", [
    ({"contexts": {"eager": 1}, "priority": 2}, "argument 'priority'"),
    ({"contexts": {"jit": 1}}, "argument 'contexts'"),
])
def test_hal_library_refuses_a_bad_routing_before_registering(options: dict, argument: str) -> None:
    import hal.library

    with pytest.raises(hal.InvalidArgumentError, match=argument):
        hal.library.register_kernel("softmax", backend="cpu", name="never", **options)
