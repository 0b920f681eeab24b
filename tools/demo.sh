#!/usr/bin/env bash
# The main job for a new user: set everything up, then run the reference engine on the bundled
# model (SmolLM2-135M-Instruct) with its KV cache held by the agent, and say what each part shows:
#   1. a chat answer, streamed, with SpeCache 1-bit;
#   2. a needle-in-a-haystack trial at DEMO_CONTEXT tokens (default 2048) in four modes sharing one
#      prefill: full, KIVI 1-bit alone, SpeCache 1-bit and 2-bit; the memory each used, a reading of
#      the table, heat maps and JSON under demo-out/;
#   3. on a machine with a GPU, the headline row of the decode-step benchmark (specache-bench step).
# The agent runs on the GPU when one is usable (--backend auto), on the CPU otherwise; the
# full-precision KV lives in the pages of a specached embedded in the process.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
build=${BUILD_DIR:-build}
model=$(tools/fetch-model.sh)
run="$build/tools/specache-run"
# 2048: long enough for the replica to be a fraction of the fp16 cache, short enough for the
# bundled 135M model to find the needle with its fp16 cache (at 3072 and 4096 it does not).
context=${DEMO_CONTEXT:-2048}

say() { printf '%s\n' "$@" | fold -s -w 100; }

echo
echo "== 1. a chat answer (SpeCache, 1-bit replica, k = 64) =="
say "The model answers a question. Its KV cache is split the SpeCache way: the device side (the" \
    "GPU when there is one) keeps a 1-bit copy of every key and value plus the newest 64 tokens in" \
    "fp16, the full-precision cache lives in host memory (specached pages), and at every step the 64" \
    "rows per head that matter most are fetched back in fp16. The last lines give the device memory" \
    "against the fp16 cache. A prompt of a few dozen tokens is too short to save any: the fixed" \
    "parts (the fp16 window of 64 tokens, the row cache of fetched rows) are most of it, so the" \
    "copy is larger than the cache. Part 2 shows a context where it is a fraction." ""
"$run" generate --model "$model" --kv specache --bits 1 --max-tokens 96 \
  --prompt "In three sentences, why does a long conversation need more GPU memory for its KV cache?"

echo
echo "== 2. needle in a haystack: $context tokens, needle at depth 0.5, four KV modes =="
say "A sentence (the needle) is hidden in the middle of $context tokens of text and the model is asked" \
    "for it. One prefill feeds four caches:" \
    "  full            the fp16 cache: the reference answer" \
    "  kivi-1bit       the 1-bit replica alone (KIVI), nothing fetched back" \
    "  specache-1bit   the 1-bit replica plus the top-64 rows per head fetched in fp16 each step" \
    "  specache-2bit   the same with a 2-bit replica" \
    "The table gives the share of correct answers; then the device memory of each mode against the" \
    "fp16 cache, and a one-line reading. On two CPU cores this part takes a few minutes." ""
"$run" niah-grid --model "$model" --haystack tools/data/gpl-3.0.txt \
  --needle "The secret password for the blue door is PINEAPPLE." \
  --question "What is the secret password for the blue door?" --answer pineapple \
  --lengths "$context" --depths 0.5 --modes full,kivi:1,specache:1,specache:2 --out-dir demo-out

bench="$build/tools/specache-bench"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && "$bench" step --help >/dev/null 2>&1; then
  echo
  echo "== 3. on this GPU: one decode step of a 32-layer model (Llama-3-8B shapes), 8 sequences x 8K =="
  say "The step with and without the speculative fetch of full-precision rows: ratio = with / without" \
      "(the fetch is hidden when it is near 1)." ""
  "$bench" step --batches 8 --tokens 8192 | sed -n '/^== step/,$p' || echo "(the step benchmark failed)"
fi

# ---- GPU machines: the whole model on the GPU ----------------------------------------------
# (kept apart from the text above) With a usable GPU, `generate` above already ran the whole
# model there (--backend auto: fp16 weights on the device, cuBLAS, only tokens to the host); this
# says so and adds a small throughput table at a fixed GPU memory budget (SmolLM2's shapes,
# random weights) with its plot.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo
  echo "== GPU found: generate ran the whole model on the GPU; decode throughput at a 4 GB budget =="
  "$run" bench --shape smollm2 --context 2048 --gpu-mem-budget 4GB --kv fp16 --kv specache --kv full-offload \
    --steps 4 --max-batch 64 --json-out demo-out/throughput.json --plot demo-out/throughput.png
fi
