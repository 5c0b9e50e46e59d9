#!/usr/bin/env bash
# gpu-e2e.sh — run ptxmig's GPU suite on a host with NVIDIA GPUs (from a `make gpu-bundle` dir).
#
#   ./gpu-e2e.sh [--only SUITE[,SUITE...]] [--list]
#
# Suites: workloads (build and self-check the four workloads), go:<name> (each tests/<name>.test
# binary), script:<area> (each gputest/<area>/run.sh), bench:<name> (bench/bench-<name>.sh, only
# when named with --only). Results: a table on stdout and in $PTXMIG_OUT/results.md (default
# ./results); per-suite logs beside it. Exit status is non-zero when any suite failed.
# A suite's result is FAIL, PASS, "PASS (N skipped)" when some of its tests skipped, SKIPPED when
# all of them did, or NO TESTS when a test binary matched none; skipped tests (Go's `--- SKIP`
# lines, a script's `== NAME: SKIP REASON` rows) are listed with their reasons under the table
# and at the end of the suite's log.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export PTXMIG_OUT=${PTXMIG_OUT:-$here/results}
export PTXMIG_BIN=$here/ptxmig PTXMIG_SHIM=$here/libptxmig.so PTXMIG_CRIU=$here/criu/criu
export PTXMIG_WORKLOADS=$here/workloads/bin
export PTXMIG_SAMPLES=$here/samples   # NVIDIA/cuda-samples sources (gpu-bundle.sh with PTXMIG_CUDA_SAMPLES; may be absent)
export PTXMIG_WORKLOADS_CU12=$here/workloads-cu12   # built by gpu-bundle.sh with CUDA 12.4 (may be absent)
export PATH=$here:$here/criu:/usr/local/cuda/bin:$PATH
mkdir -p "$PTXMIG_OUT"
only=""
case "${1:-}" in
  --only) only=",${2:?--only needs suite names},";;
  --list)
    for t in "$here"/tests/*.test; do [ -e "$t" ] && echo "go:$(basename "$t" .test)"; done
    for d in "$here"/gputest/*/; do [ -d "$d" ] && echo "script:$(basename "$d")"; done
    for b in "$here"/bench/bench-*.sh; do [ -e "$b" ] && { b=$(basename "$b" .sh); echo "bench:${b#bench-}"; }; done
    echo workloads; exit 0;;
  "") ;;
  *) echo "usage: gpu-e2e.sh [--only SUITE,...] [--list]" >&2; exit 2;;
esac
want() { [ -z "$only" ] || [[ "$only" == *",$1,"* ]]; }

rows=() skips=()
failed=0
record() { # name status seconds note
  rows+=("| $1 | $2 | $3 | ${4//|/\\|} |")
  if [ "$2" = FAIL ]; then failed=1; fi
  echo "== $1: $2 ($3 s) $4"
}

# skip_report LOG: a first line "PASSED SKIPPED EMPTY" (tests passed and skipped; EMPTY is 1 when a
# Go test binary matched no test), then "NAME: REASON" for each skipped test. Go tests count
# individually, subtests included, but a test with subtests only through them. Go's -test.v
# output streams a test's log before its "--- SKIP" line, so the reason is the last "file.go:N:"
# line of that test (or, without -v, the first one after it). Script suites count their
# "== NAME: PASS|SKIP NOTE" rows (shim/gputest/run.sh).
skip_report() {
  awk '
    /^=== (RUN|CONT|NAME|PAUSE) / { cur = $3; after = ""; next }
    /^ *--- (PASS|SKIP|FAIL): / {
      n = $3; st = $2; sub(/:$/, "", st)
      if (!(n in status)) order[++k] = n
      status[n] = st; after = ""
      if (st == "SKIP") { why[n] = (n in last) ? last[n] : ""; if (why[n] == "") after = n }
      next
    }
    /^ +[^ ]+\.go:[0-9]+: / {
      line = $0; sub(/^ +/, "", line)
      if (after != "") { why[after] = line; after = "" }
      if (cur != "") last[cur] = line
      next
    }
    /^testing: warning: no tests to run/ { empty = 1; next }
    /^== / && match($0, /: (PASS|SKIP) ?/) {
      n = substr($0, 4, RSTART - 4); st = substr($0, RSTART + 2, 4)
      rest = substr($0, RSTART + RLENGTH)
      srows[++sk] = st; sname[sk] = n; snote[sk] = rest
      next
    }
    END {
      for (i = 1; i <= k; i++) {
        n = order[i]; parent = 0
        for (j = 1; j <= k; j++) if (index(order[j], n "/") == 1) { parent = 1; break }
        if (parent) continue
        if (status[n] == "PASS") pass++
        if (status[n] == "SKIP") { skip++; out[++o] = n ": " (why[n] == "" ? "(no reason given)" : why[n]) }
      }
      for (i = 1; i <= sk; i++) {
        if (srows[i] == "PASS") pass++
        else { skip++; out[++o] = sname[i] ": " (snote[i] == "" ? "(no reason given)" : snote[i]) }
      }
      print pass + 0, skip + 0, empty + 0
      for (i = 1; i <= o; i++) print out[i]
    }' "$1"
}

