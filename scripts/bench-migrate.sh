#!/usr/bin/env bash
# bench-migrate.sh — migrate downtime: owned memory stashed in the process against the driver's
# path and the four bare driver calls, side by side in the same run.
#
#   scripts/bench-migrate.sh [SIZE_GIB...]        (default: 1 8; run as root on a GPU host)
#
# Three `counter` processes hold SIZE GiB of device memory each, the whole run long:
#   owned   under `ptxmig run --owned-memory --preempt off`: 64 MiB it advances every 200 ms and
#           SIZE GiB - 64 MiB it never writes after the start (counter --frozen-mib, as weights);
#           `ptxmig migrate` pre-copies it into the process's host memory while it runs, the stop
#           copies what changed since, and all of it device to device into memory ptxmig keeps on
#           the target GPU (the default), the driver moves the rest, the target copy comes back;
#   owned, host only  the same process, `ptxmig migrate --device-copy=false`: back from the host
#           stash (pinned again for the copy), as before the device-to-device copy;
#   owned, no pre-copy  the same process, `ptxmig migrate --precopy=false`: the stop copies it all;
#   owned, all advancing  a second owned process whose SIZE GiB all advance every step: pre-copy
#           cannot converge (the changed set is everything);
#   driver  under `ptxmig run --preempt off` (SIZE GiB advancing, the driver's own memory):
#           `ptxmig migrate` as before owned memory, the driver copies everything;
#   bare    the driver process again, moved by the four driver calls back to back (lock,
#           checkpoint, restore, unlock; scripts/cuckpt.c), their times summed.
# With two GPUs every migrate moves to the other GPU (--gpu 1, then --gpu 0 back); with one,
# `ptxmig migrate --rehearse` moves it onto its own GPU and the bare calls restore without pairs.
# Each round runs the six, in an order that alternates from round to round; BENCH_ROUNDS rounds
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

