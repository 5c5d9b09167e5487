"""The layers point one way (issue 42, DESIGN.md "The layout we aim for"): the core (``hal`` less its
command line, with ``hal.ops`` and ``hal.conformance``) imports no plugin (``hal_backend_*``) and no
kit (``hal_triton``, ``hal_cpp``, ``hal_torch``); a kit imports no plugin; no backend imports another;
no two distributions import each other. A backend imports from hal, besides ``hal.ops``,
``hal.types`` and ``hal.errors``, at most three modules: the registration module :mod:`hal.plugin`
and the plugin SDK :mod:`hal.plugin_sdk` (its submodules count as one), plus the kits.

Every ``.py`` file of the source roots is read with the AST, so an import inside a function, under
``TYPE_CHECKING`` or through ``importlib.import_module("...")`` counts as much as one at the top.
What several backends, the kits and the core share lives in the plugin SDK (:mod:`hal.plugin_sdk`)
or in a kit (:mod:`hal_torch`: every op in eager PyTorch).
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: installed package -> its folder in the checkout (as setup.py maps them; the plugins are added)
CORE_ROOTS = {"hal": "hal", "hal.ops": "ops", "hal.conformance": "conformance", "hal_triton": "kits/triton", "hal_cpp": "kits/cpp",
              "hal_torch": "kits/torch"}
KITS = ("hal_triton", "hal_cpp", "hal_torch")
#: (importer's layer, imported layer) pairs the layering forbids
FORBIDDEN = {("core", "plugin"), ("core", "kit"), ("kit", "plugin")}
#: hal modules any backend may import besides its budget (with their submodules)
FREE_FOR_BACKENDS = ("hal.ops", "hal.types", "hal.errors")
#: the plugin SDK: its submodules count as one module
SDK = "hal.plugin_sdk"
#: how many other hal modules a backend may import (today: hal.plugin and hal.plugin_sdk)
BACKEND_HAL_MODULES = 3


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement (or ``import_module`` call) of a source file, resolved to a module."""

    path: str  # relative to the checkout
    line: int
    importer: str
    imported: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


def source_roots(root: Path) -> dict[str, Path]:
    """Installed package name -> source folder, the core's and every backend's."""
    roots = {name: root / folder for name, folder in CORE_ROOTS.items()}
    roots.update({p.name: p for p in sorted(root.glob("backends/*/hal_backend_*")) if (p / "__init__.py").exists()})
    return roots


