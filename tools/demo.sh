#!/usr/bin/env bash
# The main job for a new user: set everything up, then run specache on this machine.
# Until the reference engine (specache-run on SmolLM2-135M) lands, the main job is the agent's
# benchmark: memory ratio of the low-bit replica, quantization and decode-attention speed.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
"${BUILD_DIR:-build}/tools/specache-bench" all --tokens 32768 --repeats 5
