#!/usr/bin/env bash
# One device call on the H200 (the `run` tool of this workplace): install hal and the backends once
# into the image's Python, then run what each MODE asks (several in one call: h200.sh fp8 table28), writing everything under $OUT.
#
#   HAL_COMMIT=<sha> benchmarks/h200.sh check   # GPU tests, host profile, full conformance, config sweeps
#   HAL_COMMIT=<sha> benchmarks/h200.sh verify  # the sweeps, conformance (CONF_OPS=a,b), bench (BENCH_OPS)
#   HAL_COMMIT=<sha> benchmarks/h200.sh final   # GPU tests, conformance (CONF_OPS=a,b), the whole-model table, [HOST_EXTRAS=1] optimizer host time
#   HAL_COMMIT=<sha> benchmarks/h200.sh table   # GPU tests, the whole op table, dispatch overhead, [PROFILE_MODELS=a,b] step profiles
#   HAL_COMMIT=<sha> benchmarks/h200.sh models28 # hal.optimize's example, then MODELS one process each with VARIANTS (issue 28's peers)
#   HAL_COMMIT=<sha> benchmarks/h200.sh table28 # issue 28's model table: MODELS one process each, every variant (VARIANTS to pick), [CONF_OPS=a,b|all] conformance
#   HAL_COMMIT=<sha> benchmarks/h200.sh fp8     # issue 31: FP8 GPU tests, conformance of the fp8 ops on CUDA, benchmarks/fp8.py, the convergence curves
#   HAL_COMMIT=<sha> benchmarks/h200.sh models30 # hal conformance --model all on CUDA, loss curves against conformance/golden/h200
#   HAL_COMMIT=<sha> benchmarks/h200.sh bench   # the whole hal bench table with its peers, into $OUT (BENCH_OPS=a,b to pick)
#   HAL_COMMIT=<sha> benchmarks/h200.sh host    # [GPU_TESTS=paths] [CONF_OPS=a,b] host time per layer on the training path, [PROFILE_MODELS=a,b] step profiles, [HOST_EXTRAS=1] optimizer and dispatch rows, then models A/B: MODELS, VARIANTS, AB_ENVS="A=1;B=2"
#   HAL_COMMIT=<sha> benchmarks/h200.sh check40 # issue 40: conformance and device tests of the kernels built on the VM, norm backward and AdamW bandwidth, the eager Llama-1B row
#   HAL_COMMIT=<sha> benchmarks/h200.sh check40b # issue 40's second call: the whole CUDA conformance, the FP8 device tests, HF capture per family, the eager step's memory anatomy
#   HAL_COMMIT=<sha> benchmarks/h200.sh check40c # issue 40: FP8 casts on short rows, transposed-cast candidates and bandwidth, producers' amaxes, the 8B FP8 step
#   HAL_COMMIT=<sha> CMD="..." benchmarks/h200.sh cmd  # one command after the install
#   HAL_COMMIT=<sha> benchmarks/h200.sh tune    # GPU tests, conformance, hal tune (first and second process, seeds), dispatch overhead
#   HAL_COMMIT=<sha> benchmarks/h200.sh tunemodels  # hal tune's first-step cost and seeds, then eager/hal models with the tuned cache
#   HAL_COMMIT=<sha> benchmarks/h200.sh explore # GPU tests, conformance (CONF_OPS=a,b), the C++ kernels (SKIP_CPP=1 skips), host times, step profiles
#
# HAL_COMMIT: pass the sha of this checkout literally (HAL_COMMIT=abc1234 ...): the device machine's
# copy of .git can be an older one, so `git rev-parse` there names the wrong commit.
#
# Wheels the image lacks travel in .whl/ (carry it): stevedore, and Liger-Kernel for the bench's
# "liger" peers (pip download --no-deps --only-binary=:all: -d .whl stevedore liger-kernel==0.8.5).
# Each step has its own time limit so that the call ends inside the tool's 10 minutes with whatever
# finished. bench mode leaves in $OUT: bench.json, bench.md, bench.png (the roofline) and run.tgz.
set -uo pipefail
modes=("${@:-check}")  # several modes run one after the other in one call (one install)
out=/tmp/hal-run  # packed into $OUT/run.tgz at the end (the tool returns at most 8 files)
mkdir -p "$out" "${OUT:=/tmp/out}"
export PYTHONUNBUFFERED=1 HAL_TRITON_CACHE_DIR="$out/autotune"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/eager -e backends/cpu_ref -e backends/cuda >"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import liger_kernel, importlib.metadata as m; print('Liger-Kernel', m.version('liger-kernel'))" 2>&1 | tail -1
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
bench_table() {  # Liger's peers checked against float64 first, then hal bench (bench.json rewritten after
  # every case), then the table and the roofline drawn again from bench.json: a bench cut short by
  # its limit still leaves its table and picture
    [ -z "${SKIP_LIGER_CHECK:-}" ] && step liger-check "${CHECK_LIMIT:-75}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/bench/test_liger_device.py
    step bench "${BENCH_LIMIT:-420}" python3 -m hal bench ${BENCH_OPS:+--ops "$BENCH_OPS"} --out "$out/bench"
    step render 60 python3 -m hal bench --render "$out/bench/bench.json" --out "$out/bench"
    for f in bench.json bench.md bench.png; do [ -f "$out/bench/$f" ] && cp "$out/bench/$f" "$OUT/"; done
    python3 - "$out/bench/bench.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
rows = doc["results"]
print(f"== {len(rows)} cases in {doc.get('wall_s', 0):.0f} s; the slowest (wall seconds: setup, compilation, timing):")
for r in sorted(rows, key=lambda r: -r.get("wall_s", 0))[:10]:
    print(f"  {r.get('wall_s', 0):6.1f}  {r['op']}: {r['case']}")
for r in rows:
    for t in r.get("targets", []):
        if t["target"] == "best_peer":
            shown = "n/a" if t["value"] is None else f"{t['value']:.2f}x"
            print(f"  best_peer {r['op']}: {r['case']}: {shown} ({'met' if t['met'] else t.get('reason') or 'missed'})")
PY
}
for mode in "${modes[@]}"; do
case "$mode" in
  check)  # correctness first: GPU tests, where host time goes, the full conformance suite, sweeps
    step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider tests/cuda/device
    step host-profile 60 python3 benchmarks/host_profile.py "$out/host-profile.txt"
    OMP_NUM_THREADS=2 step conformance 330 python3 -m hal conformance --backend cuda --jobs 8 --report-dir "$out/conformance"
    step probe 100 python3 benchmarks/probe_configs.py "$out/probe.json" --quick-norms
    ;;
  verify)  # after fixes: the full conformance suite again, config sweeps, then hal bench with compile peers
    step probe 100 python3 benchmarks/probe_configs.py "$out/probe.json" --quick-norms
    OMP_NUM_THREADS=2 step conformance 200 python3 -m hal conformance --backend cuda --jobs 8 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    step bench "${BENCH_LIMIT:-240}" python3 -m hal bench ${BENCH_OPS:+--ops "$BENCH_OPS"} --out "$out/bench"
    ;;
  final)  # the committed results: GPU tests (SKIP_GPU_TESTS=1 leaves them out), conformance (full: about 200 s; CONF_OPS=a,b for the ops a change touched),
    # the whole-model table (hal bench --models), then [HOST_EXTRAS=1] issue 10's optimizer host-time rows
    [ -z "${SKIP_GPU_TESTS:-}" ] && step gpu-tests 80 python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device
    OMP_NUM_THREADS=2 step conformance "${CONF_LIMIT:-230}" python3 -m hal conformance --backend cuda --jobs 8 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    step models "${MODELS_LIMIT:-300}" python3 -m hal bench --models ${MODELS:-} --no-max-autotune --out "$out/models"
    [ -n "${HOST_EXTRAS:-}" ] && step optimizer 45 python3 benchmarks/optimizer_host.py --device cuda --steps 60 --rounds 6
    for f in conformance/report.md conformance/report.json models/models.json models/models.md; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/$(dirname $f)-$(basename $f)"; done
    ;;
  explore)  # what to fix next: GPU tests, conformance, the C++ kernels on the device, where model steps spend time
    step gpu-tests 80 python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device
    OMP_NUM_THREADS=2 step conformance 180 python3 -m hal conformance --backend cuda --jobs 8 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    [ -z "${SKIP_CPP:-}" ] && HAL_CPP_CACHE_DIR="$out/cpp-cache" step cpp 90 python3 benchmarks/cpp_h200.py "$out/cpp"
    step optimizer 30 python3 benchmarks/optimizer_host.py --steps 30
    step overhead 40 python3 benchmarks/dispatch_overhead.py --repeat 5 --number 2000 --device cuda
    step profile 100 python3 benchmarks/profile_steps.py "$out/profile" "${PROFILE_MODELS:-resnet50_train,llama_train}"
    ;;
  table)  # the committed tables of a final commit: GPU tests, the whole op table (bench mode's steps), dispatch overhead, step profiles (PROFILE_MODELS)
    [ -z "${SKIP_GPU_TESTS:-}" ] && step gpu-tests "${TESTS_LIMIT:-100}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device
    SKIP_LIGER_CHECK=1 BENCH_LIMIT="${BENCH_LIMIT:-300}" bench_table
    step overhead 50 python3 benchmarks/dispatch_overhead.py --repeat 5 --number 2000 --device cuda
    [ -n "${PROFILE_MODELS:-}" ] && step profile 100 python3 benchmarks/profile_steps.py "$out/profile" "$PROFILE_MODELS"
    tar czf "$OUT/run.tgz" -C "$out" .
    ;;
  models28)  # issue 28: hal.optimize's example on the GPU, then each of MODELS (one process each) with VARIANTS, tables into $OUT
    step optimize "${OPT_LIMIT:-75}" python3 examples/train_llama_optimize.py --steps 20 --dtype bfloat16 --log-every 10
    for m in ${MODELS:-hf_llama_train llama_train}; do
      step "models-$m" "${MODEL_LIMIT:-230}" python3 -m hal bench --models "$m" --no-max-autotune \
        --variants "${VARIANTS:-eager,compile reduce-overhead,compile+graph,liger,hal,hal+graph,hal+compile+graph}" --out "$out/models-$m"
      for f in models.json models.md; do [ -f "$out/models-$m/$f" ] && cp "$out/models-$m/$f" "$OUT/$m-$f"; done
    done
    ;;
  table28)  # issue 28's model table: each of MODELS (one process each) with every peer and hal step that applies, then
    # [CONF_OPS=a,b|all] conformance; MODEL_LIMIT seconds per model (twentieth session, with the side-by-side rounds: Llama
    # training 166 s, ResNet-50 inference 90 s; the Hugging Face Llama and the MoE layer passed 190 s and 150 s)
    for m in ${MODELS:-resnet50_train hf_llama_train llama_train moe_fwd_bwd resnet50_infer_bf16 llama_prefill}; do
      step "models-$m" "${MODEL_LIMIT:-280}" python3 -m hal bench --models "$m" --no-max-autotune ${VARIANTS:+--variants "$VARIANTS"} --out "$out/models-$m"
      for f in models.json models.md; do [ -f "$out/models-$m/$f" ] && cp "$out/models-$m/$f" "$OUT/$m-$f"; done
      [ -f "$out/models-$m/models.md" ] && grep -A3 "^| model | best peer" "$out/models-$m/models.md" | tail -1
    done
    if [ -n "${CONF_OPS:-}" ]; then
      OMP_NUM_THREADS=2 step conformance "${CONF_LIMIT:-200}" python3 -m hal conformance --backend cuda --jobs 8 $([ "$CONF_OPS" != all ] && echo --ops "$CONF_OPS") --report-dir "$out/conformance"
      for f in report.md report.json; do [ -f "$out/conformance/$f" ] && cp "$out/conformance/$f" "$OUT/conformance-$f"; done
    fi
    ;;
  fp8)  # issue 31: the FP8 kernels' GPU tests, their conformance on CUDA, the GEMM/quantisation/step table, the convergence curves
    step fp8-tests "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device/test_fp8_kernels.py tests/cuda/device/test_fp8_training.py
    OMP_NUM_THREADS=2 step fp8-conformance "${CONF_LIMIT:-100}" python3 -m hal conformance --backend cuda --jobs 8 --ops fp8_quantize,fp8_quantize_transpose,fp8_dequantize,fp8_scaled_mm --report-dir "$out/fp8-conformance"
    for f in report.md report.json; do [ -f "$out/fp8-conformance/$f" ] && cp "$out/fp8-conformance/$f" "$OUT/fp8-conformance-$f"; done
    step fp8-bench "${BENCH_LIMIT:-200}" python3 benchmarks/fp8.py --json "$OUT/fp8-bench.json"
    step fp8-convergence "${CONV_LIMIT:-180}" python3 benchmarks/fp8_convergence.py --json "$OUT/fp8-convergence.json"
    ;;
  models30)  # issue 30: the built-in models' training steps on CUDA against cpu_ref call by call, and their loss curves
    # against the committed H200 golden curves (GOLDEN_WRITE=1 writes new ones into $OUT instead)
    step model-conformance "${CONF_LIMIT:-150}" python3 -m hal conformance --model "${MODELS:-all}" --report-dir "$out/model-conformance" \
      $([ -n "${GOLDEN_WRITE:-}" ] && echo --write-golden "$OUT/golden-h200" || echo --golden conformance/golden/h200/loss_curves.json)
    for f in model-report.md model-report.json model-junit.xml; do [ -f "$out/model-conformance/$f" ] && cp "$out/model-conformance/$f" "$OUT/"; done
    ;;
  bench)  # the whole hal bench table with its peers (bench_table above)
    bench_table
    ;;
  host)  # where the host time of a training layer goes, then the same models under each setting of AB_ENVS
    [ -n "${GPU_TESTS:-}" ] && step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider -rfEs $GPU_TESTS
    [ -n "${CONF_OPS:-}" ] && OMP_NUM_THREADS=2 step conformance 120 python3 -m hal conformance --backend cuda --jobs 8 --ops "$CONF_OPS" --report-dir "$out/conformance"
    step host-training 60 python3 benchmarks/host_training.py
    if [ -n "${HOST_EXTRAS:-}" ]; then  # issue 10's host-time rows: the optimizer step, the dispatch overhead table
      step optimizer 40 python3 benchmarks/optimizer_host.py --steps 30
      step overhead 60 python3 benchmarks/dispatch_overhead.py --repeat 5 --number 2000 --device cuda
    fi
    [ -n "${PROFILE_MODELS:-}" ] && step profile 120 python3 benchmarks/profile_steps.py "$out/profile" "$PROFILE_MODELS"
    IFS=';' read -ra settings <<< "${AB_ENVS:-}"
    for i in "" "${!settings[@]}"; do
      setting=${i:+${settings[$i]}}
      echo "== models with: ${setting:-defaults}"
      env $setting timeout 150 python3 -m hal bench --models "${MODELS:-resnet50_train}" --variants "${VARIANTS:-eager,hal}" --out "$out/models-ab$i" 2>&1 | grep -E "^\| (resnet|llama|moe)" | head -8
    done
    tar czf "$OUT/run.tgz" -C "$out" .
    ;;
  check40)  # issue 40's first call after VM-only sessions: conformance of the kernels changed unseen, their device tests,
    # the norm backward's launch candidates against copy bandwidth, fused AdamW's row, then the eager Llama-1B row
    OMP_NUM_THREADS=2 step conformance40 "${CONF_LIMIT:-80}" python3 -m hal conformance --backend cuda --jobs 8 --ops "${CONF_OPS:-fp8_quantize_transpose_amax,fp8_quantize_transpose,fused_adamw_,amp_unscale_,linear_cross_entropy,linear_cross_entropy_backward,layer_norm_backward,rms_norm_backward,rms_norm_amax,swiglu_amax,fp8_quantize_from_amax,fp8_quantize_transpose_from_amax,batch_norm,batch_norm_backward}" --report-dir "$out/conformance40"
    step device40 "${TESTS_LIMIT:-90}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device/test_fp8_small_tiles.py tests/cuda/device/test_fp8_amax_fusion.py tests/cuda/device/test_optim_copies.py
    step norm-bw "${NORM_LIMIT:-60}" python3 benchmarks/norm_backward_bw.py --out "$out/norm-bw"
    step adamw "${ADAMW_LIMIT:-70}" python3 -m hal bench --ops "${BENCH_OPS:-fused_adamw_,batch_norm,batch_norm_backward}" --out "$out/adamw"
    step models-1b "${MODEL_LIMIT:-220}" python3 -m hal bench --models hf_llama1b_train --variants "${VARIANTS:-eager,hal,liger}" --no-graphs --out "$out/models-1b"
    for f in models.json models.md; do [ -f "$out/models-1b/$f" ] && cp "$out/models-1b/$f" "$OUT/hf_llama1b_train-$f"; done
    ;;
  check40b)  # issue 40's second call: the whole CUDA conformance suite, the FP8 kernels' device tests, hal.optimize's
    # compile+graph capture on each Hugging Face decoder family, the memory anatomy of the eager Llama-1B step (hal.nn.patch
    # against Liger-Kernel; one process each)
    OMP_NUM_THREADS=2 step conformance "${CONF_LIMIT:-170}" python3 -m hal conformance --backend cuda --jobs 12 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    step fp8-tests "${TESTS_LIMIT:-90}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device/test_fp8_kernels.py
    step capture-hf "${CAPTURE_LIMIT:-110}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device/test_graphs.py -k hugging_face
    step anatomy "${ANATOMY_LIMIT:-150}" python3 benchmarks/memory_anatomy.py --model hf_llama1b_train --impls "${IMPLS:-hal,liger}" --timeout 70 --json "$out/anatomy-1b.json"
    [ -f "$out/anatomy-1b.json" ] && cp "$out/anatomy-1b.json" "$OUT/"
    ;;
  check40c)  # issue 40's next call after the twenty-ninth session: the FP8 casts on short rows (-x -s: the failing shape
    # printed), every transposed-cast candidate against the emulated cast, their bandwidth and the autotuner's pick, the
    # producers' amaxes (device test and benchmark), then the 8B-layer FP8 step through hal.optimize
    step fp8-small "${SMALL_LIMIT:-60}" python3 -m pytest -x -s -q -p no:cacheprovider -rfEs tests/cuda/device/test_fp8_small_tiles.py tests/cuda/device/test_fp8_transpose_candidates.py
    step fp8-transpose-bw "${TBW_LIMIT:-150}" python3 benchmarks/fp8_transpose_bw.py --out "$out/fp8-transpose-bw"
    step amax-fusion "${AMAX_LIMIT:-90}" bash -c "python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device/test_fp8_amax_fusion.py tests/cuda/device/test_optim_copies.py; python3 benchmarks/fp8_amax_fusion.py"
    step optimize-8b-fp8 "${OPT_LIMIT:-240}" python3 benchmarks/levers40.py --parts optimize --shape 8b --layers 6 --seq 4096 --batch 1 --fp8 tensor \
      --optimize-candidates "torch compile+graph,hal compile+graph" --json "$out/optimize-8b-fp8.json"
    [ -f "$out/optimize-8b-fp8.json" ] && cp "$out/optimize-8b-fp8.json" "$OUT/"
    ;;
  cmd)  # one command after the install: CMD="python3 benchmarks/x.py ..." [CMD_LIMIT=seconds]; $OUT/run.tgz is this
    # script's archive, rewritten after the step: a command keeps its own logs under other names
    step cmd "${CMD_LIMIT:-120}" bash -c "$CMD"
    ;;
  tune)  # measured kernel choice (issue 27): GPU tests, full conformance (the cuda 'eager' kernels included), what tuning
    # costs on a first step of every built-in model (hal tune, eager and graph contexts) and that a second process pays
    # nothing, and the measurements exported as the plugin's seed file
    export HAL_TUNE_CACHE="$out/tune"
    [ -z "${SKIP_GPU_TESTS:-}" ] && step gpu-tests "${TESTS_LIMIT:-100}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/cuda/device
    OMP_NUM_THREADS=2 step conformance "${CONF_LIMIT:-200}" python3 -m hal conformance --backend cuda --jobs 12 ${CONF_OPS:+--ops "$CONF_OPS"} --report-dir "$out/conformance"
    mkdir -p "$out/tuned"
    for m in ${TUNE_MODELS:-resnet50_train llama_train}; do  # one process each: a cut keeps the rest
      step "tune-$m" "${TUNE_LIMIT:-90}" bash -c "python3 -m hal tune $m --json --export $out/seeds > $out/tuned/first-$m.json"
    done
    for m in ${TUNE_AGAIN:-llama_train}; do  # a later process: what it pays once the cache holds the measurements
      step "tune-again-$m" 45 bash -c "python3 -m hal tune $m --json > $out/tuned/again-$m.json"
    done
    python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = []
