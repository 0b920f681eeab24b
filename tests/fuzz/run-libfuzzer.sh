#!/usr/bin/env bash
# Builds every fuzz target with clang's libFuzzer (+ ASan/UBSan) and runs each for SECONDS
# (default 30). Skips, saying so, when clang or libFuzzer is missing. Usage: run-libfuzzer.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-30}
if ! command -v clang++ >/dev/null; then
  echo "run-libfuzzer: clang++ not found; fuzz targets only replayed (ctest fuzz_replay_*)"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' > "$out/probe.cc"
if ! clang++ -fsanitize=fuzzer "$out/probe.cc" -o "$out/probe" 2>/dev/null; then
  echo "run-libfuzzer: clang++ has no libFuzzer runtime; fuzz targets only replayed (ctest fuzz_replay_*)"
  exit 0
fi
parsers=(protocol/src/status.cc protocol/src/shm_layout.cc protocol/src/attach_protocol.cc protocol/src/remote_protocol.cc)
for target in tests/fuzz/fuzz_*.cc; do
  name=$(basename "$target" .cc)
  if ! clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -Iprotocol/include "$target" "${parsers[@]}" -o "$out/$name" 2>"$out/$name.log"; then
    echo "run-libfuzzer: $name does not build with clang:"; cat "$out/$name.log"; exit 1
  fi
  mkdir -p "$out/$name.corpus"
  echo "run-libfuzzer: $name for ${seconds}s"
  set +e
  (cd "$out" && "./$name" -max_total_time="$seconds" -max_len=4096 "$name.corpus" >"$name.run" 2>&1)
  rc=$?
  set -e
  grep -E "DONE|Done [0-9]+ runs|ERROR|SUMMARY" "$out/$name.run" || true
  if [ $rc -ne 0 ]; then
    echo "run-libfuzzer: $name found a failing input (exit $rc):"; tail -30 "$out/$name.run"; exit 1
  fi
done
echo "run-libfuzzer: no crash"
