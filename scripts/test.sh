#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up with the test tools and every backend, then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
venv="${HAL_VENV:-.venv}"
exec "$venv/bin/python" -m pytest -q "$@"
