#!/usr/bin/env bash
# The main job for a new user: set everything up, then run the reference engine on the bundled
# model (SmolLM2-135M-Instruct) with the KV cache held by the agent:
#   1. a chat answer, streamed, with SpeCache 1-bit (figures on stderr);
#   2. a needle-in-a-haystack trial at 2K tokens in three modes sharing one prefill: full,
#      KIVI 1-bit alone, SpeCache 1-bit; heat maps and JSON under demo-out/.
# The agent runs on the GPU when one is usable (--backend auto), on the CPU otherwise; the
# full-precision KV lives in the pages of a specached embedded in the process.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
build=${BUILD_DIR:-build}
model=$(tools/fetch-model.sh)
run="$build/tools/specache-run"

echo "== generate (specache, 1-bit replica, k=64) =="
"$run" generate --model "$model" --kv specache --bits 1 --max-tokens 96 \
  --prompt "In three sentences, why does a long conversation need more GPU memory for its KV cache?"

echo
echo "== needle in a haystack, 2K tokens, needle at depth 0.5 =="
mkdir -p demo-out
"$run" niah-grid --model "$model" --haystack tools/data/gpl-3.0.txt \
  --needle "The secret password for the blue door is PINEAPPLE." \
  --question "What is the secret password for the blue door?" --answer pineapple \
  --lengths 2048 --depths 0.5 --modes full,kivi:1,specache:1,specache:2 --out-dir demo-out

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
