#!/usr/bin/env bash
# Installs a build into a temporary prefix and uses it as someone outside the tree would:
#   1. cmake --install BUILD --prefix P: the programs, libspecache_client.so.0, the headers, the
#      CMake package, specache.pc and the system files are where docs/operations.md says;
#   2. every installed program answers --version with the project's version;
#   3. two consumers (tests/deploy/consumer) build against P, one with find_package(specache 0.1),
#      one with pkg-config, and run against the installed specached;
#   4. systemd-analyze verify passes on the installed unit (which names P's binary and config).
# Usage: install-test.sh BUILD_DIR VERSION
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: install-test.sh BUILD_DIR VERSION" >&2; exit 2; }
build=$(readlink -f "$1")
version=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
daemon=""
cleanup() {
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "install-test: $*" >&2; exit 1; }

prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" > "$work/install.log" || { cat "$work/install.log"; fail "cmake --install failed"; }
libdir=$(dirname "$(find "$prefix" -name 'libspecache_client.so.0' -print -quit)")
[ -n "$libdir" ] && [ "$libdir" != "." ] || fail "libspecache_client.so.0 not installed"
for f in bin/specached bin/specachectl bin/specache-run bin/specache-bench include/specache/agent.h \
         include/specache/client.h include/specache/status.h include/specache/version.h \
         lib/systemd/system/specached.service lib/sysusers.d/specache.conf lib/tmpfiles.d/specache.conf \
         etc/specache/specached.toml; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
for f in "$libdir/libspecache_client.so.$version" "$libdir/cmake/specache/specacheConfig.cmake" \
         "$libdir/cmake/specache/specacheConfigVersion.cmake" "$libdir/pkgconfig/specache.pc"; do
  [ -e "$f" ] || fail "$f not installed"
done
soname=$(objdump -p "$libdir/libspecache_client.so.$version" | awk '$1 == "SONAME" {print $2}')
[ "$soname" = "libspecache_client.so.0" ] || fail "SONAME is '$soname', not libspecache_client.so.0"
for program in specached specachectl specache-run specache-bench; do
  got=$("$prefix/bin/$program" --version)
  [ "$got" = "$program $version" ] || fail "$program --version says '$got'"
done

# The consumers.
cmake -S "$here/consumer" -B "$work/cmake-consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_BUILD_TYPE=Release > "$work/consumer.log" 2>&1 &&
  cmake --build "$work/cmake-consumer" >> "$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; fail "find_package consumer did not build"; }
export PKG_CONFIG_PATH="$libdir/pkgconfig"
[ "$(pkg-config --modversion specache)" = "$version" ] || fail "pkg-config --modversion specache: $(pkg-config --modversion specache)"
# shellcheck disable=SC2046  # pkg-config's flags are words
c++ -std=c++20 -o "$work/pkg-config-consumer" "$here/consumer/consumer.cc" $(pkg-config --cflags --libs specache) \
    -Wl,-rpath,"$(pkg-config --variable=libdir specache)" || fail "pkg-config consumer did not build"

mkdir "$work/run"
"$prefix/bin/specached" --socket "$work/run/control.sock" --pool-bytes 64MiB --chunk-bytes 4MiB --no-lock \
    --metrics-addr off --log-level warn &
daemon=$!
for _ in $(seq 100); do [ -S "$work/run/control.sock.attach" ] && break; sleep 0.1; done
[ -S "$work/run/control.sock.attach" ] || fail "the installed specached did not start"
"$work/cmake-consumer/consumer" "$work/run/control.sock" || fail "find_package consumer failed"
"$work/pkg-config-consumer" "$work/run/control.sock" || fail "pkg-config consumer failed"
"$prefix/bin/specachectl" --socket "$work/run/control.sock" stats | grep -q "specached $version" ||
  fail "specachectl stats does not show the daemon's version"

"$here/verify-unit.sh" "$prefix/lib/systemd/system/specached.service"
grep -q "^ExecStart=$prefix/bin/specached --config $prefix/etc/specache/specached.toml" \
  "$prefix/lib/systemd/system/specached.service" || fail "the installed unit does not name the installed binary and config"
echo "install-test: OK"
