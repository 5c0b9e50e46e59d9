#!/usr/bin/env bash
# install-nvcc12.sh — a CUDA 12.4 nvcc toolchain on this machine, without a GPU and without CUDA.
#
# The GPU hosts carry CUDA 13 only, but the shim must also handle apps built against CUDA 12
# (cudart 12.x resolves the driver differently). This script assembles a relocatable CUDA 12.4
# toolkit from Debian trixie's packages (the same private apt list install-ptxas.sh uses; the
# system's sources are never touched): nvcc, cicc, ptxas, fatbinary, nvlink from
# nvidia-cuda-toolkit; headers, libcudart_static.a and libcudart.so from nvidia-cuda-dev and
# libcudart12. Only those files are unpacked (nvidia-cuda-dev is a 0.9 GB download, kept in the
# cache). Host compiler: the system's g++ (12 on Debian 12, which nvcc 12.4 supports).
#
# Usage: scripts/install-nvcc12.sh            prints the toolkit's nvcc path as its last line
# Environment: PTXMIG_CACHE (default /var/cache/ptxmig).
# Build the workloads with it:  NVCC=$(scripts/install-nvcc12.sh | tail -n1) ARCH=sm_90 \
#                                 testdata/workloads/build.sh OUTDIR
set -euo pipefail

CACHE=${PTXMIG_CACHE:-/var/cache/ptxmig}
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "install-nvcc12: error: $*" >&2; exit 1; }
log() { echo "install-nvcc12: $*" >&2; }
case "${1:-}" in -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; "") ;; *) die "unknown argument: $1 (see --help)" ;; esac

tk=$CACHE/cuda12/toolkit
if [ -x "$tk/bin/nvcc" ] && [ -f "$tk/lib64/stubs/libcuda.so" ] && [ -e "$tk/lib64/libcudart.so" ] && "$tk/bin/nvcc" --version >/dev/null 2>&1; then
  echo "$tk/bin/nvcc"; exit 0
fi
command -v g++ >/dev/null || die "g++ is needed as nvcc's host compiler (apt-get install g++)"

# nvidia-cuda-toolkit (nvcc & co.) is what install-ptxas.sh unpacks; force its download when the
# ptxas in use came from a CUDA installation instead.
root=$CACHE/ptxas/root
if [ ! -x "$root/usr/lib/nvidia-cuda-toolkit/bin/nvcc" ]; then
  PTXMIG_CACHE=$CACHE "$here/install-ptxas.sh" --force-download --prefix "$CACHE/cuda12/unused" >/dev/null
fi
[ -x "$root/usr/lib/nvidia-cuda-toolkit/bin/nvcc" ] || die "nvidia-cuda-toolkit unpacked without nvcc"

apt=$CACHE/ptxas/apt
opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::Archives=$apt/archives"
      -o APT::Architecture=amd64 -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
debs=$CACHE/cuda12/debs
mkdir -p "$debs"
for pkg in nvidia-cuda-dev libcudart12; do
  if ! ls "$debs/${pkg}"_*.deb >/dev/null 2>&1; then
    log "downloading $pkg"
    (cd "$debs" && apt-get "${opts[@]}" -qq download "$pkg" >/dev/null) || die "apt-get download $pkg failed"
  fi
done

rm -rf "$tk.tmp"
mkdir -p "$tk.tmp/bin" "$tk.tmp/nvvm/libdevice" "$tk.tmp/lib64/stubs"
x=$tk.tmp/x
mkdir -p "$x"
dev_debs=("$debs"/nvidia-cuda-dev_*.deb) rt_debs=("$debs"/libcudart12_*.deb)
dpkg-deb --fsys-tarfile "${dev_debs[0]}" \
  | tar -x -C "$x" --wildcards './usr/include/*' './usr/lib/x86_64-linux-gnu/libcudart_static.a' \
      './usr/lib/x86_64-linux-gnu/libcudadevrt.a' './usr/lib/x86_64-linux-gnu/libculibos.a' \
      './usr/lib/x86_64-linux-gnu/stubs/libcuda.so' \
  || die "unpacking nvidia-cuda-dev failed"
dpkg -x "${rt_debs[0]}" "$x" || die "unpacking libcudart12 failed"
mv "$x/usr/include" "$tk.tmp/include"
cp -a "$x"/usr/lib/x86_64-linux-gnu/libcudart* "$x"/usr/lib/x86_64-linux-gnu/libcudadevrt.a \
  "$x"/usr/lib/x86_64-linux-gnu/libculibos.a "$tk.tmp/lib64/"
cp "$x/usr/lib/x86_64-linux-gnu/stubs/libcuda.so" "$tk.tmp/lib64/stubs/"  # link-time only (-lcuda)
ln -sfn libcudart.so.12 "$tk.tmp/lib64/libcudart.so"                         # for -cudart shared
rm -rf "$x"
tb=$root/usr/lib/nvidia-cuda-toolkit
for f in nvcc cicc crt; do ln -s "$tb/bin/$f" "$tk.tmp/bin/$f"; done
for f in ptxas fatbinary nvlink cudafe++ bin2c nvprune cuobjdump; do ln -s "$root/usr/bin/$f" "$tk.tmp/bin/$f"; done
ln -s "$tb/libdevice/libdevice.10.bc" "$tk.tmp/nvvm/libdevice/libdevice.10.bc"
# nvcc reads nvcc.profile next to its binary (symlinks resolved), so the profile goes next to a
# copy of the binary instead of the symlink.
rm "$tk.tmp/bin/nvcc"; cp "$tb/bin/nvcc" "$tk.tmp/bin/nvcc"
cat >"$tk.tmp/bin/nvcc.profile" <<'PROFILE'
TOP                = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH              += $(_HERE_):
INCLUDES          += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES         =+ $(_SPACE_) "-L$(TOP)/lib64" "-L$(TOP)/lib64/stubs"
PROFILE
rm -rf "$tk"; mv "$tk.tmp" "$tk"
"$tk/bin/nvcc" --version >/dev/null 2>&1 || die "$tk/bin/nvcc does not run"
log "$("$tk/bin/nvcc" --version | tail -n 2 | head -n 1) in $tk"
echo "$tk/bin/nvcc"
