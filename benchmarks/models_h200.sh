#!/usr/bin/env bash
# The whole-model table of issue 11 on the H200, in one device call (the `run` tool of this
# workplace): install hal into the image's Python, run the whole-model GPU tests (no host
# synchronisation in a step, CUDA-graph capture and replay), then `hal bench --models` with every
# peer, then the max-autotune column of the inference models. Results land in $OUT:
#
#   models.json / models.md                    the table (eager, torch.compile, hal, hal+compile, Liger, torch._grouped_mm)
#   models-max-autotune.json / .md             hal against torch.compile max-autotune-no-cudagraphs (inference)
#   run.tgz                                    every log (gpu-tests.log, models.log, ...)
#
#   pip download --no-deps -d .whl stevedore liger-kernel==0.8.5   # once, on this side; carry .whl
#   HAL_COMMIT=<sha> benchmarks/models_h200.sh
#
# MODELS=a,b and VARIANTS=a,b pick rows and columns of the main table (default: all). Each step has
# its own time limit (seconds; override with TESTS_LIMIT, MODELS_LIMIT, AUTOTUNE_LIMIT) so that the call
# ends well inside the tool's 10 minutes, and results are written after every measured variant: a
# step cut short keeps what finished. Progress lines go to the terminal as they come.
set -uo pipefail
out=/tmp/hal-models-run
mkdir -p "$out" "${OUT:=/tmp/out}"
export PYTHONUNBUFFERED=1 HAL_TRITON_CACHE_DIR="$out/autotune" TORCHINDUCTOR_CACHE_DIR="$out/inductor"
t_start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/eager -e backends/cpu_ref -e backends/cuda >"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import liger_kernel, importlib.metadata as m; print('Liger-Kernel', m.version('liger-kernel'))" 2>&1 | tail -1
step() {  # step NAME SECONDS CMD...: run with a time limit, progress to the terminal and $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name (limit $limit s, $(( t0 - t_start )) s into the call)"
  timeout --signal=INT "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep --line-buffered -E "hal bench --models:|passed|failed|skipped|error|Error"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tar czf "$OUT/run.tgz" -C "$out" --exclude=autotune --exclude=inductor .
}
step gpu-tests "${TESTS_LIMIT:-75}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device/test_model_steps.py
step models "${MODELS_LIMIT:-270}" python3 -m hal bench --models ${MODELS:-} ${VARIANTS:+--variants "$VARIANTS"} --no-max-autotune --out "$out/models"
step max-autotune "${AUTOTUNE_LIMIT:-75}" python3 -m hal bench --models resnet50_infer_fp16,resnet50_infer_bf16,llama_prefill \
  --variants "hal,compile max-autotune" --out "$out/models-max-autotune"
for f in models/models.json models/models.md; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/"; done
for f in json md; do [ -f "$out/models-max-autotune/models.$f" ] && cp "$out/models-max-autotune/models.$f" "$OUT/models-max-autotune.$f"; done
[ -f "$out/models/models.md" ] && sed -n '/^| model | eager/,/^$/p' "$out/models/models.md"
echo "== done in $(( $(date +%s) - t_start )) s"
ls -la "$OUT"
