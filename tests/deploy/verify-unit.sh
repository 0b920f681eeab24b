#!/usr/bin/env bash
# systemd-analyze verify on deploy/specached.service, with ExecStart pointed at the built binary
# (verify checks that the executable exists). Usage: verify-unit.sh SPECACHED_BINARY
set -euo pipefail
binary=$(readlink -f "$1")
here=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
sed "s#/usr/bin/specached#$binary#" "$here/deploy/specached.service" > "$dir/specached.service"
out=$(systemd-analyze verify "$dir/specached.service" 2>&1 || true)
# Only lines about our unit count (the host's other units may have their own warnings).
ours=$(printf '%s\n' "$out" | grep -i "specached.service" || true)
if [ -n "$ours" ]; then
  printf '%s\n' "$ours"
  exit 1
fi
echo "systemd-analyze verify: specached.service OK"
