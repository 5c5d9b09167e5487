"""Issue 42's target: "adding an op touches its declaration, its kernels and its conformance cases,
and no file of the core or of a kit's registration".

A new op family is one new file in each place that holds families: its declaration
(``ops/<family>.py``), its conformance cases (``conformance/cases/<family>.py``), its eager PyTorch
function (``kits/torch/<family>.py``), its reference kernel (``backends/cpu_ref/.../<family>.py``)
and its Triton kernel (``kits/triton/<family>.py`` and the registration ``kits/triton/kernels/<family>.py``).
Each package finds its family modules on its ``__path__``; no list names them.

The proof writes such a family into a temporary folder, outside the repository, and puts that folder
on each package's ``__path__`` as the package is imported (a meta-path finder that extends the
package's spec, before the package's ``__init__`` runs: the discovery must read ``__path__``, not a
folder of the checkout). In a fresh interpreter (its op must not leak into this one's registry) hal
then has the op: ``hal.ops.<name>``, ``__all__``, ``dir``, ``from hal.ops import *``,
``torch.ops.hal.<name>``, a kernel on cpu_ref, eager and the Triton kit, and ``hal conformance``
passes it on cpu_ref (against eager) and on eager (against cpu_ref). No file of the checkout changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import hal
import hal.ops
from hal.registry import OPS

ROOT = Path(__file__).resolve().parents[2]

FAMILY = "zz_halving"  # sorted after every family, in every package

#: the package -> (the folder of the checkout its families live in, the new family's file there)
FILES = {
    "hal.ops": ("ops", '''
        """A family hal has never had: halve."""

        from hal.arrays import FLOAT_DTYPES
        from hal.registry import declare
        from hal.types import Tensor

        from ._fake import like
        from ._tolerances import ELEMENTWISE

        ORDER = 1000


        @declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE)
        def halve(x: Tensor) -> Tensor:
            """``x / 2``, elementwise."""


        @halve.fake
        def _fake(a):
            return like(a["x"])


        __all__ = ["halve"]
    '''),
    "hal.conformance.cases": ("conformance/cases", '''
        from . import Call, case


        def _draw(d, shape):
            return Call({"x": d.normal(*shape)})


        CASES = {"halve": [case("small", _draw, quick=True, shape=(3, 5)), case("odd", _draw, shape=(7, 13, 2))]}
    '''),
    "hal_torch": ("kits/torch", '''
        def halve(x):
            return x / 2


        __all__ = ["halve"]
    '''),
    "hal_backend_cpu_ref": ("backends/cpu_ref/hal_backend_cpu_ref", '''
        import numpy as np

        from ._common import reference


        @reference("halve")
        def halve(x):
            return (np.asarray(x, dtype=np.float64) / 2).astype(x.dtype)
    '''),
    "hal_triton.kernels": ("kits/triton/kernels", f'''
        from .kit import FIRST, Kit, family


        def register(kit: Kit) -> None:
            @kit.kernel("halve", "triton", FIRST)
            def halve(x):
                return family("{FAMILY}").halve(x)
    '''),
    "hal_triton": ("kits/triton", '''
        def halve(x):  # (a kernel family's host function; this one launches no Triton kernel)
            return x / 2
    '''),
}

SCRIPT = textwrap.dedent('''
    import json, sys

    EXTRA = json.loads(sys.argv[1])
    FAMILY = sys.argv[2]
    REPORTS = sys.argv[3]


    class OnPath:
        """Adds a folder to a package's __path__ when the package is imported, before its __init__ runs."""

        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name not in EXTRA:
                return None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(name, path, target) if finder is not cls and find is not None else None
                if spec is not None:
                    spec.submodule_search_locations.append(EXTRA[name])
                    return spec
            return None


    sys.meta_path.insert(0, OnPath)

    import numpy as np
    import torch

    import hal
    import hal.ops
    from hal.registry import OPS

    # the declaration: hal.ops.<name>, its names, torch.ops.hal.<name>
    assert hal.ops.FAMILIES[-1].__name__ == f"hal.ops.{FAMILY}" and hal.ops.NAMES[-1] == "halve" and list(OPS)[-1] == "halve"
    assert "halve" in vars(hal.ops) and "halve" in hal.ops.__all__ and "halve" in dir(hal.ops)
    assert hal.ops.halve is OPS["halve"].entry and OPS["halve"].sealed and hasattr(torch.ops.hal, "halve")
    star = {}
    exec("from hal.ops import *", star)
    assert star["halve"] is hal.ops.halve
    x = torch.arange(6, dtype=torch.float64)
    for backend, kernel in (("cpu_ref", "numpy"), ("eager", "torch")):
        with hal.use(backend=backend):
            assert torch.equal(hal.ops.halve(x), x / 2), backend
            d = hal.explain("halve", x)
            assert (d.backend, d.kernel) == (backend, kernel), d
    assert np.array_equal(hal.ops.halve(np.arange(4.0)), np.arange(4.0) / 2)

    # the kernels: cpu_ref's, hal_torch's (the eager backend's), the Triton kit's
    import hal_backend_cpu_ref, hal_backend_eager, hal_torch.table, hal_triton.kernels
    from hal.conformance.cases import all_cases
    assert [k.name for k in hal_backend_cpu_ref.plugin.kernels if k.op == "halve"] == ["numpy"]
    assert [k.name for k in hal_backend_eager.plugin.kernels if k.op == "halve"] == ["torch"]
    assert hal_torch.table.FUNCTIONS["halve"](x).equal(x / 2)
    assert FAMILY in hal_triton.kernels.FAMILIES and [c.name for c in all_cases()["halve"]] == ["small", "odd"]
    from hal.plugin import Archs, Plugin
    from hal_triton.kernels import VendorLibs, register
    from hal_triton.kernels.kit import family
    from hal_triton.tables import LaunchTables

    def unused(*args):
        raise AssertionError("registering calls no vendor library and asks no launch table")

    tables = type("Tables", (LaunchTables,), {m: unused for m in LaunchTables.__abstractmethods__})()
    plugin = Plugin("kit", "1.0")
    plugin.define_backend(priority=1, device_types=("cuda",))
    registered = register(plugin, tables, archs=Archs(lambda arch: True, "any"), vendor=VendorLibs("cudnn", unused, unused, "cublas", unused, unused))
    assert ("halve", "triton") in registered and [k.name for k in plugin.kernels if k.op == "halve"] == ["triton"]
    assert family(FAMILY).halve(x).equal(x / 2)

    # the conformance cases: the command line, on the reference (against eager) and on eager (against cpu_ref)
    from hal.cli import main
    for backend in ("cpu_ref", "eager"):
        status = main(["conformance", "--backend", backend, "--ops", "halve", "--report-dir", f"{REPORTS}/{backend}"])
        summary = json.load(open(f"{REPORTS}/{backend}/report.json"))["summary"]
        assert status == 0 and summary["pass"] > 0 and summary["pass"] == sum(summary.values()), (backend, status, summary)
        print(backend, summary)
    print("ok")