run_suite() { # name logfile cmd...
  local name=$1 log=$2; shift 2
  local t0=$SECONDS rc=0 secs report passed skipped empty first note r
  local -a reasons
  "$@" >"$log" 2>&1 || rc=$?
  secs=$((SECONDS - t0))
  report=$(skip_report "$log")
  read -r passed skipped empty <<<"${report%%$'\n'*}"
  mapfile -t reasons < <(tail -n +2 <<<"$report")
  note=""
  if [ ${#reasons[@]} -gt 0 ]; then
    for r in "${reasons[@]}"; do skips+=("| $name | ${r//|/\\|} |"); done
    first=${reasons[0]}; [ ${#first} -le 150 ] || first="${first:0:147}..."
    note="skipped: $first"; [ "$skipped" -le 1 ] || note="$note (and $((skipped - 1)) more, below)"
  fi
  if [ "$rc" -ne 0 ]; then
    record "$name" FAIL "$secs" "see $(basename "$log")${note:+; $note}"
    # The failing tests' own lines first (go test -v output), then the log's end.
    grep -n -E -- '--- FAIL|^panic:|_test\.go:[0-9]+:' "$log" | head -n 60
    tail -n 25 "$log"
  elif [ "$empty" -eq 1 ] && [ "$passed" -eq 0 ] && [ "$skipped" -eq 0 ]; then
    record "$name" "NO TESTS" "$secs" "no test matched its -test.run pattern"
  elif [ "$skipped" -gt 0 ] && [ "$passed" -eq 0 ]; then
    record "$name" SKIPPED "$secs" "$note"
  elif [ "$skipped" -gt 0 ]; then
    record "$name" "PASS ($skipped skipped)" "$secs" "$note"
  else
    record "$name" PASS "$secs" ""
  fi
  if [ ${#reasons[@]} -gt 0 ]; then
    printf '     skipped: %s\n' "${reasons[@]}"
    { echo; echo "== skipped in $name ($skipped):"; printf '    %s\n' "${reasons[@]}"; } >>"$log"
  fi
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,persistence_mode --format=csv,noheader
  nvcc --version | tail -n 2
  uname -r
} >"$PTXMIG_OUT/host.txt" 2>&1
cat "$PTXMIG_OUT/host.txt"

# shellcheck disable=SC2317  # called through run_suite
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
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    a=$(./twogpu --mib 64 --steps 20 --interval-ms 0 | tail -n1); b=$(./twogpu --mib 64 --steps 20 --interval-ms 0 | tail -n1)
    echo "twogpu: $a / $b"; [ "$a" = "$b" ]
  fi
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
  if [ -z "$only" ] || ! want "$name"; then continue; fi
  run_suite "$name" "$PTXMIG_OUT/$(basename "$b" .sh).log" "$b"
done

{
  echo "# ptxmig GPU suite results"
  echo
  sed 's/^/    /' "$PTXMIG_OUT/host.txt"
  echo
  echo "| suite | result | seconds | note |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  if [ ${#skips[@]} -gt 0 ]; then
    echo
    echo "Skipped tests (${#skips[@]}):"
    echo
    echo "| suite | test: reason |"
    echo "|---|---|"
    printf '%s\n' "${skips[@]}"
  fi
} >"$PTXMIG_OUT/results.md"
echo; cat "$PTXMIG_OUT/results.md"
exit $failed
