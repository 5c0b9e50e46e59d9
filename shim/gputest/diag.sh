#!/usr/bin/env bash
# diag.sh — why does a runtime-API app under the shim show no launches? Runs the counter workload
# under `ptxmig run` with PTXMIG_DEBUG=1 and prints the shim's status (interception counters:
# dlsym, cuGetProcAddress[_v2], by_name, unmatched, passthrough), its debug log, and how the
# binary reaches the driver. Needs PTXMIG_BIN, PTXMIG_SHIM, PTXMIG_WORKLOADS (built workloads).
set -uo pipefail
: "${PTXMIG_BIN:?}" "${PTXMIG_SHIM:?}" "${PTXMIG_WORKLOADS:?}"
S=$(mktemp -d)
trap 'rm -rf "$S"' EXIT
query() {
  python3 - "$1" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b'{"cmd":"status"}\n')
buf = b''
while not buf.endswith(b'\n'):
    d = s.recv(65536)
    if not d:
        break
    buf += d
print(buf.decode())
PY
}
PTXMIG_DEBUG=1 "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$S" -- \
  "$PTXMIG_WORKLOADS/counter" --mib 64 --steps 30 --interval-ms 100 >"$S/out" 2>"$S/err" &
for _ in $(seq 50); do ls "$S"/*.sock >/dev/null 2>&1 && break; sleep 0.1; done
sleep 1
sock=$(ls "$S"/*.sock 2>/dev/null | head -n1)
if [ -n "$sock" ]; then query "$sock"; else echo "no control socket appeared"; fi
wait
echo "--- shim debug log"; head -c 4000 "$S/err"; echo
echo "--- how counter reaches the driver"
nm -D "$PTXMIG_WORKLOADS/counter" | grep -E ' U (dl|cu)' | head -n 20
ldd "$PTXMIG_WORKLOADS/counter"
