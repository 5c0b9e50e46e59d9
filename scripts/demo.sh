#!/usr/bin/env bash
# demo.sh — ptxmig's main job, for real, on the machine it runs on (`make demo`, as root).
#
# On a host with NVIDIA GPUs and the CUDA workloads (built with nvcc, or prebuilt in
# $PTXMIG_WORKLOADS, e.g. dist/gpu/workloads): the `counter` workload is checkpointed while it
# runs, restored (onto the other GPU when there are two) and must end with the checksum of an
# uninterrupted run; then `longgrid`, one long many-block kernel under the shim (`ptxmig run`), is
# checkpointed in the middle of that kernel, restored, and must print the results of an
# uninterrupted run. Without GPUs (or without the workloads) the same job runs with a small CPU
# process. ptxmig's status line, timings and GPU listings show as they would to an operator.
#
# Everything lives in one temporary directory (the image store, staging, logs, locks, sockets)
# and is removed at the end, whatever happens; only processes this script started are stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
PTXMIG=${PTXMIG:-$PWD/bin/ptxmig}
[ -x "$PTXMIG" ] || { echo "demo: $PTXMIG not built (make build)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "demo: run as root (CRIU needs it): sudo make demo" >&2; exit 1; }

work=$(mktemp -d /tmp/ptxmig-demo.XXXXXX)
export PTXMIG_STORE=$work/store PTXMIG_LOG_DIR=$work/logs PTXMIG_STAGING_DIR=$work/staging \
  PTXMIG_LOCK_DIR=$work/locks PTXMIG_JOURNAL_DIR=$work/journal PTXMIG_SOCKET_DIR=$work/sock
pids=() # every process this script started (or restored): stopped by cleanup

cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '\033[2m$ %s\033[0m\n' "$*"; "$@"; }

