#!/usr/bin/env bash
# bench-cr.sh — time ptxmig's checkpoint, restore and migrate against the bare baseline, per phase.
#
#   scripts/bench-cr.sh [SIZE_GIB...]        (default: 1 8 32; run as root)
#
# The workload holds SIZE GiB: on a host with GPUs, a `counter` process with SIZE GiB of device
# memory (BENCH_KIND=cuda, the default there); elsewhere, or with BENCH_KIND=cpu, `memhold`, a CPU
# process built here holding SIZE GiB of host memory in 4 MiB blocks that cycle random bytes,
# random bytes, slowly varying float32 values and written zeros. For each size it is checkpointed
# and restored by:
#   ptxmig                `ptxmig checkpoint` / `ptxmig restore` (JSON timings per phase), CRIU's
#                         images streamed into and out of the store (the default);
#   ptxmig --no-stream    CRIU writes into staging, the store reads that (restore: materialize);
#   ptxmig --owned-memory (BENCH_MODES with "owned"; CUDA only) the workload runs under `ptxmig run
#                         --owned-memory --preempt off` and holds 64 MiB it advances plus SIZE GiB
#                         - 64 MiB it never writes after the start (counter --frozen-mib, model
#                         weights); a first checkpoint --leave-running copies everything (the row
#                         compared with the baseline), a second one, which ends it, copies what
#                         changed; then the restore;
#   baseline              the driver calls made by a tiny C tool (cuckpt, built here: dlopen
#                         libcuda, cuCheckpointProcess* by PID, each call timed; CUDA only) plus
#                         plain `criu dump` / `criu restore -d` to the same disk, no store;
#   baseline, made durable  the same checkpoint followed by `sync -f` of CRIU's images: what
#                         ptxmig does before it reports an image (CRIU leaves its files in the
#                         page cache, so a host crash right after `criu dump` loses them).
# With two GPUs, also `ptxmig migrate --gpu 1` against the four driver calls back to back.
# Page cache is dropped before every restore (all sides read cold). Bytes on disk: `du` of the
# store after the checkpoint vs the CRIU image directory. Wall time is measured around each command.
# Environment: PTXMIG_BIN, PTXMIG_WORKLOADS (counter; CUDA only), PTXMIG_CRIU, PTXMIG_OUT
# (results; default ./results), BENCH_DIR (disk directory for stores and baseline images; default
# $PTXMIG_OUT/bench), BENCH_KIND (cuda|cpu), BENCH_MODES (ptxmig's modes: "stream staged", the
# default, "stream" alone to leave out --no-stream when time is short, "stream owned" or
# "stream staged owned").
# Output: a markdown table on stdout and in $PTXMIG_OUT/bench-cr.md, raw JSON in $PTXMIG_OUT/bench-cr/.
set -euo pipefail
PTXMIG_BIN=${PTXMIG_BIN:-$(command -v ptxmig || echo ./bin/ptxmig)}
CRIU=${PTXMIG_CRIU:-$(command -v criu)}
OUT=${PTXMIG_OUT:-$PWD/results}
BENCH_DIR=${BENCH_DIR:-$OUT/bench}
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(1 8 32)
[ "$(id -u)" -eq 0 ] || { echo "bench-cr: run as root" >&2; exit 1; }
ngpu=0; command -v nvidia-smi >/dev/null && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
kind=${BENCH_KIND:-$([ "$ngpu" -gt 0 ] && echo cuda || echo cpu)}
case $kind in
  cuda) [ "$ngpu" -ge 1 ] || { echo "bench-cr: BENCH_KIND=cuda needs a GPU" >&2; exit 1; }
        PTXMIG_WORKLOADS=${PTXMIG_WORKLOADS:?set PTXMIG_WORKLOADS to the compiled workloads (testdata/workloads/build.sh)} ;;
  cpu) ;;
  *) echo "bench-cr: BENCH_KIND is cuda or cpu" >&2; exit 2 ;;
esac
cuda() { [ "$kind" = cuda ]; }
read -r -a modes <<<"${BENCH_MODES:-stream staged}"
case " ${modes[*]} " in
  " stream " | " stream staged " | " staged stream " | " stream owned " | " stream staged owned ") ;;
  *) echo "bench-cr: BENCH_MODES is \"stream staged\", \"stream\", \"stream owned\" or \"stream staged owned\"" >&2; exit 2 ;;
