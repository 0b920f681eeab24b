#!/usr/bin/env bash
# On the GPU machine (CUDA, CMake, python3 with PyTorch, transformers, nanobind, pytest; no
# network, none of the service's Debian packages): builds the specache Python package with CUDA
# (the agent only: no Client/Session/DaemonSource there), runs the pytest tests marked `gpu`
# (SPECACHE_REQUIRE_GPU semantics: a missing device fails) and the decode benchmark of
# specache.transformers.generate next to the model's own generate (batch 8, 8K context).
#
#   bash python/gpu/run.sh            # results under $OUT (or gpu-out/): pytest.log, decode_8k_b8.json
#
# What it needs carried (paths ignored by git; python/gpu/prepare.sh makes them on a machine with
# PyPI): .whl/ with the `gguf` wheel (transformers' GGUF loader; not in the GPU image), and the
# model, either as models/SmolLM2-135M-Instruct.Q4_1.gguf or as .carry/model.part-* pieces (each
# below the 64 MiB a call may carry; the pieces of earlier calls stay on a warm machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/specache-site.XXXXXX)  # a fixed path another user could make first
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi

model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$model" ] && compgen -G ".carry/model.part-*" >/dev/null; then
  mkdir -p models
  cat .carry/model.part-* > "$model.tmp" && mv "$model.tmp" "$model"
fi
if [ -s "$model" ]; then
  sha256sum "$model" | tee "$out/model.sha256"
else
  echo "run.sh: $model missing: the model tests will fail, the benchmark uses random weights" >&2
fi

"$py" - <<'PY' | tee "$out/environment.txt"
import sys, sysconfig, torch, transformers, nanobind
print("python", sys.version.split()[0], "headers", sysconfig.get_paths()["include"])
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("transformers", transformers.__version__, "nanobind", nanobind.__version__)
PY

build=build-gpu-py
cmake -S . -B "$build" -G Ninja -DSPECACHE_PYTHON=ON -DSPECACHE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DSPECACHE_BUILD_TESTS=OFF -DSPECACHE_RUN=OFF -DSPECACHE_SERVICE_MODE=OFF \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DPython_EXECUTABLE="$(command -v "$py")" > "$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target specache_core specache_python_files specache_core_stub \
  > "$out/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$out/build.log" | head -60; exit 1; }
export PYTHONPATH=$PWD/$build/python:$PWD/python/tests${PYTHONPATH:+:$PYTHONPATH}
"$py" -c "import specache; assert specache.has_cuda; print('specache', specache.__version__, 'cuda', specache.has_cuda)"

status=0
"$py" -m pytest -m gpu -v -p no:cacheprovider python/tests 2>&1 | tee "$out/pytest.log" || status=1
"$py" python/gpu/bench_decode.py --model "$model" --batch 8 --context 8192 --new-tokens 64 \
  --json "$out/decode_8k_b8.json" 2>&1 | tee "$out/bench.log" || status=1
exit $status
