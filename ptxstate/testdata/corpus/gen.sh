#!/usr/bin/env bash
# gen.sh — regenerate the nvcc PTX of this corpus (run on a host with nvcc 13.0; commit the output).
#
#   ptxstate/testdata/corpus/gen.sh            # writes NAME.ptx for every NAME.cu (-arch=sm_90),
#                                              # plus NAME.sm_80.ptx for the files in SM80
# Fails loudly on any nvcc error or a missing/empty output. NVCC overrides the compiler path.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "gen.sh: nvcc not found (set NVCC)" >&2; exit 1; }
"$NVCC" --version | tail -n 2
SM80="vecadd reduce"
n=0
for cu in *.cu; do
  name=${cu%.cu}
  "$NVCC" -ptx -arch=sm_90 -o "$name.ptx" "$cu" || { echo "gen.sh: nvcc failed on $cu (sm_90)" >&2; exit 1; }
  [ -s "$name.ptx" ] || { echo "gen.sh: $name.ptx is empty" >&2; exit 1; }
  n=$((n + 1))
done
for name in $SM80; do
  "$NVCC" -ptx -arch=sm_80 -o "$name.sm_80.ptx" "$name.cu" || { echo "gen.sh: nvcc failed on $name.cu (sm_80)" >&2; exit 1; }
  [ -s "$name.sm_80.ptx" ] || { echo "gen.sh: $name.sm_80.ptx is empty" >&2; exit 1; }
  n=$((n + 1))
done
echo "gen.sh: wrote $n PTX files with $("$NVCC" --version | grep -o 'release [0-9.]*')"
