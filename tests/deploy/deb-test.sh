#!/usr/bin/env bash
# Builds the .deb of a build (cpack -G DEB) and checks what dpkg would install from it: the
# programs in /usr/bin, libspecache_client.so.0, the CMake and pkg-config files, the unit,
# sysusers, tmpfiles and default config at the paths the unit names, the maintainer script and
# the conffile; Depends from the binaries' libraries; and systemd-analyze verify on the packaged
# unit (with ExecStart pointed at the packaged specached, since it is not in /usr/bin here).
# Usage: deb-test.sh BUILD_DIR VERSION
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: deb-test.sh BUILD_DIR VERSION" >&2; exit 2; }
build=$(readlink -f "$1")
version=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "deb-test: $*" >&2; exit 1; }

(cd "$work" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$work/out" > "$work/cpack.log" 2>&1) ||
  { cat "$work/cpack.log"; fail "cpack -G DEB failed"; }
deb=$(find "$work/out" -maxdepth 1 -name "specache_${version}_*.deb" -print -quit)
[ -n "$deb" ] || { ls "$work/out"; fail "no specache_${version}_*.deb"; }
dpkg-deb -c "$deb" | awk '{print $6}' | sed 's#^\./#/#' > "$work/contents"
for f in /usr/bin/specached /usr/bin/specachectl /usr/bin/specache-run /usr/bin/specache-bench \
         /usr/lib/libspecache_client.so.0 "/usr/lib/libspecache_client.so.$version" \
         /usr/lib/cmake/specache/specacheConfig.cmake /usr/lib/cmake/specache/specacheConfigVersion.cmake \
         /usr/lib/pkgconfig/specache.pc /usr/include/specache/agent.h /usr/include/specache/client.h \
         /usr/include/specache/version.h /usr/lib/systemd/system/specached.service \
         /usr/lib/sysusers.d/specache.conf /usr/lib/tmpfiles.d/specache.conf /etc/specache/specached.toml \
         /usr/share/doc/specache/README.md; do
  grep -qxF "$f" "$work/contents" || fail "$f is not in the package"
done
# Nothing outside /usr and /etc, and nothing from the build tree.
if grep -vE '^/(usr|etc)(/|$)|^/$' "$work/contents"; then fail "files outside /usr and /etc"; fi
[ "$(dpkg-deb -f "$deb" Version)" = "$version" ] || fail "Version is $(dpkg-deb -f "$deb" Version)"
depends=$(dpkg-deb -f "$deb" Depends)
for d in systemd libc6 libstdc++6 libgrpc; do
  [[ $depends == *"$d"* ]] || fail "Depends lacks $d: $depends"
done
dpkg-deb -e "$deb" "$work/control"
[ -x "$work/control/postinst" ] || fail "no postinst"
grep -qxF /etc/specache/specached.toml "$work/control/conffiles" || fail "the config is not a conffile"

dpkg-deb -x "$deb" "$work/root"
unit=$work/root/usr/lib/systemd/system/specached.service
grep -q '^ExecStart=/usr/bin/specached --config /etc/specache/specached.toml' "$unit" ||
  fail "the packaged unit does not name /usr/bin/specached and /etc/specache/specached.toml"
"$here/verify-unit.sh" "$unit" "$work/root/usr/bin/specached"
echo "deb-test: OK ($(basename "$deb"), $(wc -l < "$work/contents") entries)"
