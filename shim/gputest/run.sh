#!/usr/bin/env bash
# GPU-host checks of the shim (issue 6), run by gpu-e2e.sh as script:shim. Needs PTXMIG_BIN,
# PTXMIG_SHIM, PTXMIG_WORKLOADS (built workloads), PTXMIG_OUT; nvcc/ptxas in /usr/local/cuda/bin.
#  1. counter, ptxload, train.py run unmodified under `ptxmig run` with identical output
#  2. `ptxmig kernels` lists their kernels with plausible counts and sampled times
#  3. `ptxmig modules --dump` output assembles with the host's ptxas
#  4. the driver checkpoint API (lock/checkpoint/restore/unlock) works on a shimmed process
#  5. benchmark: empty-kernel launch cost and train.py steps/s with and without the shim
# Results: $PTXMIG_OUT/shim-results.md (+ logs in $PTXMIG_OUT/shim/).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${PTXMIG_BIN:?}" "${PTXMIG_SHIM:?}" "${PTXMIG_WORKLOADS:?}" "${PTXMIG_OUT:?}"
export PATH=/usr/local/cuda/bin:$PATH
out=$PTXMIG_OUT/shim
mkdir -p "$out"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
sockdir=$work/sock
W=$PTXMIG_WORKLOADS
fail=0
rows=()
row() { rows+=("| $1 | $2 | $3 |"); echo "== $1: $2 $3"; [ "$2" = PASS ] || [ "$2" = INFO ] || fail=1; }

nvcc -O2 -arch=native -o "$work/emptyloop" "$here/emptyloop.cu" || { echo "nvcc emptyloop failed"; exit 1; }
cc -O2 -o "$work/ckpt" "$here/ckpt.c" -ldl || exit 1

# shimmed CMD...: start under ptxmig run in the background; sets $spid (the ptxmig pid) and
# $cpid (the app's pid, from its control socket).
shimmed() {
  rm -rf "$sockdir"
  "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sockdir" -- "$@" >"$work/shimmed.out" 2>"$work/shimmed.err" &
  spid=$!
  cpid=""
  for _ in $(seq 1 600); do
    s=$(ls "$sockdir" 2>/dev/null | head -n1)
    if [ -n "$s" ]; then cpid=${s%.sock}; return 0; fi
    kill -0 $spid 2>/dev/null || break
    sleep 0.05
  done
  return 1
}
# check_kernels NAME MINLAUNCHES: ptxmig kernels of $cpid lists NAME (substring) with >= MIN launches and a time.
check_kernels() {
  "$PTXMIG_BIN" --json kernels --socket-dir "$sockdir" "$cpid" >"$out/kernels-$1.json" 2>"$out/kernels-$1.err" || return 1
  "$PTXMIG_BIN" kernels --socket-dir "$sockdir" "$cpid" >"$out/kernels-$1.txt" 2>&1
  python3 - "$out/kernels-$1.json" "$1" "$2" <<'PY'
import json, sys
k = json.load(open(sys.argv[1]))
want, mn = sys.argv[2], int(sys.argv[3])
hits = [x for x in k["kernels"] if x["name"] and want in x["name"]]
n = sum(x["launches"] for x in hits)
timed = [x for x in hits if x.get("time_us") and x["time_us"]["p50"] > 0]
print(f"{want}: {len(hits)} handles, {n} launches, timed {len(timed)}; total kernels {len(k['kernels'])}")
sys.exit(0 if n >= mn and timed else 1)
PY
}
check_dump() {
  local d=$work/dump-$1
  "$PTXMIG_BIN" modules --socket-dir "$sockdir" "$cpid" >"$out/modules-$1.txt" 2>&1 || return 1
  "$PTXMIG_BIN" modules --socket-dir "$sockdir" --dump "$d" "$cpid" >>"$out/modules-$1.txt" 2>&1 || return 1
  local n=0 bad=0
  for f in "$d"/*.ptx; do
    [ -e "$f" ] || continue
    n=$((n + 1))
    arch=$(sed -n 's/^\.target[[:space:]]*\(sm_[0-9a-z]*\).*/\1/p' "$f" | head -n1)
    ptxas -arch "${arch:-sm_90}" -o /dev/null "$f" 2>>"$out/ptxas-$1.log" || bad=$((bad + 1))
  done
  echo "$1: $n PTX files dumped, $bad rejected by ptxas" | tee -a "$out/modules-$1.txt"
  [ "$n" -gt 0 ] && [ "$bad" -eq 0 ]
}
finish() { wait $spid; }

