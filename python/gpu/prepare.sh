#!/usr/bin/env bash
# On a machine with PyPI (here): puts what python/gpu/run.sh needs carried to the GPU machine into
# ignored paths of the work tree: .whl/ (the `gguf` wheel, pure Python, for the GPU image's
# Python 3.12) and .carry/model.part-aa, -ab (the model in pieces under the 64 MiB per call).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .carry
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform any -d .whl gguf==0.19.0
model=$(tools/fetch-model.sh)
rm -f .carry/model.part-*
split -b 50M "$model" .carry/model.part-
ls -l .whl .carry
