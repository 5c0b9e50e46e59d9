#!/usr/bin/env bash
# bench-job.sh — a PyTorch DDP job (one rank per GPU) checkpointed, restored and migrated by ptxmig
# against the bare baseline, and what NCCL over sockets costs its all-reduce.
#
#   bench/bench-job.sh [RANKS]     (default: every GPU, at most 4; root; a host with 2+ GPUs)
#
# 1. All-reduce bus bandwidth (allreduce_bw.py, 1, 16 and 256 MiB) with NCCL's default transports
#    and with the ones `ptxmig run --nccl-sockets` sets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
#    NCCL_CUMEM_ENABLE=0), one after the other on the same GPUs.
# 2. ptxmig: ddp.py under `ptxmig run --nccl-sockets` (200 ms sleep a step, so the ranks are
#    mostly between collectives, as for the baseline); `ptxmig checkpoint --tcp-established` (ends
#    the job), `ptxmig restore`, then `ptxmig migrate` of the whole job with its GPUs rotated.
# 3. Baseline: the same job started plainly with the same transports; the ranks' driver calls by
#    cuckpt (bench/cuckpt.c; all ranks at once, each lock bounded to 10 s: a rank whose lock waits
#    for a rank already locked times out, and the row says so), plain `criu dump --tcp-established`
#    of the tree + `sync -f` of its images, `criu restore -d`, the ranks' driver restore + unlock;
#    and the driver's migrate: each rank lock, checkpoint, restore with the rotated pairs, unlock.
# Wall time around each command; ptxmig's JSON keeps its own per-step timings.
# Environment: PTXMIG_BIN, PTXMIG_SHIM, PTXMIG_WORKLOADS (ddp.py, allreduce_bw.py), PTXMIG_CRIU,
# PTXMIG_OUT (results; default ./results), BENCH_DIR (store and baseline images; default
# $PTXMIG_OUT/bench-job). Output: a markdown table on stdout and in $PTXMIG_OUT/bench-job.md, raw
# JSON and logs in $PTXMIG_OUT/bench-job/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PTXMIG_BIN=${PTXMIG_BIN:-$(command -v ptxmig || echo ./bin/ptxmig)}
SHIM=${PTXMIG_SHIM:?PTXMIG_SHIM: the libptxmig.so to run the job under}
WL=${PTXMIG_WORKLOADS:?PTXMIG_WORKLOADS: the directory with ddp.py and allreduce_bw.py}
CRIU=${PTXMIG_CRIU:-$(command -v criu)}
OUT=${PTXMIG_OUT:-$PWD/results}
BENCH_DIR=${BENCH_DIR:-$OUT/bench-job}
export NCCL_NVLS_ENABLE=0
sockets=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0 USE_LIBUV=0)

[ "$(id -u)" = 0 ] || { echo "bench-job: run as root" >&2; exit 1; }
gpus=$(nvidia-smi -L | wc -l)
ranks=${1:-$(( gpus < 4 ? gpus : 4 ))}
if [ "$ranks" -lt 2 ] || [ "$ranks" -gt "$gpus" ]; then echo "bench-job: needs 2..$gpus ranks, got $ranks" >&2; exit 2; fi
raw=$OUT/bench-job
rm -rf "$BENCH_DIR/store" "$BENCH_DIR/base"
mkdir -p "$raw" "$BENCH_DIR"
store=$BENCH_DIR/store
work=$(mktemp -d)
gcc -O2 -o "$work/cuckpt" "$here/cuckpt.c" -ldl

