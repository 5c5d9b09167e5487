#!/usr/bin/env bash
# Issue 40's rows at the sizes people train (hal_bench.models_big) on one GPU, in one device call (the
# `run` tool of this workplace, at most 10 minutes): install hal into the image's Python, then each of
# MODELS in its own process (a row that runs out of memory or is cut leaves the others), every row
# bounded by MODEL_LIMIT seconds so that four rows end inside the call. Results land in $OUT:
#
#   <model>-models.json / <model>-models.md   each row's table (tokens/s, MFU, peak memory; with MAX_BATCH=1 the largest batch)
#   run.tgz                                   every log
#
#   pip download --no-deps --only-binary=:all: -d .whl stevedore liger-kernel==0.8.5   # once, on this side; carry .whl
#   HAL_COMMIT=<sha> benchmarks/big_models.sh
#
# MODELS (space-separated; default the four rows), VARIANTS (comma-separated columns). The default
# columns are the ones four rows can time in one call at these sizes (each compiled variant compiles
# for about a minute): eager, compile, liger, liger+compile, hal. The rest of a row in a second call,
# e.g. VARIANTS="eager,compile reduce-overhead,compile+graph,hal+compile,hal+graph,hal+compile+graph,hal.optimize"
# with MODELS=hf_llama1b_train and MODEL_LIMIT=540. MAX_BATCH=1 adds the largest-batch search of eager
# and hal (--max-batch; a few steps per try: give the row time). PEAK_TFLOPS overrides the MFU peak
# (default by the device's name: 989 for an H100 SXM or H200). PAIRED_ROUNDS (default 0 here: the
# side-by-side rounds rebuild the judged pairs, a minute per row at these sizes).
set -uo pipefail
out=/tmp/hal-big-models
mkdir -p "$out" "${OUT:=/tmp/out}"
export PYTHONUNBUFFERED=1 HAL_TRITON_CACHE_DIR="$out/autotune" TORCHINDUCTOR_CACHE_DIR="$out/inductor"
t_start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/eager -e backends/cpu_ref -e backends/cuda >"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import torch, transformers, importlib.metadata as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'Liger-Kernel', m.version('liger-kernel'))" 2>&1 | tail -1
step() {  # step NAME SECONDS CMD...: run with a time limit, progress to the terminal and $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name (limit $limit s, $(( t0 - t_start )) s into the call)"
  timeout --signal=INT "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep --line-buffered -E "hal bench --models:|Error|error"
  echo "== $name: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"
  tar czf "$OUT/run.tgz" -C "$out" --exclude=autotune --exclude=inductor .
}
for m in ${MODELS:-hf_llama1b_train hf_llama1b_t4096_train hf_llama8b_layers_train hf_mixtral_train}; do
  step "models-$m" "${MODEL_LIMIT:-130}" python3 -m hal bench --models "$m" --no-max-autotune \
    --variants "${VARIANTS:-eager,compile,liger,liger+compile,hal}" --paired-rounds "${PAIRED_ROUNDS:-0}" \
    ${PEAK_TFLOPS:+--peak-tflops "$PEAK_TFLOPS"} $([ -n "${MAX_BATCH:-}" ] && echo --max-batch) --out "$out/models-$m"
  for f in models.json models.md; do [ -f "$out/models-$m/$f" ] && cp "$out/models-$m/$f" "$OUT/$m-$f"; done
  # the row's every-variant lines: step, tokens/s, model TFLOP/s (MFU), peak memory
  [ -f "$out/models-$m/models.md" ] && grep -E "^\| $m \| " "$out/models-$m/models.md" | grep -v "≥\|≤" | head -12
done
echo "== done in $(( $(date +%s) - t_start )) s"
ls -la "$OUT"
