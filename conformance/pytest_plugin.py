"""pytest plugin: ``pytest --hal-backend NAME`` runs the conformance cases of a backend as tests,
named by their report ids (``conv2d[numpy,float16,groups4]``), so a backend's own CI can run them
with its other tests, select them with ``-k`` and collect JUnit output with ``--junitxml``.

Installed with hal through the ``pytest11`` entry point; without ``--hal-backend`` it adds nothing
(and imports nothing beyond pytest). Cases listed in the backend's xfail file are marked
``xfail`` (not strict: a pass shows as XPASS), forced kernels that decline a case are skipped, and a
failure's report shows the errors and the reproduction snippet. Options: ``--hal-device``,
``--hal-ops``, ``--hal-dtypes``, ``--hal-quick``, ``--hal-seed``, ``--hal-xfail``, as the
``hal conformance`` flags.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hal", "hal conformance suite")
    group.addoption("--hal-backend", metavar="NAME", default=None, help="run the hal conformance cases of this backend as tests")
    group.addoption("--hal-device", metavar="N", type=int, default=0, help="device index of the backend (default 0)")
    group.addoption("--hal-ops", metavar="a,b", default=None, help="only these ops (comma separated, shell patterns allowed)")
    group.addoption("--hal-dtypes", metavar="a,b", default=None, help="only these dtypes (comma separated)")
    group.addoption("--hal-quick", action="store_true", default=False, help="only the quick cases")
    group.addoption("--hal-seed", metavar="S", type=int, default=0, help="seed of the case data (default 0)")
    group.addoption("--hal-xfail", metavar="FILE", default=None, help="an xfail file to use besides conformance/xfail/<backend>.txt")


class ConformanceFailure(Exception):
    """A case that failed or errored; carries its result for the report."""

    def __init__(self, result: Any) -> None:
        super().__init__(str(result))
        self.result = result


class ConformanceItem(pytest.Item):
    """One conformance case as a test."""

    def __init__(self, *, suite: Any, planned: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.suite = suite
        self.planned = planned

    def runtest(self) -> None:
        result = self.suite.run_case(self.planned)
        self.user_properties.append(("seed", self.suite.seed))
        if result.status == "skip":
            pytest.skip(result.reason or "skipped")
        if result.status in ("fail", "error", "xfail"):  # xfail: the marker turns this into XFAIL
            raise ConformanceFailure(result)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ConformanceFailure):
            r = excinfo.value.result
            return f"{r}\n\nreproduce with:\n{r.repro}" if r.repro else str(r)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, self.name


class ConformanceCollector(pytest.Collector):
    """The cases of one backend, under a node named ``hal-conformance[<backend>]``."""

    def __init__(self, *, suite: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.suite = suite

    def collect(self) -> Iterator[ConformanceItem]:
        for planned in self.suite.plan():
            item = ConformanceItem.from_parent(self, name=planned.id, suite=self.suite, planned=planned)
            known = self.suite.xfails.reason(planned.id)
            if known is not None:
                item.add_marker(pytest.mark.xfail(reason=known, strict=False))
            yield item


def _csv(text: Any) -> Any:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    backend = config.getoption("hal_backend")
    if not backend:
        return
    from hal.errors import HalError

    from .runner import Suite

    try:
        suite = Suite(
            backend=backend,
            device=config.getoption("hal_device"),
            seed=config.getoption("hal_seed"),
            quick=config.getoption("hal_quick"),
            ops=_csv(config.getoption("hal_ops")),
            dtypes=_csv(config.getoption("hal_dtypes")),
            xfail_file=config.getoption("hal_xfail"),
        )
    except (HalError, ValueError, FileNotFoundError) as exc:
        raise pytest.UsageError(f"--hal-backend {backend}: {exc}") from None
    for stale in suite.stale_xfails():
        warnings.warn(pytest.PytestWarning(f"hal conformance: xfail entry {stale} matches no case of {backend} (stale)"), stacklevel=1)
    node = f"hal-conformance[{backend}]"
    collector = ConformanceCollector.from_parent(session, name=node, nodeid=node, suite=suite)
    items.extend(collector.collect())
