#!/usr/bin/env bash
# probe-peer.sh — the two-GPU driver facts that issue 33 (peer access) and issue 34 (device to
# device moves) rest on, on a host with two GPUs or more. Peer cases: scripts/probe-peer.c waits
# at "ready" while the driver's four calls (scripts/cuckpt.c: lock, checkpoint, restore, unlock;
# "swapped": the restore's pairs exchange GPUs 0 and 1) move it, then goes on and prints its
# "fact:" lines; a probe whose restore fails stays checkpointed: it is killed, and the case says
# so. Keeper case: scripts/probe-holder.c MIB 1 (another process keeps the memory, copied to GPU
# 1 over the peer path, while the app is moved onto GPU 1 and maps it again).
#
#   scripts/probe-peer.sh [MIB] [CASE...]    (root; default 1024 MiB and every case below)
#
# Cases: peer-keep (peer access left on: the control), peer-toggle, peer-toggle-swapped,
# peer-toggle-late (device 0's access enabled before device 1 holds memory, as a runtime does),
# peer-toggle-fresh (and before device 1's context has a module), peer-toggle-big and
# peer-toggle-split (device 1 also holds MIB in one allocation, or in 64 MiB ones),
# peer-toggle-thread (enabled again from another thread, as the shim does), vmm-peer, vmm-peer-swapped (a VMM mapping of the other GPU's memory made and dropped before the
# checkpoint), keeper. Output: one block per case on stdout and in $PTXMIG_OUT/probe-peer.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mib=${1:-1024}
shift || true
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(peer-keep peer-toggle peer-toggle-swapped peer-toggle-late peer-toggle-fresh peer-toggle-big peer-toggle-split peer-toggle-thread vmm-peer vmm-peer-swapped keeper)
out=${PTXMIG_OUT:-./results}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
cc -O2 -o "$work/probe-peer" "$here/probe-peer.c" -ldl || exit 1
cc -O2 -o "$work/cuckpt" "$here/cuckpt.c" -ldl || exit 1
cc -O2 -o "$work/probe-holder" "$here/probe-holder.c" -ldl || exit 1
mapfile -t uuids < <(nvidia-smi --query-gpu=uuid --format=csv,noheader)
if [ ${#uuids[@]} -lt 2 ]; then
  echo "probe-peer: needs 2 GPUs, this host has ${#uuids[@]}" >&2
  exit 1
fi
# Every GPU of the host gets a pair (the driver wants a full permutation): 0 and 1 exchanged.
swap="${uuids[0]}=${uuids[1]},${uuids[1]}=${uuids[0]}"
for ((i = 2; i < ${#uuids[@]}; i++)); do swap+=",${uuids[i]}=${uuids[i]}"; done

run_case() {
  if [ "$1" = keeper ]; then
    echo "== keeper (probe-holder $mib 1: the app restored onto GPU 1) =="
    "$work/probe-holder" "$mib" 1
    echo "result: probe-holder exited $?"
    return
  fi
  local name=$1 mode=${1%-swapped} restore=restore
  [ "$name" = "$mode" ] || restore="restore:$swap"
  local log="$work/$name.log" fifo="$work/$name.in"
  mkfifo "$fifo"
  "$work/probe-peer" "$mode" "$mib" < "$fifo" > "$log" 2>&1 &
  local pid=$!
  exec 9> "$fifo"
  local pidline=""
  for _ in $(seq 600); do
    pidline=$(grep -m1 '^ready ' "$log" || true)
    [ -n "$pidline" ] && break
    kill -0 $pid 2> /dev/null || break
    sleep 0.1
  done
  local how="its own GPUs"
  [ "$restore" = restore ] || how="GPUs 0 and 1 swapped"
  echo "== $name (restored onto $how) =="
  if [ -z "$pidline" ]; then
    cat "$log"
    echo "result: the probe did not get ready"
    exec 9>&-
    kill -9 $pid 2> /dev/null
    wait $pid 2> /dev/null
    return
  fi
  grep -v '^ready ' "$log"
  if "$work/cuckpt" "$pid" lock:10000 checkpoint "$restore" unlock > "$work/$name.ck" 2>&1; then
    sed 's/^/driver: /' "$work/$name.ck"
    echo go >&9
    exec 9>&-
    wait $pid
    local rc=$?
    # Only the lines printed after "ready".
    sed -n '/^ready /,$p' "$log" | grep -v '^ready '
    echo "result: the driver's calls succeeded; the probe exited $rc"
  else
    sed 's/^/driver: /' "$work/$name.ck"
    echo "result: a driver call failed; the probe (pid $pid) is killed: $("$work/cuckpt" "$pid" state 2>&1 | tail -1)"
    exec 9>&-
    kill -9 $pid 2> /dev/null
    wait $pid 2> /dev/null
  fi
}

{
  echo "# probe-peer $(date -u +%FT%TZ), $mib MiB, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), ${#uuids[@]} GPUs"
  nvidia-smi topo -m 2> /dev/null | head -3
  for c in "${cases[@]}"; do run_case "$c"; done
} | tee "$out/probe-peer.txt"
