#!/usr/bin/env bash
# install-criu.sh — make a working CRIU (>= 4.2.1) available to ptxmig.
#
# Uses the system's criu when `criu --version` is >= 4.2.1 and `criu check` passes. Otherwise builds
# CRIU 4.2.1 from Debian's source tarball (sha256-verified, cached) and installs it to
# $PREFIX/sbin/criu. Debian 12's own criu 3.17 fails `criu check` on kernel 6.x; CRIU 4.1.1 cannot
# dump an INET socket on Linux >= 6.16 and hangs where ptrace hardware breakpoints do not fire
# (docs/PLATFORM.md); 4.2 fixed both, hence the build.
#
# Usage: scripts/install-criu.sh [--bundle DIR] [--prefix DIR] [--force-build]
#   --bundle DIR   also write a relocatable copy (criu, its non-libc shared libraries, and a
#                  wrapper `DIR/criu` that sets LD_LIBRARY_PATH) to carry to a host without packages
#   --prefix DIR   install prefix for a built CRIU (default: $PREFIX or /usr/local)
#   --force-build  build even when a suitable criu is already installed
# Environment: PTXMIG_CACHE (default /var/cache/ptxmig) holds the tarball and the build.
# Prints the path of the criu it settled on as its last line.
set -euo pipefail

CRIU_VERSION=4.2.1
CRIU_TARBALL=criu_${CRIU_VERSION}.orig.tar.xz
CRIU_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
CRIU_URL=http://deb.debian.org/debian/pool/main/c/criu/${CRIU_TARBALL}
BUILD_DEPS=(build-essential libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
  python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev
  uuid-dev pkg-config iproute2 xz-utils curl ca-certificates)

PREFIX=${PREFIX:-/usr/local}
CACHE=${PTXMIG_CACHE:-/var/cache/ptxmig}
BUNDLE=""
FORCE=0

die() { echo "install-criu: error: $*" >&2; exit 1; }
log() { echo "install-criu: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=${2:?--bundle needs a directory}; shift 2 ;;
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --force-build) FORCE=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

# criu_ok BIN: version >= CRIU_VERSION and `criu check` passes.
criu_ok() {
  local bin=$1 ver
  [ -x "$bin" ] || return 1
  ver=$("$bin" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
  [ -n "$ver" ] || return 1
  if [ "$(printf '%s\n%s\n' "$CRIU_VERSION" "$ver" | sort -V | head -n1)" != "$CRIU_VERSION" ]; then
    log "$bin is version $ver (< $CRIU_VERSION)"
    return 1
  fi
  if ! "$bin" check >/dev/null 2>&1; then
    log "$bin $ver fails 'criu check'"
    return 1
  fi
  return 0
}

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "need root to install build dependencies: ${missing[*]}"
  log "installing build dependencies: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get -qq update >/dev/null || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

fetch_tarball() {
  local dst=$CACHE/$CRIU_TARBALL
  if [ -f "$dst" ] && echo "$CRIU_SHA256  $dst" | sha256sum -c --status; then return 0; fi
  log "downloading $CRIU_URL"
  curl -fsSL --retry 3 -o "$dst.part" "$CRIU_URL" || die "download of $CRIU_URL failed"
  echo "$CRIU_SHA256  $dst.part" | sha256sum -c --status \
    || { rm -f "$dst.part"; die "sha256 mismatch for $CRIU_TARBALL (expected $CRIU_SHA256)"; }
  mv "$dst.part" "$dst"
}

build_criu() {
  local src=$CACHE/criu-$CRIU_VERSION
  if [ -x "$src/criu/criu" ] && [ -f "$src/.ptxmig-built" ]; then
    log "using cached build in $src"
    return 0
  fi
  apt_install "${BUILD_DEPS[@]}"
  fetch_tarball
  rm -rf "$src" "$src.tmp"
  mkdir -p "$src.tmp"
  tar -xJf "$CACHE/$CRIU_TARBALL" -C "$src.tmp" --strip-components=1 || die "unpacking $CRIU_TARBALL failed"
  mv "$src.tmp" "$src"
  log "building CRIU $CRIU_VERSION (make criu, ~30 s on 2 cores)"
  if ! make -C "$src" -j"$(nproc)" criu >"$src/build.log" 2>&1; then
    tail -n 30 "$src/build.log" >&2
    die "CRIU build failed; full log in $src/build.log"
  fi
  touch "$src/.ptxmig-built"
}

write_bundle() {
  local bin=$1 dir=$2
  mkdir -p "$dir/lib"
  cp -f "$bin" "$dir/criu.bin"
  # Every resolved shared library except glibc's own parts, which the target host provides.
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
      *) cp -fL "$lib" "$dir/lib/" ;;
    esac
  done
  cat >"$dir/criu" <<'WRAP'
#!/bin/sh
# Relocatable CRIU written by ptxmig's install-criu.sh: runs the bundled binary with its libraries.
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/criu.bin" "$@"
WRAP
  chmod 0755 "$dir/criu" "$dir/criu.bin"
  log "bundle written to $dir"
}

mkdir -p "$CACHE"
chosen=""
if [ "$FORCE" -eq 0 ]; then
  for cand in "$(command -v criu 2>/dev/null || true)" "$PREFIX/sbin/criu"; do
    [ -n "$cand" ] || continue
    if criu_ok "$cand"; then chosen=$cand; break; fi
  done
fi

if [ -z "$chosen" ]; then
  build_criu
  built=$CACHE/criu-$CRIU_VERSION/criu/criu
  criu_ok "$built" || die "the freshly built CRIU $CRIU_VERSION fails 'criu check' on this kernel ($(uname -r)); run '$built check' for details"
  if [ -w "$PREFIX" ] || [ "$(id -u)" -eq 0 ]; then
    install -D -m 0755 "$built" "$PREFIX/sbin/criu"
    chosen=$PREFIX/sbin/criu
  else
    log "no permission to install into $PREFIX; using $built in place"
    chosen=$built
  fi
  log "installed CRIU $CRIU_VERSION as $chosen"
fi

if [ -n "$BUNDLE" ]; then
  real=$chosen
  # A wrapper from an earlier bundle is a script; bundle the real binary behind it.
  if head -c 2 "$chosen" | grep -q '#!'; then real=$(dirname "$chosen")/criu.bin; fi
  write_bundle "$real" "$BUNDLE"
fi
echo "$chosen"
