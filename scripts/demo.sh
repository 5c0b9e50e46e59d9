#!/usr/bin/env bash
# demo.sh — ptxmig's main job, for real, with the default store (run by `make demo`, as root).
#
# On a host with NVIDIA GPUs (and nvcc): starts the `counter` workload, checkpoints it into the
# store, restores it (onto the other GPU when there are two) and checks that it continued exactly:
# its final checksum must equal an uninterrupted run's. Without GPUs it does the same with a small
# CPU sample process (internal/testproc). Then it lists the image, and cleans up after itself
# (processes, temporary files, and the demo image).
set -euo pipefail
cd "$(dirname "$0")/.."
PTXMIG=${PTXMIG:-$PWD/bin/ptxmig}
[ -x "$PTXMIG" ] || { echo "demo: $PTXMIG not built (make build)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "demo: run as root (CRIU needs it): sudo make demo" >&2; exit 1; }
work=$(mktemp -d /tmp/ptxmig-demo.XXXXXX)
image=demo-$(date +%Y%m%d-%H%M%S)-$$
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi
  if [ -n "$image" ] && "$PTXMIG" images 2>/dev/null | grep -q "^$image "; then
    "$PTXMIG" image rm "$image" >/dev/null && "$PTXMIG" image gc >/dev/null \
      || echo "demo: could not remove image $image from the store" >&2
  fi
  rm -rf "$work"
}
trap cleanup EXIT
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
wait_line() { # file regex timeout_s
  local i
  for ((i = 0; i < $3 * 10; i++)); do grep -qE "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "demo: timed out waiting for '$2' in $1" >&2; cat "$1" >&2; return 1
}
wait_gone() { local i; for ((i = 0; i < 600; i++)); do [ -e "/proc/$1" ] || return 0; sleep 0.1; done; return 1; }

ngpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then ngpu=$(nvidia-smi -L | wc -l); fi
if [ "$ngpu" -gt 0 ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  say "GPU host: $ngpu GPU(s); building the counter workload"
  testdata/workloads/build.sh "$work/bin" >/dev/null
  say "reference: an uninterrupted run"
  "$work/bin/counter" --mib 256 --steps 50 --interval-ms 0 >"$work/ref.log"
  want=$(grep '^final' "$work/ref.log")
  echo "$want"
  say "start counter on GPU 0 (256 MiB, 50 steps, 100 ms apart)"
  setsid "$work/bin/counter" --mib 256 --steps 50 --interval-ms 100 </dev/null >>"$work/run.log" 2>&1 &
  pid=$!
  wait_line "$work/run.log" '^step 10 ' 60
  head -n 1 "$work/run.log"
  "$PTXMIG" gpus
  target=0; [ "$ngpu" -ge 2 ] && target=1
  say "ptxmig checkpoint $pid"
  "$PTXMIG" checkpoint --name "$image" "$pid"
  wait "$pid" 2>/dev/null || true
  wait_gone "$pid"
  say "ptxmig restore --gpu $target $image"
  "$PTXMIG" restore --gpu "$target" "$image"
  "$PTXMIG" ps
  while [ -e "/proc/$pid" ] && ! grep -q '^final' "$work/run.log"; do sleep 0.2; done
  got=$(grep '^final' "$work/run.log")
else
  say "no NVIDIA GPU here: the same job with a CPU sample process"
  gcc -O2 -o "$work/sample" internal/testproc/csrc/testproc.c
  "$work/sample" "$work/ref.state" --mib 4 --interval-ms 0 --steps 200
  want=$(awk '{print "step", $4, "hash", $6}' "$work/ref.state")
  echo "reference (uninterrupted run): $want"
  say "start the sample process (4 MiB of state, 200 steps, 30 ms apart)"
  setsid "$work/sample" "$work/run.state" --mib 4 --interval-ms 30 --steps 200 </dev/null >/dev/null 2>&1 &
  pid=$!
  wait_line "$work/run.state" ' step [4-9][0-9] ' 30
  cat "$work/run.state"
  say "ptxmig checkpoint $pid"
  "$PTXMIG" checkpoint --name "$image" "$pid"
  wait "$pid" 2>/dev/null || true
  wait_gone "$pid"
  echo "process $pid is gone; its state file says: $(cat "$work/run.state")"
  say "ptxmig restore $image"
  "$PTXMIG" restore "$image"
  wait_line "$work/run.state" ' done 1' 60
  got=$(awk '{print "step", $4, "hash", $6}' "$work/run.state")
fi
say "result"
echo "restored run:      $got"
echo "uninterrupted run: $want"
if [ "$got" != "$want" ]; then echo "demo: FAILED: the restored process did not continue exactly" >&2; exit 1; fi
echo "identical: the process continued exactly"
say "the image in the store"
"$PTXMIG" images
pid=""
say "demo passed (cleaning up: processes, temporary files, image $image)"
