#!/usr/bin/env bash
# Create ./.venv (or $HAL_VENV) with hal, the backends this machine can use, and optionally the test
# tools. Idempotent: re-running only installs what changed.
#
#   scripts/setup.sh            # runtime: torch, hal, eager, cpu_ref, cpu (+ cuda / rocm backend when a GPU is seen)
#   scripts/setup.sh --test     # also pytest, hypothesis, triton, every backend and Debian's HIP
#                               # compiler (scripts/install_hip.sh) for the test suite
#
# Environment: HAL_VENV (default .venv), HAL_TORCH_SPEC (default "torch==2.13.0"; on a GPU machine
# with torch already installed nothing is reinstalled), HAL_TORCH_INDEX (a pip index URL for torch:
# an AMD GPU needs torch's ROCm wheel index), PYTHON (default python3).
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

has_cuda_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }
has_rocm_gpu() { command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q gfx; }

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if [ "$test_mode" = 0 ] && [ -z "${HAL_TORCH_INDEX:-}" ] && has_rocm_gpu; then
    echo "setup: rocminfo sees an AMD GPU: torch must be a ROCm build. Re-run with HAL_TORCH_INDEX set to" \
      "torch's ROCm wheel index for your ROCm version (PyTorch's install page gives its URL)" >&2
    exit 1
  fi
  echo "setup: installing ${HAL_TORCH_SPEC:-torch==2.13.0}"
  "${pip[@]}" ${HAL_TORCH_INDEX:+--index-url "$HAL_TORCH_INDEX"} "${HAL_TORCH_SPEC:-torch==2.13.0}"
fi

# the backends, each its own distribution (eager: every op in eager PyTorch, the hal_torch kit's functions)
packages=(-e . -e backends/eager -e backends/cpu_ref -e backends/cpu)
if [ "$test_mode" = 1 ]; then
  packages=(-e ".[test,triton]" build -e backends/eager -e backends/cpu_ref -e backends/cpu)
  for b in cuda rocm; do [ -f "backends/$b/pyproject.toml" ] && packages+=(-e "backends/$b"); done
  packages+=("cupy-cuda13x>=14,<15" "nvidia-cuda-nvrtc==13.0.*")  # NVRTC for tests/cpp's sm_80/sm_90 compiles (no GPU needed)
  scripts/install_hip.sh
else
  if has_cuda_gpu && [ -f backends/cuda/pyproject.toml ]; then packages+=(-e ".[triton]" -e backends/cuda); fi
  if has_rocm_gpu && [ -f backends/rocm/pyproject.toml ]; then
    packages+=(-e ".[triton]" -e backends/rocm)
    # hip-python's release must match the installed ROCm (its first three numbers)
    rocm_version=$(cut -d- -f1 /opt/rocm/.info/version 2>/dev/null | cut -d. -f1-2 || true)
    [ -n "$rocm_version" ] && packages+=("hip-python~=$rocm_version.0")
  fi
fi
echo "setup: installing ${packages[*]}"
"${pip[@]}" "${packages[@]}"
