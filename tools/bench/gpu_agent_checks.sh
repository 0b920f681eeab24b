#!/usr/bin/env bash
# The CUDA agent's checks after a change to its GPU code, in one device call of at most ~9 minutes:
# its device tests (and the GPU model's, tools_llama_kernels_test), compute-sanitizer over the
# tests that drive the fetch's streams with no host wait, and the fetch's A/B figures (the agent's
# step, the whole model at 8K), each stage under a time limit of its own so that one slow stage
# leaves the others their time. For a GPU machine that has CUDA but none of the build's libraries:
# the binaries travel as a bundle made here.
#
#   here:     tools/bench/gpu_agent_checks.sh bundle   # build, then .bundle/agent.tar.xz (~35 MB)
#   GPU host: tools/bench/gpu_agent_checks.sh run      # every stage, results to $OUT (default ./gpu-out)
#             tools/bench/gpu_agent_checks.sh tests    # one stage: tests, sanitize, step, model
#             tools/bench/gpu_agent_checks.sh profile  # not in run: where a step's host and GPU time go
#                                                      # (PROFILE_BATCH, PROFILE_TOKENS, PROFILE_KV, PROFILE_FETCH)
#             tools/bench/gpu_agent_checks.sh steady   # not in run: the whole model's queued steps at 48 GB
#                                                      # (STEADY_CONTEXT, default 8192; STEADY_KV, default the int8
#                                                      # table's mode): a plain run, then its batch under the GPU
#                                                      # timeline and under the host sampler to the exit (per step:
#                                                      # gpu_timeline.py --steps EmbedKernel), the step bench at that
#                                                      # batch (STEADY_STEP_KV, default specache-1bit-int8; ~6 minutes)
#             tools/bench/gpu_agent_checks.sh int8     # not in run: the int8 host rows' table at 48 GB, 8K and 32K,
#                                                      # PyTorch SDPA's fp16 row beside each (~4 minutes)
#             tools/bench/gpu_agent_checks.sh goals    # not in run: the issues' goal figures of this build in one
#                                                      # call (~7 minutes, each part skipped once GOALS_S, default
#                                                      # 420 s, have gone): the step with and without the fetch at
#                                                      # 1/8/32 x 8K and 1/8 x 32K (fp16 and int8 host rows,
#                                                      # GOALS_STEP_KV) beside PyTorch's fp16 step, one
#                                                      # layer's attention against the copy's bandwidth (and
#                                                      # again with normal L2 copies, --codes-l2), the int8
#                                                      # table at 48 GB with SDPA, the host-pace probe at 176 x 8K
#             tools/bench/gpu_agent_checks.sh selection # not in run: the top-k on a stream of its own or in order
#                                                      # on the model's (selection_on_own_stream), the whole model
#                                                      # at 176 x 8K int8 alternated, two rounds (~4 minutes)
#             tools/bench/gpu_agent_checks.sh ahead    # not in run: the whole model's decode steps queued a step
#                                                      # ahead (specache-run bench's default) or one at a time
#                                                      # (--no-step-ahead), 176 x 8K int8 alternated two rounds,
#                                                      # 46 x 32K once (~4-8 minutes)
#             tools/bench/gpu_agent_checks.sh topk     # not in run: one layer's top-k at 99 and 176 x 8K (parts forced
#                                                      # to 1024-8192 tokens) and 24 and 46 x 32K (2048-8192) against
#                                                      # its chosen cut (specache-bench attend --topk-parts; ~2 minutes)
#             tools/bench/gpu_agent_checks.sh ncu      # not in run: Nsight Compute on one launch of one kernel
#                                                      # under specache-bench attend (NCU_KERNEL, a regex, default
#                                                      # TopKPartKernel; NCU_TOKENS x NCU_BATCH, default 32768 x 46;
#                                                      # NCU_ROWS substituted rows a head, default attend's 64;
#                                                      # NCU_SKIP launches skipped first, default 3): the full set's
#                                                      # details, then instructions and stall samples per source line
#                                                      # and SASS instruction, in $OUT/ncu.tgz (~3 minutes)
#             tools/bench/gpu_agent_checks.sh variants # not in run: kernel variants (tools/bench/kernel_variant.sh,
#                                                      # .bundle/variants.tar.xz beside the bundle) alternated: one
#                                                      # layer's attention and top-k (specache-bench attend) of each of
#                                                      # VARIANTS (default: all packed) at 8K (VARIANT_BATCHES_8K, default
#                                                      # 32,176) and 32K (VARIANT_BATCHES_32K, 46; empty: the context
#                                                      # left out), ROUNDS (default 3); VARIANT_SUITE=step times the
#                                                      # 32-layer step instead (VARIANT_STEP_KV, default
#                                                      # specache-1bit-int8; 150 s a run at most)
#                                                      # rounds, then their means against BASELINE (default v0):
#                                                      # tools/bench/variant_means.py (~1-2 s a run, 60 s at most);
#                                                      # first each variant's own device tests where packed
#                                                      # (VARIANT_TESTS, default CudaAttentionTest.*:CudaTopKTest.*;
#                                                      # a GPU model variant's tools_llama_kernels_test, whole)
#             tools/bench/gpu_agent_checks.sh stores   # not in run: the gather's store kinds A/B (the step at
#                                                      # STORES_BATCHES, default 32,176, int8 rows; the whole model
#                                                      # at 8K alternated, two rounds; ~7 minutes)
#   here, after: tools/profile/host_profile.py OUT/samples_N.txt --binary build/tools/specache-bench --binary
#             OUT/libc.so.6 --within CudaAgent::DecodeLayer (each N; OUT/timeline_summary.txt has the GPU's side)
#
# SHARES (default "0 0.3") are the fetch_sm_share values the step and the whole model compare;
# SANITIZE (default: the two device-tensor tests) the gtest filter compute-sanitizer runs, TOOLS
# (default memcheck) its tools: racecheck takes 50-125 s a test on the H200, so run it as a stage
# of its own (TOOLS=racecheck ... sanitize). Stage limits: tests 120 s and the model's 60, each
# tool 150, step 90, each share of the model 60: `run` stays under 9 minutes with the default
# TOOLS; profile: 100 and 3 x 90 (at most ~6 minutes); steady: 90, 2 x 120 and 150; int8: 4 x 90; stores: 200 and 4 x 80;
# goals: a part starts only
# before GOALS_S (420 s), the last may end ~90 s after; selection: 4 x 80; ahead: 4 x 80 and 2 x 100; topk: 2 x 80; variants: 60 a run (step: 150); ncu: 240,
# 60 and 90. Each stage prints a line "stage: exit N, S s"; the script's exit status is the tests'
# (a failing or missing GPU fails, SPECACHE_REQUIRE_GPU=1), for int8, steady, stores, goals, selection,
# ahead, topk, variants and ncu 1 when any of their runs failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
bundle=.bundle/agent
stage=${1:-}
shares=${SHARES:-0 0.3}
sanitize=${SANITIZE:-CudaAgentTest.EveryFetchOverlapOnDeviceTensorsMatchesTheCpuAgent:CudaAgentTest.ChangingBatchesOnDeviceTensorsMatchTheCpuAgent}
tools=${TOOLS:-memcheck}