ms() { echo "$(( ($(date +%s%N) - $1) / 1000000 ))"; }
jq_ms() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round($2/1e6))" "$1"; }
uuids=()
while IFS=, read -r _ u; do uuids+=("$(echo "$u" | tr -d ' ')"); done < <(nvidia-smi --query-gpu=index,uuid --format=csv,noheader)
rot_map() { local i out=""; for ((i = 0; i < ranks; i++)); do out+="${out:+,}$i=$(( (i + $1 + ranks) % ranks ))"; done; echo "$out"; }
# rot_pairs BY: the driver's pairs for every GPU of the host, the job's GPUs rotated by BY.
rot_pairs() {
  local i j out=""
  for ((i = 0; i < gpus; i++)); do
    j=$i; [ "$i" -lt "$ranks" ] && j=$(( (i + $1 + ranks) % ranks ))
    out+="${out:+,}${uuids[$i]}=${uuids[$j]}"
  done
  echo "$out"
}
# job_ranks ROOT: the pids of ROOT's tree that hold GPU memory.
job_ranks() {
  local tree p
  tree=" $(ps -o pid= --ppid "$1" | tr '\n' ' ') "
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
    [[ "$tree" == *" $p "* ]] && echo "$p"
  done
}
# tree ROOT: ROOT and its descendants.
tree() { local c; echo "$1"; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
# gone PID...: wait (at most 60 s) until none of the pids lives: CRIU ends the whole tree, and
# a rank still closing its sockets keeps the job's ports bound for the restore.
gone() {
  local p i
  for p in "$@"; do
    for ((i = 0; i < 600; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$p" 2>/dev/null && { echo "bench-job: pid $p still lives 60 s after the checkpoint" >&2; return 1; }
  done
  return 0
}
wait_for() { # FILE PATTERN SECONDS
  local i
  for ((i = 0; i < $3 * 10; i++)); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "bench-job: no '$2' in $1 after $3 s" >&2; tail -20 "$1" >&2; return 1
}
jobs_started=()
cleanup() { for p in "${jobs_started[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
start_job() { # LOG PORT CMD...: the job in a session of its own (no job control here: setsid
  # execs, so $! is the job's root); sets root
  local log=$1 port=$2
  shift 2
  setsid "$@" python3 "$WL/ddp.py" --world "$ranks" --steps 1000000 --sleep-ms 200 --log-every 1 --port "$port" >"$log" 2>&1 &
  root=$!
  jobs_started+=("$root")
  wait_for "$log" "^step 5 " 300
}
# each_rank OUT_PREFIX ACTION...: cuckpt on every rank at once; fails if one failed.
each_rank() {
  local prefix=$1 r pids=() ok=0
  shift
  for r in "${rk[@]}"; do "$work/cuckpt" "$r" "$@" >"$prefix-$r.txt" 2>&1 & pids+=($!); done
  for r in "${pids[@]}"; do wait "$r" || ok=1; done
  return $ok
}
progress() { # LOG: wait (at most 120 s) for a new step line
  local n i
  n=$(grep -c '^step ' "$1")
  for ((i = 0; i < 2400; i++)); do [ "$(grep -c '^step ' "$1")" -gt "$n" ] && return 0; sleep 0.05; done
  echo "bench-job: the job made no progress in 120 s ($1)" >&2
  return 1
}
rows=()

# 1. All-reduce bandwidth.
python3 "$WL/allreduce_bw.py" --world "$ranks" --port 29711 >"$raw/allreduce-default.txt"
env "${sockets[@]}" python3 "$WL/allreduce_bw.py" --world "$ranks" --port 29712 >"$raw/allreduce-sockets.txt"
while read -r _ mib us bw; do
  read -r _ _ sus sbw < <(grep "^allreduce $mib " "$raw/allreduce-sockets.txt")
  ratio=$(python3 -c "print(f'{$bw/$sbw:.1f}' if $sbw > 0 else '-')")
  rows+=("| all-reduce $mib MiB, bus bandwidth | sockets: $sbw GB/s ($sus µs) | NCCL's default transports: $bw GB/s ($us µs) | default / sockets **${ratio}×** |")
done <"$raw/allreduce-default.txt"

# 2. ptxmig.
log=$raw/job-ptxmig.log
start_job "$log" 29713 "$PTXMIG_BIN" run --shim "$SHIM" --socket-dir "$work/sock" --nccl-sockets --
mapfile -t all < <(tree "$root")
t=$(date +%s%N)
"$PTXMIG_BIN" --json --store "$store" checkpoint --tcp-established --lock-timeout 10s --name job "$root" >"$raw/ptxmig-ck.json"
p_ck=$(ms "$t")
gone "${all[@]}"
sync; echo 3 >/proc/sys/vm/drop_caches
t=$(date +%s%N)
"$PTXMIG_BIN" --json --store "$store" restore job >"$raw/ptxmig-rs.json"
p_rs=$(ms "$t")
progress "$log"
"$PTXMIG_BIN" --json migrate --gpu-map "$(rot_map 1)" "$root" >"$raw/ptxmig-mig.json"
p_mig=$(jq_ms "$raw/ptxmig-mig.json" "d['downtime_ns']")
kill -KILL -- "-$root" 2>/dev/null || true

# 3. Baseline: the same job plainly, the driver calls and CRIU by hand.
log=$raw/job-bare.log
start_job "$log" 29714 env "${sockets[@]}"
mapfile -t rk < <(job_ranks "$root")
mapfile -t all < <(tree "$root")
[ "${#rk[@]}" = "$ranks" ] || { echo "bench-job: found ranks ${rk[*]}, want $ranks" >&2; exit 1; }
bare_ok=yes
base=$BENCH_DIR/base
# The connection lock ptxmig chooses: nftables where this CRIU has it, else iptables.
netlock=nftables
"$CRIU" check --feature network_lock_nftables >/dev/null 2>&1 || netlock=iptables
# criu_failed LOG: the reason a bare CRIU command failed, from its log, for the row and stderr.
criu_failed() { grep -m3 'Error' "$1" | tee /dev/stderr | head -1 | sed 's/|/\\|/g'; }
mkdir -p "$base"
t=$(date +%s%N)
each_rank "$raw/base-ck" lock:10000 checkpoint || bare_ok="no: a rank's lock or checkpoint failed (bench-job/base-ck-*.txt)"
b_drv=$(ms "$t")
if [ "$bare_ok" = yes ]; then
  t=$(date +%s%N)
  "$CRIU" dump -t "$root" -D "$base" -o dump.log --tcp-established --network-lock "$netlock" --ghost-limit 1G --file-locks ||
    bare_ok="no: criu dump failed: $(criu_failed "$base/dump.log")"
  b_dump=$(ms "$t")
fi
if [ "$bare_ok" = yes ]; then
  t=$(date +%s%N); sync -f "$base"/*.img; b_sync=$(ms "$t")
  gone "${all[@]}"
  sync; echo 3 >/proc/sys/vm/drop_caches
  t=$(date +%s%N)
  "$CRIU" restore -d -D "$base" -o restore.log --tcp-established --network-lock "$netlock" --file-locks --manage-cgroups=ignore ||
    bare_ok="no: criu restore failed: $(criu_failed "$base/restore.log")"
  b_crest=$(ms "$t")
fi
if [ "$bare_ok" = yes ]; then
  t=$(date +%s%N)
  each_rank "$raw/base-rs" restore unlock || bare_ok="no: a rank's driver restore failed (bench-job/base-rs-*.txt)"
  b_drs=$(ms "$t")
fi
if [ "$bare_ok" = yes ]; then
  rows+=("| checkpoint (ends the job) | ptxmig $p_ck ms | driver calls $b_drv ms + \`criu dump\` $b_dump ms + \`sync -f\` $b_sync ms = $((b_drv + b_dump + b_sync)) ms | **$(python3 -c "print(f'{$p_ck/($b_drv+$b_dump+$b_sync):.2f}')")×** |")
  rows+=("| restore | ptxmig $p_rs ms | \`criu restore\` $b_crest ms + driver calls $b_drs ms = $((b_crest + b_drs)) ms | **$(python3 -c "print(f'{$p_rs/($b_crest+$b_drs):.2f}')")×** |")
  progress "$log"
  t=$(date +%s%N)
  if each_rank "$raw/base-mig" lock:10000 checkpoint "restore:$(rot_pairs 1)" unlock; then
    b_mig=$(ms "$t")
    rows+=("| migrate downtime, GPUs rotated | ptxmig $p_mig ms | the ranks' four driver calls, all ranks at once: $b_mig ms | **$(python3 -c "print(f'{$p_mig/$b_mig:.2f}')")×** |")
  else
    bare_ok="no: a rank's driver migrate failed (bench-job/base-mig-*.txt)"
  fi
fi
[ "$bare_ok" = yes ] || rows+=("| baseline | ptxmig: checkpoint $p_ck ms, restore $p_rs ms, migrate $p_mig ms | $bare_ok | – |")

{
  echo "# bench-job $(date -u +%FT%TZ) on $(hostname): $ranks ranks, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $("$CRIU" --version | head -1)"
  echo
  echo "| what | ptxmig / sockets | baseline | ratio |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/bench-job.md"