''')


def _write_family(tmp_path: Path) -> dict[str, str]:
    """The new family's files, one folder per package (none in the checkout): package -> folder."""
    extra = {}
    for package, (_, text) in FILES.items():
        folder = tmp_path / "family" / package  # (not at the top of tmp_path, the run's folder: no package's name there)
        folder.mkdir(parents=True)
        (folder / f"{FAMILY}.py").write_text(textwrap.dedent(text).lstrip())
        extra[package] = str(folder)
    return extra


def test_a_new_op_family_is_one_new_file_per_place_and_nothing_else(tmp_path: Path) -> None:
    extra = _write_family(tmp_path)
    reports = tmp_path / "reports"
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(extra), FAMILY, str(reports)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stdout + done.stderr
    for folder, _ in FILES.values():  # the checkout holds no file of the family: it came from tmp_path alone
        assert not (ROOT / folder / f"{FAMILY}.py").exists()
    assert FAMILY not in {f.__name__.rsplit(".", 1)[1] for f in hal.ops.FAMILIES} and "halve" not in OPS  # not in this process


def test_each_place_holds_the_families_found_on_its_path() -> None:
    """The places of FILES are the packages whose families are found; today's families are there."""
    import importlib

    for package, (folder, _) in FILES.items():
        assert [str(ROOT / folder)] == list(importlib.import_module(package).__path__), package
    assert [f.__name__.rsplit(".", 1)[1] for f in hal.ops.FAMILIES][:3] == ["conv", "elementwise", "gemm"]


def test_hal_ops_names_come_from_the_declarations() -> None:
    """hal.ops lists no op: its names, ``__all__`` and the registry's order come from the families'
    declarations, in the order of the families' ORDER (API.md's), as when they were listed by hand."""
    assert list(hal.ops.NAMES) == list(OPS)[: len(hal.ops.NAMES)] == [d.name for d in hal.list_ops()][: len(hal.ops.NAMES)]
    assert hal.ops.__all__ == [*hal.ops.NAMES, "ACTIVATIONS"]
    assert [f.ORDER for f in hal.ops.FAMILIES] == sorted(f.ORDER for f in hal.ops.FAMILIES)
    assert list(hal.ops.NAMES[:4]) == ["conv2d", "conv2d_backward", "batch_norm", "batch_norm_backward"]
    assert hal.ops.NAMES[-1] == "linear_cross_entropy_backward"
    star: dict = {}
    exec("from hal.ops import *", star)
    assert {n for n in star if not n.startswith("__")} == set(hal.ops.__all__)
    for name in hal.ops.NAMES:
        assert vars(hal.ops)[name] is OPS[name].entry and name in dir(hal.ops), name
        assert OPS[name].module in {f.__name__ for f in hal.ops.FAMILIES}, name
