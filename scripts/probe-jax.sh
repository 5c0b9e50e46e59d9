#!/usr/bin/env bash
# probe-jax.sh OUT — where a JAX process is lost (issue 33), on a GPU host, from a GPU bundle:
#   A: under `ptxmig run` (preemption on), the bare driver calls (lock, checkpoint, restore,
#      unlock; no quiesce, no CRIU): does the process die at the driver checkpoint without ptxmig?
#   B: without the shim, the driver calls around a bare CRIU dump and restore: does the driver know
#      the restored process (state), at once and a second later, and does it run on?
#   C: ptxmig's `checkpoint --leave-running` under `ptxmig run` (the shim quiesces first);
#   D: ptxmig's checkpoint + restore without the shim;
#   E: C with XLA's default preallocation (75 % of the GPU);
#   F: PROBE_CYCLES bare driver cycles with a second between checkpoint and restore, under `ptxmig
#      run` and without it: what the driver's checkpoint unmaps from the process, and what the
#      process maps meanwhile (the address space is diffed around each call);
#   G: PROBE_CYCLES `checkpoint --leave-running` in a row, per variant (shim with preemption, shim
#      with --preempt off, no shim), stopping at the first failure with its logs and maps;
#   R: three checkpoints, each followed by a restore of the image, under the shim and without.
# PTXMIG_PROBE_BIN, when set, is the ptxmig that C, D, E, G and R run (default PTXMIG_BIN).
# Everything goes to OUT/summary.txt (the step outputs, the tails of the logs, the kernel's NVRM
# lines). Needs PTXMIG_BIN, PTXMIG_WORKLOADS (frameworks.py) and PTXMIG_CRIU, as gpu-e2e.sh sets.
set -u
out=${1:?usage: probe-jax.sh OUT}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
gcc -O2 -o "$out/cuckpt" "$here/cuckpt.c" -ldl || exit 1
ck=$out/cuckpt fw=$PTXMIG_WORKLOADS/frameworks.py criu=$PTXMIG_CRIU
export CUDA_VISIBLE_DEVICES=0

# start LOG CMD...: a JAX loop in its own session, a child of this shell, its pid in $pid.
start() {
  local log=$1; shift
  setsid "$@" python3 "$fw" jax --steps 100000 --sleep-ms 20 >"$log" 2>&1 </dev/null &
  pid=$!
}
# steps LOG: the last step printed.
steps() { awk '/^step /{s=$2} END{print s+0}' "$1"; }
ready() { for _ in $(seq 600); do [ "$(steps "$1")" -ge 5 ] && return 0; sleep 0.1; done; return 1; }
# runs_on NAME PID LOG: alive and stepping two seconds later?
runs_on() {
  local a; a=$(steps "$3"); sleep 2
  if kill -0 "$2" 2>/dev/null && [ "$(steps "$3")" -gt "$a" ]; then echo "$1: runs on (step $a -> $(steps "$3"))"
  else echo "$1: LOST (alive: $(kill -0 "$2" 2>/dev/null && echo yes || echo no), step $a -> $(steps "$3"))"; fi
}
nvrm() { echo "-- dmesg NVRM/Xid ($1):"; dmesg 2>/dev/null | grep -iE 'nvrm|xid' | tail -n 10; }
# show NAME FILE [N]: the last N lines of FILE into the summary.
show() { echo "-- $1 (last ${3:-25} lines):"; tail -n "${3:-25}" "$2" 2>/dev/null; }

parts=${PROBE_PARTS:-ABCDE} # which of the probes run
[[ $parts == *A* ]] && echo "== A: under ptxmig run, bare driver calls" | tee -a "$out/summary.txt"
[[ $parts == *A* ]] && for mode in auto off; do
  log=$out/A-$mode.log
  start "$log" env PTXMIG_DEBUG=1 "$PTXMIG_BIN" run --preempt "$mode" --socket-dir "$out/sock" --
  ready "$log" || { echo "A $mode: JAX did not start" | tee -a "$out/summary.txt"; tail -n 20 "$log"; kill -9 "$pid"; continue; }
  "$ck" "$pid" state lock:10000 state checkpoint state restore state unlock state >"$out/A-$mode-cuckpt.txt" 2>&1
  echo "A $mode: cuckpt exit $? ($(tr '\n' ' ' <"$out/A-$mode-cuckpt.txt"))" | tee -a "$out/summary.txt"
  runs_on "A $mode" "$pid" "$log" | tee -a "$out/summary.txt"
  nvrm "A-$mode" >>"$out/summary.txt"
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
done