if [ "$stage" = bundle ]; then
  set -e
  build=${BUILD_DIR:-build}
  nice -n 10 cmake --build "$build" -j2 --target gpu_agent_device_test tools_llama_kernels_test specache-bench specache-run \
    specache_host_sampler
  # The GPU timeline's library exists only where CUPTI was found.
  has_timeline=$(cmake --build "$build" --target help | grep -c specache_gpu_timeline || true)
  if [ "$has_timeline" -gt 0 ]; then cmake --build "$build" -j2 --target specache_gpu_timeline; fi
  rm -rf "$bundle"
  tools/gpu-bundle "$bundle" "$build/tests/gpu_agent_device_test" "$build/tests/tools_llama_kernels_test" \
    "$build/tools/specache-bench" "$build/tools/specache-run"
  # The profile stage's preloaded libraries (their symbols are not needed: they sample, not are sampled).
  mkdir -p "$bundle/profile"
  cp "$build/tools/libspecache_host_sampler.so" "$bundle/profile/"
  if [ "$has_timeline" -gt 0 ]; then cp "$build/tools/libspecache_gpu_timeline.so" "$bundle/profile/"; fi
  strip --strip-debug "$bundle/profile/"*.so
  tar -C .bundle -cf - agent | xz -T2 -6 > .bundle/agent.tar.xz
  du -sh .bundle/agent.tar.xz
  exit 0
