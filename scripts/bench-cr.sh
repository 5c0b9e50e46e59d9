#!/usr/bin/env bash
# bench-cr.sh — time ptxmig's checkpoint, restore and migrate against the bare baseline, per phase.
#
#   scripts/bench-cr.sh [SIZE_GIB...]        (default: 1 8 32; run as root on a host with 2 GPUs)
#
# For each size, a `counter` process holding SIZE GiB of device memory is:
#   ptxmig:   `ptxmig checkpoint` (JSON timings: lock, device->host, dump, store), `ptxmig restore`
#             (materialize, criu restore, host->device, unlock), and `ptxmig migrate --gpu 1`
#             (lock, checkpoint, restore, unlock, downtime) — wall time measured around each command;
#   baseline: the same driver calls made by a tiny C tool (cuckpt, built here from the source
#             below: dlopen libcuda, cuCheckpointProcess* by PID, one cuInit, each call timed) plus
#             plain `criu dump` / `criu restore -d` to the same disk, by hand, no store; and for
#             migrate, the four driver calls back to back in one cuckpt process.
# Page cache is dropped before every restore (both sides read cold). Bytes on disk: `du` of the
# store after the checkpoint vs the CRIU image directory.
# Environment: PTXMIG_BIN, PTXMIG_WORKLOADS (counter), PTXMIG_CRIU, PTXMIG_OUT (results; default
# ./results), BENCH_DIR (disk directory for store and baseline images; default $PTXMIG_OUT/bench).
# Output: a markdown table on stdout and in $PTXMIG_OUT/bench-cr.md, raw JSON in $PTXMIG_OUT/bench-cr/.
set -euo pipefail
PTXMIG_BIN=${PTXMIG_BIN:-$(command -v ptxmig || echo ./bin/ptxmig)}
PTXMIG_WORKLOADS=${PTXMIG_WORKLOADS:?set PTXMIG_WORKLOADS to the compiled workloads (testdata/workloads/build.sh)}
CRIU=${PTXMIG_CRIU:-$(command -v criu)}
OUT=${PTXMIG_OUT:-$PWD/results}
BENCH_DIR=${BENCH_DIR:-$OUT/bench}
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(1 8 32)
[ "$(id -u)" -eq 0 ] || { echo "bench-cr: run as root" >&2; exit 1; }
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "bench-cr: needs 2 GPUs" >&2; exit 1; }
raw=$OUT/bench-cr; mkdir -p "$raw" "$BENCH_DIR"
work=$(mktemp -d); trap 'rm -rf "$work"; [ -n "${pid:-}" ] && kill -9 "$pid" 2>/dev/null; true' EXIT

