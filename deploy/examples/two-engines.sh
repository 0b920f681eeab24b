#!/usr/bin/env bash
# Two engine processes sharing one specached: each opens its own session (own chunks, own page
# table) and decodes with SpeCache; specachectl shows both while they run.
# Run from the repository root after tools/setup.sh. Uses a private socket, no root needed.
set -euo pipefail
build=${BUILD_DIR:-build}
model=$(tools/fetch-model.sh)
dir=$(mktemp -d)
trap 'kill $daemon 2>/dev/null || true; rm -rf "$dir"' EXIT
"$build/daemon/specached" --socket "$dir/control.sock" --pool-bytes 1GiB --metrics-addr off --no-lock &
daemon=$!
while [ ! -S "$dir/control.sock.attach" ]; do sleep 0.1; done
for q in "Name three rivers in Europe." "Name three prime numbers."; do
  "$build/tools/specache-run" generate --model "$model" --daemon "$dir/control.sock" --kv specache --bits 1 \
    --max-tokens 48 --prompt "$q" > "$dir/out-${#q}.txt" &
done
# Show the two sessions once both engines have attached (model loading takes a few seconds).
for _ in $(seq 100); do
  n=$("$build/tools/specachectl" --socket "$dir/control.sock" stats --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["sessions"])')
  [ "$n" = 2 ] && break
  sleep 0.2
done
"$build/tools/specachectl" --socket "$dir/control.sock" sessions
wait %2 %3 2>/dev/null || wait
cat "$dir"/out-*.txt
"$build/tools/specachectl" --socket "$dir/control.sock" stats
