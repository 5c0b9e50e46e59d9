#!/usr/bin/env bash
# gpu-bundle.sh DIR — assemble everything a GPU host needs to run ptxmig's GPU suite.
#
# The GPU host may have no Go toolchain and no network, but has the NVIDIA driver and nvcc. DIR gets:
#   ptxmig, libptxmig.so        the binaries (bin/ must be built: `make build`)
#   criu/                       a relocatable CRIU (scripts/install-criu.sh --bundle)
#   tests/*.test                `go test -c -tags gpu` binaries of every package with GPU tests
#   workloads/                  workload sources + build.sh (compiled with nvcc on the GPU host)
#   workloads-cu12/             the workloads compiled HERE with CUDA 12.4 (scripts/install-nvcc12.sh)
#                               for sm_90, static and shared cudart (+ libcudart.so.12), so the
#                               shim suite also sees CUDA 12 apps on a CUDA 13 host; skipped
#                               with a warning when that toolkit cannot be installed
#                               (PTXMIG_BUNDLE_CU12=0 skips it on purpose)
#   gputest/<area>/             script-driven GPU suites (ptxstate, shim, ...) with their sources
#   bench/                      benchmark scripts
#   samples/                    with PTXMIG_CUDA_SAMPLES=DIR (a checkout of NVIDIA/cuda-samples):
#                               the sources of the public samples bench-p2.sh builds and runs
#                               (copied from that checkout at bundle time, not kept in this repo)
#   gpu-e2e.sh                  the runner
# With --tar FILE, also packs DIR into FILE (xz) for carrying to a remote GPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
dist=${1:?usage: gpu-bundle.sh DIR [--tar FILE]}
tarfile=""
[ "${2:-}" = "--tar" ] && tarfile=${3:?--tar needs a file}
export PATH=/usr/local/go/bin:$PATH CGO_CFLAGS=${CGO_CFLAGS:--Wno-deprecated-declarations}
if [ ! -x bin/ptxmig ] || [ ! -f bin/libptxmig.so ]; then echo "gpu-bundle: build first (make build)" >&2; exit 1; fi

rm -rf "$dist"
mkdir -p "$dist/tests" "$dist/workloads" "$dist/gputest" "$dist/bench"
cp bin/ptxmig bin/libptxmig.so "$dist/"
scripts/install-criu.sh --bundle "$dist/criu" >/dev/null

# Packages whose test files carry the gpu build tag.
pkgs=$(grep -rl --include='*_test.go' '^//go:build.*\bgpu\b' --exclude-dir=dist . | xargs -r -n1 dirname | sort -u)
for p in $pkgs; do
  name=$(echo "${p#./}" | tr '/' '-')
  go test -c -tags gpu -trimpath -ldflags="-s -w" -o "$dist/tests/$name.test" "$p"
  # A dedicated gputest package runs whole; elsewhere only the GPU tests (TestGPU*) run there,
  # since unit tests need testdata/ that the bundle does not carry.
  [ "$(basename "$p")" = gputest ] || echo '^TestGPU' >"$dist/tests/$name.run"
done

cp testdata/workloads/* "$dist/workloads/"
if [ "${PTXMIG_BUNDLE_CU12:-1}" != 0 ]; then
  if nvcc12=$(scripts/install-nvcc12.sh 2>"$dist/workloads-cu12.log" | tail -n1) && [ -x "$nvcc12" ]; then
    c12=$dist/workloads-cu12
    if ! { NVCC=$nvcc12 ARCH=sm_90 testdata/workloads/build.sh "$c12" >>"$dist/workloads-cu12.log" 2>&1 &&
      "$nvcc12" -O2 -arch=sm_90 -cudart shared -o "$c12/counter-shared" testdata/workloads/counter.cu \
        >>"$dist/workloads-cu12.log" 2>&1 &&
      cp -L "$(dirname "$nvcc12")/../lib64/libcudart.so.12" "$c12/"; }; then
      echo "gpu-bundle: warning: CUDA 12 workloads not built (see $dist/workloads-cu12.log)" >&2; rm -rf "$c12"
    fi
  else
    echo "gpu-bundle: warning: no CUDA 12.4 toolkit, CUDA 12 workloads skipped (see $dist/workloads-cu12.log)" >&2
  fi
fi
while IFS= read -r d; do
  area=$(basename "$(dirname "$d")")
  mkdir -p "$dist/gputest/$area"
  cp -r "$d"/. "$dist/gputest/$area/"
done < <(find . -path ./dist -prune -o -type d -name gputest -print | sort)
# The ptxstate suite instruments the committed nvcc corpus.
if [ -d "$dist/gputest/ptxstate" ]; then
  mkdir -p "$dist/gputest/ptxstate/corpus"
  cp ptxstate/testdata/corpus/*.ptx "$dist/gputest/ptxstate/corpus/"
  mkdir -p "$dist/gputest/ptxstate/mid"
  cp ptxstate/testdata/nvcc12/midblock.sm_90.ptx ptxstate/testdata/nvcc12/threadloop.sm_90.ptx "$dist/gputest/ptxstate/mid/"
  mkdir -p "$dist/gputest/ptxstate/public"
  cp ptxstate/testdata/public/*.ptx "$dist/gputest/ptxstate/public/"
fi
for b in scripts/bench-*.sh scripts/probe-*.sh scripts/probe-*.c scripts/probe-*.ptx scripts/cuckpt.c scripts/dlsymlog.c; do [ -e "$b" ] && cp "$b" "$dist/bench/"; done
cp scripts/gpu-e2e.sh "$dist/"
if [ -n "${PTXMIG_CUDA_SAMPLES:-}" ]; then
  cs=$PTXMIG_CUDA_SAMPLES
  [ -f "$cs/Common/helper_cuda.h" ] || { echo "gpu-bundle: PTXMIG_CUDA_SAMPLES=$cs is not a cuda-samples checkout" >&2; exit 1; }
  mkdir -p "$dist/samples/Common"
  cp "$cs"/Common/helper_*.h "$cs"/Common/exception.h "$dist/samples/Common/"
  for s in $(scripts/bench-p2.sh --list-samples); do
    d=$(find "$cs/Samples" -mindepth 2 -maxdepth 2 -type d -name "$s" | head -n1)
    [ -n "$d" ] || { echo "gpu-bundle: sample $s not found in $cs" >&2; exit 1; }
    mkdir -p "$dist/samples/$s"
    find "$d" -maxdepth 1 -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) -exec cp {} "$dist/samples/$s/" \;
    # Common sources a sample's own build compiles with it (MonteCarloMultiGPU: multithreading;
    # its header from Common/, found through -I../Common, its source beside the sample's own)
    if grep -qs '#include *[<"]multithreading\.h[>"]' "$d"/*; then
      cp "$cs/Common/multithreading.h" "$dist/samples/Common/"
      cp "$cs/Common/multithreading.cpp" "$dist/samples/$s/"
    fi
  done
fi
echo "gpu-bundle: $(du -sh "$dist" | cut -f1) in $dist ($(find "$dist/tests" -mindepth 1 -maxdepth 1 | wc -l) test binaries)"
if [ -n "$tarfile" ]; then
  mkdir -p "$(dirname "$tarfile")"
  tar -C "$(dirname "$dist")" -cJf "$tarfile" "$(basename "$dist")"
  echo "gpu-bundle: packed into $tarfile ($(du -h "$tarfile" | cut -f1))"
fi