esac
case " ${modes[*]} " in *" owned "*) cuda || { echo "bench-cr: owned needs BENCH_KIND=cuda" >&2; exit 2; } ;; esac
raw=$OUT/bench-cr; mkdir -p "$raw" "$BENCH_DIR"
work=$(mktemp -d); trap 'rm -rf "$work"; [ -n "${pid:-}" ] && kill -9 "$pid" 2>/dev/null; true' EXIT

cat >"$work/memhold.c" <<'EOF'
/* memhold MIB: hold MIB MiB of host memory, then print "step N" every 200 ms. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
  size_t n = (argc > 1 ? strtoull(argv[1], 0, 10) : 1) << 20, blk = 4 << 20;
  unsigned char *p = malloc(n);
  if (!p) { perror("malloc"); return 1; }
  uint64_t x = 88172645463325252ull;
  for (size_t off = 0; off < n; off += blk) {
    size_t len = n - off < blk ? n - off : blk, kind = (off / blk) % 4;
    if (kind < 2) {
      for (size_t i = 0; i + 8 <= len; i += 8) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; memcpy(p + off + i, &x, 8); }
    } else if (kind == 2) {
      float *f = (float *)(p + off);
      for (size_t i = 0; i < len / 4; i++) f[i] = 1.0f + (float)(i % 4096) * 1e-4f + (float)(off / blk) * 1e-3f;
    } else {
      memset(p + off, 0, len);
    }
  }
  for (unsigned long step = 1;; step++) { printf("step %lu %u\n", step, p[(step * 4099) % n]); fflush(stdout); usleep(200000); }
}
EOF
gcc -O2 -o "$work/memhold" "$work/memhold.c"

if cuda; then
gcc -O2 -o "$work/cuckpt" "$(dirname "$0")/cuckpt.c" -ldl
fi

ms() { echo "$(( ($(date +%s%N) - $1) / 1000000 ))"; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
start_workload() { # GiB [owned]
  : >"$work/counter.log"
  if [ "${2:-}" = owned ]; then
    setsid "$PTXMIG_BIN" run --owned-memory --preempt off --socket-dir "$work/sock" -- "$PTXMIG_WORKLOADS/counter" \
      --mib 64 --frozen-mib $(($1 * 1024 - 64)) --steps 1000000 --interval-ms 200 --device 0 </dev/null >>"$work/counter.log" 2>&1 &
  elif [ "$kind" = cuda ]; then
    setsid "$PTXMIG_WORKLOADS/counter" --mib $(($1 * 1024)) --steps 1000000 --interval-ms 200 --device 0 </dev/null >>"$work/counter.log" 2>&1 &
  else
    setsid "$work/memhold" $(($1 * 1024)) </dev/null >>"$work/counter.log" 2>&1 &
  fi
  pid=$!
  for _ in $(seq 1200); do grep -q '^step 2 ' "$work/counter.log" && return 0; sleep 0.2; done
  echo "workload did not start" >&2; cat "$work/counter.log" >&2; exit 1
}
# advances: the restored workload prints new steps.
advances() { local n; n=$(grep -c '^step ' "$work/counter.log"); for _ in $(seq 100); do [ "$(grep -c '^step ' "$work/counter.log")" -gt "$n" ] && return 0; sleep 0.1; done; echo "restored workload does not advance" >&2; return 1; }
gone() { for _ in $(seq 600); do [ -e "/proc/$1" ] || return 0; sleep 0.05; done; return 1; }
jq_ms() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(eval(sys.argv[2], {}, {'d': d, 't': {x['step']: x['duration_ns'] for x in d.get('timings', [])}}) / 1e6))" "$@"; }
phase() { jq_ms "$1" "t.get('$2', 0)"; }
# outside: wall ms of a command less the sum of its steps (starting ptxmig, probing the host, planning).
outside() { echo $(( $2 - $(jq_ms "$1" "sum(t.values())") )); }
# owned: what the save of the owned memory did (copied, skipped, GB/s).
owned() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d.get('preemption') or []:
    s=(r.get('owned_memory') or {}).get('save')
    if s: print(f\"copied {s['copied_bytes']>>20} MiB in {s['copy_ns']/1e6:.0f} ms = {s['copied_bytes']/max(s['copy_ns'],1):.1f} GB/s, skipped {s['skipped_bytes']>>20} MiB, hash {s['hash_ns']/1e6:.1f} ms\")
" "$1"; }
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
two() { cuda && [ "$ngpu" -ge 2 ]; }
uuid() { nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$1"; }
if two; then u0=$(uuid 0); u1=$(uuid 1); fi

# Warm-up, untimed: one small checkpoint and restore by each tool, so that the first timed row
# does not pay for loading CRIU, ptxmig and the driver from a cold page cache.
warm() {
  local store=$BENCH_DIR/warmup base=$BENCH_DIR/warmup-base
  rm -rf "$store" "$base"; mkdir -p "$base"
  if [ "$kind" = cuda ]; then
    setsid "$PTXMIG_WORKLOADS/counter" --mib 64 --steps 1000000 --interval-ms 200 --device 0 </dev/null >"$work/counter.log" 2>&1 &
  else
    setsid "$work/memhold" 64 </dev/null >"$work/counter.log" 2>&1 &
  fi
  pid=$!
  for _ in $(seq 600); do grep -q '^step 2 ' "$work/counter.log" && break; sleep 0.2; done
  "$PTXMIG_BIN" --store "$store" checkpoint --name warm "$pid" >/dev/null
  wait "$pid" 2>/dev/null || true; gone "$pid"
  "$PTXMIG_BIN" --store "$store" restore warm >/dev/null
  kill -9 "$pid"; gone "$pid" || true; pid=""
  rm -rf "$store" "$base"
}
warm
rows=()
for g in "${sizes[@]}"; do
  echo "== ${g} GiB ($kind)" >&2
  declare -A ck rs disk
  for mode in "${modes[@]}"; do
    store=$BENCH_DIR/store-$g-$mode; flag=(); [ "$mode" = staged ] && flag=(--no-stream)
    rm -rf "$store"
    start_workload "$g" "$mode"
    if [ "$mode" = owned ]; then
      t=$(date +%s%N); "$PTXMIG_BIN" --json --store "$store" checkpoint --leave-running --name "bench-$g-1" "$pid" >"$raw/ckpt-$g-owned-1.json"; ck[owned]=$(ms "$t")
      c1=$raw/ckpt-$g-owned-1.json
      rows+=("| $g GiB | ptxmig --owned-memory | checkpoint --leave-running | ${ck[owned]} (save $(phase "$c1" save-device-memory) [$(owned "$c1")], lock $(phase "$c1" lock), d->h $(phase "$c1" checkpoint), dump $(phase "$c1" dump), load back $(phase "$c1" load-device-memory), store $(phase "$c1" store)) | |")
      mode=owned2
    fi
    t=$(date +%s%N); "$PTXMIG_BIN" --json --store "$store" checkpoint "${flag[@]}" --name "bench-$g" "$pid" >"$raw/ckpt-$g-$mode.json"; ck[$mode]=$(ms "$t")
    wait "$pid" 2>/dev/null || true; gone "$pid"
    sync; disk[$mode]=$(du -sb "$store" | cut -f1)
    drop_caches
    t=$(date +%s%N); "$PTXMIG_BIN" --json --store "$store" restore "${flag[@]}" "bench-$g" >"$raw/rst-$g-$mode.json"; rs[$mode]=$(ms "$t")
    advances
    if [ "$mode" = stream ] && two; then
      t=$(date +%s%N); "$PTXMIG_BIN" --json migrate --gpu 1 "$pid" >"$raw/mig-$g.json"; p_mg=$(ms "$t")
    fi
    kill -9 "$pid"; gone "$pid" || true; pid=""
    rm -rf "$store"
    label=ptxmig; [ "$mode" = staged ] && label="ptxmig --no-stream"
    c=$raw/ckpt-$g-$mode.json r=$raw/rst-$g-$mode.json
    if [ "$mode" = owned2 ]; then
      rows+=("| $g GiB | ptxmig --owned-memory | 2nd checkpoint | ${ck[$mode]} (save $(phase "$c" save-device-memory) [$(owned "$c")], lock $(phase "$c" lock), d->h $(phase "$c" checkpoint), dump $(phase "$c" dump), store $(phase "$c" store)) | $((disk[$mode] >> 20)) MiB (both) |")
      rows+=("| $g GiB | ptxmig --owned-memory | restore | ${rs[$mode]} (criu $(phase "$r" criu-restore), h->d $(phase "$r" driver-restore), unlock $(phase "$r" unlock), load $(phase "$r" load-device-memory)) | |")
      rs[owned]=${rs[$mode]}
      continue
    fi
    rows+=("| $g GiB | $label | checkpoint | ${ck[$mode]} (lock $(phase "$c" lock), d->h $(phase "$c" checkpoint), dump $(phase "$c" dump), store $(phase "$c" store), end tree $(phase "$c" finish), outside the steps $(outside "$c" "${ck[$mode]}")) | $((disk[$mode] >> 20)) MiB |")
    rows+=("| $g GiB | $label | restore | ${rs[$mode]} (materialize $(jq_ms "$r" "d['materialize_ns']"), criu $(phase "$r" criu-restore), h->d $(phase "$r" driver-restore), unlock $(phase "$r" unlock)) | |")
  done
  base=$BENCH_DIR/base-$g
  rm -rf "$base"; mkdir -p "$base"
  start_workload "$g"
  : >"$raw/base-ck-$g.txt"; : >"$raw/base-rs-$g.txt"
  t=$(date +%s%N)
  if cuda; then "$work/cuckpt" "$pid" lock:10000 checkpoint >"$raw/base-ck-$g.txt"; fi
  t1=$(date +%s%N); "$CRIU" dump -t "$pid" -D "$base" -o dump.log; b_dump=$(ms "$t1")
  b_ck=$(ms "$t")
  # What ptxmig's store does before it reports an image: the files durable on disk (syncfs).
  t1=$(date +%s%N); sync -f "$base"; b_sync=$(ms "$t1"); b_cks=$((b_ck + b_sync))
  wait "$pid" 2>/dev/null || true; gone "$pid"
  sync; b_disk=$(du -sb "$base" | cut -f1)
  drop_caches
  t=$(date +%s%N); "$CRIU" restore -d -D "$base" -o restore.log; b_crest=$(ms "$t")
  if cuda; then "$work/cuckpt" "$pid" restore unlock >"$raw/base-rs-$g.txt"; fi
  b_rs=$(ms "$t")
  advances
  if two; then
    "$work/cuckpt" "$pid" lock:10000 checkpoint "restore:$u0=$u1,$u1=$u0" unlock >"$raw/base-mig-$g.txt"
    b_mg=$(awk '$1 != "cuInit" {s += $2} END {printf "%d", s}' "$raw/base-mig-$g.txt")
  fi
  kill -9 "$pid"; gone "$pid" || true; pid=""
  rm -rf "$base"
  rows+=("| $g GiB | baseline | checkpoint | $b_ck ($({ grep -v cuInit "$raw/base-ck-$g.txt" || true; } | tr '\n' ' ')criu dump $b_dump) | $((b_disk >> 20)) MiB |")
  rows+=("| $g GiB | baseline, made durable | checkpoint | $b_cks (the above, then \`sync -f\` of its images $b_sync) | |")
  rows+=("| $g GiB | baseline | restore | $b_rs (criu restore $b_crest $({ grep -v cuInit "$raw/base-rs-$g.txt" || true; } | tr '\n' ' ')) | |")
  nc="" nr=""
  if [ -n "${ck[staged]:-}" ]; then
    nc=" (--no-stream $(ratio "${ck[staged]}" "$b_ck")×)" nr=" (--no-stream $(ratio "${rs[staged]}" "$b_rs")×)"
  fi
  rows+=("| $g GiB | **ptxmig / baseline** | | checkpoint **$(ratio "${ck[stream]}" "$b_ck")×**$nc (**$(ratio "${ck[stream]}" "$b_cks")×** the durable baseline), restore **$(ratio "${rs[stream]}" "$b_rs")×**$nr | $(ratio "${disk[stream]}" "$b_disk")× |")
  if [ -n "${ck[owned]:-}" ]; then
    rows+=("| $g GiB | **ptxmig --owned-memory / baseline** | | checkpoint (1st, full copy) **$(ratio "${ck[owned]}" "$b_ck")×**, 2nd **$(ratio "${ck[owned2]}" "$b_ck")×**, restore **$(ratio "${rs[owned]}" "$b_rs")×** | |")
  fi
  if two; then
    m=$raw/mig-$g.json
    rows+=("| $g GiB | migrate | | downtime $(jq_ms "$m" "d['downtime_ns']") ms (lock $(jq_ms "$m" "d['lock_ns']"), d->h $(jq_ms "$m" "d['checkpoint_ns']"), h->d $(jq_ms "$m" "d['restore_ns']"), unlock $(jq_ms "$m" "d['unlock_ns']")); command $p_mg ms; driver calls $b_mg ms | |")
  fi
done
host="$(nproc) CPUs, kernel $(uname -r)"
if cuda; then host="$host, $ngpu x $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0)"; fi
{
  echo "# bench-cr $(date -u +%FT%TZ) on $(hostname): $kind workload, $host, $("$CRIU" --version | head -1), disk $(df --output=source "$BENCH_DIR" | tail -1)"
  echo
  echo "| size | tool | operation | wall ms (phases, ms) | bytes on disk |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/bench-cr.md"