[[ $parts == *B* ]] && echo "== B: no shim, driver calls around a bare CRIU dump and restore" | tee -a "$out/summary.txt"
log=$out/B.log
if [[ $parts != *B* ]]; then :
elif start "$log" env && ready "$log"; then
  "$ck" "$pid" lock:10000 checkpoint state >"$out/B-ck.txt" 2>&1
  echo "B: lock+checkpoint exit $? ($(tr '\n' ' ' <"$out/B-ck.txt"))" | tee -a "$out/summary.txt"
  img=$(mktemp -d /tmp/probe-jax.XXXX)
  "$criu" dump -t "$pid" -D "$img" --shell-job --ext-unix-sk --file-locks --link-remap -v4 -o dump.log
  echo "B: criu dump exit $? ($(du -sh "$img" | cut -f1))" | tee -a "$out/summary.txt"
  show "criu dump.log" "$img/dump.log" 8 >>"$out/summary.txt"
  wait "$pid" 2>/dev/null
  "$criu" restore -D "$img" -d --shell-job --ext-unix-sk --file-locks --link-remap -v4 -o restore.log
  echo "B: criu restore exit $?" | tee -a "$out/summary.txt"
  { show "criu restore.log" "$img/restore.log" 40; grep -E 'Error|error|fail' "$img/restore.log" | head -n 20; } >>"$out/summary.txt"
  "$ck" "$pid" state >"$out/B-state0.txt" 2>&1; echo "B: state at once: $(tr '\n' ' ' <"$out/B-state0.txt")" | tee -a "$out/summary.txt"
  sleep 1
  "$ck" "$pid" state restore unlock state >"$out/B-rs.txt" 2>&1
  echo "B: a second later: exit $? ($(tr '\n' ' ' <"$out/B-rs.txt"))" | tee -a "$out/summary.txt"
  runs_on "B" "$pid" "$log" | tee -a "$out/summary.txt"
  nvrm B >>"$out/summary.txt"
  show "JAX (B)" "$log" 15 >>"$out/summary.txt"
  kill -9 "$pid" 2>/dev/null
  rm -rf "$img"
else
  echo "B: JAX did not start" | tee -a "$out/summary.txt"; tail -n 20 "$log"
fi

pm() { "${PTXMIG_PROBE_BIN:-$PTXMIG_BIN}" --store "$out/store" "$@"; }
[[ $parts == *C* ]] && echo "== C: ptxmig checkpoint --leave-running under ptxmig run (shim quiesce first)" | tee -a "$out/summary.txt"
log=$out/C.log
if [[ $parts != *C* ]]; then :
elif start "$log" env PTXMIG_DEBUG=1 "$PTXMIG_BIN" run --socket-dir "$out/sock" -- && ready "$log"; then
  pm --log-level debug checkpoint --leave-running --lock-timeout 10s --name c1 "$pid" >"$out/C-ptxmig.txt" 2>&1
  echo "C: ptxmig exit $?" | tee -a "$out/summary.txt"
  { show "ptxmig (C)" "$out/C-ptxmig.txt" 40; runs_on C "$pid" "$log"; nvrm C
    echo "-- JAX (C), shim lines and errors:"; grep -vE 'trace: (resolve|dlsym)' "$log" | tail -n 40; } >>"$out/summary.txt"
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
else
  echo "C: JAX did not start" | tee -a "$out/summary.txt"
