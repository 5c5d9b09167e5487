#!/usr/bin/env bash
# The main job on a fresh machine: set up, show what hal sees, and check every kernel of the best
# local backend against the reference (cuda or rocm when a GPU is usable, else the fast cpu backend; rocm
# whenever rocminfo sees an AMD GPU, so that a broken ROCm set-up fails with its reason).
# Extra arguments go to `hal conformance` (for example --quick or --ops conv2d,softmax).
# On an AMD GPU: HAL_TORCH_INDEX=<torch's ROCm wheel index URL> scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
venv="${HAL_VENV:-.venv}"
"$venv/bin/hal" info
backend=()
if command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q gfx; then
  backend=(--backend rocm)
fi
"$venv/bin/hal" conformance "${backend[@]}" "$@"