# ---- counter (runtime API, static cudart: seen through cuGetProcAddress) ----
"$W/counter" --mib 64 --steps 200 --interval-ms 5 >"$work/counter.ref" 2>&1
if shimmed "$W/counter" --mib 64 --steps 200 --interval-ms 5; then
  sleep 0.3
  check_kernels "" 20 >"$out/counter-kernels.log" 2>&1 && row "counter: kernels listed" PASS "$(tail -n1 "$out/counter-kernels.log")" || row "counter: kernels listed" FAIL "$(cat "$out/counter-kernels.log" "$out/kernels-.err" | tail -n3)"
  check_dump counter && row "counter: dumped PTX assembles" PASS "" || row "counter: dumped PTX assembles" FAIL "see shim/modules-counter.txt"
  finish; rc=$?
  cp "$work/shimmed.out" "$out/counter.shim.out"
  # The first line carries the pid, which differs between runs by design.
  if [ $rc -eq 0 ] && diff -q <(grep -v '^pid ' "$work/counter.ref") <(grep -v '^pid ' "$work/shimmed.out") >/dev/null; then row "counter: identical output" PASS "$(tail -n1 "$work/counter.ref")"; else row "counter: identical output" FAIL "rc=$rc"; fi
else
  row "counter: under ptxmig run" FAIL "no control socket appeared ($(tail -n2 "$work/shimmed.err"))"; finish
fi

# ---- ptxload (driver API, cuModuleLoadData of a PTX file) ----
"$W/ptxload" "$W/vecadd.ptx" --iters 20000 >"$work/ptxload.ref" 2>&1
if shimmed "$W/ptxload" "$W/vecadd.ptx" --iters 20000; then
  sleep 0.5
  check_kernels vecadd 1 >"$out/ptxload-kernels.log" 2>&1 && row "ptxload: kernels listed" PASS "$(tail -n1 "$out/ptxload-kernels.log")" || row "ptxload: kernels listed" FAIL "$(tail -n2 "$out/ptxload-kernels.log")"
  check_dump ptxload && row "ptxload: dumped PTX assembles" PASS "" || row "ptxload: dumped PTX assembles" FAIL "see shim/modules-ptxload.txt"
  finish; rc=$?
  if [ $rc -eq 0 ] && diff -q "$work/ptxload.ref" "$work/shimmed.out" >/dev/null; then row "ptxload: identical output" PASS "$(cat "$work/ptxload.ref")"; else row "ptxload: identical output" FAIL "rc=$rc"; fi
else
  row "ptxload: under ptxmig run" FAIL "no control socket appeared"; finish
fi

# ---- driver checkpoint API on a shimmed process ----
"$W/counter" --mib 64 --steps 300 --interval-ms 5 >"$work/ck.ref" 2>&1
if shimmed "$W/counter" --mib 64 --steps 300 --interval-ms 5; then
  sleep 0.5
  "$work/ckpt" "$cpid" >"$out/ckpt.log" 2>&1; ck=$?
  finish; rc=$?
  if [ $ck -eq 0 ] && [ $rc -eq 0 ] && [ "$(tail -n1 "$work/ck.ref")" = "$(tail -n1 "$work/shimmed.out")" ]; then
    row "checkpoint API on shimmed counter" PASS "lock/checkpoint/restore/unlock ok, same final checksum"
  else
    row "checkpoint API on shimmed counter" FAIL "ckpt=$ck rc=$rc $(tail -n1 "$out/ckpt.log")"
  fi
