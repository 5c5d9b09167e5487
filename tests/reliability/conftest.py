"""Session summary of the property-based tests: how many op calls they generated and how each
ended (tests/core/test_bad_input.py counts its calls here too)."""

from __future__ import annotations

import pytest

from tests.reliability.calls import COUNTS, summary


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if sum(COUNTS.values()):
        terminalreporter.write_line(summary())
