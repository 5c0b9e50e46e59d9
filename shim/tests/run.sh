#!/usr/bin/env bash
# Shim integration tests: the shim (plain, then built with ASan+UBSan) preloaded into apps that
# reach a fake libcuda.so.1 directly, through dlopen+dlsym, through cuGetProcAddress and through a
# runtime registering a real nvcc-built fatbin; tests/drive.py checks what the control socket
# reports, the protocol (garbage included), dumps, and that the apps behave as without the shim.
#   tests/run.sh SHIM BUILD_DIR
# Results go to $SHIM_RESULTS (tests/results.sh); run on its own, it ends with its own counts.
# Exit status non-zero when a test failed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shim=$(realpath "$1")
build=$(realpath "$2")
# shellcheck source=shim/tests/results.sh
. "$here/results.sh"
results_init
standalone=${results_own:-0}
fails_before=$(grep -c '^FAIL' "$SHIM_RESULTS" || true)
command -v python3 >/dev/null || { result FAIL integration "python3 is required (tests/drive.py)"; exit 1; }
sd=$(mktemp -d)
trap 'rm -rf "$sd"' EXIT

# An unrelated program is unaffected by the preload, and the library identifies itself.
preload_echo() { [ "$(LD_PRELOAD="$shim" /bin/echo shim-loaded)" = shim-loaded ]; }
exports_info() { nm -D --defined-only "$shim" | grep -q ptxmig_shim_info; }
# A non-CUDA program that uses dlsym heavily (python) runs normally and gets no socket.
non_cuda() {
  PTXMIG_SOCKET_DIR=$sd LD_PRELOAD="$shim" python3 -c 'import ctypes, json; print(json.dumps([1]))' >/dev/null &&
    [ -z "$(ls -A "$sd")" ]
}
check integration/preload-echo preload_echo
check integration/exports-shim-info exports_info
check integration/non-cuda-no-socket non_cuda
# fork while another thread is inside the shim's bookkeeping: every child must finish (no lock
# inherited held); app_fork kills a stuck child with SIGALRM and fails.
check integration/fork-while-tracking env LD_LIBRARY_PATH="$build/fake" PTXMIG_SOCKET_DIR="$sd" LD_PRELOAD="$shim" "$build/app_fork" 300

harness drive.py python3 "$here/drive.py" --shim "$shim" --build "$build" || true
harness preempt.py python3 "$here/preempt.py" --shim "$shim" --build "$build" || true
asan=$(${CC:-cc} -print-file-name=libasan.so)
if [ -f "$asan" ]; then
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    harness drive.py-san python3 "$here/drive.py" --shim "$build/libptxmig-san.so" --preload-first "$(realpath "$asan")" --build "$build" || true
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    harness preempt.py-san python3 "$here/preempt.py" --shim "$build/libptxmig-san.so" --preload-first "$(realpath "$asan")" --build "$build" || true
else
  skip asan drive-san "sanitized shim run: libasan.so not found for ${CC:-cc}"
fi
if [ "$standalone" = 1 ]; then results_summary ""; exit; fi
[ "$(grep -c '^FAIL' "$SHIM_RESULTS" || true)" = "$fails_before" ]