fi

case "$stage" in
  run | tests | sanitize | step | model | profile | steady | int8 | stores | goals | selection | ahead | topk | ncu | variants) ;;
  *) sed -n '2,/^[^#]/{/^#/p}' "$0" >&2; exit 2 ;;  # the header above, whole
esac
if [ ! -x "$bundle/run" ]; then
  [ -s .bundle/agent.tar.xz ] || { echo "gpu_agent_checks: no .bundle/agent.tar.xz (run the bundle stage here first)" >&2; exit 1; }
  tar -C .bundle -xJf .bundle/agent.tar.xz
fi
mkdir -p "$out"
export SPECACHE_REQUIRE_GPU=1
sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}

# The toolkit's libcupti directory, for the GPU timeline's preload (profile, steady).
cupti_dir() { dirname "$(find /usr/local/cuda/ -name 'libcupti.so*' 2>/dev/null | head -1)"; }

timed() {  # timed NAME LIMIT_S COMMAND...: output to $out/NAME.txt, a summary line to stdout
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  rc=$?
  echo "$name: exit $rc, $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
  return "$rc"
}

tests_rc=0
if [ "$stage" = run ] || [ "$stage" = tests ]; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  timed tests 120 "$bundle/run" gpu_agent_device_test
  tests_rc=$?
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$out/tests.txt"
  # The GPU model's own (its kernels against CPU references, its decode graphs, its products' kernels).
  timed model_tests 60 "$bundle/run" tools_llama_kernels_test || tests_rc=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$out/model_tests.txt"
fi
if [ "$stage" = run ] || [ "$stage" = sanitize ]; then
  for tool in $tools; do
    timed "sanitize_$tool" 150 env LD_LIBRARY_PATH="$PWD/$bundle/lib:/usr/local/cuda/lib64" \
      "$sanitizer" --tool "$tool" --error-exitcode 99 \
      "$bundle/bin/gpu_agent_device_test" --gtest_filter="$sanitize"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitize_$tool.txt" | head -4
  done
fi
if [ "$stage" = run ] || [ "$stage" = step ]; then
  timed step 90 "$bundle/run" specache-bench step --tokens 8192 --batches 8,32 --fetch-sm-share "${shares// /,}"
  grep -A1 "^specache" "$out/step.txt"
fi
# The whole model at 48 GB (specache-run bench, Llama-3-8B shapes), a process per run (the host's
# state between runs moves the figures; read a ratio to the SDPA row of the same call): its result
# lines, each with the host line under it, and the SDPA line.
bench_rc=0
bench_48gb() {  # bench_48gb NAME LIMIT CONTEXT ARGS...
  local name=$1 limit=$2 context=$3
  shift 3
  timed "$name" "$limit" "$bundle/run" specache-run bench --shape llama3-8b --gpu-mem-budget 48GB --steps 16 \
    --context "$context" "$@" || bench_rc=1
  grep -h -A1 -E "^ +[0-9]+ " "$out/$name.txt"
  grep -h "fp16 (SDPA)" "$out/$name.txt"
}
if [ "$stage" = run ] || [ "$stage" = model ]; then
  for share in $shares; do
    bench_48gb "model_8k_share_$share" 60 8192 --kv specache --fetch-sm-share "$share"
  done
