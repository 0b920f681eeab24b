#!/usr/bin/env bash
# The remote-fetch measurement of docs/remote.md at full size, for a machine with cores to spare
# (it needs ~1.5 GiB of RAM and a few CPU-minutes per transport): specache-remote-bench for the
# decode pattern B = 8 x 8 KV heads x top-64 rows of 512 B from 1 GiB of pages, both fetch
# methods, each next to ucx_perftest at the same message size, over TCP (UCX_TLS_LIST: other
# UCX_TLS values, e.g. "tcp rc" on an RDMA host; shared memory is not reachable through UCX's
# listener, see docs/remote.md).
# Usage: tools/remote-bench.sh [BUILD_DIR] [OUT_DIR]   (needs ucx-utils for ucx_perftest)
set -euo pipefail
build=${1:-build}
out=${2:-remote-bench-out}
mkdir -p "$out"
bench="$build/tools/specache-remote-bench"
command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing: apt install ucx-utils" >&2; exit 1; }
for tls in ${UCX_TLS_LIST:-tcp}; do
  name=${tls%%,*}
  echo "== UCX_TLS=$tls"
  UCX_TLS=$tls "$bench" --batch 8 --kv-heads 8 --topk 64 --head-dim 128 --layers 4 --tokens 8192 --steps 50 \
    --json > "$out/remote-$name.json"
  python3 - "$out/remote-$name.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for m in j["methods"]:
    p = m.get("ucx_perftest", {})
    print(f'  {m["method"]:6} {m["rows_per_s"]:10.0f} rows/s {m["gb_per_s"]:7.3f} GB/s at {m["message_bytes"]:.0f} B/message;'
          f' ucx_perftest {p.get("test")} {p.get("bytes")} B: {p.get("gb_per_s", 0):.3f} GB/s'
          f' -> {m.get("fraction_of_perftest", float("nan")):.2f}')
print(f'  gather / gets: {j.get("gather_over_gets", float("nan")):.1f}x')
PY
done
echo "JSON in $out/"
