"""Explicit wiring (issue 42 item 3): ``import hal`` puts the core together in one place
(:func:`hal.wiring.wire`); no module of the core fills a slot of another as a side effect of being
imported; the op declarations are sealed (immutable) once registered; ``hal.ops.<name>`` shows its
source, signature and docstring and leads to the dispatcher; the core's modules import each other
one way."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import pickle
import pydoc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hal
from hal import dispatch, registry
from hal.integration import autograd, compile, library
from hal.types import Tensor
from tests.core.test_layers import ROOT, all_imports, cycles, is_module, layer, module_of, source_roots

#: the modules that run at ``import hal`` by design: the package, the wiring, ``python -m hal``
ENTRY_MODULES = ("hal/__init__.py", "hal/wiring.py", "hal/__main__.py")


def _side_effects(path: Path) -> list[str]:
    """Statements at a module's top level that act on something else when it is imported: a call
    whose result is dropped, or an assignment into an attribute or item (``HOOKS.autograd = f``)."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)) or any(isinstance(t, (ast.Attribute, ast.Subscript)) for t in targets):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:90]}")
    return found


def _registrations(source: str, module: str, package: bool = False) -> list[str]:
    """Definitions at a module's top level decorated by a function of another module of hal (as
    ``@register`` of hal.dist.algorithms decorated hal.dist.hierarchical's algorithm): a decorator
    that can fill the other module's table as this one is imported."""
    here = module.split(".") if package else module.split(".")[:-1]
    roots = source_roots(ROOT)
    tree = ast.parse(source)
    origin: dict[str, str] = {}  # a name bound by an import -> the hal module that defines it (or is it)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) if node.level else str(node.module)
            if base == "hal" or base.startswith("hal."):
                origin.update({a.asname or a.name: f"{base}.{a.name}" if is_module(f"{base}.{a.name}", roots) else base for a in node.names})
        elif isinstance(node, ast.Import):
            origin.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                           for a in node.names if a.name == "hal" or a.name.startswith("hal.")})
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for deco in node.decorator_list:
                root = deco.func if isinstance(deco, ast.Call) else deco
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in origin and origin[root.id] != module:
                    found.append(f"{module}:{node.lineno}: @{ast.unparse(deco)[:70]} (from {origin[root.id]}) on {node.name}")
    return found


def test_importing_a_module_of_the_core_fills_no_slot_of_another() -> None:
    """Before: the entry builder (hal.dispatch.entry), the autograd, traced and compile hooks
    (hal.integration.*), torch.library's subscription to declarations and hal.dist's explainers
    were installed by importing the modules that define them, and hal.dist's hierarchical and
    compressed algorithms by their modules' ``@register`` decorators, acting on
    hal.dist.algorithms' table when hal.dist imported them (in the order of its imports)."""
    found = [line for path in sorted((ROOT / "hal").rglob("*.py")) if str(path.relative_to(ROOT)) not in ENTRY_MODULES
             for line in _side_effects(path)]
    roots = source_roots(ROOT)
    for path in sorted((ROOT / "hal").rglob("*.py")):
        module, package = module_of(path, roots)
        found += _registrations(path.read_text(encoding="utf-8"), module, package)
    assert not found, ("module-level statements or decorators acting on other modules (connect them in hal.wiring.wire, "
                       "or list them as data the wiring installs):\n" + "\n".join(found))