# gone PID: the process ended (a zombie counts as ended).
gone() {
  [ -e "/proc/$1" ] || return 0
  [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" = Z ]
}
wait_gone() { local i; for ((i = 0; i < 600; i++)); do gone "$1" && return 0; sleep 0.1; done; return 1; }
wait_line() { # file regex timeout_s
  local i
  for ((i = 0; i < $3 * 10; i++)); do grep -qE "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "demo: timed out waiting for '$2' in $1" >&2
  cat "$1" >&2
  return 1
}
# start LOG CMD...: runs CMD in its own session, output to LOG, outside bash's job table (so a
# checkpoint that ends it prints no "Killed" line); sets $pid.
start() {
  local log=$1
  shift
  setsid "$@" </dev/null >>"$log" 2>&1 &
  pid=$!
  disown "$pid"
  pids+=("$pid")
}
# compare WHAT GOT WANT
compare() {
  echo "restored run:      $2"
  echo "uninterrupted run: $3"
  if [ "$2" != "$3" ]; then echo "demo: FAILED: $1 did not continue exactly" >&2; exit 1; fi
  echo "identical: $1 continued exactly"
}

ngpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
wl=${PTXMIG_WORKLOADS:-}
if [ "$ngpu" -gt 0 ] && [ -z "$wl" ]; then
  export PATH=$PATH:/usr/local/cuda/bin
  if command -v nvcc >/dev/null; then
    say "GPU host: $ngpu GPU(s); building the CUDA workloads with nvcc"
    wl=$work/workloads
    testdata/workloads/build.sh "$wl" >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
  else
    say "GPU host: $ngpu GPU(s), but no nvcc to build the CUDA workloads (set PTXMIG_WORKLOADS to prebuilt ones): the CPU demo instead"
  fi
fi

say "the host, as ptxmig sees it"
run "$PTXMIG" doctor || true

if [ "$ngpu" -gt 0 ] && [ -n "$wl" ] && [ -x "$wl/counter" ]; then
  run "$PTXMIG" gpus
  target=0
  [ "$ngpu" -ge 2 ] && target=1

  say "1. a CUDA process: checkpoint, restore onto GPU $target, continue exactly"
  "$wl/counter" --mib 256 --steps 50 --interval-ms 0 >"$work/ref.log"
  want=$(grep '^final' "$work/ref.log")
  start "$work/counter.log" "$wl/counter" --mib 256 --steps 50 --interval-ms 100
  wait_line "$work/counter.log" '^step 10 ' 60
  echo "counter runs as pid $pid: $(grep '^step' "$work/counter.log" | tail -n 1)"
  run "$PTXMIG" ps
  run "$PTXMIG" checkpoint --name counter-demo "$pid"
  wait_gone "$pid"
  echo "pid $pid is gone; its GPU memory is in the image"
  run "$PTXMIG" restore --gpu "$target" counter-demo
  run "$PTXMIG" ps
  wait_line "$work/counter.log" '^final' 60
  compare "the counter" "$(grep '^final' "$work/counter.log")" "$want"

  if [ -x "$wl/longgrid" ] && [ -e bin/libptxmig.so ]; then
    say "2. a long kernel under the shim: checkpoint in the middle of the kernel, restore, continue exactly"
    start "$work/longgrid.log" "$PTXMIG" run --preempt always -- "$wl/longgrid" --seconds 10 --repeat 2
    wait_line "$work/longgrid.log" '^params ' 120
    params=$(grep '^params ' "$work/longgrid.log")
    read -r blocks work_ repeat <<<"$(sed -E 's/params blocks=([0-9]+) work=([0-9]+) repeat=([0-9]+)/\1 \2 \3/' <<<"$params")"
    wait_line "$work/longgrid.log" '^started' 60
    sleep 3
    echo "longgrid (pid $pid) is 3 s into a ~10 s kernel of $blocks blocks"
    run "$PTXMIG" kernels "$pid"
    run "$PTXMIG" checkpoint --name longgrid-demo "$pid"
    wait_gone "$pid"
    run "$PTXMIG" restore longgrid-demo
    wait_line "$work/longgrid.log" '^(done|check FAILED)' 120
    got=$(grep '^result' "$work/longgrid.log" | tr '\n' ' ')
    echo "reference: the same kernels, uninterrupted and without the shim"
    "$wl/longgrid" --blocks "$blocks" --work "$work_" --repeat "$repeat" >"$work/longgrid-ref.log" 2>/dev/null
    compare "the long kernel" "$got" "$(grep '^result' "$work/longgrid-ref.log" | tr '\n' ' ')"
  else
    echo "(no longgrid workload or no bin/libptxmig.so: the mid-kernel checkpoint is skipped)"
  fi
else
  [ "$ngpu" -eq 0 ] && say "no NVIDIA GPU here: the same job with a CPU process"
  state() { sed 's/ *$//' "$work/run.state"; }
  gcc -O2 -o "$work/sample" internal/testproc/csrc/testproc.c
  "$work/sample" "$work/ref.state" --mib 4 --interval-ms 0 --steps 200
  want=$(awk '{print "step", $4, "hash", $6}' "$work/ref.state")
  start /dev/null "$work/sample" "$work/run.state" --mib 4 --interval-ms 30 --steps 200
  wait_line "$work/run.state" ' step [4-9][0-9] ' 30
  echo "the sample process (4 MiB of state, 200 steps, 30 ms apart) runs as pid $pid: $(state)"
  run "$PTXMIG" checkpoint --name sample-demo "$pid"
  wait_gone "$pid"
  echo "pid $pid is gone; its state file says: $(state)"
  run "$PTXMIG" restore sample-demo
  wait_line "$work/run.state" ' done 1' 60
  compare "the process" "$(awk '{print "step", $4, "hash", $6}' "$work/run.state")" "$want"
fi

say "the images in the (temporary) store"
run "$PTXMIG" images
run "$PTXMIG" image verify
say "demo passed (removing the temporary store, logs and processes)"