fi
[[ $parts == *D* ]] && echo "== D: ptxmig checkpoint + restore, no shim" | tee -a "$out/summary.txt"
log=$out/D.log
if [[ $parts != *D* ]]; then :
elif start "$log" env && ready "$log"; then
  pm checkpoint --lock-timeout 10s --name d1 "$pid" >"$out/D-ck.txt" 2>&1
  echo "D: checkpoint exit $?" | tee -a "$out/summary.txt"
  wait "$pid" 2>/dev/null
  pm --log-level debug restore --keep-staging d1 >"$out/D-rs.txt" 2>&1
  echo "D: restore exit $?" | tee -a "$out/summary.txt"
  { show "ptxmig checkpoint (D)" "$out/D-ck.txt" 5; show "ptxmig restore (D)" "$out/D-rs.txt" 40
    for f in /var/log/ptxmig/restore-*/restore.log; do [ -e "$f" ] && { show "$f" "$f" 30; grep -nE 'Error|error' "$f" | head -n 20; }; done
    runs_on D "$pid" "$log"; nvrm D; show "JAX (D)" "$log" 10; } >>"$out/summary.txt"
  kill -9 "$pid" 2>/dev/null
else
  echo "D: JAX did not start" | tee -a "$out/summary.txt"
fi
[[ $parts == *E* ]] && echo "== E: C with XLA's default preallocation" | tee -a "$out/summary.txt"
log=$out/E.log
if [[ $parts != *E* ]]; then :
elif start "$log" env XLA_PYTHON_CLIENT_PREALLOCATE=true "$PTXMIG_BIN" run --socket-dir "$out/sock" -- && ready "$log"; then
  { grep MemAvailable /proc/meminfo; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; } >>"$out/summary.txt"
  pm checkpoint --leave-running --lock-timeout 10s --name e1 "$pid" >"$out/E-ptxmig.txt" 2>&1
  echo "E: ptxmig exit $?" | tee -a "$out/summary.txt"
  { show "ptxmig (E)" "$out/E-ptxmig.txt" 5; runs_on E "$pid" "$log"; } >>"$out/summary.txt"
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
else
  echo "E: JAX did not start" | tee -a "$out/summary.txt"
fi

cycles=${PROBE_CYCLES:-8}
# mapsnap PID FILE: the process's mappings, addresses and names only.
mapsnap() { awk '{print $1, $6}' "/proc/$1/maps" >"$2" 2>/dev/null; }
[[ $parts == *F* ]] && echo "== F: driver cycles with a gap, the address space around them" | tee -a "$out/summary.txt"
[[ $parts == *F* ]] && for mode in shim none; do
  log=$out/F-$mode.log
  if [ "$mode" = shim ]; then start "$log" env "$PTXMIG_BIN" run --socket-dir "$out/sock" --; else start "$log" env; fi
  ready "$log" || { echo "F $mode: JAX did not start" | tee -a "$out/summary.txt"; kill -9 "$pid"; continue; }
  for i in $(seq "$cycles"); do
    mapsnap "$pid" "$out/m0"
    "$ck" "$pid" lock:10000 checkpoint >"$out/F-a.txt" 2>&1; ra=$?
    mapsnap "$pid" "$out/m1"; sleep 1; mapsnap "$pid" "$out/m2"
    "$ck" "$pid" restore unlock >"$out/F-b.txt" 2>&1; rb=$?
    mapsnap "$pid" "$out/m3"
    gone=$(comm -23 <(sort "$out/m0") <(sort "$out/m1") | wc -l); new=$(comm -13 <(sort "$out/m1") <(sort "$out/m2") | wc -l)
    back=$(comm -13 <(sort "$out/m2") <(sort "$out/m3") | wc -l)
    echo "F $mode $i: lock+ckpt $ra ($(tr '\n' ' ' <"$out/F-a.txt")) restore+unlock $rb ($(tr '\n' ' ' <"$out/F-b.txt")); maps: $gone gone at checkpoint, $new new while checkpointed, $back new at restore" | tee -a "$out/summary.txt"
    if [ "$i" = 1 ] || [ $ra != 0 ] || [ $rb != 0 ]; then
      { echo "-- gone at checkpoint:"; comm -23 <(sort "$out/m0") <(sort "$out/m1") | head -n 12
        echo "-- new while checkpointed:"; comm -13 <(sort "$out/m1") <(sort "$out/m2") | head -n 12
        echo "-- new at restore:"; comm -13 <(sort "$out/m2") <(sort "$out/m3") | head -n 12; } >>"$out/summary.txt"
    fi
    if [ $ra != 0 ] || [ $rb != 0 ]; then nvrm "F-$mode" >>"$out/summary.txt"; break; fi
  done
  runs_on "F $mode" "$pid" "$log" | tee -a "$out/summary.txt"
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
done

