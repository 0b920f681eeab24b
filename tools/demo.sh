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
