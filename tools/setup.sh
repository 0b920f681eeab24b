#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for specache and builds it: installs the Debian packages the
# build needs (only those missing, so running it again is cheap), configures CMake (with CUDA when
# nvcc is present), builds into build/ and fetches the bundled model (tools/fetch-model.sh).
# Environment: BUILD_DIR (default build), SPECACHE_CUDA (AUTO|ON|OFF, default AUTO),
# CUDA_ARCHS (default "80;90"), SPECACHE_NO_MODEL=1 to skip the model download,
# SPECACHE_WERROR=1 to make compiler warnings errors (the default when CI is set, as .ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build ccache pkg-config libgtest-dev libgmock-dev
          libopenblas-dev libcli11-dev nlohmann-json3-dev libpng-dev libfreetype-dev fonts-dejavu-core libstb-dev
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libboost-dev libspdlog-dev
          libtomlplusplus-dev libsystemd-dev prometheus-cpp-dev systemd librocksdb-dev libxxhash-dev
          libucx-dev ucx-utils iproute2 openssl libssl-dev python3-dev python3-venv python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

build_dir=${BUILD_DIR:-build}
cuda_args=()
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; }
if [ "${SPECACHE_CUDA:-AUTO}" != "OFF" ] && [ -n "$nvcc" ]; then
  cuda_args=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80;90}")
fi
werror=OFF
if [ "${SPECACHE_WERROR:-${CI:+1}}" = "1" ]; then werror=ON; fi
cmake -S . -B "$build_dir" -G Ninja -DSPECACHE_CUDA="${SPECACHE_CUDA:-AUTO}" -DSPECACHE_RUN=ON -DSPECACHE_SERVICE_MODE=ON \
      -DSPECACHE_WERROR="$werror" "${cuda_args[@]}"
cmake --build "$build_dir" -j "$(nproc)"
echo "setup: built into $build_dir"
if [ "${SPECACHE_NO_MODEL:-0}" != "1" ]; then
  echo "setup: model at $(tools/fetch-model.sh)"
fi
