#!/usr/bin/env bash
# Two hosts as two network namespaces joined by a veth pair: specached in one, the engine
# (specache-run) in the other, over TLS + UCX (TCP). Checks:
#   1. the engine's greedy output with the full-precision KV on the remote daemon is identical to
#      the local path (a specached embedded in the engine's process), for the same prompt and
#      settings, by both fetch methods;
#   2. the daemon SIGKILLed mid-decode: the engine reports the error within its deadline and
#      exits with a status (not a crash, not a hang);
#   3. the daemon restarted: a new run works and gives the same output.
# Needs root (it makes the namespaces) and the model; exits 77 (ctest: skipped) with the reason
# when namespaces cannot be made here or the model is missing (SPECACHE_REQUIRE_MODEL=1: a
# missing model fails instead).
# Also: specachectl against the remote daemon (the tenant's view).
# Usage: remote_netns_test.sh SPECACHED SPECACHE_RUN SPECACHECTL MODEL
set -euo pipefail
specached=$1
run=$2
ctl=$3
model=$4

if [ ! -f "$model" ]; then
  if [ "${SPECACHE_REQUIRE_MODEL:-0}" = "1" ]; then echo "FAIL: model $model missing"; exit 1; fi
  echo "SKIP: model $model missing (tools/fetch-model.sh)"
  exit 77
fi
id=$$
ns_d=sc-remote-d-$id
ns_e=sc-remote-e-$id
if [ "$(id -u)" -ne 0 ] || ! ip netns add "$ns_d" 2>/dev/null; then
  echo "SKIP: network namespaces unavailable here (needs root and 'ip netns add'); the loopback tests in service_remote_test cover the protocol"
  exit 77
fi
dir=$(mktemp -d /tmp/specache-netns-XXXXXX)
daemon_pid=""
cleanup() {
  [ -n "$daemon_pid" ] && kill -9 "$daemon_pid" 2>/dev/null || true
  ip netns del "$ns_d" 2>/dev/null || true
  ip netns del "$ns_e" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
ip netns add "$ns_e"
# A /30 from the id, so concurrent runs do not clash.
net=$((id % 250 + 1))
ip link add "vd$id" type veth peer name "ve$id"
ip link set "vd$id" netns "$ns_d"
ip link set "ve$id" netns "$ns_e"
ip -n "$ns_d" addr add "10.218.$net.1/30" dev "vd$id"
ip -n "$ns_e" addr add "10.218.$net.2/30" dev "ve$id"
for ns in "$ns_d" "$ns_e"; do
  ip -n "$ns" link set lo up
done
ip -n "$ns_d" link set "vd$id" up
ip -n "$ns_e" link set "ve$id" up
host=10.218.$net.1

# Certificates (the daemon's names its veth address) and the tenant's secret.
(cd "$dir" &&
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -subj /CN=netns-ca -days 1 -out ca.pem 2>/dev/null &&
  openssl req -newkey rsa:2048 -nodes -keyout server.key -subj /CN=kv-host -out server.csr 2>/dev/null &&
  echo "subjectAltName=IP:$host" > san.ext &&
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out server.pem -extfile san.ext 2>/dev/null)
echo "netns-test-secret-0123456789" > "$dir/default.secret"
chmod 600 "$dir/default.secret"
cat > "$dir/specached.toml" <<EOF
pool_bytes = "512MiB"
chunk_bytes = "16MiB"
lock_memory = false
metrics_addr = ""
[tenants.default]
quota_bytes = "512MiB"
remote_secret_file = "$dir/default.secret"
[remote]
control_addr = "$host:7700"
data_addr = "$host:7701"
tls_cert = "$dir/server.pem"
tls_key = "$dir/server.key"
rma = true
EOF

start_daemon() {
  # UCX over the veth: TCP (sockcm for the connection setup).
  ip netns exec "$ns_d" env UCX_TLS=tcp "$specached" --socket "$dir/control.sock" --config "$dir/specached.toml" \
    --log-level info 2>>"$dir/specached.log" &
  daemon_pid=$!
  for _ in $(seq 100); do
    grep -q "remote: control plane" "$dir/specached.log" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "FAIL: specached did not come up"; cat "$dir/specached.log"; exit 1
}

prompt="Name three colours of the rainbow."
common=(generate --model "$model" --prompt "$prompt" --max-tokens 24 --json --backend cpu)
remote_env=(env UCX_TLS=tcp SPECACHE_TLS_CA="$dir/ca.pem" SPECACHE_TENANT=default
            SPECACHE_SECRET_FILE="$dir/default.secret" SPECACHE_REMOTE_DEADLINE_MS=2000)
output_of() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["output"])'; }

