#!/usr/bin/env bash
# gen.sh — regenerate the nvcc 12.4 PTX of this corpus (commit the output).
#
#   ptxstate/testdata/nvcc12/gen.sh     # NAME.sm_90.ptx for every NAME.cu, and NAME.sm_80.ptx
#                                       # where it differs from the sm_90 PTX beyond .target
#
# The sources are written for this corpus (no third-party code) and need nothing beyond the
# CUDA headers of scripts/install-nvcc12.sh (no libcu++, CUB, Thrust or cuRAND), which is the
# default compiler: NVCC overrides it. Unlike ../corpus (nvcc 13, ISA 9.0), these files are ISA 8.4,
# which the local ptxas 12.4 assembles without lowering. Fails loudly on any nvcc error or a
# missing/empty output.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-$(../../../scripts/install-nvcc12.sh | tail -n 1)}
[ -x "$NVCC" ] || { echo "gen.sh: nvcc not found (set NVCC)" >&2; exit 1; }
"$NVCC" --version | tail -n 2
n=0
for cu in *.cu; do
  name=${cu%.cu}
  for arch in sm_90 sm_80; do
    "$NVCC" -ptx -arch=$arch -o "$name.$arch.ptx" "$cu" || { echo "gen.sh: nvcc failed on $cu ($arch)" >&2; exit 1; }
    [ -s "$name.$arch.ptx" ] || { echo "gen.sh: $name.$arch.ptx is empty" >&2; exit 1; }
  done
  if cmp -s <(grep -v '^\.target' "$name.sm_80.ptx") <(grep -v '^\.target' "$name.sm_90.ptx"); then
    rm "$name.sm_80.ptx" # the tests assemble the sm_90 file for sm_80 as well
  fi
  n=$((n + 1))
done
echo "gen.sh: compiled $n sources with $("$NVCC" --version | grep -o 'release [0-9.]*'): $(find . -maxdepth 1 -name "*.ptx" | wc -l) PTX files"