fi
if [ "$stage" = profile ]; then
  # One profiled step (PROFILE_TOKENS x PROFILE_BATCH, default 8192 x 32, PROFILE_KV the step's
  # --kv, default the bench's; PROFILE_FETCH=0 (default) leaves the fetch out): the GPU's kernels
  # and gaps (CUPTI; it slows the host's launches, so read which gaps, not their sum), then the
  # main thread sampled every 25 us over that step in PROFILE_RUNS runs, default 3 (SPECACHE_SAMPLE_STOP=1).
  step_args=(specache-bench step --tokens "${PROFILE_TOKENS:-8192}" --batches "${PROFILE_BATCH:-32}" --profile-step)
  [ -n "${PROFILE_KV:-}" ] && step_args+=(--kv "$PROFILE_KV")
  [ "${PROFILE_FETCH:-0}" = 1 ] || step_args+=(--profile-no-fetch)
  cupti=$(cupti_dir)
  timed timeline 100 env SPECACHE_TIMELINE_OUT="$out/timeline.csv" LD_LIBRARY_PATH="$cupti" \
    LD_PRELOAD="$PWD/$bundle/profile/libspecache_gpu_timeline.so" "$bundle/run" "${step_args[@]}"
  [ -s "$out/timeline.csv" ] && python3 tools/profile/gpu_timeline.py "$out/timeline.csv" > "$out/timeline_summary.txt" 2>&1
  head -3 "$out/timeline_summary.txt" 2>/dev/null
  for i in $(seq "${PROFILE_RUNS:-3}"); do
    timed "samples_run_$i" 90 env SPECACHE_SAMPLE_OUT="$out/samples_$i.txt" SPECACHE_SAMPLE_US=25 SPECACHE_SAMPLE_STOP=1 \
      LD_PRELOAD="$PWD/$bundle/profile/libspecache_host_sampler.so" "$bundle/run" "${step_args[@]}"
  done
  # The C library that ran (host_profile.py names its frames by its dynamic symbols: a lock's wait
  # from a copy's memcpy); the driver stays named by its file.
  libc=$(awk '$1 == "map" && $NF ~ /\/libc\.so\.6$/ {print $NF; exit}' "$out/samples_1.txt" 2>/dev/null)
  [ -n "$libc" ] && cp "$libc" "$out/libc.so.6"
fi
if [ "$stage" = steady ]; then
  # The batch the search finds (a plain run), then that batch again with its profiled step (from an
  # idle device: the host's launches lead) and the 16 timed steps after it, queued a step ahead as
  # unprofiled runs queue them (the warm-up steps come before the profiler starts): in the
  # timeline, step 1 is the profiled one, steps 2-16 the timed ones whole (--skip 1 --count 15),
  # then the phase-timed ones. The step bench runs STEADY_STEP_KV (its name for the mode) there.
  steady_kv=${STEADY_KV:-specache/host-rows=int8}
  steady_ctx=${STEADY_CONTEXT:-8192}
  bench_48gb steady_plain 90 "$steady_ctx" --kv "$steady_kv"
  steady_batch=$(awk -v c="$steady_ctx" '$1 == c && $3 ~ /^[0-9]+$/ {print $3; exit}' "$out/steady_plain.txt")
  model=(specache-run bench --shape llama3-8b --gpu-mem-budget 48GB --steps 16 --context "$steady_ctx"
         --kv "$steady_kv" --profile-step)
  [ -n "$steady_batch" ] && model+=(--max-batch "$steady_batch")
  cupti=$(cupti_dir)
  timed steady_timeline 120 env SPECACHE_TIMELINE_OUT="$out/steady_timeline.csv" SPECACHE_TIMELINE_STOP=0 \
    LD_LIBRARY_PATH="$cupti" LD_PRELOAD="$PWD/$bundle/profile/libspecache_gpu_timeline.so" "$bundle/run" "${model[@]}" \
    || bench_rc=1
  grep -h -A1 -E "^ +[0-9]+ " "$out/steady_timeline.txt"
  if [ -s "$out/steady_timeline.csv" ]; then
    python3 tools/profile/gpu_timeline.py "$out/steady_timeline.csv" --steps EmbedKernel --skip 1 --count 15 \
      > "$out/steady_timeline_steps.txt" 2>&1
    head -4 "$out/steady_timeline_steps.txt"
    xz -f -T0 "$out/steady_timeline.csv"
  fi
  timed steady_samples 120 env SPECACHE_SAMPLE_OUT="$out/steady_samples.txt" SPECACHE_SAMPLE_US=100 \
    LD_PRELOAD="$PWD/$bundle/profile/libspecache_host_sampler.so" "$bundle/run" "${model[@]}" || bench_rc=1
  [ -s "$out/steady_samples.txt" ] && xz -f -T0 "$out/steady_samples.txt"
  [ -n "$steady_batch" ] && { timed steady_step 150 "$bundle/run" specache-bench step --tokens "$steady_ctx" \
    --batches "$steady_batch" --kv "${STEADY_STEP_KV:-specache-1bit-int8}" || bench_rc=1;
    grep -A1 "^specache" "$out/steady_step.txt"; }
