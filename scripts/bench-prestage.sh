#!/usr/bin/env bash
# bench-prestage.sh — A/B of the checkpoint's overlap of store and CRIU dump (store.Prestage).
#
#   scripts/bench-prestage.sh [SIZE_GIB [ROUNDS [WORKERS...]]]     (default: 8 2 -1 0 4; root, 1 GPU)
#
# Each round, for each WORKERS value (`ptxmig checkpoint --prestage-workers`: -1 stores only after
# the dump, 0 uses half the CPUs), starts a `counter` holding SIZE GiB of device memory, checkpoints
# it, prints the JSON timings, then removes the image and runs gc so the next checkpoint
# deduplicates nothing. Values are interleaved within a round so drift affects them alike.
# Environment: PTXMIG_BIN, PTXMIG_WORKLOADS (counter), PTXMIG_CRIU, BENCH_STORE (default
# /var/tmp/ptxmig-bench-store, on disk). Output: one line per checkpoint on stdout.
set -euo pipefail
bin=${PTXMIG_BIN:-$(command -v ptxmig || echo ./bin/ptxmig)}
W=${PTXMIG_WORKLOADS:?set PTXMIG_WORKLOADS to the compiled workloads (testdata/workloads/build.sh)}
st=${BENCH_STORE:-/var/tmp/ptxmig-bench-store}
size=${1:-8}; rounds=${2:-2}; shift $(($# > 2 ? 2 : $#)); workers=("$@"); [ ${#workers[@]} -gt 0 ] || workers=(-1 0 4)
[ "$(id -u)" -eq 0 ] || { echo "bench-prestage: run as root" >&2; exit 1; }
work=$(mktemp -d); pid=""
trap 'rm -rf "$work"; [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; true' EXIT
for r in $(seq "$rounds"); do
  for w in "${workers[@]}"; do
    setsid "$W/counter" --mib $((size * 1024)) --steps 1000000 --interval-ms 200 --device 0 </dev/null >"$work/counter.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q '^step 2 ' "$work/counter.log" && break; sleep 0.2; done
    a=$(date +%s%N)
    rc=0; "$bin" --store "$st" --json checkpoint --name prestage-ab --prestage-workers "$w" "$pid" >"$work/ck.json" 2>"$work/ck.err" || rc=$?
    b=$(date +%s%N)
    python3 - "$size" "$r" "$w" "$rc" $(((b - a) / 1000000)) "$work" <<'PY'
import json, sys
size, r, w, rc, wall, work = sys.argv[1:]
try:
    d = json.load(open(f"{work}/ck.json"))
    t = " ".join(f"{x['step']} {x['duration_ns'] / 1e6:.0f}" for x in d["timings"])
    print(f"{size} GiB round {r} prestage-workers {w:>2}: wall {wall} ms, total {d['total_ns'] / 1e6:.0f} ms ({t})")
except Exception as e:
    print(f"{size} GiB round {r} prestage-workers {w}: rc {rc} failed: {e}: {open(f'{work}/ck.err').read()[-300:]}")
PY
    kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""
    "$bin" --store "$st" image rm prestage-ab >/dev/null 2>&1 || true
    "$bin" --store "$st" image gc >/dev/null 2>&1 || true
  done
done
