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
"$NVCC" -O2 -o "$out/ptxload" "$here/ptxload.c" -lcuda
"$NVCC" -ptx -arch=sm_90 -o "$out/vecadd.ptx" "$here/vecadd_kernel.cu"
cp "$here/train.py" "$out/train.py"
echo "workloads built in $out"
