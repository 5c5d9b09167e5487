#!/usr/bin/env bash
# The main job on a fresh machine: set up, show what hal sees, and check every kernel of the best
# local backend against the reference (cuda or rocm when a GPU is usable, else cpu_ref).
# Extra arguments go to `hal conformance` (for example --quick or --ops conv2d,softmax).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
venv="${HAL_VENV:-.venv}"
"$venv/bin/hal" info
"$venv/bin/hal" conformance "$@"
