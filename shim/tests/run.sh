#!/usr/bin/env bash
# Shim integration tests: the shim (plain, then built with ASan+UBSan) preloaded into apps that
# reach a fake libcuda.so.1 directly, through dlopen+dlsym, through cuGetProcAddress and through a
# runtime registering a real nvcc-built fatbin; tests/drive.py checks what the control socket
# reports, the protocol (garbage included), dumps, and that the apps behave as without the shim.
#   tests/run.sh SHIM BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shim=$(realpath "$1")
build=$(realpath "$2")
command -v python3 >/dev/null || { echo "shim tests: python3 is required (tests/drive.py)" >&2; exit 1; }

# An unrelated program is unaffected by the preload, and the library identifies itself.
out=$(LD_PRELOAD="$shim" /bin/echo shim-loaded)
[ "$out" = shim-loaded ] || { echo "shim test: echo under LD_PRELOAD printed '$out'" >&2; exit 1; }
nm -D --defined-only "$shim" | grep -q ptxmig_shim_info || { echo "shim test: ptxmig_shim_info not exported" >&2; exit 1; }
# A non-CUDA program that uses dlsym heavily (python) runs normally and gets no socket.
sd=$(mktemp -d)
trap 'rm -rf "$sd"' EXIT
PTXMIG_SOCKET_DIR=$sd LD_PRELOAD="$shim" python3 -c 'import ctypes, json; print(json.dumps([1]))' >/dev/null
[ -z "$(ls -A "$sd")" ] || { echo "shim test: a non-CUDA process created a socket" >&2; exit 1; }

# fork while another thread is inside the shim's bookkeeping: every child must finish (no lock
# inherited held); app_fork kills a stuck child with SIGALRM and fails.
LD_LIBRARY_PATH="$build/fake" PTXMIG_SOCKET_DIR=$sd LD_PRELOAD="$shim" "$build/app_fork" 300 >/dev/null \
  || { echo "shim test: fork while tracking deadlocked or failed (app_fork)" >&2; exit 1; }

python3 "$here/drive.py" --shim "$shim" --build "$build"
asan=$(${CC:-cc} -print-file-name=libasan.so)
if [ -f "$asan" ]; then
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    python3 "$here/drive.py" --shim "$build/libptxmig-san.so" --preload-first "$(realpath "$asan")" --build "$build"
else
  echo "shim tests: SKIP sanitized shim run: libasan.so not found for ${CC:-cc}"
fi
echo "shim tests: ok"
