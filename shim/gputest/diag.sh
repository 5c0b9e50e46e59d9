#!/usr/bin/env bash
# diag.sh — how does each kind of CUDA app reach the driver under the shim? For the static-cudart
# counter, a shared-cudart build of it, and train.py (PyTorch), runs the app under `ptxmig run`
# with PTXMIG_DEBUG=1 and keeps the shim's status (interception counters, kernels, modules) and
# its trace log (every cu* dlsym, resolver answer and export-table request), plus the dynamic
# linker's bindings of dl*/cu* symbols for the static build. Needs PTXMIG_BIN, PTXMIG_SHIM,
# PTXMIG_WORKLOADS (built workloads; sources one level up) and PTXMIG_OUT.
set -uo pipefail
: "${PTXMIG_BIN:?}" "${PTXMIG_SHIM:?}" "${PTXMIG_WORKLOADS:?}" "${PTXMIG_OUT:?}"
export PATH=/usr/local/cuda/bin:$PATH
out=$PTXMIG_OUT/diag
mkdir -p "$out"
S=$(mktemp -d)
trap 'rm -rf "$S"' EXIT
query() {
  python3 - "$1" "$2" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(('{"cmd":"%s"}\n' % sys.argv[2]).encode())
buf = b''
while not buf.endswith(b'\n'):
    d = s.recv(65536)
    if not d:
        break
    buf += d
print(buf.decode())
PY
}
# case NAME WAIT CMD...: run CMD under the shim, query status and kernels after WAIT seconds.
case_() {
  local name=$1 wait=$2; shift 2
  rm -rf "$S/sock"
  PTXMIG_DEBUG=1 "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$S/sock" -- "$@" >"$out/$name.out" 2>"$out/$name.err" &
  local pid=$!
  sleep "$wait"
  local sock
  sock=$(find "$S/sock" -maxdepth 1 -name '*.sock' 2>/dev/null | head -n1)
  if [ -n "$sock" ]; then
    query "$sock" status >"$out/$name.status" 2>&1
    query "$sock" kernels >"$out/$name.kernels" 2>&1
  else
    echo "no control socket appeared" >"$out/$name.status"
  fi
  wait $pid
  echo "== $name: rc=$? $(head -c 600 "$out/$name.status")"
  grep -c 'trace:' "$out/$name.err" | sed "s/^/   trace lines: /"
}
src=$(dirname "$PTXMIG_WORKLOADS")
nvcc -O2 -arch=native -cudart shared -o "$S/counter_shared" "$src/counter.cu" || echo "nvcc shared failed"
case_ counter-static 2 "$PTXMIG_WORKLOADS/counter" --mib 64 --steps 40 --interval-ms 100
case_ counter-shared 2 "$S/counter_shared" --mib 64 --steps 40 --interval-ms 100
case_ train 15 python3 "$PTXMIG_WORKLOADS/train.py" --steps 3000 --log-every 500
LD_DEBUG=bindings LD_PRELOAD="$PTXMIG_SHIM" "$PTXMIG_WORKLOADS/counter" --mib 8 --steps 2 --interval-ms 1 2>&1 \
  | grep -E "normal symbol .(dl|cu)" | sed 's/^ *[0-9]*: *//' | sort | uniq -c | sort -rn >"$out/counter-static.bindings"
echo "--- bindings (static counter)"; head -n 30 "$out/counter-static.bindings"
echo "--- how counter reaches the driver"
nm -D "$PTXMIG_WORKLOADS/counter" | grep -E ' U (dl|cu)'
ldd "$PTXMIG_WORKLOADS/counter"