def test_the_scan_finds_a_registration_decorator_of_another_module() -> None:
    before = """
        from hal.dist.algorithms import register as reg
        from . import algorithms
        import hal.dist.engine as engine
        import functools

        @reg("all_reduce", "hierarchical", cost=None)
        def hierarchical(call): ...

        @algorithms.register("all_reduce", "other", cost=None)
        def other(call): ...

        @engine.steps
        class Steps: ...

        @functools.lru_cache
        def cached(): ...

        def local(fn):
            return fn

        @local
        def fine(): ...
    """
    found = _registrations(textwrap.dedent(before), "hal.dist.hierarchical")
    assert [line.split(": @")[0] for line in found] == ["hal.dist.hierarchical:8", "hal.dist.hierarchical:11", "hal.dist.hierarchical:14"], found
    assert "(from hal.dist.algorithms) on other" in found[1]
    assert _registrations("from hal.dist.algorithms import register\n@register('x', 'y')\ndef f(c): ...\n", "hal.dist.algorithms") == []
    assert len(_registrations("from . import algorithms\n@algorithms.register('x', 'y')\ndef f(c): ...\n", "hal.dist", package=True)) == 1


def test_import_hal_installs_the_collective_algorithms_in_their_order() -> None:
    """hal.dist's algorithms, as its imports registered them before: the native one of each
    collective, then hierarchical, compressed_fp16, compressed_bf16 (explain's order, auto's ties)."""
    from hal.dist import compressed, hierarchical
    from hal.dist.algorithms import REGISTRY

    assert list(REGISTRY["all_reduce"]) == ["native", "hierarchical", "compressed_fp16", "compressed_bf16"]
    assert all(list(algs) == ["native"] for c, algs in REGISTRY.items() if c != "all_reduce")
    assert [REGISTRY["all_reduce"][a.name] for a in (*hierarchical.ALGORITHMS, *compressed.ALGORITHMS)] == [
        *hierarchical.ALGORITHMS, *compressed.ALGORITHMS]
    assert [(a.lossy, a.single_step) for a in REGISTRY["all_reduce"].values()] == [(False, True), (False, False), (True, False), (True, False)]


def test_import_hal_connects_every_layer() -> None:
    """The dispatcher's integration, the entry builder and the collectives' names are in place once
    ``import hal`` returns (before, hal.explain("all_reduce") imported hal.dist to register them)."""
    connected = dispatch.DISPATCHER.integration
    assert connected == dispatch.Integration(autograd.autograd_runner, library.traced_call, compile.tag_compile_caches,
                                             compile.measure_for_compile, compile.traced_alternative)
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"} <= set(dispatch.EXPLAINERS)
    assert dispatch.kernel_names("all_reduce") >= {"native", "hierarchical", "compressed_fp16", "compressed_bf16"}
    assert set(library.TORCH_OPS) == {d.name for d in hal.list_ops()}