fi
sdpa=(--kv fp16 --sdpa-script tools/bench/fp16_baseline.py --python "${PYTHON:-python3}")
# The int8 host rows' table at 48 GB, 8K and 32K, SDPA's fp16 row beside each, runs named
# PREFIX{sdpa,int8}_CONTEXT; each run only while GUARD... succeeds (goals' time budget).
int8_table() {  # int8_table PREFIX GUARD...
  local prefix=$1 context
  shift
  for context in 8192 32768; do
    "$@" && bench_48gb "${prefix}sdpa_$context" 90 "$context" "${sdpa[@]}"
    "$@" && bench_48gb "${prefix}int8_$context" 90 "$context" --kv specache/host-rows=int8
  done
}
if [ "$stage" = goals ]; then
  goals_start=$(date +%s)
  time_left() { [ $(( $(date +%s) - goals_start )) -lt "${GOALS_S:-420}" ]; }
  # Fetch overlap (step with / without <= 1.05) and 32 x 8K tokens/s (>= 1.3x fp16), the fp16
  # step in the same call; the attention's share of the copy's bandwidth (>= 50% for B >= 8).
  # The step's rows: fp16 host rows (specache-1bit) and the table's int8 ones (GOALS_STEP_KV).
  step_kv=${GOALS_STEP_KV:-specache-1bit,specache-1bit-int8}
  timed goals_step_8k 170 "$bundle/run" specache-bench step --tokens 8192 --batches 1,8,32 --kv "$step_kv" || bench_rc=1
  grep -A1 "^specache" "$out/goals_step_8k.txt"
  time_left && { timed goals_step_32k 120 "$bundle/run" specache-bench step --tokens 32768 --batches 1,8 --kv "$step_kv" || bench_rc=1;
                 grep -A1 "^specache" "$out/goals_step_32k.txt"; }
  time_left && { timed goals_fp16 90 "${PYTHON:-python3}" tools/bench/fp16_baseline.py --batches 1,8,32 \
                   --contexts 8192,32768 --steps 10 || bench_rc=1; grep "^fp16 decode" "$out/goals_fp16.txt"; }
  time_left && { timed goals_attend_8k 90 "$bundle/run" specache-bench attend --random-rows --free-slots 32 \
                   --tokens 8192 --batches 8,32,176 --codes-l2 normal || bench_rc=1; sed -n '/^== attend/,/per layer;/p' "$out/goals_attend_8k.txt"; }
  time_left && { timed goals_attend_32k 90 "$bundle/run" specache-bench attend --random-rows --free-slots 32 \
                   --tokens 32768 --batches 8,46 --codes-l2 normal || bench_rc=1; sed -n '/^== attend/,/per layer;/p' "$out/goals_attend_32k.txt"; }
  # The table at 48 GB (8K >= 3x, 32K >= 6x fp16), int8 host rows, SDPA in the same call; then
  # whether the host's pace sets the 8K step (it grows by 32 x 150 us if it does).
  int8_table goals_ time_left
  time_left && bench_48gb goals_probe_150 80 8192 --kv specache/host-rows=int8 --host-delay-us 150
  # One archive of the parts' outputs (a device call returns at most 8 files).
  tar -C "$out" -czf "$out/goals.tgz" $(cd "$out" && ls goals_*.txt) && rm -f "$out"/goals_*.txt
  exit "$bench_rc"
