#!/usr/bin/env bash
# bench-migrate.sh — migrate downtime: owned memory stashed in the process against the driver's
# path and the four bare driver calls, side by side in the same run.
#
#   scripts/bench-migrate.sh [SIZE_GIB...]        (default: 1 8; run as root on a GPU host)
#
# Two `counter` processes hold SIZE GiB of device memory each, the whole run long:
#   owned   under `ptxmig run --owned-memory --preempt off`: 64 MiB it advances every 200 ms and
#           SIZE GiB - 64 MiB it never writes after the start (counter --frozen-mib, as weights);
#           `ptxmig migrate` stashes it in the process's host memory, the driver moves the rest;
#   driver  under `ptxmig run --preempt off` (SIZE GiB advancing, the driver's own memory):
#           `ptxmig migrate` as before owned memory, the driver copies everything;
#   bare    the driver process again, moved by the four driver calls back to back (lock,
#           checkpoint, restore, unlock; scripts/cuckpt.c), their times summed.
# With two GPUs every migrate moves to the other GPU (--gpu 1, then --gpu 0 back); with one,
# `ptxmig migrate --rehearse` moves it onto its own GPU and the bare calls restore without pairs.
# Each round runs the three, in an order that alternates from round to round; BENCH_ROUNDS rounds
# (default 3). Every process must advance after each move. Reported: the median downtime per way
# and size (ptxmig's downtime: quiesce to resume; bare: the calls' sum), its parts, and the ratios.
# Environment: PTXMIG_BIN, PTXMIG_WORKLOADS (counter: testdata/workloads/build.sh), PTXMIG_OUT
# (results; default ./results), BENCH_ROUNDS.
# Output: a markdown table on stdout and in $PTXMIG_OUT/bench-migrate.md, raw JSON in
# $PTXMIG_OUT/bench-migrate/.
set -euo pipefail
PTXMIG_BIN=${PTXMIG_BIN:-$(command -v ptxmig || echo ./bin/ptxmig)}
PTXMIG_WORKLOADS=${PTXMIG_WORKLOADS:?set PTXMIG_WORKLOADS to the compiled workloads (testdata/workloads/build.sh)}
OUT=${PTXMIG_OUT:-$PWD/results}
ROUNDS=${BENCH_ROUNDS:-3}
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(1 8)
[ "$(id -u)" -eq 0 ] || { echo "bench-migrate: run as root" >&2; exit 1; }
command -v nvidia-smi >/dev/null || { echo "bench-migrate: needs a GPU host (no nvidia-smi)" >&2; exit 1; }
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$ngpu" -ge 1 ] || { echo "bench-migrate: no GPU" >&2; exit 1; }
raw=$OUT/bench-migrate; mkdir -p "$raw"
work=$(mktemp -d)
pids=()
cleanup() { local p; for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap 'cleanup; true' EXIT
gcc -O2 -o "$work/cuckpt" "$(dirname "$0")/cuckpt.c" -ldl

uuid() { nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$1"; }
u0=$(uuid 0); u1=""; [ "$ngpu" -ge 2 ] && u1=$(uuid 1)

start() { # NAME GIB [owned]: start a counter under ptxmig run; sets the global started
  local log=$work/$1.log
  : >"$log"
  if [ "${3:-}" = owned ]; then
    setsid "$PTXMIG_BIN" run --owned-memory --preempt off --socket-dir "$work/sock" -- "$PTXMIG_WORKLOADS/counter" \
      --mib 64 --frozen-mib $(($2 * 1024 - 64)) --steps 100000000 --interval-ms 200 --device 0 </dev/null >>"$log" 2>&1 &
  else
    setsid "$PTXMIG_BIN" run --preempt off --socket-dir "$work/sock" -- "$PTXMIG_WORKLOADS/counter" \
      --mib $(($2 * 1024)) --steps 100000000 --interval-ms 200 --device 0 </dev/null >>"$log" 2>&1 &
  fi
  started=$!
  pids+=("$started")
  for _ in $(seq 1500); do grep -q '^step 2 ' "$log" && return 0; sleep 0.2; done
  echo "bench-migrate: $1 did not start" >&2; cat "$log" >&2; exit 1
}
advances() { # NAME: the workload prints a new step within 10 s
  local log=$work/$1.log n
  n=$(grep -c '^step ' "$log")
  for _ in $(seq 100); do [ "$(grep -c '^step ' "$log")" -gt "$n" ] && return 0; sleep 0.1; done
  echo "bench-migrate: $1 does not advance after the move" >&2; tail -5 "$log" >&2; exit 1
}
# where[NAME]: the GPU the process is on (0 or 1).
declare -A where
move() { # NAME PID OUTJSON: ptxmig migrate to the other GPU (or a rehearsal)
  local args=(--rehearse)
  if [ -n "$u1" ]; then
    local to=$((1 - ${where[$1]}))
    args=(--gpu "$to")
    where[$1]=$to
  fi
  "$PTXMIG_BIN" --json migrate "${args[@]}" "$2" >"$3"
  advances "$1"
}
bare() { # PID OUTTXT: the four driver calls, to the other GPU of the driver process (or none)
  local r=restore
  if [ -n "$u1" ]; then
    if [ "${where[driver]}" = 0 ]; then r="restore:$u0=$u1,$u1=$u0"; where[driver]=1; else r="restore:$u1=$u0,$u0=$u1"; where[driver]=0; fi
  fi
  "$work/cuckpt" "$1" lock:10000 checkpoint "$r" unlock >"$2"
  advances driver
}
j() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {'d': d}))" "$@"; }
median() { python3 -c "import statistics,sys; print(round(statistics.median(float(x) for x in sys.argv[1:])))" "$@"; }