def test_declarations_are_sealed_once_registered() -> None:
    """Before: an OpDecl stayed mutable, so a rule could change under the decisions cached from it."""
    decl = hal.ops.softmax.op
    assert all(d.sealed for d in hal.list_ops())
    with pytest.raises(dataclasses.FrozenInstanceError, match="op softmax: its declaration is sealed"):
        decl.check = None
    with pytest.raises(dataclasses.FrozenInstanceError, match="field 'fake' of op softmax"):
        hal.ops.softmax.fake(lambda a: a["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        del decl.doc
    with pytest.raises(TypeError):
        decl.tolerances["float32"] = decl.tolerances["float64"]  # type: ignore[index]
    assert copy.deepcopy(decl) is decl and pickle.loads(pickle.dumps(decl)) is decl


def test_hal_ops_functions_show_source_signature_and_doc_and_lead_to_the_dispatcher() -> None:
    for decl in hal.list_ops():
        entry = getattr(hal.ops, decl.name)
        source = inspect.getsource(entry)
        assert source.startswith(f"def {decl.name}(") and "_DISPATCHER.plan(_decl" in source, decl.name
        assert "_DISPATCHER: hal.dispatch.DISPATCHER" in source, decl.name
        assert tuple(inspect.signature(entry).parameters) == decl.param_names, decl.name
        assert inspect.cleandoc(entry.__doc__ or "") == decl.doc and entry.__module__ == "hal.ops", decl.name
    text = pydoc.render_doc(hal.ops.softmax, renderer=pydoc.plaintext)
    assert "softmax(x: 'Tensor', dim: 'int' = -1) -> 'Tensor'" in text and hal.ops.softmax.op.doc.splitlines()[0] in text


def _in_fresh_interpreter(script: str) -> None:
    """Run ``script`` in a new interpreter (its ops must not leak into this process's registry)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_op_declared_later_is_complete_until_its_first_call_and_the_wiring_puts_it_in_hal_ops() -> None:
    """Before: hal.registry wrote the op into the hal.ops module (sys.modules), and its declaration
    stayed open for good; then hal.ops' module ``__getattr__`` read it from the registry, which
    stopped CPython from specialising every ``hal.ops.<name>`` lookup (6 -> 19 ns). Now the wiring's
    listener sets it on hal.ops as it is declared, and hal.ops has no ``__getattr__``."""
    _in_fresh_interpreter("""
        import dataclasses, torch, hal, hal.library
        from hal.types import Tensor

        @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)
        def triple(x: Tensor) -> Tensor:
            '''3 x'''

        @triple.fake
        def _(a):
            return torch.empty_like(a["x"])

        hal.library.register_kernel("triple", backend="cpu", name="torch")(lambda x: 3 * x)
        assert hal.ops.triple is triple and vars(hal.ops)["triple"] is triple and "triple" in dir(hal.ops)
        assert "__getattr__" not in vars(hal.ops)
        assert not triple.op.sealed and hasattr(torch.ops.hal, "triple")
        assert torch.equal(hal.ops.triple(torch.ones(2)), torch.full((2,), 3.0)) and triple.op.sealed
        try:
            triple.checker(lambda x: None)
        except dataclasses.FrozenInstanceError as exc:
            assert "op triple: its declaration is sealed" in str(exc)
        else:
            raise AssertionError("a checker attached after the first call was accepted")
    """)


def test_no_import_cycle_in_the_core() -> None:
    """hal's modules (the core with ``hal.ops`` and ``hal.conformance``, its command line, the kits
    and the backends; every import counted wherever it stands, inside functions too) import each
    other one way. A module importing its own package (``hal.ops.conv`` calling ``hal.ops.*`` in a
    decomposition) is no cycle: the package has run before its module. Before: hal.parallel.checks
    and hal.parallel.comm imported each other (comm held the group membership checks needs), and so
    did hal.dist.bench and hal.cli.bench_collectives (the bench's option checks)."""
    edges = {(i.importer, i.imported) for i in all_imports(ROOT)
             if layer(i.importer) is not None and layer(i.imported) is not None
             and not i.importer.startswith(i.imported + ".") and i.importer != i.imported}
    assert cycles(edges) == []


#: the modules of the core that are command lines themselves (``python -m hal``, ``hal conformance``)
COMMAND_LINES = ("hal.__main__", "hal.conformance.cli", "hal.conformance.model_cli")


def test_the_core_imports_its_command_line_only_from_command_lines() -> None:
    """Before: hal.dist.bench imported hal.cli.bench_collectives and hal.cli.usage to check its options."""
    found = [str(i) for i in all_imports(ROOT) if layer(i.importer) == "core" and layer(i.imported) == "cli" and i.importer not in COMMAND_LINES]
    assert not found, "the core imports the command line (move what both need into the core):\n" + "\n".join(found)


def test_declaring_before_the_wiring_is_refused_with_the_reason() -> None:
    """A declaration needs the dispatcher's entry builder, which only the wiring installs."""
    def unwired(x: Tensor) -> Tensor:
        """x"""

    saved = list(registry._ENTRY_FACTORY)
    registry._ENTRY_FACTORY.clear()
    try:
        with pytest.raises(RuntimeError, match="entry builder, which hal.wiring.wire installs"):
            registry.declare(dtypes=("float32",), tolerances={})(unwired)
    finally:
        registry._ENTRY_FACTORY[:] = saved
    assert "unwired" not in registry.OPS
