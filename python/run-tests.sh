#!/usr/bin/env bash
# The Python package's tests (pytest, python/tests), run by tools/run-tests after the CTest suites.
# Makes a virtual environment (SPECACHE_VENV, default .venv), installs into it from PyPI what the
# tests need (NumPy, pytest, the build backend, and PyTorch, transformers, gguf and accelerate for
# specache.transformers), installs the package with `pip install .` (the CMake build is kept in
# build-py/, so a second run rebuilds only what changed) and runs every test not marked `gpu`
# (those run on the GPU machine: python/gpu/run.sh). A missing dependency fails; nothing skips.
# The tests also use the ordinary build's specache-agent-replay and specache-run (BUILD_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SPECACHE_VENV:-.venv}
build_dir=${BUILD_DIR:-build}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py=$(cd "$venv" && pwd)/bin/python
# One pip call that finds everything present costs a few seconds; the first one downloads
# PyTorch (about 3 GB of wheels from PyPI, measured at 65 s download + 164 s install).
"$py" -m pip install -q --disable-pip-version-check scikit-build-core nanobind numpy pytest \
  torch transformers gguf accelerate
werror=OFF
if [ "${SPECACHE_WERROR:-${CI:+1}}" = "1" ]; then werror=ON; fi
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation \
  --config-settings=cmake.define.SPECACHE_WERROR="$werror" .
# Imported from the installed package, not from the source tree.
(cd /tmp && "$py" -c "import specache, specache.transformers; print('specache', specache.__version__, 'from', specache.__file__)")
SPECACHE_BUILD_DIR="$build_dir" "$py" -m pytest -m "not gpu" -p no:cacheprovider python/tests "$@"