for path in sorted((out / "tuned").glob("*.json")):
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"== {path.name}: {exc}"); continue
    for r in doc["rows"]:
        rows.append({"run": path.stem.split("-")[0], **r})
        print(f"== {path.stem}: {r['model']} [{r['context']}]: {r['calls_measured']} calls measured in {r['measuring_s']} s, step {r['step_s']} s")
(out / "tune.json").write_text(json.dumps(rows, indent=1))
PY
    for f in tune.json conformance/report.md conformance/report.json; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/$(echo $f | tr / -)"; done
    for f in "$out"/seeds/*.json; do [ -f "$f" ] && cp "$f" "$OUT/seed-$(basename "$f")"; done
    ;;
  tunemodels)  # measured choice on whole models: hal tune's cost on a first step (seeds exported), then the model table
    # with the tuned cache: eager and hal, each eagerly and as a whole-step CUDA graph (MODELS, VARIANTS to pick)
    export HAL_TUNE_CACHE="$out/tune"
    step tune "${TUNE_LIMIT:-150}" bash -c "python3 -m hal tune ${TUNE_MODELS:-resnet50_train llama_train} --json --export $out/seeds > $out/tune.json"
    step models "${MODELS_LIMIT:-300}" python3 -m hal bench --models "${MODELS:-resnet50_train,llama_train,resnet50_infer_bf16}" \
      --variants "${VARIANTS:-eager,hal,eager+graph,hal+graph}" --no-max-autotune --out "$out/models"
    for f in tune.json models/models.json models/models.md; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/$(basename $f)"; done
    for f in "$out"/seeds/*.json; do [ -f "$f" ] && cp "$f" "$OUT/seed-$(basename "$f")"; done
    [ -f "$out/models/models.md" ] && sed -n '/^| model | eager/,/^$/p' "$out/models/models.md"
    ;;
  *) echo "unknown mode $mode (check, verify, final, table, models28, table28, fp8, models30, bench, host, explore, cmd, tune, tunemodels)"; exit 2 ;;
esac
done
ls -la "$OUT"
