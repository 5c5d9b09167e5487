#!/usr/bin/env bash
# The main job on a fresh machine: set up, show what hal sees, and check every kernel of the best
# local backend against the reference (cuda or rocm when a GPU is usable, else the fast cpu backend; rocm
# whenever rocminfo sees an AMD GPU, so that a broken ROCm set-up fails with its reason).
# Extra arguments go to `hal conformance` (for example --quick or --ops conv2d,softmax). The reports
# go to ./hal-conformance/, a --quick run's to ./hal-conformance/quick/ (so that it never replaces a
# full run's) unless --report-dir is given.
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
quick=0 report=()
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --report-dir|--report-dir=*) quick=0; break ;;
  esac
done
if [ "$quick" = 1 ]; then
  report=(--report-dir hal-conformance/quick)
  echo "quickstart: a --quick run writes its reports to hal-conformance/quick/ (a full run's stay in hal-conformance/)"
fi
"$venv/bin/hal" conformance "${backend[@]}" "${report[@]}" "$@"
