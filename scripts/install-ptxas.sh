#!/usr/bin/env bash
# install-ptxas.sh — put a real `ptxas` on this machine, even without CUDA.
#
# Uses a CUDA installation's ptxas when present (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin).
# Otherwise downloads Debian's nvidia-cuda-toolkit 12.4 package from trixie's non-free component
# with `apt-get download` through a private apt list directory (the system's sources are never
# touched), unpacks it with `dpkg -x` into the cache, and links $PREFIX/bin/ptxas to it.
# That ptxas is self-contained and assembles PTX ISA <= 8.4 for targets up to sm_90.
#
# Usage: scripts/install-ptxas.sh [--prefix DIR] [--force-download]
# Environment: PTXMIG_CACHE (default /var/cache/ptxmig). Prints the ptxas path as its last line.
set -euo pipefail

PREFIX=${PREFIX:-/usr/local}
CACHE=${PTXMIG_CACHE:-/var/cache/ptxmig}
FORCE=0
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PKG=nvidia-cuda-toolkit

die() { echo "install-ptxas: error: $*" >&2; exit 1; }
log() { echo "install-ptxas: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --force-download) FORCE=1; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

ptxas_ok() { [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }

if [ "$FORCE" -eq 0 ]; then
  for cand in "$(command -v ptxas 2>/dev/null || true)" "${CUDA_HOME:+$CUDA_HOME/bin/ptxas}" /usr/local/cuda/bin/ptxas; do
    [ -n "$cand" ] || continue
    if ptxas_ok "$cand"; then echo "$cand"; exit 0; fi
  done
fi

root=$CACHE/ptxas
unpacked=$root/root/usr/bin/ptxas
if [ "$FORCE" -eq 1 ] || ! ptxas_ok "$unpacked"; then
  apt=$root/apt
  mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$root/debs"
  cat >"$apt/sources.list" <<SRC
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main non-free
SRC
  opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::Archives=$apt/archives"
        -o APT::Architecture=amd64 -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  log "reading trixie package lists into $apt (private; system sources untouched)"
  apt-get "${opts[@]}" -qq update >/dev/null 2>"$apt/update.log" \
    || { cat "$apt/update.log" >&2; die "apt-get update for the private trixie list failed"; }
  log "downloading $PKG"
  (cd "$root/debs" && rm -f "${PKG}"_*.deb && apt-get "${opts[@]}" -qq download "$PKG" >/dev/null) \
    || die "apt-get download $PKG failed"
  debs=("$root/debs/${PKG}"_*.deb); deb=${debs[0]}
  rm -rf "$root/root.tmp"
  dpkg -x "$deb" "$root/root.tmp" || die "dpkg -x $deb failed"
  [ -x "$root/root.tmp/usr/bin/ptxas" ] || die "$deb contains no usr/bin/ptxas"
  rm -rf "$root/root"; mv "$root/root.tmp" "$root/root"
  rm -f "$deb"
fi
ptxas_ok "$unpacked" || die "$unpacked does not run on this machine"
if [ -w "$PREFIX/bin" ] || [ "$(id -u)" -eq 0 ]; then
  mkdir -p "$PREFIX/bin"
  ln -sfn "$unpacked" "$PREFIX/bin/ptxas"
  log "$("$unpacked" --version | tail -n 1) linked as $PREFIX/bin/ptxas"
  echo "$PREFIX/bin/ptxas"
else
  echo "$unpacked"
fi
