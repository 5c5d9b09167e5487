#!/usr/bin/env bash
# Create ./.venv (or $HAL_VENV) with hal, the backends this machine can use, and optionally the test
# tools. Idempotent: re-running only installs what changed.
#
#   scripts/setup.sh            # runtime: torch, hal, cpu_ref (+ cuda / rocm backend when a GPU is seen)
#   scripts/setup.sh --test     # also pytest, hypothesis, triton and every backend (for the test suite)
#
# Environment: HAL_VENV (default .venv), HAL_TORCH_SPEC (default "torch==2.13.0"; on a GPU machine
# with torch already installed nothing is reinstalled), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${HAL_VENV:-.venv}"
python="${PYTHON:-python3}"
test_mode=0
[ "${1:-}" = "--test" ] && test_mode=1

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${HAL_TORCH_SPEC:-torch==2.13.0}"
  "${pip[@]}" "${HAL_TORCH_SPEC:-torch==2.13.0}"
fi

has_cuda_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }
has_rocm_gpu() { command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q gfx; }

packages=(-e . -e backends/cpu_ref)
if [ "$test_mode" = 1 ]; then
  packages=(-e ".[test,triton]" -e backends/cpu_ref)
  for b in cuda rocm; do [ -f "backends/$b/pyproject.toml" ] && packages+=(-e "backends/$b"); done
  packages+=("cupy-cuda13x>=14,<15" "nvidia-cuda-nvrtc==13.0.*")  # NVRTC for tests/cpp's sm_80/sm_90 compiles (no GPU needed)
else
  if has_cuda_gpu && [ -f backends/cuda/pyproject.toml ]; then packages+=(-e ".[triton]" -e backends/cuda); fi
  if has_rocm_gpu && [ -f backends/rocm/pyproject.toml ]; then packages+=(-e ".[triton]" -e backends/rocm); fi
fi
echo "setup: installing ${packages[*]}"
"${pip[@]}" "${packages[@]}"
