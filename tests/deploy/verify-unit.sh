#!/usr/bin/env bash
# systemd-analyze verify on a specached unit. Only lines about the unit count (the host's other
# units may have warnings of their own).
#   verify-unit.sh UNIT_FILE                 the unit as it is (an installed one)
#   verify-unit.sh UNIT_FILE SPECACHED       with ExecStart pointed at SPECACHED first (verify checks
#                                            that the executable exists; deploy/'s names /usr/bin)
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: verify-unit.sh UNIT_FILE [SPECACHED]" >&2; exit 2; }
unit=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
if [ $# -eq 2 ]; then
  binary=$(readlink -f "$2")
  sed "s#^ExecStart=[^ ]*#ExecStart=$binary#" "$unit" > "$dir/specached.service"
  unit=$dir/specached.service
fi
grep -q '^ExecStart=' "$unit" || { echo "verify-unit: $unit has no ExecStart" >&2; exit 1; }
out=$(systemd-analyze verify "$unit" 2>&1 || true)
ours=$(printf '%s\n' "$out" | grep -i "specached.service" || true)
if [ -n "$ours" ]; then
  printf '%s\n' "$ours"
  exit 1
fi
echo "systemd-analyze verify: $(basename "$unit") OK"
