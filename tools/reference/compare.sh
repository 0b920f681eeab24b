#!/usr/bin/env bash
# Builds llama-cpp-python (from PyPI, compiled here: several minutes the first time) in .venv-ref
# and compares specache-run's tokenizer and logits with llama.cpp's on the bundled model.
# Not part of CI: CI checks the golden data this writes (tests/data/smollm2_llama_cpp.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$(tools/fetch-model.sh)
[ -x build/tools/specache-run ] || tools/setup.sh
if [ ! -x .venv-ref/bin/python ] || ! .venv-ref/bin/python -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv .venv-ref
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" .venv-ref/bin/pip install --quiet \
    llama-cpp-python==0.3.36 numpy
fi
.venv-ref/bin/python tools/reference/llama_cpp_reference.py --model "$model" "$@"