def module_of(path: Path, roots: dict[str, Path]) -> tuple[str, bool]:
    """The dotted module name of a source file (the deepest root that holds it wins: ops/ is
    hal.ops, not part of hal/) and whether it is a package's ``__init__``."""
    name, folder = max(((n, f) for n, f in roots.items() if path.is_relative_to(f)), key=lambda nf: len(nf[1].parts))
    parts = list(path.relative_to(folder).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join([name, *parts[:-1]] if package else [name, *parts]), package


def _constant_prefix(node: ast.expr) -> Optional[str]:
    """The module a string argument names: a constant, or the constant head of an f-string up to
    its last dot (``f"hal_triton.{name}"`` names hal_triton)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        head = str(node.values[0].value)
        return head.rstrip(".") if head.endswith(".") else head
    return None


def is_module(name: str, roots: dict[str, Path]) -> bool:
    """Whether ``name`` is a module or package of the source roots (not a name defined in one)."""
    owners = [(n, f) for n, f in roots.items() if name == n or name.startswith(n + ".")]
    if not owners:
        return False
    root, folder = max(owners, key=lambda nf: len(nf[0]))
    path = folder.joinpath(*name[len(root):].split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path, roots: dict[str, Path]) -> Iterator[Import]:
    """Every import in ``path``, wherever it stands, relative ones resolved; ``from m import x``
    imports the module ``m.x`` where there is one, else ``m``."""
    module, package = module_of(path, roots)
    here = module.split(".") if package else module.split(".")[:-1]
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
            names = list(dict.fromkeys(f"{base}.{a.name}" if is_module(f"{base}.{a.name}", roots) else str(base) for a in node.names))
        elif isinstance(node, ast.Call) and node.args and _called(node) in ("import_module", "__import__"):
            target = _constant_prefix(node.args[0])
            names = [target] if target else []
        else:
            continue
        for name in names:
            yield Import(rel, node.lineno, module, name)


def _called(call: ast.Call) -> Optional[str]:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def layer(module: str) -> Optional[str]:
    """"cli", "core", "kit" or "plugin" (None: not hal's)."""
    top = module.split(".")[0]
    if top == "hal":
        return "cli" if module == "hal.cli" or module.startswith("hal.cli.") else "core"
    if top in KITS:
        return "kit"
    if top.startswith("hal_backend_"):
        return "plugin"
    return None


def distribution(module: str) -> str:
    """The top-level package a module ships in (``hal`` for the core and its command line)."""
    return module.split(".")[0]


def all_imports(root: Path) -> list[Import]:
    roots = source_roots(root)
    files = sorted({p for folder in roots.values() for p in folder.rglob("*.py")})
    return [imp for p in files for imp in imports_of(p, roots)]


def forbidden(imports: list[Import]) -> list[Import]:
    return [i for i in imports if (layer(i.importer), layer(i.imported)) in FORBIDDEN]


def between_plugins(imports: list[Import]) -> list[Import]:
    return [i for i in imports if layer(i.importer) == layer(i.imported) == "plugin" and distribution(i.importer) != distribution(i.imported)]


def counted_module(module: str) -> Optional[str]:
    """The hal module an import by a backend counts as (None: free, not hal's core): the plugin
    SDK's submodules as the SDK, ``hal.ops``, ``hal.types`` and ``hal.errors`` not at all."""
    if layer(module) not in ("core", "cli") or any(module == m or module.startswith(m + ".") for m in FREE_FOR_BACKENDS):
        return None
    return SDK if module.startswith(SDK + ".") else module


def hal_modules_of_backends(imports: list[Import]) -> dict[str, dict[str, list[Import]]]:
    """Backend distribution -> each hal module it imports (as :func:`counted_module` counts) -> the imports."""
    found: dict[str, dict[str, list[Import]]] = {}
    for i in imports:
        counted = counted_module(i.imported) if layer(i.importer) == "plugin" else None
        if counted is not None:
            found.setdefault(distribution(i.importer), {}).setdefault(counted, []).append(i)
    return found


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def tree() -> list[Import]:
    return all_imports(ROOT)


def test_the_core_imports_no_plugin_or_kit_and_kits_import_no_plugin(tree: list[Import]) -> None:
    bad = forbidden(tree)
    assert not bad, ("imports against the layers (core -> plugin/kit, kit -> plugin); move what they share into "
                     "hal.plugin_sdk (or a kit, for kit code), or let the core ask the registry:\n"
                     + "\n".join(map(str, bad)))


def test_no_backend_imports_another(tree: list[Import]) -> None:
    found = between_plugins(tree)
    assert not found, ("imports of one backend by another: share code through hal.plugin_sdk or a kit (hal_torch for "
                       "eager PyTorch) instead:\n" + "\n".join(map(str, found)))


def test_backends_import_few_hal_modules(tree: list[Import]) -> None:
    """hal.plugin and the plugin SDK (hal.plugin_sdk, one module however many submodules), at most
    three in all, besides hal.ops, hal.types and hal.errors; kits are free. What else a backend
    needs from the core belongs in the SDK (a submodule that re-exports it says why)."""
    over = {dist: modules for dist, modules in hal_modules_of_backends(tree).items() if len(modules) > BACKEND_HAL_MODULES}
    assert not over, "backends that import more than {} hal modules (besides {}):\n{}".format(
        BACKEND_HAL_MODULES, ", ".join(FREE_FOR_BACKENDS),
        "\n".join(f"{dist}: {sorted(modules)}\n  " + "\n  ".join(str(i) for imps in modules.values() for i in imps[:1])
                  for dist, modules in sorted(over.items())))


def test_no_cycle_between_distributions(tree: list[Import]) -> None:
    edges = {(distribution(i.importer), distribution(i.imported)) for i in tree
             if layer(i.imported) is not None and distribution(i.importer) != distribution(i.imported)}
    assert not cycles(edges), f"distributions that import each other: {cycles(edges)}"


@pytest.mark.parametrize("package", [*KITS, SDK])
def test_no_cycle_through_a_kit_or_the_sdk(tree: list[Import], package: str) -> None:
    """What backends build on imports nothing that imports it back, inside it or through the core."""
    edges = {(i.importer, i.imported) for i in tree if i.importer != i.imported and layer(i.imported) is not None}
    inside = [c for c in cycles(edges) if any(m == package or m.startswith(package + ".") for m in c)]
    assert not inside, f"modules that import each other through {package}: {inside}"


def test_no_cycle_in_the_dispatcher(tree: list[Import]) -> None:
    """The modules of hal.dispatch follow a call one way (TYPE_CHECKING imports count too)."""
    inside = [i for i in tree if i.importer.startswith("hal.dispatch.") and i.imported.startswith("hal.dispatch.")]
    edges = {(i.importer, i.imported) for i in inside}
    assert not cycles(edges), f"hal.dispatch modules that import each other: {cycles(edges)}"


# --- the scan itself, on small trees ---------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_scan_finds_imports_in_functions_relative_and_by_name(tmp_path: Path) -> None:
    _write(tmp_path, {
        "hal/__init__.py": "",
        "hal/cli/__init__.py": "import hal_backend_x\n",  # the command line may
        "hal/nn/__init__.py": "",
        "hal/nn/mod.py": "def f():\n    from hal_backend_x.fold import g\n",
        "hal/fp8/dev.py": "import importlib\nimportlib.import_module('hal_triton.checks')\n",
        "kits/triton/__init__.py": "",
        "kits/triton/kernels.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hal_backend_x.gemm\n",
        "kits/triton/ok.py": "from . import kernels\nfrom hal.plugin_sdk.linear import grads_of_rows\n",
        "backends/x/hal_backend_x/__init__.py": "from hal_triton.kernels import register\n",
        "backends/x/hal_backend_x/fold.py": "from . import g\nimport hal_backend_y\n",
        "backends/x/hal_backend_x/g.py": "from . import plugin\n",  # a name of the package, not a module
        "backends/y/hal_backend_y/__init__.py": "import importlib\nm = importlib.import_module(f'hal_backend_x.{1}')\n",
    })
    found = all_imports(tmp_path)
    assert sorted(str(i).replace(str(tmp_path) + "/", "") for i in forbidden(found)) == [
        "hal/fp8/dev.py:2: hal.fp8.dev imports hal_triton.checks",
        "hal/nn/mod.py:2: hal.nn.mod imports hal_backend_x.fold",
        "kits/triton/kernels.py:3: hal_triton.kernels imports hal_backend_x.gemm",
    ]
    assert sorted((i.importer, i.imported) for i in between_plugins(found)) == [
        ("hal_backend_x.fold", "hal_backend_y"), ("hal_backend_y", "hal_backend_x")]
    pairs = {(i.importer, i.imported) for i in found}
    assert ("hal_backend_x.fold", "hal_backend_x.g") in pairs and ("hal_backend_x.g", "hal_backend_x") in pairs  # relative, resolved
    assert cycles({("hal_backend_x", "hal_backend_y"), ("hal_backend_y", "hal_backend_x"), ("hal", "hal_backend_x")}) == [
        ["hal_backend_x", "hal_backend_y"]]


def test_the_scan_counts_the_hal_modules_a_backend_imports(tmp_path: Path) -> None:
    _write(tmp_path, {
        "hal/__init__.py": "",
        "hal/arrays.py": "",
        "hal/errors.py": "",
        "hal/plugin.py": "",
        "hal/registry.py": "",
        "hal/plugin_sdk/__init__.py": "",
        "hal/plugin_sdk/fold.py": "",
        "hal/plugin_sdk/kept.py": "",
        "ops/__init__.py": "",
        "ops/fp8.py": "",
        "kits/torch/__init__.py": "",
        "kits/torch/conv.py": "from hal.registry import OPS\n",  # kits are not counted
        "backends/x/hal_backend_x/__init__.py": "from hal.plugin import Plugin\nfrom hal.errors import HalError\nfrom hal.ops.fp8 import FORMATS\n",
        "backends/x/hal_backend_x/a.py": "from hal.plugin_sdk.fold import fold\nfrom hal.plugin_sdk import kept\nfrom hal_torch import conv\n",
        "backends/x/hal_backend_x/b.py": "def f():\n    from hal import arrays\n    import hal.registry\n",
        "backends/y/hal_backend_y/__init__.py": "from hal import ops, plugin\n",
    })
    counted = {dist: sorted(modules) for dist, modules in hal_modules_of_backends(all_imports(tmp_path)).items()}
    assert counted == {"hal_backend_x": ["hal.arrays", "hal.plugin", "hal.plugin_sdk", "hal.registry"], "hal_backend_y": ["hal.plugin"]}
