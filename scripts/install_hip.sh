#!/usr/bin/env bash
# Debian's HIP compiler and runtime for the CI checks of AMD code (no AMD GPU needed): hipcc,
# libamdhip64 (ROCm 5.2, hiprtc inside it), rocminfo and LLVM 15's llvm-readelf/llvm-objdump.
# 32 packages, about 350 MiB installed on the project's Debian 12 VM, under a minute; nothing to do
# when already installed. Compile with HIP_PLATFORM=amd where an nvcc is on the PATH. Runs apt-get
# as root, or through sudo otherwise.
set -euo pipefail
packages=(hipcc libamdhip64-dev)

installed() {
  local p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
  done
}

installed && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_hip: apt-get not found; install ROCm's hipcc and HIP runtime (libamdhip64) by hand" >&2
  exit 1
fi
as_root=()
[ "$(id -u)" = 0 ] || as_root=(sudo)
echo "install_hip: installing ${packages[*]} (Debian's ROCm HIP)"
export DEBIAN_FRONTEND=noninteractive
apt-cache show hipcc >/dev/null 2>&1 || "${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
installed