fi
if [ "$stage" = int8 ]; then int8_table "" true; fi
if [ "$stage" = stores ]; then
  timed stores_step 200 "$bundle/run" specache-bench step --tokens 8192 --batches "${STORES_BATCHES:-32,176}" \
    --kv specache-1bit-int8 --fetch-gather-stores cached,streaming || bench_rc=1
  grep -A1 "^specache" "$out/stores_step.txt"
  for round in 1 2; do
    for kind in cached streaming; do
      bench_48gb "stores_${kind}_$round" 80 8192 --kv specache/host-rows=int8 --fetch-gather-stores "$kind"
    done
  done
fi
if [ "$stage" = selection ]; then
  for round in 1 2; do
    for where in own compute; do
      bench_48gb "selection_${where}_$round" 80 8192 --kv specache/host-rows=int8 --selection-stream "$where"
    done
  done
fi
if [ "$stage" = ahead ]; then
  for round in 1 2; do
    for ahead in off on; do
      flag=(--no-step-ahead); [ "$ahead" = on ] && flag=(--step-ahead)
      bench_48gb "ahead_8k_${ahead}_$round" 80 8192 --kv specache/host-rows=int8 "${flag[@]}"
    done
  done
  for ahead in off on; do
    flag=(--no-step-ahead); [ "$ahead" = on ] && flag=(--step-ahead)
    bench_48gb "ahead_32k_$ahead" 100 32768 --kv specache/host-rows=int8 "${flag[@]}"
  done
fi
if [ "$stage" = topk ]; then
  timed topk_8k 80 "$bundle/run" specache-bench attend --random-rows --free-slots 32 --tokens 8192 --batches 99,176 \
    --topk-parts 1024,2048,4096,8192 || bench_rc=1
  grep -E "^(99|176) +1m" "$out/topk_8k.txt"
  timed topk_32k 80 "$bundle/run" specache-bench attend --random-rows --free-slots 32 --tokens 32768 --batches 24,46 \
    --topk-parts 2048,4096,6144,8192 || bench_rc=1
  grep -E "^(24|46) +1m" "$out/topk_32k.txt"
fi
if [ "$stage" = ncu ]; then
  ncu_bin=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
  attend=(specache-bench attend --random-rows --free-slots 32 --tokens "${NCU_TOKENS:-32768}" --batches "${NCU_BATCH:-46}"
          ${NCU_ROWS:+--attend-rows "$NCU_ROWS"})
  # The bundle's runner execs the binary: ncu follows it (its default, every process).
  timed ncu_profile 240 "$ncu_bin" --kernel-name "regex:${NCU_KERNEL:-TopKPartKernel}" --launch-skip "${NCU_SKIP:-3}" \
    --launch-count 1 --set full --import-source yes -f -o "$out/ncu" "$bundle/run" "${attend[@]}" || bench_rc=1
  if [ -s "$out/ncu.ncu-rep" ]; then
    timed ncu_details 60 "$ncu_bin" -i "$out/ncu.ncu-rep" --page details || bench_rc=1
    timed ncu_source 90 "$ncu_bin" -i "$out/ncu.ncu-rep" --page source --csv --print-source cuda,sass || bench_rc=1
    grep -E "Duration|Issue Slots Busy|DRAM Throughput|Registers Per|Achieved Occupancy|Eligible Warps" "$out/ncu_details.txt" | head -8
  fi
  tar -C "$out" -czf "$out/ncu.tgz" $(cd "$out" && ls ncu_*.txt ncu.ncu-rep 2>/dev/null) && rm -f "$out"/ncu_*.txt "$out/ncu.ncu-rep"
