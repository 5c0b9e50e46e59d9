#!/usr/bin/env bash
# gpu-e2e.sh — run ptxmig's GPU suite on a host with NVIDIA GPUs (from a `make gpu-bundle` dir).
#
#   ./gpu-e2e.sh [--only SUITE[,SUITE...]] [--list]
#
# Suites: workloads (build and self-check the four workloads), go:<name> (each tests/<name>.test
# binary), script:<area> (each gputest/<area>/run.sh), bench:<name> (bench/bench-<name>.sh, only
# when named with --only). Results: a table on stdout and in $PTXMIG_OUT/results.md (default
# ./results); per-suite logs beside it. Exit status is non-zero when any suite failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export PTXMIG_OUT=${PTXMIG_OUT:-$here/results}
export PTXMIG_BIN=$here/ptxmig PTXMIG_SHIM=$here/libptxmig.so PTXMIG_CRIU=$here/criu/criu
export PTXMIG_WORKLOADS=$here/workloads/bin
export PTXMIG_WORKLOADS_CU12=$here/workloads-cu12   # built by gpu-bundle.sh with CUDA 12.4 (may be absent)
export PATH=$here:$here/criu:/usr/local/cuda/bin:$PATH
mkdir -p "$PTXMIG_OUT"
only=""
case "${1:-}" in
  --only) only=",${2:?--only needs suite names},";;
  --list) ls "$here/tests" 2>/dev/null | sed 's/\.test$//; s/^/go:/'; ls "$here/gputest" | sed 's/^/script:/'; ls "$here/bench" | sed 's/^bench-//; s/\.sh$//; s/^/bench:/'; echo workloads; exit 0;;
  "") ;;
  *) echo "usage: gpu-e2e.sh [--only SUITE,...] [--list]" >&2; exit 2;;
esac
want() { [ -z "$only" ] || [[ "$only" == *",$1,"* ]]; }

declare -a rows
failed=0
record() { # name status seconds note
  rows+=("| $1 | $2 | $3 | $4 |")
  [ "$2" = PASS ] || failed=1
  echo "== $1: $2 ($3 s) $4"
}
run_suite() { # name logfile cmd...
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  if "$@" >"$log" 2>&1; then record "$name" PASS $((SECONDS - t0)) ""
  else
    record "$name" FAIL $((SECONDS - t0)) "see $(basename "$log")"
    # The failing tests' own lines first (go test -v output), then the log's end.
    grep -n -E -- '--- FAIL|^panic:|_test\.go:[0-9]+:' "$log" | head -n 60
    tail -n 25 "$log"
  fi
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,persistence_mode --format=csv,noheader
  nvcc --version | tail -n 2
  uname -r
} >"$PTXMIG_OUT/host.txt" 2>&1
cat "$PTXMIG_OUT/host.txt"

workloads_check() {
  set -e
  "$here/workloads/build.sh" "$PTXMIG_WORKLOADS"
  cd "$PTXMIG_WORKLOADS"
  a=$(./counter --mib 64 --steps 20 --interval-ms 0 | tail -n1)
  b=$(./counter --mib 64 --steps 20 --interval-ms 0 --device "$(($(nvidia-smi -L | wc -l) - 1))" | tail -n1)
  echo "counter: $a / $b"; [ "$a" = "$b" ]
  l1=$(./longkernel --seconds 1); iters=$(echo "$l1" | awk '/^iters/{print $2}')
  l2=$(./longkernel --iters "$iters")
  echo "longkernel: $l1 / $l2"; [ "$(echo "$l1" | tail -n1)" = "$(echo "$l2" | tail -n1)" ]
  ./ptxload vecadd.ptx
  t1=$(python3 train.py --steps 40 --log-every 10); t2=$(python3 train.py --steps 40 --log-every 10)
  echo "$t1"; [ "$(echo "$t1" | grep -v ^pid)" = "$(echo "$t2" | grep -v ^pid)" ]
}

if want workloads || [ ! -x "$PTXMIG_WORKLOADS/counter" ]; then
  run_suite workloads "$PTXMIG_OUT/workloads.log" workloads_check
fi
for t in "$here"/tests/*.test; do
  [ -e "$t" ] || continue
  name=go:$(basename "$t" .test)
  want "$name" || continue
  pattern=.; [ -f "${t%.test}.run" ] && pattern=$(cat "${t%.test}.run")
  run_suite "$name" "$PTXMIG_OUT/${name#go:}.log" "$t" -test.v -test.timeout 9m -test.run "$pattern"
done
for d in "$here"/gputest/*/; do
  [ -x "$d/run.sh" ] || continue
  name=script:$(basename "$d")
  want "$name" || continue
  run_suite "$name" "$PTXMIG_OUT/$(basename "$d").log" "$d/run.sh"
done
for b in "$here"/bench/bench-*.sh; do
  [ -e "$b" ] || continue
  name=bench:$(basename "$b" .sh); name=${name/bench-/}
  [ -n "$only" ] && want "$name" || continue
  run_suite "$name" "$PTXMIG_OUT/$(basename "$b" .sh).log" "$b"
done

{
  echo "# ptxmig GPU suite results"
  echo
  cat "$PTXMIG_OUT/host.txt" | sed 's/^/    /'
  echo
  echo "| suite | result | seconds | note |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >"$PTXMIG_OUT/results.md"
echo; cat "$PTXMIG_OUT/results.md"
exit $failed