cat >"$work/cuckpt.c" <<'EOF'
/* cuckpt PID ACTION... — the driver checkpoint API by PID, each call timed (like cuda-checkpoint).
 * ACTION: lock[:TIMEOUT_MS] | checkpoint | restore[:OLD=NEW[,OLD=NEW...]] | unlock | state
 * Prints "ACTION MS" per call; exits 1 on the first failure. No CUDA headers: types declared here. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef struct { unsigned char b[16]; } uuid_t_;
typedef struct { unsigned int timeoutMs, r0; uint64_t r1[7]; } lock_args;
typedef struct { uint64_t r[8]; } plain_args;
typedef struct { uuid_t_ o, n; } pair;
typedef struct { pair *pairs; unsigned int count; char r[44]; uint64_t r1; } restore_args;
static int (*cuInit)(unsigned), (*getState)(int, int *), (*lockp)(int, lock_args *), (*ckpt)(int, plain_args *),
    (*rest)(int, restore_args *), (*unlock)(int, plain_args *), (*errname)(int, const char **);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
static int parse_uuid(const char *s, uuid_t_ *u) {
  if (!strncmp(s, "GPU-", 4)) s += 4;
  int n = 0;
  for (; *s && n < 32; s++) {
    if (*s == '-') continue;
    int v = (*s >= '0' && *s <= '9') ? *s - '0' : (*s >= 'a' && *s <= 'f') ? *s - 'a' + 10 : -1;
    if (v < 0) return -1;
    u->b[n / 2] = n % 2 ? u->b[n / 2] | v : v << 4;
    n++;
  }
  return n == 32 ? 0 : -1;
}
int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: cuckpt PID ACTION...\n"); return 2; }
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "no NVIDIA driver: %s\n", dlerror()); return 1; }
  *(void **)&cuInit = dlsym(h, "cuInit"); *(void **)&getState = dlsym(h, "cuCheckpointProcessGetState");
  *(void **)&lockp = dlsym(h, "cuCheckpointProcessLock"); *(void **)&ckpt = dlsym(h, "cuCheckpointProcessCheckpoint");
  *(void **)&rest = dlsym(h, "cuCheckpointProcessRestore"); *(void **)&unlock = dlsym(h, "cuCheckpointProcessUnlock");
  *(void **)&errname = dlsym(h, "cuGetErrorName");
  if (!cuInit || !getState || !lockp || !ckpt || !rest || !unlock) { fprintf(stderr, "driver lacks the checkpoint API\n"); return 1; }
  double t0 = now();
  if (cuInit(0)) { fprintf(stderr, "cuInit failed\n"); return 1; }
  printf("cuInit %.1f\n", now() - t0);
  int pid = atoi(argv[1]);
  for (int i = 2; i < argc; i++) {
    char *a = argv[i], *arg = strchr(a, ':');
    if (arg) *arg++ = 0;
    int r = 0; double s = now();
    if (!strcmp(a, "lock")) { lock_args l; memset(&l, 0, sizeof l); l.timeoutMs = arg ? atoi(arg) : 0; r = lockp(pid, &l); }
    else if (!strcmp(a, "checkpoint")) { plain_args p; memset(&p, 0, sizeof p); r = ckpt(pid, &p); }
    else if (!strcmp(a, "unlock")) { plain_args p; memset(&p, 0, sizeof p); r = unlock(pid, &p); }
    else if (!strcmp(a, "state")) { int st = -1; r = getState(pid, &st); printf("state %d\n", st); }
    else if (!strcmp(a, "restore")) {
      pair pairs[16]; unsigned n = 0; restore_args ra; memset(&ra, 0, sizeof ra);
      for (char *tok = arg ? strtok(arg, ",") : NULL; tok && n < 16; tok = strtok(NULL, ",")) {
        char *eq = strchr(tok, '='); if (!eq) { fprintf(stderr, "bad pair %s\n", tok); return 2; }
        *eq = 0;
        if (parse_uuid(tok, &pairs[n].o) || parse_uuid(eq + 1, &pairs[n].n)) { fprintf(stderr, "bad uuid\n"); return 2; }
        n++;
      }
      if (n) { ra.pairs = pairs; ra.count = n; }
      r = rest(pid, &ra);
    } else { fprintf(stderr, "unknown action %s\n", a); return 2; }
    if (r) { const char *e = "?"; if (errname) errname(r, &e); fprintf(stderr, "%s: %s (%d)\n", a, e, r); return 1; }
    printf("%s %.1f\n", a, now() - s);
  }
  return 0;
}
EOF
gcc -O2 -o "$work/cuckpt" "$work/cuckpt.c" -ldl

ms() { echo "$(( ($(date +%s%N) - $1) / 1000000 ))"; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
start_counter() { # GiB
  : >"$work/counter.log"
  setsid "$PTXMIG_WORKLOADS/counter" --mib $(($1 * 1024)) --steps 1000000 --interval-ms 200 --device 0 </dev/null >>"$work/counter.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q '^step 2 ' "$work/counter.log" && return 0; sleep 0.2; done
  echo "counter did not start" >&2; cat "$work/counter.log" >&2; exit 1
}
gone() { for _ in $(seq 600); do [ -e "/proc/$1" ] || return 0; sleep 0.05; done; return 1; }
jq_ms() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(eval(sys.argv[2], {}, {'d': d, 't': {x['step']: x['duration_ns'] for x in d.get('timings', [])}}) / 1e6))" "$@"; }
uuid() { nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$1"; }
u0=$(uuid 0); u1=$(uuid 1)

rows=()
for g in "${sizes[@]}"; do
  echo "== ${g} GiB" >&2
  store=$BENCH_DIR/store-$g base=$BENCH_DIR/base-$g
  rm -rf "$store" "$base"; mkdir -p "$base"
  # --- ptxmig checkpoint / restore
  start_counter "$g"
  t=$(date +%s%N); "$PTXMIG_BIN" --json --store "$store" checkpoint --name "bench-$g" "$pid" >"$raw/ckpt-$g.json"; p_ck=$(ms "$t")
  wait "$pid" 2>/dev/null || true; gone "$pid"
  p_disk=$(du -sb "$store" | cut -f1)
  drop_caches
  t=$(date +%s%N); "$PTXMIG_BIN" --json --store "$store" restore "bench-$g" >"$raw/rst-$g.json"; p_rs=$(ms "$t")
  # --- ptxmig migrate (the restored process, GPU 0 -> 1)
  t=$(date +%s%N); "$PTXMIG_BIN" --json migrate --gpu 1 "$pid" >"$raw/mig-$g.json"; p_mg=$(ms "$t")
  kill -9 "$pid"; gone "$pid" || true; pid=""
  # --- baseline: driver calls + plain criu, by hand
  start_counter "$g"
  t=$(date +%s%N)
  "$work/cuckpt" "$pid" lock:10000 checkpoint >"$raw/base-ck-$g.txt"
  t1=$(date +%s%N); "$CRIU" dump -t "$pid" -D "$base" -o dump.log; b_dump=$(ms "$t1")
  b_ck=$(ms "$t"); wait "$pid" 2>/dev/null || true; gone "$pid"
  sync; b_disk=$(du -sb "$base" | cut -f1)
  drop_caches
  t=$(date +%s%N); "$CRIU" restore -d -D "$base" -o restore.log; b_crest=$(ms "$t")
  "$work/cuckpt" "$pid" restore unlock >"$raw/base-rs-$g.txt"; b_rs=$(ms "$t")
  # baseline migrate: the four driver calls back to back in one process (the driver's own time)
  "$work/cuckpt" "$pid" lock:10000 checkpoint "restore:$u0=$u1,$u1=$u0" unlock >"$raw/base-mig-$g.txt"
  b_mg=$(awk '$1 != "cuInit" {s += $2} END {printf "%d", s}' "$raw/base-mig-$g.txt")
  kill -9 "$pid"; gone "$pid" || true; pid=""
  rm -rf "$base" "$store"
  rows+=("| $g GiB | checkpoint | $p_ck ms (lock $(jq_ms "$raw/ckpt-$g.json" "t['lock']"), d->h $(jq_ms "$raw/ckpt-$g.json" "t['checkpoint']"), dump $(jq_ms "$raw/ckpt-$g.json" "t['dump']"), store $(jq_ms "$raw/ckpt-$g.json" "t['store']")) | $b_ck ms ($(tr '\n' ' ' <"$raw/base-ck-$g.txt")dump $b_dump) | $((p_disk >> 20)) MiB vs $((b_disk >> 20)) MiB |")
  rows+=("| $g GiB | restore | $p_rs ms (materialize $(jq_ms "$raw/rst-$g.json" "d['materialize_ns']"), criu $(jq_ms "$raw/rst-$g.json" "t['criu-restore']"), h->d $(jq_ms "$raw/rst-$g.json" "t['driver-restore']"), unlock $(jq_ms "$raw/rst-$g.json" "t['unlock']")) | $b_rs ms (criu restore $b_crest, $(tr '\n' ' ' <"$raw/base-rs-$g.txt")) | |")
  rows+=("| $g GiB | migrate | downtime $(jq_ms "$raw/mig-$g.json" "d['downtime_ns']") ms (lock $(jq_ms "$raw/mig-$g.json" "d['lock_ns']"), d->h $(jq_ms "$raw/mig-$g.json" "d['checkpoint_ns']"), h->d $(jq_ms "$raw/mig-$g.json" "d['restore_ns']"), unlock $(jq_ms "$raw/mig-$g.json" "d['unlock_ns']")); command $p_mg ms | driver calls $b_mg ms ($(grep -v cuInit "$raw/base-mig-$g.txt" | tr '\n' ' ')) | |")
done
{
  echo "# bench-cr $(date -u +%FT%TZ) on $(hostname), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0)"
  echo
  echo "| size | operation | ptxmig (end to end, phases in ms) | baseline (driver calls + plain criu, ms) | bytes on disk (ptxmig vs criu) |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/bench-cr.md"
