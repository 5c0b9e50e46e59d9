#!/usr/bin/env bash
# Compile the GPU workloads with nvcc into OUTDIR (default ./bin). Needs CUDA (nvcc) on this host.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/bin}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "build.sh: nvcc not found (set NVCC or install CUDA)" >&2; exit 1; }
# Default: the first GPU's own architecture as sm_XY, which embeds both its SASS and its PTX
# (-arch=native would embed SASS only, leaving the shim no PTX to capture).
if [ -z "${ARCH:-}" ]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
  ARCH=${cc:+sm_$cc}
  ARCH=${ARCH:-native}
fi
mkdir -p "$out"
"$NVCC" -O2 -arch="$ARCH" -o "$out/counter" "$here/counter.cu"
"$NVCC" -O2 -arch="$ARCH" -o "$out/longkernel" "$here/longkernel.cu"
"$NVCC" -O2 -arch="$ARCH" -o "$out/twogpu" "$here/twogpu.cu"
# longgrid/hazards (many-block kernels for block-granular twins): explicit -gencode, always sm_90
# SASS + compute_90 PTX (the shim instruments the PTX), plus the host GPU's own SASS + PTX when
# ARCH names another sm_XY.
gencode=(-gencode "arch=compute_90,code=sm_90" -gencode "arch=compute_90,code=compute_90")
if [[ $ARCH == sm_* && $ARCH != sm_90 ]]; then
  cc=${ARCH#sm_}
  gencode+=(-gencode "arch=compute_$cc,code=sm_$cc" -gencode "arch=compute_$cc,code=compute_$cc")
fi
"$NVCC" -O2 "${gencode[@]}" -o "$out/longgrid" "$here/longgrid.cu"
"$NVCC" -O2 "${gencode[@]}" -o "$out/hazards" "$here/hazards.cu" -lpthread
"$NVCC" -O2 -o "$out/ptxload" "$here/ptxload.c" -lcuda
"$NVCC" -O2 -arch="$ARCH" -o "$out/vmmhold" "$here/vmmhold.cu" -lcuda
"$NVCC" -ptx -arch=sm_90 -o "$out/vecadd.ptx" "$here/vecadd_kernel.cu"
cp "$here"/*.py "$out/"
echo "workloads built in $out"
