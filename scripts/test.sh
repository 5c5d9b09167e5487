#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up with the test tools and every backend, then pytest.
# Extra arguments go to pytest (`-n 0`: in this process, without pytest-xdist's workers).
#
# The tests run in HAL_TEST_WORKERS (default 2) pytest-xdist workers, a test file to one worker
# (--dist loadfile: a module's shared fixtures, such as one launch of gloo ranks, run once). Much of
# the suite waits on the processes it starts (the command line, conformance workers, gloo ranks),
# so two workers on the project's 2-core VM take about half the time of one (docs/verification.md).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
venv="${HAL_VENV:-.venv}"
exec "$venv/bin/python" -m pytest -q -n "${HAL_TEST_WORKERS:-2}" --dist loadfile "$@"
