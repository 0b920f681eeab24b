#!/usr/bin/env bash
# A/B of one kernel change in one device call: specache-bench built here with a patch applied to
# some of the agent library's own sources (gpu_agent/src/**/*.cu or .cc) or the GPU model's
# (tools/src/gpu/**/*.cu or .cc; not headers, whose includers the script does not know), the rest
# of each library as the build has it. The variants
# travel in one archive beside the bundle (tools/bench/gpu_agent_checks.sh bundle), each as
# `specache-bench-NAME` in its bin/, so that on the GPU machine, after both are unpacked,
#   .bundle/agent/run specache-bench-NAME attend ...
# runs a variant with the bundle's libraries, and `gpu_agent_device_test-NAME` (the device tests linked
# against the variant's agent library) or `tools_llama_kernels_test-NAME` (the GPU model's kernels'
# tests, for a variant of that library) its tests; gpu_agent_checks.sh's `variants` stage runs the
# attention's and the top-k's tests of each variant before timing them.
#
#   tools/bench/kernel_variant.sh NAME [PATCH]   # build variant NAME; without PATCH, the two kernels'
#                                                # files (lowbit_decode.cu, topk.cu; or BASE_FILES, e.g.
#                                                # gpu_agent/src/cuda/fetch.cu for a patch of that file)
#                                                # unchanged, compiled the same way: a baseline (call it v0)
#   tools/bench/kernel_variant.sh pack           # .bundle/variants.tar.xz of every variant built
#
# Every variant, a baseline included, compiles its files for sm_90 alone (the devices that run
# it); compare variants with each other, not with the bundle's specache-bench. The files are
# copied from the working tree (uncommitted edits included) and patched; the headers they include
# are the working tree's, the rest of the library the build's objects (BUILD_DIR, default build: a
# configured build whose specache-bench is current). Each file's ptxas report (registers, spills) is kept
# beside the variant: .bundle/variants/NAME/. A failed build leaves an earlier NAME as it was.
set -euo pipefail
patch_arg=${2:-}
if [ -n "$patch_arg" ]; then
  [ -f "$patch_arg" ] || { echo "kernel_variant.sh: no patch $patch_arg" >&2; exit 2; }
  patch_arg=$(realpath "$patch_arg")
fi
cd "$(dirname "$0")/../.."
root=$PWD
build=${BUILD_DIR:-build}
variants=.bundle/variants
name=${1:?usage: kernel_variant.sh NAME [PATCH] | pack}

