#!/usr/bin/env bash
# A/B of one kernel change in one device call: specache-bench built here with a patch applied to
# some of the agent library's own sources (gpu_agent/src/**/*.cu or .cc; not headers, whose
# includers the script does not know), the rest of the library as the build has it. The variants
# travel in one archive beside the bundle (tools/bench/gpu_agent_checks.sh bundle), each as
# `specache-bench-NAME` in its bin/, so that on the GPU machine, after both are unpacked,
#   .bundle/agent/run specache-bench-NAME attend ...
# runs a variant with the bundle's libraries.
#
#   tools/bench/kernel_variant.sh NAME [PATCH]   # build variant NAME (no PATCH: the build's own
#                                                # sources, compiled the same way: the baseline)
#   tools/bench/kernel_variant.sh pack           # .bundle/variants.tar.xz of every variant built
#
# Every variant, the baseline included, compiles its patched files for sm_90 alone (the devices
# that run it); compare variants with each other, not with the bundle's specache-bench. Each
# file's ptxas report (registers, spills) is kept beside the variant: .bundle/variants/NAME/.
# BUILD_DIR (default build) is a configured build whose specache-bench is current.
set -euo pipefail
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
  done
  tar -C "$staging" -cf - agent | xz -T2 -6 > .bundle/variants.tar.xz
  ls -la .bundle/variants.tar.xz
  exit 0
fi

patch_file=${2:-}
[[ $name =~ ^[A-Za-z0-9_]+$ ]] || { echo "kernel_variant.sh: NAME is letters, digits and _" >&2; exit 2; }
[ -z "$patch_file" ] || [ -f "$patch_file" ] || { echo "kernel_variant.sh: no patch $patch_file" >&2; exit 2; }
out=$variants/$name
rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The files to rebuild: the patch's (paths relative to the repository, as `git diff` writes them),
# or for the baseline the two kernels most variants touch.
if [ -n "$patch_file" ]; then
  mapfile -t files < <(git apply --numstat "$patch_file" | cut -f3)
else
  files=(gpu_agent/src/cuda/lowbit_decode.cu gpu_agent/src/cuda/topk.cu)
fi
for f in "${files[@]}"; do
  [[ $f =~ ^gpu_agent/src/.*\.(cu|cc)$ ]] || { echo "kernel_variant.sh: $f is not a source of the agent library" >&2; exit 2; }
  mkdir -p "$work/$(dirname "$f")"
  cp "$f" "$work/$f"
done
if [ -n "$patch_file" ]; then
  patch_path=$(realpath "$patch_file")
  (cd "$work" && patch -s -p1 < "$patch_path") || { echo "kernel_variant.sh: $patch_file does not apply" >&2; exit 1; }
fi

lib=$out/libspecache_agent.a
cp "$build/gpu_agent/libspecache_agent.a" "$lib"
for f in "${files[@]}"; do
  base=$(basename "$f")
  obj=gpu_agent/CMakeFiles/specache_agent.dir/${f#gpu_agent/}.o
  cmd=$(cd "$build" && ninja -t commands "$obj" | tail -1)
  [ -n "$cmd" ] || { echo "kernel_variant.sh: $build has no rule for $obj" >&2; exit 2; }
  # sm_90 alone, no ccache, no dependency file; the patched copy compiled with the original's
  # directory on the include path (its quoted includes), into the variant's directory.
  cmd=${cmd//--generate-code=arch=compute_80,code=\[compute_80,sm_80\] /}
  cmd=${cmd/\/usr\/bin\/ccache /}
  cmd=${cmd/ -MD -MT $obj -MF $obj.d/}
  cmd=${cmd/ -o $obj/ -o $root/$out/$base.o}
  cmd=${cmd/ $root\/$f / -I$root/$(dirname "$f") $work/$f }
  ptxas=
  [[ $f == *.cu ]] && ptxas="-Xptxas -v"
  (cd "$build" && eval "$cmd $ptxas") > "$out/$base.ptxas.txt" 2>&1 || { cat "$out/$base.ptxas.txt" >&2; exit 1; }
  (cd "$out" && ar r libspecache_agent.a "$base.o")
done
link=$(cd "$build" && ninja -t commands tools/specache-bench | tail -1)
link=${link//gpu_agent\/libspecache_agent.a/$root/$lib}
link=${link/-o tools\/specache-bench/-o $root/$out/specache-bench}
(cd "$build" && eval "$link")
echo "kernel_variant.sh: $out/specache-bench (${files[*]})"