else
  row "checkpoint API on shimmed counter" FAIL "no control socket appeared"; finish
fi

# ---- train.py (PyTorch, shared cudart): identical output, kernels, steps/s ----
t0=$(date +%s.%N); python3 "$W/train.py" --steps 200 --log-every 20 >"$work/train.ref" 2>&1; t1=$(date +%s.%N)
if shimmed python3 "$W/train.py" --steps 200 --log-every 20; then

  sleep 3
  check_kernels "" 100 >"$out/train-kernels.log" 2>&1 && row "train.py: kernels listed" PASS "$(tail -n1 "$out/train-kernels.log")" || row "train.py: kernels listed" FAIL "$(tail -n2 "$out/train-kernels.log")"
  finish; rc=$?
  if [ $rc -eq 0 ] && [ "$(grep -v ^pid "$work/train.ref")" = "$(grep -v ^pid "$work/shimmed.out")" ]; then row "train.py: identical output" PASS "$(grep -v ^pid "$work/train.ref" | tail -n1)"; else row "train.py: identical output" FAIL "rc=$rc"; fi
else
  row "train.py: under ptxmig run" FAIL "no control socket appeared"; finish
fi

# ---- benchmark ----
"$work/emptyloop" 200000 >"$out/emptyloop.plain" 2>&1
"$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sockdir" -- "$work/emptyloop" 200000 >"$out/emptyloop.shim" 2>&1
p0=$(sed -n 's/.*p50=\([0-9]*\).*/\1/p' "$out/emptyloop.plain"); p1=$(sed -n 's/.*p50=\([0-9]*\).*/\1/p' "$out/emptyloop.shim")
if [ -n "$p0" ] && [ -n "$p1" ]; then
  d=$((p1 - p0))
  st=PASS; [ $d -le 1000 ] || st=FAIL
  row "bench: empty launch p50 (target +<=1000 ns)" $st "plain $(cat "$out/emptyloop.plain") / shim $(cat "$out/emptyloop.shim") / added ${d} ns"
else
  row "bench: empty launch" FAIL "$(cat "$out/emptyloop.plain" "$out/emptyloop.shim" | tail -n2)"
fi
# train.py steps/s, three runs each, alternating, median.
sps() { python3 -c "import sys; print(f'{200/(float(sys.argv[2])-float(sys.argv[1])):.2f}')" "$1" "$2"; }
plain=(); shim=()
for i in 1 2 3; do
  a=$(date +%s.%N); python3 "$W/train.py" --steps 200 --log-every 200 >/dev/null 2>&1; b=$(date +%s.%N); plain+=("$(sps "$a" "$b")")
  a=$(date +%s.%N); "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sockdir" -- python3 "$W/train.py" --steps 200 --log-every 200 >/dev/null 2>&1; b=$(date +%s.%N); shim+=("$(sps "$a" "$b")")
done
mp=$(printf '%s\n' "${plain[@]}" | sort -n | sed -n 2p); ms=$(printf '%s\n' "${shim[@]}" | sort -n | sed -n 2p)
slow=$(python3 -c "print(f'{(1-float(\"$ms\")/float(\"$mp\"))*100:.1f}')")
st=PASS; python3 -c "import sys; sys.exit(0 if $slow <= 2.0 else 1)" || st=FAIL
row "bench: train.py steps/s incl. startup (target <=2% slower)" $st "plain ${plain[*]} (median $mp) / shim ${shim[*]} (median $ms) / ${slow}% slower"

{
  echo "# shim GPU checks ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1))"
  echo
  echo "| check | result | detail |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >"$PTXMIG_OUT/shim-results.md"
cat "$PTXMIG_OUT/shim-results.md"
exit $fail
