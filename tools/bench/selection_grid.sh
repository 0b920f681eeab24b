#!/usr/bin/env bash
# Row-selection measurement on the bundled model (docs/method.md, "Choosing the rows"): the
# needle-in-a-haystack grid and teacher-forced fidelity for every selection rule, side by side with
# full precision, KIVI alone, the non-speculative baseline and the oracle bound. Writes
# OUT/selection.json and OUT/selection.md (tables), and keeps each run's own output under OUT/runs.
#
#   tools/bench/selection_grid.sh [OUT]          (default OUT: selection-out)
#
# Environment (defaults: the full measurement):
#   LENGTHS=1024,2048,4096,8000   DEPTHS=0,0.25,0.5,0.75,1   FIDELITY_CONTEXTS=4096,7168
#   EVAL_TOKENS=256   JOBS=(cores / 2)   THREADS=2 (per job)   BACKEND=cpu   MODES=(below)
#   BUILD_DIR=build   MODEL=(tools/fetch-model.sh)
# FIDELITY_CONTEXTS=none skips fidelity. BACKEND=cuda runs the agent on the GPU (the adaptive
# budget, mass=, too). About 30 minutes on 16 cores with the CPU
# backend (an estimate: 20 NIAH jobs of 15 modes, the longest at 8000 tokens, and 28 fidelity jobs).
# Every (length, depth) point and every (context, mode) fidelity run is a job of its own; JOBS of
# them run at once, each with THREADS threads.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-selection-out}
build=${BUILD_DIR:-build}
run="$build/tools/specache-run"
[ -x "$run" ] || { echo "selection_grid: build specache-run first ($run)" >&2; exit 1; }
model=${MODEL:-$(tools/fetch-model.sh)}
lengths=${LENGTHS:-1024,2048,4096,8000}
depths=${DEPTHS:-0,0.25,0.5,0.75,1}
contexts=${FIDELITY_CONTEXTS:-4096,7168}
eval_tokens=${EVAL_TOKENS:-256}
cores=$(nproc)
jobs=${JOBS:-$(( cores / 2 > 0 ? cores / 2 : 1 ))}
threads=${THREADS:-2}
backend=${BACKEND:-cpu}
# Every rule is spelled out, its row cache too (the paper's: select=spec, no-resident, k=64, 128
# rows: twice its selection), so that it stays the same whatever specache-run's defaults become;
# "specache:1" alone is the current default.
modes=${MODES:-full,kivi:1,specache:1/select=spec/no-resident/topk=64/cached-rows=128,specache:1,specache:1/select=spec/resident/cached-rows=128,specache:1/select=real/resident/no-next/cached-rows=128,specache:1/select=real/resident/next/cached-rows=128,specache:1/select=union/topk-real=32/resident/no-next/cached-rows=192,specache:1/select=union/topk-real=32/next/no-resident/cached-rows=192,specache:1/select=union/topk-real=64/resident/no-next/cached-rows=256,specache:1/select=union/topk-real=64/resident/next/cached-rows=256,specache:1/select=spec/resident/mass=0.9/k-min=16/k-max=128/cached-rows=256,specache-nonspec:1/no-resident/cached-rows=128,specache-oracle:1/no-resident/cached-rows=128,specache-oracle:1/resident/cached-rows=128}
needle="The secret password for the blue door is PINEAPPLE."
question="What is the secret password for the blue door?"

mkdir -p "$out/runs"
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
tasks="$out/runs/tasks"
: > "$tasks"
IFS=, read -ra length_list <<< "$lengths"
IFS=, read -ra depth_list <<< "$depths"
IFS=, read -ra context_list <<< "$contexts"
IFS=, read -ra mode_list <<< "$modes"
# Longest first, so the slowest jobs do not start last.
for ((i = ${#length_list[@]} - 1; i >= 0; --i)); do
  for d in "${depth_list[@]}"; do echo "niah ${length_list[i]} $d" >> "$tasks"; done
done
[ "$contexts" = none ] && context_list=()
for c in "${context_list[@]}"; do
  for m in "${mode_list[@]}"; do
    [ "$m" = full ] || echo "fidelity $c $m" >> "$tasks"
  done
done

one() {  # one task: "niah LENGTH DEPTH" or "fidelity CONTEXT MODE"
  local kind=$1 a=$2 b=$3
  if [ "$kind" = niah ]; then
    local dir="$out/runs/niah_${a}_${b}"
    mkdir -p "$dir"
    "$run" niah-grid --model "$model" --backend "$backend" --haystack tools/data/gpl-3.0.txt --needle "$needle" \
      --question "$question" --answer pineapple --lengths "$a" --depths "$b" --modes "$modes" --out-dir "$dir" \
      > "$dir/table.txt" 2> "$dir/log.txt"
  else
    local name
    name=$(printf '%s' "$b" | tr '/:=' '_-_')
    "$run" fidelity --model "$model" --backend "$backend" --text tools/data/gpl-3.0.txt --context-tokens "$a" \
      --eval-tokens "$eval_tokens" --modes "$b" --json > "$out/runs/fidelity_${a}_${name}.jsonl" \
      2> "$out/runs/fidelity_${a}_${name}.log"
  fi
  echo "selection_grid: done $kind $a $b" >&2
}
export -f one
export out run model backend modes needle question eval_tokens

start=$(date +%s)
echo "selection_grid: $(wc -l < "$tasks") jobs, $jobs at once, $threads threads each" >&2
status=0
xargs -P "$jobs" -L 1 bash -c 'one "$@"' _ < "$tasks" || status=$?  # a failed job is named in its log
echo "selection_grid: $(( $(date +%s) - start )) s" >&2
python3 tools/bench/selection_report.py "$out"
[ "$status" -eq 0 ] || { echo "selection_grid: some jobs failed (see $out/runs/*log*)" >&2; exit 1; }