fi
if [ "$stage" = variants ]; then
  [ -s .bundle/variants.tar.xz ] ||
    { echo "gpu_agent_checks: no .bundle/variants.tar.xz (tools/bench/kernel_variant.sh ... and pack, here)" >&2; exit 1; }
  tar -C .bundle -xJf .bundle/variants.tar.xz
  names=${VARIANTS:-$(cd "$bundle/bin" && ls specache-bench-* | sed 's/^specache-bench-//')}
  # VARIANT_SUITE: attend (one layer's attention and top-k) or step (the 32-layer step with and
  # without the fetch, VARIANT_STEP_KV's rows: for changes to the fetch or the caches' update).
  suite=${VARIANT_SUITE:-attend}
  case "$suite" in
    attend) suite_args=(attend --random-rows --free-slots 32); run_limit=60 ;;
    step) suite_args=(step --kv "${VARIANT_STEP_KV:-specache-1bit-int8}"); run_limit=150 ;;
    *) echo "gpu_agent_checks: VARIANT_SUITE is attend or step" >&2; exit 2 ;;
  esac
  # Each variant's kernel tests first, where it was packed with its device tests (kernel_variant.sh):
  # a variant that fails them is still timed, and the stage fails.
  # (A variant of the GPU model's kernels: all of tools_llama_kernels_test.)
  for v in $names; do
    if [ -x "$bundle/bin/gpu_agent_device_test-$v" ]; then
      timed "variant-tests-$v" 60 "$bundle/run" "gpu_agent_device_test-$v" \
        --gtest_filter="${VARIANT_TESTS:-CudaAttentionTest.*:CudaTopKTest.*}" || bench_rc=1
      grep -E "^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test" "$out/variant-tests-$v.txt"
    fi
    if [ -x "$bundle/bin/tools_llama_kernels_test-$v" ]; then
      timed "variant-tests-model-$v" 60 "$bundle/run" "tools_llama_kernels_test-$v" || bench_rc=1
      grep -E "^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test" "$out/variant-tests-model-$v.txt"
    fi
  done
  for round in $(seq "${ROUNDS:-3}"); do
    for context in 8192 32768; do
      batches=${VARIANT_BATCHES_8K-32,176}
      [ "$context" = 32768 ] && batches=${VARIANT_BATCHES_32K-46}
      [ -z "$batches" ] && continue  # a context left out
      for v in $names; do
        timed "variant_${v}_${context}_$round" "$run_limit" "$bundle/run" "specache-bench-$v" "${suite_args[@]}" \
          --tokens "$context" --batches "$batches" || bench_rc=1
      done
    done
  done
  python3 tools/bench/variant_means.py "$out" --baseline "${BASELINE:-v0}" | tee "$out/variant_means.txt" || bench_rc=1
  tar -C "$out" -czf "$out/variants.tgz" $(cd "$out" && ls variant_*_*.txt variant-tests-*.txt 2>/dev/null) &&
    rm -f "$out"/variant_*_*_*.txt "$out"/variant-tests-*.txt
fi
if [ "$stage" = int8 ] || [ "$stage" = stores ] || [ "$stage" = selection ] || [ "$stage" = ahead ] || [ "$stage" = topk ] ||
   [ "$stage" = ncu ] || [ "$stage" = variants ] || [ "$stage" = steady ]; then
  exit "$bench_rc"
fi  # (goals exits above)
exit "$tests_rc"
