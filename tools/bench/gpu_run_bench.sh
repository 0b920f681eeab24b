#!/usr/bin/env bash
# The GPU figures of specache-run (the whole model on the GPU): its gpu tests and the throughput
# table at a 48 GB budget, on a GPU machine that has CUDA and PyTorch but none of the build's
# libraries (the binaries travel as a bundle made here, tools/gpu-bundle).
#
#   here:     tools/bench/gpu_run_bench.sh bundle        # build, then .bundle/gpu.tar.xz (binaries +
#                                                        # libs, ~20 MB) and .bundle/model/part-aa..ad
#                                                        # (the model in 25 MB parts) and its SHA256
#   GPU host: tools/bench/gpu_run_bench.sh tests         # gpu tests (needs all four model parts)
#             tools/bench/gpu_run_bench.sh bench CONTEXT # one context of the table (llama3-8b, random
#                                                        # weights, all modes, SDPA next to fp16)
#             tools/bench/gpu_run_bench.sh plot          # the plot from every bench_*.json so far
#
# Results stay in .bundle/results (kept between calls on the same machine) and each stage copies
# its own to $OUT (default ./gpu-out). The bench needs no model; BUDGET (48GB) and STEPS (8) change
# the table's budget and timed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
results=.bundle/results
bundle=.bundle/gpu
budget=${BUDGET:-48GB}
stage=${1:-}

join_model() {  # the model file from its parts (each call can carry only so much), checked
  local model=.bundle/model/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -s "$model" ]; then
    cat .bundle/model/part-* > "$model.tmp" 2>/dev/null
    if ! (cd .bundle/model && sed 's/  .*/  SmolLM2-135M-Instruct.Q4_1.gguf.tmp/' SHA256 | sha256sum -c --quiet -) >&2; then
      echo "gpu_run_bench: the model parts under .bundle/model are missing or incomplete (need part-aa to part-ad and SHA256)" >&2
      rm -f "$model.tmp"
      return 1
    fi
    mv "$model.tmp" "$model"
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
    # 153 MB -> 20 MB: the large dictionary finds what the three executables share.
    tar -C .bundle -cf - gpu | xz -T2 -9 --lzma2=dict=256MiB > .bundle/gpu.tar.xz
    mkdir -p .bundle/model
    rm -f .bundle/model/part-*
    model=$(tools/fetch-model.sh)
    split -n 4 "$model" .bundle/model/part-  # 4 x 25 MB: at most two with the bundle per call
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > .bundle/model/SHA256
    du -sh .bundle/gpu.tar.xz .bundle/model/*
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
    mkdir -p "$out" "$results"
    model=$(join_model) || exit 1
    nvidia-smi > "$results/nvidia-smi.txt" 2>&1
    SPECACHE_REQUIRE_GPU=1 SPECACHE_REQUIRE_MODEL=1 SPECACHE_MODEL="$model" SPECACHE_SOURCE_DIR="$PWD" \
      "$bundle/run" tools_gpu_model_test 2>&1 | tee "$results/tools_gpu_model_test.txt"
    rc_model=${PIPESTATUS[0]}
    SPECACHE_REQUIRE_GPU=1 "$bundle/run" gpu_agent_device_test > "$results/gpu_agent_device_test.txt" 2>&1
    rc_agent=$?
    tail -3 "$results/gpu_agent_device_test.txt"
    echo "tools_gpu_model_test exit $rc_model, gpu_agent_device_test exit $rc_agent" | tee "$results/tests_rc.txt"
    cp "$results"/tools_gpu_model_test.txt "$results"/gpu_agent_device_test.txt "$results"/tests_rc.txt \
      "$results"/nvidia-smi.txt "$out/"
    [ "$rc_model" = 0 ] && [ "$rc_agent" = 0 ]
    ;;
  bench)
    context=${2:?context tokens, e.g. 32768}
    steps=${STEPS:-8}
    mkdir -p "$out" "$results"
    python=${PYTHON:-python3}
    "$bundle/run" specache-run bench --shape llama3-8b --context "$context" --gpu-mem-budget "$budget" \
      --kv specache --kv fp16 --kv kivi --kv specache-nonspec --kv full-offload --steps "$steps" \
      --sdpa-script tools/bench/fp16_baseline.py --python "$python" \
      --json-out "$results/bench_$context.json" 2>&1 | tee "$results/bench_$context.txt"
    rc=${PIPESTATUS[0]}
    cp "$results/bench_$context.json" "$results/bench_$context.txt" "$out/" 2>/dev/null
    exit "$rc"
    ;;
  plot)
    mkdir -p "$out"
    merge=()
    for f in "$results"/bench_*.json; do merge+=(--merge "$f"); done
    "$bundle/run" specache-run bench --plot-only --gpu-mem-budget "$budget" "${merge[@]}" --plot "$out/throughput.png"
    cp "$results"/bench_*.json "$out/" 2>/dev/null
    ;;
  *)
    sed -n 2,18p "$0" >&2
    exit 2
    ;;
esac