start_daemon
local_out=$("$run" "${common[@]}" | output_of)
for method in gather gets; do
  remote_json=$(ip netns exec "$ns_e" "${remote_env[@]}" SPECACHE_FETCH_METHOD=$method "$run" "${common[@]}" \
                --daemon "tcp://$host:7700")
  remote_out=$(echo "$remote_json" | output_of)
  if [ "$remote_out" != "$local_out" ]; then
    echo "FAIL: $method: remote output differs from the local path"; echo "local:  $local_out"; echo "remote: $remote_out"
    exit 1
  fi
  echo "$remote_json" | grep -q '"kv_memory":"remote daemon"' || { echo "FAIL: $method run did not use the remote daemon"; exit 1; }
  echo "ok: $method: remote output identical to local ($(echo "$local_out" | wc -w) words)"
done

stats=$(ip netns exec "$ns_e" "${remote_env[@]}" "$ctl" --socket "tcp://$host:7700" stats --json)
echo "$stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); assert [t["tenant"] for t in s["tenants"]] == ["default"], s' ||
  { echo "FAIL: specachectl stats over tcp://: $stats"; exit 1; }
echo "ok: specachectl stats over tcp:// shows the tenant"

# SIGKILL mid-decode: a long generation, the daemon killed once decoding runs.
ip netns exec "$ns_e" "${remote_env[@]}" "$run" generate --model "$model" --prompt "$prompt" --max-tokens 2000 \
  --backend cpu --daemon "tcp://$host:7700" >"$dir/long.out" 2>"$dir/long.err" &
engine=$!
for _ in $(seq 300); do
  [ -s "$dir/long.out" ] && break  # the first generated text is out: decoding
  sleep 0.05
done
kill -9 "$daemon_pid"
killed_at=$(date +%s.%N)
wait "$daemon_pid" 2>/dev/null || true
daemon_pid=""
set +e
wait "$engine"
code=$?
set -e
took=$(python3 -c "import time; print(round(time.time() - $killed_at, 2))")
if [ "$code" -ge 128 ] || [ "$code" -eq 0 ]; then
  echo "FAIL: engine exit status $code after the daemon was killed (want an error exit, not a crash or success)"
  cat "$dir/long.err"; exit 1
fi
if python3 -c "import sys; sys.exit(0 if $took < 4.0 else 1)"; then :; else
  echo "FAIL: the engine took ${took}s to report the dead daemon (deadline 2 s)"; exit 1
fi
grep -q "remote daemon" "$dir/long.err" || { echo "FAIL: the error does not name the remote daemon"; cat "$dir/long.err"; exit 1; }
echo "ok: daemon killed mid-decode: engine exited $code after ${took}s: $(grep -m1 'remote daemon' "$dir/long.err" | cut -c1-160)"

# Restarted: a new session works and gives the same output.
start_daemon
again=$(ip netns exec "$ns_e" "${remote_env[@]}" "$run" "${common[@]}" --daemon "tcp://$host:7700" | output_of)
[ "$again" = "$local_out" ] || { echo "FAIL: output after the restart differs"; exit 1; }
echo "ok: after the restart a new session gives the same output"