start() { # NAME GIB [owned|hot]: start a counter under ptxmig run; sets the global started
  local log=$work/$1.log
  : >"$log"
  if [ "${3:-}" = hot ]; then
    setsid "$PTXMIG_BIN" run --owned-memory --preempt off --socket-dir "$work/sock" -- "$PTXMIG_WORKLOADS/counter" \
      --mib $(($2 * 1024)) --steps 100000000 --interval-ms 200 --device 0 </dev/null >>"$log" 2>&1 &
  elif [ "${3:-}" = owned ]; then
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
move() { # NAME PID OUTJSON [FLAG...]: ptxmig migrate to the other GPU (or a rehearsal)
  local name=$1 pid=$2 out=$3; shift 3
  local args=(--rehearse "$@")
  if [ -n "$u1" ]; then
    local to=$((1 - ${where[$name]}))
    args=(--gpu "$to" "$@")
    where[$name]=$to
  fi
  "$PTXMIG_BIN" --json migrate "${args[@]}" "$pid" >"$out"
  advances "$name"
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
# summary WHAT FILE: a migrate's pre-copy rounds, its step times, or its stash and unstash, as text.
summary() {
  python3 - "$@" <<'PY'
import json, sys
what, d = sys.argv[1], json.load(open(sys.argv[2]))
owned = [r['owned_memory'] for r in d.get('preemption') or [] if r.get('owned_memory')]
if what == 'rounds':
    for o in owned:
        print('pre-copy rounds: ' + (', '.join('%d MiB in %.0f ms' % (x['bytes'] >> 20, x['copy_us'] / 1e3) for x in o.get('precopy') or []) or 'none'))
elif what == 'parts':
    print(', '.join('%s %.0f' % (k, d[k + '_ns'] / 1e6) for k in ['stash', 'lock', 'checkpoint', 'restore', 'unlock', 'unstash'] if d.get(k + '_ns')))
else:
    for o in owned:
        s, u = o['stash'], o['unstash']
        line = ('stash %d MiB (prepared %s, copied %d MiB in %.0f ms, %.1f GB/s, GPU hash %.0f ms, map and pin %.0f, unpin %.0f, release %.0f); '
                'unstash: re-create %.0f, pin %.0f, pin and copy %.0f ms' % (
                    s['bytes'] >> 20, s.get('prepared', False), s.get('copied_bytes', s['bytes']) >> 20, s['copy_us'] / 1e3,
                    s.get('copied_bytes', s['bytes']) / max(s['copy_us'], 1) / 1e3, s.get('hash_us', 0) / 1e3,
                    (s.get('populate_us', 0) + s['pin_us']) / 1e3, s.get('unpin_us', 0) / 1e3, s.get('release_us', 0) / 1e3,
                    u.get('remap_us', 0) / 1e3, u['pin_us'] / 1e3, u['copy_us'] / 1e3))
        t = s.get('target')
        if t:
            line += '; device copy to the target: %s %d MiB in %.1f ms (map %.1f ms)' % (
                'filled' if t.get('filled') else 'FAILED ' + t.get('error', ''), t.get('bytes', 0) >> 20, t.get('copy_us', 0) / 1e3, t.get('map_us', 0) / 1e3)
        line += '; unstash from %s%s' % (u.get('from', 'host'), ' (' + u['target_error'] + ')' if u.get('target_error') else '')
        if o.get('target_note'):
            line += '; ' + o['target_note']
        print(line)
PY
}
median() { python3 -c "import statistics,sys; print(round(statistics.median(float(x) for x in sys.argv[1:])))" "$@"; }

rows=()
for g in "${sizes[@]}"; do
  echo "== ${g} GiB" >&2
  start owned "$g" owned; p_owned=$started
  start hot "$g" hot; p_hot=$started
  start driver "$g"; p_driver=$started
  # (`ptxmig run` execs the counter: $! is the process.)
  where[owned]=0; where[hot]=0; where[driver]=0
  # Warm-up, untimed: the first migrate of each pays for loading ptxmig and the driver's paths.
  move owned "$p_owned" "$raw/warm-owned-$g.json"; move hot "$p_hot" "$raw/warm-hot-$g.json"
  move driver "$p_driver" "$raw/warm-driver-$g.json"
  down_o=() down_x=() down_n=() down_h=() down_d=() down_b=()
  for r in $(seq "$ROUNDS"); do
    order=(owned host nopre hot driver bare); [ $((r % 2)) = 0 ] && order=(bare driver hot nopre host owned)
    for w in "${order[@]}"; do
      case $w in
        owned) move owned "$p_owned" "$raw/owned-$g-$r.json"; down_o+=("$(j "$raw/owned-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        host) move owned "$p_owned" "$raw/host-$g-$r.json" --device-copy=false; down_x+=("$(j "$raw/host-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        nopre) move owned "$p_owned" "$raw/nopre-$g-$r.json" --precopy=false; down_n+=("$(j "$raw/nopre-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        hot) move hot "$p_hot" "$raw/hot-$g-$r.json"; down_h+=("$(j "$raw/hot-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        driver) move driver "$p_driver" "$raw/driver-$g-$r.json"; down_d+=("$(j "$raw/driver-$g-$r.json" "d['downtime_ns']/1e6")") ;;
        bare) bare "$p_driver" "$raw/bare-$g-$r.txt"; down_b+=("$(awk '$1 != "cuInit" {s += $2} END {printf "%.1f", s}' "$raw/bare-$g-$r.txt")") ;;
      esac
    done
  done
  mo=$(median "${down_o[@]}") mx=$(median "${down_x[@]}") mn=$(median "${down_n[@]}") mh=$(median "${down_h[@]}") md=$(median "${down_d[@]}") mb=$(median "${down_b[@]}")
  o=$raw/owned-$g-1.json d1=$raw/driver-$g-1.json
  rows+=("| $g GiB | ptxmig, owned memory, pre-copied (64 MiB advancing), device to device | **$mo** (${down_o[*]}) | $(summary rounds "$o"); $(summary parts "$o"); $(summary stash "$o") |")
  rows+=("| $g GiB | ptxmig, owned memory, pre-copied, --device-copy=false (host stash only) | **$mx** (${down_x[*]}) | $(summary parts "$raw/host-$g-1.json"); $(summary stash "$raw/host-$g-1.json") |")
  rows+=("| $g GiB | ptxmig, owned memory, --precopy=false | **$mn** (${down_n[*]}) | $(summary parts "$raw/nopre-$g-1.json"); $(summary stash "$raw/nopre-$g-1.json") |")
  rows+=("| $g GiB | ptxmig, owned memory, all advancing | **$mh** (${down_h[*]}) | $(summary rounds "$raw/hot-$g-1.json"); $(summary parts "$raw/hot-$g-1.json"); $(summary stash "$raw/hot-$g-1.json") |")
  rows+=("| $g GiB | ptxmig, the driver's memory | **$md** (${down_d[*]}) | $(summary parts "$d1") |")
  rows+=("| $g GiB | the four driver calls | **$mb** (${down_b[*]}) | $(grep -v cuInit "$raw/bare-$g-1.txt" | tr '\n' ' ') |")
  rows+=("| $g GiB | **owned pre-copied / driver's path**, **/ bare calls**; device to device / host stash only; no pre-copy / driver's path; all advancing / driver's path | **$(python3 -c "print(f'{$mo/$md:.2f}')")×**, **$(python3 -c "print(f'{$mo/$mb:.2f}')")×**; $(python3 -c "print(f'{$mo/$mx:.2f}')")×; $(python3 -c "print(f'{$mn/$md:.2f}')")×; $(python3 -c "print(f'{$mh/$md:.2f}')")× | |")
  kill -9 "$p_owned" "$p_hot" "$p_driver" 2>/dev/null || true
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
