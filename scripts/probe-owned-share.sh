#!/usr/bin/env bash
# probe-owned-share.sh — the share of a framework process's GPU memory that the shim owns under
# `ptxmig run --owned-memory` (what a checkpoint or migrate copies itself and stashes; the rest,
# the CUDA context and allocations the shim does not serve, stays with the driver).
#
#   scripts/probe-owned-share.sh [FRAMEWORK...]     (root, on a GPU host; default: resnet gpt2
#                                                    compile triton cupy numba jax)
#
# Each FRAMEWORK runs testdata/workloads/frameworks.py under `ptxmig run --owned-memory --preempt
# off`; at step 10, `ptxmig --json ps` gives the process's GPU memory as NVML counts it and its
# shim's owned bytes. Environment: PTXMIG_BIN, PTXMIG_FRAMEWORKS (frameworks.py), PTXMIG_OUT
# (results; default ./results). Output: a markdown table on stdout and in
# $PTXMIG_OUT/owned-share.md.
set -euo pipefail
PTXMIG_BIN=${PTXMIG_BIN:-$(command -v ptxmig || echo ./bin/ptxmig)}
FW=${PTXMIG_FRAMEWORKS:-$(dirname "$0")/../testdata/workloads/frameworks.py}
OUT=${PTXMIG_OUT:-$PWD/results}
fws=("$@"); [ ${#fws[@]} -gt 0 ] || fws=(resnet gpt2 compile triton cupy numba jax)
[ "$(id -u)" -eq 0 ] || { echo "probe-owned-share: run as root" >&2; exit 1; }
[ -f "$FW" ] || { echo "probe-owned-share: no frameworks.py at $FW (set PTXMIG_FRAMEWORKS)" >&2; exit 1; }
mkdir -p "$OUT"
work=$(mktemp -d)
pid=""
cleanup() { if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi; rm -rf "$work"; }
trap 'cleanup; true' EXIT
rows=()
for f in "${fws[@]}"; do
  log=$work/$f.log
  setsid "$PTXMIG_BIN" run --owned-memory --preempt off -- python3 "$FW" "$f" --steps 100000 --sleep-ms 100 </dev/null >"$log" 2>&1 &
  pid=$!
  state=timeout
  for _ in $(seq 900); do
    if grep -q '^step 10 ' "$log"; then state=ok; break; fi
    if grep -q '^skip:' "$log"; then state=skip; break; fi
    [ -e "/proc/$pid" ] || { state=exited; break; }
    sleep 0.2
  done
  if [ "$state" = ok ]; then
    "$PTXMIG_BIN" --json ps >"$work/ps.json"
    rows+=("$(python3 - "$work/ps.json" "$pid" "$f" <<'PY'
import json, sys
entries, pid, name = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
e = next((x for x in entries if x['pid'] == pid), None)
if e is None:
    print(f'| {name} | not in ptxmig ps | | | |')
else:
    used = sum(g['used_memory_bytes'] for g in e['gpus'])
    o = e.get('owned_memory') or {}
    owned = o.get('bytes', 0)
    share = f'{100 * owned / used:.0f} %' if used else '-'
    print(f"| {name} | {used / 2**20:.0f} MiB | {owned / 2**20:.0f} MiB in {o.get('regions', 0)} allocations | **{share}** | {(used - owned) / 2**20:.0f} MiB |")
PY
)")
  else
    rows+=("| $f | $state: $(tail -1 "$log" | cut -c1-120) | | | |")
  fi
  kill -9 "$pid" 2>/dev/null || true
  pid=""
  sleep 1
done
{
  echo "# probe-owned-share $(date -u +%FT%TZ) on $(hostname): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0)"
  echo
  echo "| framework | GPU memory (NVML) | owned by the shim | share | left to the driver |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/owned-share.md"