[[ $parts == *G* ]] && echo "== G: $cycles leave-running checkpoints in a row" | tee -a "$out/summary.txt"
[[ $parts == *G* ]] && for mode in auto off none; do
  log=$out/G-$mode.log
  if [ "$mode" = none ]; then start "$log" env; else start "$log" env PTXMIG_DEBUG=1 "$PTXMIG_BIN" run --preempt "$mode" --socket-dir "$out/sock" --; fi
  ready "$log" || { echo "G $mode: JAX did not start" | tee -a "$out/summary.txt"; kill -9 "$pid"; continue; }
  for i in $(seq "$cycles"); do
    mapsnap "$pid" "$out/g0"
    pm --log-level debug checkpoint --leave-running --lock-timeout 10s --name "g-$mode-$i" "$pid" >"$out/G-ptxmig.txt" 2>&1; r=$?
    echo "G $mode $i: exit $r $(tail -n 1 "$out/G-ptxmig.txt")" | tee -a "$out/summary.txt"
    if [ $r != 0 ]; then
      mapsnap "$pid" "$out/g1"
      { show "ptxmig (G $mode $i)" "$out/G-ptxmig.txt" 40
        echo "-- maps gone since before:"; comm -23 <(sort "$out/g0") <(sort "$out/g1") | head -n 20
        echo "-- maps new since before:"; comm -13 <(sort "$out/g0") <(sort "$out/g1") | head -n 20
        nvrm "G-$mode"; echo "-- JAX (G $mode), shim lines and errors:"; grep -vE 'trace: (resolve|dlsym)' "$log" | tail -n 40; } >>"$out/summary.txt"
      break
    fi
    "${PTXMIG_PROBE_BIN:-$PTXMIG_BIN}" --store "$out/store" image rm "g-$mode-$i" >/dev/null 2>&1
  done
  runs_on "G $mode" "$pid" "$log" | tee -a "$out/summary.txt"
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
done

[[ $parts == *R* ]] && echo "== R: checkpoint + restore, three times" | tee -a "$out/summary.txt"
[[ $parts == *R* ]] && for mode in auto none; do
  log=$out/R-$mode.log
  if [ "$mode" = none ]; then start "$log" env; else start "$log" env "$PTXMIG_BIN" run --socket-dir "$out/sock" --; fi
  ready "$log" || { echo "R $mode: JAX did not start" | tee -a "$out/summary.txt"; kill -9 "$pid"; continue; }
  for i in 1 2 3; do
    pm checkpoint --lock-timeout 10s --name "r-$mode-$i" "$pid" >"$out/R-ck.txt" 2>&1; r1=$?
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    pm --log-level debug restore "r-$mode-$i" >"$out/R-rs.txt" 2>&1; r2=$?
    echo "R $mode $i: checkpoint exit $r1, restore exit $r2 ($(tail -n 1 "$out/R-rs.txt"))" | tee -a "$out/summary.txt"
    if [ $r1 != 0 ] || [ $r2 != 0 ]; then
      { show "checkpoint (R)" "$out/R-ck.txt" 10; show "restore (R)" "$out/R-rs.txt" 30; nvrm "R-$mode"; show "JAX (R)" "$log" 10; } >>"$out/summary.txt"
      break
    fi
    runs_on "R $mode $i" "$pid" "$log" | tee -a "$out/summary.txt"
  done
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
done