rows=()
for g in "${sizes[@]}"; do
  echo "== ${g} GiB" >&2
  start owned "$g" owned; p_owned=$started
  start driver "$g"; p_driver=$started
  # (`ptxmig run` execs the counter: $! is the process.)
  where[owned]=0; where[driver]=0
  # Warm-up, untimed: the first migrate of each pays for loading ptxmig and the driver's paths.
  move owned "$p_owned" "$raw/warm-owned-$g.json"; move driver "$p_driver" "$raw/warm-driver-$g.json"
  down_o=() down_d=() down_b=()
  for r in $(seq "$ROUNDS"); do
    order=(owned driver bare); [ $((r % 2)) = 0 ] && order=(bare driver owned)
    for w in "${order[@]}"; do
      case $w in
        owned) move owned "$p_owned" "$raw/owned-$g-$r.json"; down_o+=("$(j "$raw/owned-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        driver) move driver "$p_driver" "$raw/driver-$g-$r.json"; down_d+=("$(j "$raw/driver-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        bare) bare "$p_driver" "$raw/bare-$g-$r.txt"; down_b+=("$(awk '$1 != "cuInit" {s += $2} END {printf "%.1f", s}' "$raw/bare-$g-$r.txt")") ;;
      esac
    done
  done
  mo=$(median "${down_o[@]}") md=$(median "${down_d[@]}") mb=$(median "${down_b[@]}")
  o=$raw/owned-$g-1.json d1=$raw/driver-$g-1.json
  parts() { j "$1" "', '.join(f\"{k} {d.get(k+'_ns',0)/1e6:.0f}\" for k in ['stash','lock','checkpoint','restore','unlock','unstash'] if d.get(k+'_ns'))"; }
  stash=$(j "$o" "'; '.join(f\"stash {s['bytes']>>20} MiB (prepared {s.get('prepared', False)}): copy {s['copy_us']/1e3:.0f} ms ({s['bytes']/max(s['copy_us'],1)/1e3:.1f} GB/s), map and pin {(s.get('populate_us',0)+s['pin_us'])/1e3:.0f}, unpin {s.get('unpin_us',0)/1e3:.0f}, release {s.get('release_us',0)/1e3:.0f}; unstash: re-create {u.get('remap_us',0)/1e3:.0f}, copy {u['copy_us']/1e3:.0f} ms ({u['bytes']/max(u['copy_us'],1)/1e3:.1f} GB/s), pin {u['pin_us']/1e3:.0f}\" for r in d['preemption'] for s in [r['owned_memory']['stash']] for u in [r['owned_memory']['unstash']])")
  rows+=("| $g GiB | ptxmig, owned memory stashed | **$mo** (${down_o[*]}) | $(parts "$o"); $stash |")
  rows+=("| $g GiB | ptxmig, the driver's memory | **$md** (${down_d[*]}) | $(parts "$d1") |")
  rows+=("| $g GiB | the four driver calls | **$mb** (${down_b[*]}) | $(grep -v cuInit "$raw/bare-$g-1.txt" | tr '\n' ' ') |")
  rows+=("| $g GiB | **owned / driver's path**, **owned / bare calls** | **$(python3 -c "print(f'{$mo/$md:.2f}')")×**, **$(python3 -c "print(f'{$mo/$mb:.2f}')")×** | |")
  kill -9 "$p_owned" "$p_driver" 2>/dev/null || true
  sleep 1
done
how="--gpu to the other GPU and back"; [ -z "$u1" ] && how="--rehearse (one GPU)"
{
  echo "# bench-migrate $(date -u +%FT%TZ) on $(hostname): $ngpu x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0), migrate $how, $ROUNDS rounds"
  echo
  echo "| size | way | downtime ms, median (each round) | parts of round 1, ms |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/bench-migrate.md"
