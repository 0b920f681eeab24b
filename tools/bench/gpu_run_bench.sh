#!/usr/bin/env bash
# The GPU figures of specache-run (the whole model on the GPU): its gpu tests and the throughput
# table at a 48 GB budget, on a GPU machine that has CUDA and PyTorch but none of the build's
# libraries (the binaries travel as a bundle made here, tools/gpu-bundle).
#
#   here:     tools/bench/gpu_run_bench.sh bundle        # build, then .bundle/gpu (binaries + libs)
#                                                        # and .bundle/model/part-* (the model, in parts)
#   GPU host: tools/bench/gpu_run_bench.sh tests         # gpu tests (needs the model parts)
#             tools/bench/gpu_run_bench.sh bench CONTEXT # one context of the table (llama3-8b, random
#                                                        # weights, all modes, SDPA next to fp16)
#             tools/bench/gpu_run_bench.sh plot          # the plot from every bench_*.json in $OUT
#
# Results go to $OUT (default ./gpu-out). Every stage says what it ran; the bench needs no model.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
bundle=.bundle/gpu
budget=${BUDGET:-48GB}
stage=${1:-}

join_model() {  # the model file from its parts (each call can carry only so much)
  local model=.bundle/model/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -s "$model" ]; then
    ls .bundle/model/part-* >/dev/null 2>&1 || { echo "gpu_run_bench: no model parts under .bundle/model" >&2; return 1; }
    cat .bundle/model/part-* > "$model"
  fi
  echo "$model"
}

case "$stage" in
  bundle)
    set -e
    build=${BUILD_DIR:-build}
    nice -n 10 cmake --build "$build" -j2 --target specache-run tools_gpu_model_test gpu_agent_device_test
    rm -rf "$bundle"
    tools/gpu-bundle "$bundle" "$build/tools/specache-run" "$build/tests/tools_gpu_model_test" \
      "$build/tests/gpu_agent_device_test"
    tar -C .bundle -cf - gpu | xz -T2 -6 > .bundle/gpu.tar.xz  # 126 MB -> 23 MB
    mkdir -p .bundle/model
    rm -f .bundle/model/part-*
    split -b 40M "$(tools/fetch-model.sh)" .bundle/model/part-
    du -sh .bundle/gpu.tar.xz .bundle/model/part-*
    exit 0
    ;;
esac

# On the GPU machine: unpack the bundle once.
if [ ! -x "$bundle/run" ]; then
  [ -s .bundle/gpu.tar.xz ] || { echo "gpu_run_bench: no .bundle/gpu.tar.xz (run the bundle stage here first)" >&2; exit 1; }
  tar -C .bundle -xJf .bundle/gpu.tar.xz
fi

case "$stage" in
  tests)
    mkdir -p "$out"
    model=$(join_model) || exit 1
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1
    SPECACHE_REQUIRE_GPU=1 SPECACHE_REQUIRE_MODEL=1 SPECACHE_MODEL="$model" SPECACHE_SOURCE_DIR="$PWD" \
      "$bundle/run" tools_gpu_model_test 2>&1 | tee "$out/tools_gpu_model_test.txt"
    rc_model=${PIPESTATUS[0]}
    SPECACHE_REQUIRE_GPU=1 "$bundle/run" gpu_agent_device_test 2>&1 | tail -5 | tee "$out/gpu_agent_device_test.txt"
    rc_agent=${PIPESTATUS[0]}
    echo "tools_gpu_model_test exit $rc_model, gpu_agent_device_test exit $rc_agent" | tee "$out/tests_rc.txt"
    [ "$rc_model" = 0 ] && [ "$rc_agent" = 0 ]
    ;;
  bench)
    context=${2:?context tokens, e.g. 32768}
    steps=${STEPS:-8}
    mkdir -p "$out"
    python=${PYTHON:-python3}
    "$bundle/run" specache-run bench --shape llama3-8b --context "$context" --gpu-mem-budget "$budget" \
      --kv fp16 --kv kivi --kv specache --kv specache-nonspec --kv full-offload --steps "$steps" \
      --sdpa-script tools/bench/fp16_baseline.py --python "$python" \
      --json-out "$out/bench_$context.json" 2>&1 | tee "$out/bench_$context.txt"
    exit "${PIPESTATUS[0]}"
    ;;
  plot)
    merge=()
    for f in "$out"/bench_*.json; do merge+=(--merge "$f"); done
    "$bundle/run" specache-run bench --plot-only --gpu-mem-budget "$budget" "${merge[@]}" --plot "$out/throughput.png"
    ;;
  *)
    sed -n 2,13p "$0" >&2
    exit 2
    ;;
esac
