#!/usr/bin/env bash
# hal as a user installs it (CI runs this after scripts/test.sh, whose editable install would hide a
# module a wheel leaves out): build the core's sdist and its wheel (from that sdist, as pip does
# with an sdist) and every backend's wheel, install them, not editable, into a new venv that sees
# neither this checkout nor the system's site-packages, and run scripts/check_installed.py with it
# from a folder outside the checkout (imports, hal info, hal conformance --backend cpu --quick and
# --model cnn, python -m hal.cli.docs --check, a few steps of each example). The out-of-tree backend
# template (examples/backend_template, hal-backend-template) is built and installed beside them, as
# a third party's backend would be, and checked with hal conformance --backend template.
#
# The dependencies are installed at the versions ./.venv has (scripts/setup.sh --test put them in
# pip's cache: torch's CPU build, triton, numba, ...), without byte-compiling them (pip's compile of
# torch and triton took minutes on 2 cores). Environment: HAL_VENV (the set-up venv, default .venv),
# HAL_TORCH_INDEX (as scripts/setup.sh), HAL_KEEP_INSTALL=1 keeps the work folder (it is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
source_dir=$PWD
builder="$(cd "${HAL_VENV:-.venv}" && pwd)/bin/python"
work=$(mktemp -d "${TMPDIR:-/tmp}/hal-install.XXXXXX")
if [ -n "${HAL_KEEP_INSTALL:-}" ]; then echo "check_install: work folder $work"; else trap 'rm -rf "$work"' EXIT; fi
started=$(date +%s)
say() { echo "check_install: $* ($(( $(date +%s) - started )) s)"; }
quiet() {  # run "$@" with its output in $work/log, shown only when it fails
  "$@" >>"$work/log" 2>&1 || { status=$?; tail -n 60 "$work/log" >&2; exit "$status"; }
}

commit=$(git rev-parse HEAD)
say "building the sdist and wheels of hal, of backends eager, cpu_ref, cpu, cuda, rocm and of the backend template at ${commit:0:12}"
quiet "$builder" -m build --no-isolation --outdir "$work/dist" .
for backend in backends/eager backends/cpu_ref backends/cpu backends/cuda backends/rocm examples/backend_template; do
  quiet "$builder" -m build --no-isolation --wheel --outdir "$work/dist" "$backend"
done

say "installing them into a new venv"
"$builder" -c 'import sys; print(sys._base_executable)' >"$work/base_python"
"$(cat "$work/base_python")" -m venv --without-pip "$work/venv"
"$builder" -m pip freeze --exclude-editable 2>>"$work/log" | grep -v '^hal' >"$work/constraints.txt"
pip=("$builder" -m pip --python "$work/venv/bin/python" install --no-compile --disable-pip-version-check -c "$work/constraints.txt")
quiet "${pip[@]}" ${HAL_TORCH_INDEX:+--index-url "$HAL_TORCH_INDEX"} torch
quiet "${pip[@]}" "$work"/dist/*.whl pytest  # pytest: for hal.conformance's pytest plugin module

say "checking the installed hal from $work/run"
mkdir "$work/run"
cp scripts/check_installed.py "$work/run/"
cd "$work/run"
# PYTHONDONTWRITEBYTECODE unset: the venv was installed without byte-compiling, so the first process
# compiles what it imports once for the rest (with it set, as on the project's VMs, every `hal`
# command compiled the sources of torch it imports again, about 7 s a process on that VM)
env -u PYTHONPATH -u HAL_COMMIT -u HAL_DIRTY -u PYTHONDONTWRITEBYTECODE "$work/venv/bin/python" check_installed.py --source "$source_dir" --commit "$commit"
say "done"
