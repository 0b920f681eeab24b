#!/usr/bin/env bash
# Several engine processes sharing one specached: each prompt is first decoded by an
# engine alone, then all engines decode at once (engine i on GPU i mod the --gpus list); the
# outputs must be identical, and the decode rates are compared. Writes summary.json and prints a
# table. Run from the repository root after tools/setup.sh.
#
#   tools/multi-engine-check.sh [--engines N] [--backend auto|cpu|cuda] [--gpus 0,1]
#                               [--max-tokens M] [--prompt-chars C] [--threads T] [--out DIR]
#
# The reference engine's dense layers run on the CPU (OpenBLAS, every core by default), so engines
# that share a host also share its cores: --threads T gives each engine T BLAS/OpenMP threads, the
# same alone and together, so that the comparison shows the shared daemon, memory and PCIe rather
# than oversubscribed cores.
#
# Binaries come from build/ unless SPECACHED, SPECACHE_RUN, SPECACHECTL name other commands (on
# the GPU machine: SPECACHED=".bundle/run specached", and so on); MODEL overrides the model path.
set -Eeuo pipefail
trap 'echo "multi-engine-check: failed at line $LINENO" >&2' ERR
engines=2 backend=auto gpus="" max_tokens=48 prompt_chars=6000 threads="" out=""
while [ $# -gt 0 ]; do
  case $1 in
    --engines) engines=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;;
    --prompt-chars) prompt_chars=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: $0 [--engines N] [--backend B] [--gpus 0,1] [--max-tokens M] [--prompt-chars C] [--threads T] [--out DIR]" >&2; exit 2 ;;
  esac
done
specached=${SPECACHED:-build/daemon/specached}
run=${SPECACHE_RUN:-build/tools/specache-run}
ctl=${SPECACHECTL:-build/tools/specachectl}
model=${MODEL:-$(tools/fetch-model.sh)}
text=$(dirname "$0")/data/gpl-3.0.txt
[ -f "$text" ] || { echo "multi-engine-check: $text is missing (the prompts' text)" >&2; exit 2; }
if [ $((engines * prompt_chars)) -gt "$(stat -c %s "$text")" ]; then
  echo "multi-engine-check: $engines prompts of $prompt_chars characters are more than $text holds" >&2; exit 2
fi
dir=$(mktemp -d)
out=${out:-$(mktemp -d /tmp/multi-engine-check.XXXXXX)}  # kept: the results
mkdir -p "$out"
trap 'kill $daemon 2>/dev/null || true; rm -rf "$dir"' EXIT
$specached --socket "$dir/control.sock" --pool-bytes 2GiB --metrics-addr off --no-lock --log-level warn &
daemon=$!
for _ in $(seq 100); do [ -S "$dir/control.sock.attach" ] && break; sleep 0.1; done

IFS=, read -r -a gpu_list <<< "$gpus"
# Engine i reads a different slice of the text, then answers one question about it.
prompt() {
  # (no pipe: under pipefail a writer cut off by `head` would fail the script now and then)
  dd if="$text" of="$out/prompt-$1.txt" bs="$prompt_chars" skip="$1" count=1 status=none
  printf '\n\nIn two sentences, what does the text above say?\n' >> "$out/prompt-$1.txt"
}
engine() {  # engine INDEX TAG
  local env=(env)
  if [ ${#gpu_list[@]} -gt 0 ]; then env+=(CUDA_VISIBLE_DEVICES="${gpu_list[$(($1 % ${#gpu_list[@]}))]}"); fi
  if [ -n "$threads" ]; then env+=(OPENBLAS_NUM_THREADS="$threads" OMP_NUM_THREADS="$threads"); fi
  "${env[@]}" $run generate --model "$model" --daemon "$dir/control.sock" --backend "$backend" --kv specache --bits 1 \
    --max-tokens "$max_tokens" --prompt-file "$out/prompt-$1.txt" --json > "$out/engine-$1-$2.json"
}
for i in $(seq 0 $((engines - 1))); do prompt "$i"; done
for i in $(seq 0 $((engines - 1))); do engine "$i" alone; done
pids=()
for i in $(seq 0 $((engines - 1))); do engine "$i" together & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
$ctl --socket "$dir/control.sock" stats --json > "$out/daemon-stats.json"

python3 - "$out" "$engines" "$threads" <<'PY'
import json, sys
out, n, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows, same = [], True
for i in range(n):
    alone = json.load(open(f"{out}/engine-{i}-alone.json"))
    together = json.load(open(f"{out}/engine-{i}-together.json"))
    equal = alone["output"] == together["output"]
    same &= equal
    rows.append({"engine": i, "backend": together.get("backend"), "prompt_tokens": together["prompt_tokens"],
                 "generated_tokens": together["generated_tokens"], "same_output": equal,
                 "decode_tokens_per_s_alone": alone["decode_tokens_per_s"],
                 "decode_tokens_per_s_together": together["decode_tokens_per_s"]})
summary = {"engines": n, "threads_per_engine": int(threads) if threads else None, "all_outputs_identical": same, "per_engine": rows,
           "sum_tokens_per_s_alone": sum(r["decode_tokens_per_s_alone"] for r in rows),
           "sum_tokens_per_s_together": sum(r["decode_tokens_per_s_together"] for r in rows)}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"{'engine':>6} {'backend':>8} {'prompt':>7} {'tokens':>7} {'same':>5} {'tok/s alone':>12} {'tok/s together':>15}")
for r in rows:
    print(f"{r['engine']:>6} {str(r['backend']):>8} {r['prompt_tokens']:>7} {r['generated_tokens']:>7} "
          f"{'yes' if r['same_output'] else 'NO':>5} {r['decode_tokens_per_s_alone']:>12.2f} "
          f"{r['decode_tokens_per_s_together']:>15.2f}")
print(f"outputs identical: {same}; sum of rates alone {summary['sum_tokens_per_s_alone']:.2f}, "
      f"together {summary['sum_tokens_per_s_together']:.2f} tok/s")
sys.exit(0 if same else 1)
PY
echo "multi-engine-check: results in $out"
