#!/usr/bin/env bash
# One device call on the H200 (the `run` tool of this workplace): install hal and the backends
# into the image's Python, then run what MODE asks, writing everything under $OUT.
#
#   HAL_COMMIT=<sha> benchmarks/h200.sh check   # GPU tests, host profile, full conformance, config sweeps
#   HAL_COMMIT=<sha> benchmarks/h200.sh verify  # the sweeps, conformance (CONF_OPS=a,b), bench (BENCH_OPS)
#   HAL_COMMIT=<sha> benchmarks/h200.sh final   # GPU tests, full conformance, hal bench with compile, sweeps
#   HAL_COMMIT=<sha> benchmarks/h200.sh bench   # hal bench with torch.compile peers (BENCH_OPS=a,b to pick)
#   HAL_COMMIT=<sha> benchmarks/h200.sh explore # GPU tests, conformance (CONF_OPS=a,b), the C++ kernels, host times, step profiles
#
# Wheels the image lacks (stevedore) travel in .whl/ (carry it). Each step has its own time limit so
# that the call ends inside the tool's 10 minutes with whatever finished.
set -uo pipefail
mode="${1:-check}"
out=/tmp/hal-run  # packed into $OUT/run.tgz at the end (the tool returns at most 8 files)
mkdir -p "$out" "${OUT:=/tmp/out}"
export PYTHONUNBUFFERED=1 HAL_TRITON_CACHE_DIR="$out/autotune"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cpu_ref -e backends/cuda >"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
python3 -m hal info > "$out/hal-info.txt" 2>&1; head -30 "$out/hal-info.txt"
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --signal=INT "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -n 25 "$out/$name.log"
  tar czf "$OUT/run.tgz" -C "$out" .  # after every step: a call cut short still returns what finished
}
case "$mode" in
  check)  # correctness first: GPU tests, where host time goes, the full conformance suite, sweeps
    step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider tests/cuda/device
    step host-profile 60 python3 benchmarks/host_profile.py "$out/host-profile.txt"
    OMP_NUM_THREADS=2 step conformance 330 python3 -m hal conformance --backend cuda --jobs 8 --report-dir "$out/conformance"
    step probe 100 python3 benchmarks/probe_configs.py "$out/probe.json" --quick-norms
    ;;
  verify)  # after fixes: the full conformance suite again, config sweeps, then hal bench with compile peers
    [ -f .scratch/int8_debug.py ] && step int8-debug 60 python3 .scratch/int8_debug.py
    step probe 100 python3 benchmarks/probe_configs.py "$out/probe.json" --quick-norms
    OMP_NUM_THREADS=2 step conformance 200 python3 -m hal conformance --backend cuda --jobs 8 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    step bench "${BENCH_LIMIT:-240}" python3 -m hal bench ${BENCH_OPS:+--ops "$BENCH_OPS"} --out "$out/bench"
    ;;
  final)  # the committed results: GPU tests, full conformance, hal bench with compile peers, sweeps
    step gpu-tests 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/device
    OMP_NUM_THREADS=2 step conformance 200 python3 -m hal conformance --backend cuda --jobs 8 --report-dir "$out/conformance"
    step bench "${BENCH_LIMIT:-380}" python3 -m hal bench --out "$out/bench"
    step probe 40 python3 benchmarks/probe_configs.py "$out/probe.json" --quick-norms
    ;;
  explore)  # what to fix next: GPU tests, conformance, the C++ kernels on the device, where model steps spend time
    step gpu-tests 80 python3 -m pytest -q -p no:cacheprovider -rs tests/cuda/device
    OMP_NUM_THREADS=2 step conformance 180 python3 -m hal conformance --backend cuda --jobs 8 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    HAL_CPP_CACHE_DIR="$out/cpp-cache" step cpp 90 python3 benchmarks/cpp_h200.py "$out/cpp"
    step optimizer 30 python3 benchmarks/optimizer_host.py --steps 30
    step overhead 40 python3 benchmarks/dispatch_overhead.py --repeat 5 --number 2000 --device cuda
    step profile 100 python3 benchmarks/profile_steps.py "$out/profile" "${PROFILE_MODELS:-resnet50_train,llama_train}"
    ;;
  bench)  # hal bench with the torch.compile peers (bench.json is rewritten after every case)
    step bench "${BENCH_LIMIT:-540}" python3 -m hal bench ${BENCH_OPS:+--ops "$BENCH_OPS"} --out "$out/bench"
    ;;
  *) echo "unknown mode $mode (check, verify, final, bench, explore)"; exit 2 ;;
esac
ls -la "$OUT"
