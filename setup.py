"""Build hooks of the core distribution ``hal`` (its metadata is in pyproject.toml).

- Packages are found, not listed: every folder with an ``__init__.py`` under each source root below,
  installed under the root's package name (``ops/`` as ``hal.ops``, ``kits/triton`` as
  ``hal_triton``, ``kits/torch`` as ``hal_torch``, ...). A new sub-package needs no edit here.
- The commit is stamped into what is built: a wheel's and an sdist's ``hal/_build_stamp.py`` hold
  the commit of the checkout they came from (a wheel built from the sdist keeps the sdist's), so an
  installed hal reports it (:func:`hal.version.source_commit`); an editable install reads git.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent

#: installed package name -> its source folder in this checkout
ROOTS = {
    "hal": "hal",
    "hal.ops": "ops",
    "hal.conformance": "conformance",
    "hal_triton": "kits/triton",
    "hal_cpp": "kits/cpp",
    "hal_torch": "kits/torch",
    "hal_bench": "bench",
}


def packages() -> list[str]:
    """Every package under the source roots, by its installed name."""
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(str(HERE / folder))]
    return found


def _version_module():
    """hal/version.py, loaded by path (importing hal would import torch)."""
    spec = importlib.util.spec_from_file_location("_hal_version", HERE / "hal" / "version.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_stamp(package_dir: Path) -> None:
    """Write the commit stamp into ``package_dir`` (a built or released copy of ``hal/``) when this
    source tree is a git checkout; otherwise (building from an sdist) keep the stamp it carries."""
    version = _version_module()
    commit, dirty = version.checkout_commit(HERE)
    if commit is None:
        return
    target = package_dir / f"{version.STAMP_MODULE}.py"
    target.unlink(missing_ok=True)  # the sdist's release tree hard-links files: never write through a link
    target.write_text(f'"""Written by setup.py when this package was built."""\n\nCOMMIT = {commit!r}\nDIRTY = {dirty!r}\n')


class BuildPy(build_py):
    """build_py, then the commit stamp into the built ``hal`` (not for an editable install, which
    runs from the checkout and reads git)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            write_stamp(Path(self.build_lib) / "hal")


class Sdist(sdist):
    """sdist with the commit stamp in its ``hal/``: a wheel built from it has no git to ask."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        write_stamp(Path(base_dir) / "hal")


if __name__ == "__main__":  # as setuptools runs it; tests load ROOTS and packages() without building
    setup(packages=packages(), package_dir=ROOTS, cmdclass={"build_py": BuildPy, "sdist": Sdist})