if [ "$name" = pack ]; then
  [ -d "$variants" ] || { echo "kernel_variant.sh: no variants built" >&2; exit 2; }
  staging=$(mktemp -d)
  trap 'rm -rf "$staging"' EXIT
  mkdir -p "$staging/agent/bin"
  for d in "$variants"/*/; do
    v=$(basename "$d")
    [ -x "$d/specache-bench" ] && strip --strip-debug -o "$staging/agent/bin/specache-bench-$v" "$d/specache-bench"
    for t in gpu_agent_device_test tools_llama_kernels_test; do
      [ -x "$d/$t" ] && strip --strip-debug -o "$staging/agent/bin/$t-$v" "$d/$t"
    done
  done
  # One stream with a dictionary larger than a binary: the variants differ in a few objects, so
  # each after the first packs to little (nine benches and five test binaries: ~16 MB).
  tar -C "$staging" -cf - agent | xz -T1 --lzma2=preset=6,dict=192MiB > .bundle/variants.tar.xz
  ls -la .bundle/variants.tar.xz
  exit 0
fi

[[ $name =~ ^[A-Za-z0-9_]+$ ]] || { echo "kernel_variant.sh: NAME is letters, digits and _" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
staged=$work/out  # the variant, moved to $variants/$name once it is whole
mkdir -p "$staged"

# The files to rebuild: the patch's (paths relative to the repository, as `git diff` writes them),
# or for a baseline the two kernels most variants touch.
if [ -n "$patch_arg" ]; then
  git apply --numstat "$patch_arg" > "$work/numstat"
  mapfile -t files < <(cut -f3 "$work/numstat")
  [ "${#files[@]}" -gt 0 ] || { echo "kernel_variant.sh: the patch changes no file" >&2; exit 2; }
else
  read -r -a files <<< "${BASE_FILES:-gpu_agent/src/cuda/lowbit_decode.cu gpu_agent/src/cuda/topk.cu}"
fi
# The build's library of a source and its object there: the agent's or the GPU model's.
library_of() {
  case $1 in
    gpu_agent/src/*.cu | gpu_agent/src/*.cc) echo "gpu_agent/libspecache_agent.a gpu_agent/CMakeFiles/specache_agent.dir/${1#gpu_agent/}.o" ;;
    tools/src/gpu/*.cu | tools/src/gpu/*.cc) echo "tools/libspecache_gpu_model.a tools/CMakeFiles/specache_gpu_model.dir/${1#tools/}.o" ;;
    *) return 1 ;;
  esac
}
for f in "${files[@]}"; do
  library_of "$f" > /dev/null ||
    { echo "kernel_variant.sh: $f is not a source of the agent library or the GPU model" >&2; exit 2; }
  mkdir -p "$work/src/$(dirname "$f")"
  cp "$f" "$work/src/$f"
done
if [ -n "$patch_arg" ]; then
  (cd "$work/src" && patch -s -p1 --batch --forward < "$patch_arg") ||
    { echo "kernel_variant.sh: $patch_arg does not apply to the working tree's files" >&2; exit 1; }
fi

declare -A libs  # the build's library (path in the build) -> the variant's copy
for f in "${files[@]}"; do
  read -r built obj < <(library_of "$f")
  lib=$staged/$(basename "$built")
  if [ -z "${libs[$built]:-}" ]; then
    cp "$build/$built" "$lib"
    libs[$built]=$lib
  fi
  base=$(basename "$f")
  cmd=$(cd "$build" && ninja -t commands "$obj" 2>/dev/null | tail -1) || true
  [ -n "$cmd" ] || { echo "kernel_variant.sh: $build has no rule for $obj" >&2; exit 2; }
  # No ccache, no dependency file, sm_90 alone; the patched copy compiled with the original's
  # directory on the include path (its quoted includes), into the variant. Each rewrite is checked:
  # one that missed would compile the original, or write over the build's own object.
  cmd="$cmd "
  cmd=${cmd/\/usr\/bin\/ccache /}
  cmd=${cmd/ -MD -MT $obj -MF $obj.d / }
  cmd=$(sed -E 's/--generate-code=arch=compute_[0-9]+,code=\[[^]]*\] //g' <<< "$cmd")
  cmd=${cmd/ -o $obj / -o $staged/$base.o }
  cmd=${cmd/ $root\/$f / -I$root/$(dirname "$f") $work/src/$f }
  extra=
  [[ $f == *.cu ]] && extra="--generate-code=arch=compute_90,code=[compute_90,sm_90] -Xptxas -v"
  if [[ $cmd != *" $work/src/$f "* || $cmd != *" -o $staged/$base.o "* || $cmd == *" -o ${obj%%/*}/"* ||
        $cmd == *"generate-code"* || $cmd == *" -MF "* ]]; then
    echo "kernel_variant.sh: could not rewrite the build's command for $f:" >&2
    echo "$cmd" >&2
    exit 1
  fi
  (cd "$build" && eval "$cmd $extra") > "$staged/$base.ptxas.txt" 2>&1 || { cat "$staged/$base.ptxas.txt" >&2; exit 1; }
  (cd "$staged" && ar r "$(basename "$lib")" "$base.o")
done
# The build's link of TARGET (a path in the build) against the variant's libraries, into the
# variant; the rewrite is checked, as the compiles' are.
relink() {
  local target=$1 out=$staged/$(basename "$1") link built
  link="$(cd "$build" && ninja -t commands "$target" | tail -1) "
  for built in "${!libs[@]}"; do
    [[ $link == *" $built "* ]] || continue
    link=${link//" $built "/" ${libs[$built]} "}
    [[ $link == *" ${libs[$built]} "* ]] ||
      { echo "kernel_variant.sh: could not rewrite the build's link of $target" >&2; exit 1; }
  done
  link=${link/ -o $target / -o $out }
  [[ $link == *" -o $out "* ]] || { echo "kernel_variant.sh: could not rewrite the build's link of $target" >&2; exit 1; }
  (cd "$build" && eval "$link")
}
relink tools/specache-bench
# The device tests against the same libraries (when the build has built them), so that the
# variant's kernels are checked against their CPU references on the device before they are timed.
if [ -n "${libs[gpu_agent/libspecache_agent.a]:-}" ] && [ -x "$build/tests/gpu_agent_device_test" ]; then
  relink tests/gpu_agent_device_test
fi
if [ -n "${libs[tools/libspecache_gpu_model.a]:-}" ] && [ -x "$build/tests/tools_llama_kernels_test" ]; then
  relink tests/tools_llama_kernels_test
fi
mkdir -p "$variants"
rm -rf "${variants:?}/$name"
mv "$staged" "$variants/$name"
echo "kernel_variant.sh: $variants/$name/specache-bench (${files[*]})"
