#!/usr/bin/env bash
# bench-train.sh — train.py steps/s with and without the shim, in pairs (target: the shim costs
# at most 2 %). Run by run.sh with the defaults; run it alone for more pairs:
#
#   bench-train.sh [PAIRS [AA_PAIRS]]        defaults 8 and 4
#
# Needs PTXMIG_BIN, PTXMIG_SHIM, PTXMIG_WORKLOADS and PTXMIG_OUT (gpu-e2e.sh sets them);
# TRAIN_RUN_FLAGS adds `ptxmig run` flags to the shimmed side (e.g. --owned-memory), and
# TRAIN_SELFTIME=0 leaves out the in-process runs. Writes
# $PTXMIG_OUT/shim/train-bench.txt, starting with "verdict MET|NOT_MET|INCONCLUSIVE", and
# train-aa.txt, starting with "control UNBIASED|BIASED"; the statistics follow.
#
# Method. The loop is CPU-bound (Python dispatch, ~2 ms/step, the GPU mostly idle); steps/s is
# taken over the steps after the first 20. Each pair runs a plain and a shimmed train.py at the
# same time, so both see the same host conditions (this host's CPU speed drifts by +-15 % between
# runs); with two GPUs one per GPU, with one GPU both on it; each pinned to its own CPUs when the
# host has 16. Which side starts first, and which CPUs and GPU each side gets, alternate between
# pairs: an A/A control (plain against plain) showed the side that starts second ~2.4 % slower on
# average. The per-pair ratio shim/plain still varies by ~6.5 % (sd) from one process to the
# next, so the verdict uses a 90 % bootstrap confidence interval of the median ratio: MET when the
# whole interval is within the target, NOT_MET when it is all beyond it, else INCONCLUSIVE. The
# A/A pairs measure the method's own noise with the same pairing (their interval should hold 0).
# A last shimmed run with PTXMIG_SELF_TIME=1 measures the shim's own time inside the process
# (train-selftime.txt): its share of the loop's wall time, free of the noise between processes,
# though blind to indirect costs (caches) and to hooked calls other than launches.
set -uo pipefail
: "${PTXMIG_BIN:?}" "${PTXMIG_SHIM:?}" "${PTXMIG_WORKLOADS:?}" "${PTXMIG_OUT:?}"
npairs=${1:-8}
naa=${2:-4}
target=2.0
out=$PTXMIG_OUT/shim
mkdir -p "$out"
sockdir=$(mktemp -d)
trap 'rm -rf "$sockdir"' EXIT
W=$PTXMIG_WORKLOADS
ngpu=$(nvidia-smi -L | wc -l)

train1() { # train1 KIND I GPU CPUS: one run (KIND shim: under the shim; else plain); steps/s and wall s to $out/train.KIND.I
  local f=$out/train.$1.$2 a b pin=() shim=()
  [ -n "$4" ] && command -v taskset >/dev/null && pin=(taskset -c "$4")
  # shellcheck disable=SC2206 # TRAIN_RUN_FLAGS is a list of flags
  [ "$1" = shim ] && shim=("$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sockdir" ${TRAIN_RUN_FLAGS:-} --)
  a=$(date +%s.%N)
  CUDA_VISIBLE_DEVICES=$3 "${pin[@]}" "${shim[@]}" python3 "$W/train.py" --steps 2000 --log-every 2000 --report-time >/dev/null 2>"$f"
  b=$(date +%s.%N)
  echo "wall_s $(python3 -c "print(f'{$b-$a:.2f}')")" >>"$f"
}
pair() { # pair KIND_A KIND_B I: one run of each at the same time
  local first=$1 second=$2 swap=$((($3 / 2) % 2)) ga=0 gb=0 ca="" cb=""
  [ $(($3 % 2)) -eq 1 ] && first=$2 second=$1
  [ "$ngpu" -ge 2 ] && { ga=$swap; gb=$((1 - swap)); }
  if [ "$(nproc)" -ge 16 ]; then
    ca=2-7 cb=10-15
    [ $swap -eq 1 ] && ca=10-15 cb=2-7
  fi
  local g1=$ga c1=$ca g2=$gb c2=$cb
  [ "$first" = "$1" ] || { g1=$gb c1=$cb g2=$ga c2=$ca; }
  train1 "$first" "$3" "$g1" "$c1" &
  train1 "$second" "$3" "$g2" "$c2" &
  wait
}
# summarize KIND_A KIND_B N: verdict and statistics of pairs 1..N (pair 0 is a discarded warm-up)
summarize() {
  python3 - "$out" "$target" "$@" <<'PY'
import random, statistics, sys
d, target, ka, kb, n = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
def read(kind, i):
    kv = dict(l.split() for l in open(f"{d}/train.{kind}.{i}") if l.startswith(("steps_per_s", "wall_s")))
    return float(kv["steps_per_s"]), float(kv["wall_s"])
a = [read(ka, i) for i in range(1, n + 1)]
b = [read(kb, i) for i in range(1, n + 1)]
ratios = [y[0] / x[0] for x, y in zip(a, b)]
rnd = random.Random(1)
meds = sorted(statistics.median(rnd.choices(ratios, k=n)) for _ in range(20000))
lo, hi = (1 - meds[int(0.95 * len(meds))]) * 100, (1 - meds[int(0.05 * len(meds))]) * 100
slow = (1 - statistics.median(ratios)) * 100
if ka == "plainA":  # the A/A control: its interval should hold 0
    print(f"control {'UNBIASED' if lo <= 0 <= hi else 'BIASED'} (interval {'holds' if lo <= 0 <= hi else 'excludes'} 0)")
else:
    print(f"verdict {'MET' if hi <= target else 'NOT_MET' if lo > target else 'INCONCLUSIVE'}")
print(f"slowdown {slow:.2f} % (median of {n} pairs), 90% CI [{lo:.1f}, {hi:.1f}] %")
print(f"ratios {' '.join(f'{r:.3f}' for r in ratios)} (mean {statistics.mean(ratios):.3f}, sd {statistics.stdev(ratios) if n > 1 else 0:.3f})")
print(f"{ka} " + " ".join(f"{x[0]:.1f}" for x in a) + f" (median {statistics.median(x[0] for x in a):.1f})")
print(f"{kb} " + " ".join(f"{x[0]:.1f}" for x in b) + f" (median {statistics.median(x[0] for x in b):.1f})")
print(f"wall {ka} median {statistics.median(x[1] for x in a):.2f} s, {kb} median {statistics.median(x[1] for x in b):.2f} s")
PY
}

# selftime TAG [VAR=VALUE...]: one shimmed run with PTXMIG_SELF_TIME=1 (and the given shim
# settings); two `ptxmig kernels` snapshots 3 s apart in the loop give the shim's own time per
# launch and its share of the loop's wall time, measured inside the process (no cross-process
# noise). Writes $out/train-selftime$TAG.txt.
selftime() {
  local tag=$1; shift
  rm -rf "${sockdir:?}"/*
  env PTXMIG_SELF_TIME=1 "$@" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sockdir" -- \
    python3 "$W/train.py" --steps 5000 --log-every 1000000 --report-time >/dev/null 2>"$out/train.selftime$tag" &
  local spid=$!
  python3 - "$PTXMIG_BIN" "$sockdir" >"$out/train-selftime$tag.raw" 2>&1 <<'PY'
import glob, json, os, subprocess, sys, time
ptxmig, sd = sys.argv[1], sys.argv[2]
def snap(pid):
    r = subprocess.run([ptxmig, "--json", "kernels", "--socket-dir", sd, str(pid)], capture_output=True, text=True)
    if r.returncode:
        return None
    d = json.loads(r.stdout)
    return time.monotonic(), d["total_launches"], d["self_time"]["launches"], d["self_time"]["ns"], d["self_time"]["clock_ns"]
deadline, pid, a = time.monotonic() + 120, None, None
while pid is None and time.monotonic() < deadline:
    s = glob.glob(os.path.join(sd, "*.sock"))
    pid = int(os.path.basename(s[0])[:-5]) if s else None
    time.sleep(0.1)
while pid and time.monotonic() < deadline:  # past start-up and the first 20 sampled launches per kernel
    a = snap(pid)
    if a and a[1] > 4000:
        break
    time.sleep(0.1)
time.sleep(3)
b = snap(pid) if a else None
if not (a and b):
    sys.exit("no snapshots in the loop")
dt, calls, ns = b[0] - a[0], b[2] - a[2], b[3] - a[3]
print(f"window_s {dt:.3f}\nlaunch_calls {calls}\nself_ns {ns}\nclock_ns {min(a[4], b[4])}")
PY
  wait $spid
  python3 - "$out" "$tag" >"$out/train-selftime$tag.txt" 2>&1 <<'PY'
import sys
d, tag = sys.argv[1], sys.argv[2]
kv = {}
for f in (f"train-selftime{tag}.raw", f"train.selftime{tag}"):
    for l in open(f"{d}/{f}"):
        p = l.split()
        if len(p) == 2 and p[0] in ("window_s", "launch_calls", "self_ns", "clock_ns", "steps_per_s"):
            kv[p[0]] = float(p[1])
dt, calls, ns, clk, sps = kv["window_s"], kv["launch_calls"], kv["self_ns"], kv["clock_ns"], kv["steps_per_s"]
share = ns / (dt * 1e9) * 100
net = max(ns - 2 * clk * calls, 0)
print(f"share {share:.3f}")
print(f"shim bookkeeping {share:.2f} % of the loop's wall time: {ns / calls:.0f} ns per launch, "
      f"{calls / dt / sps:.1f} launches per step, {ns / dt / sps / 1000:.2f} us per {1e6 / sps:.0f} us step "
      f"({calls:.0f} launches in a {dt:.2f} s window; {sps:.1f} steps/s with self-timing on); "
      f"without the 2 clock reads of {clk:.0f} ns each: {net / calls:.0f} ns per launch, {net / (dt * 1e9) * 100:.2f} %")
PY
}

pairing="concurrent on GPU 0"
[ "$ngpu" -ge 2 ] && pairing="concurrent on GPUs 0 and 1"
[ "$(nproc)" -ge 16 ] && pairing="$pairing, CPUs 2-7 / 10-15"
pairing="$pairing; start order, sides alternated; shimmed side: ptxmig run ${TRAIN_RUN_FLAGS:-}"
for i in $(seq 0 "$npairs"); do pair plain shim "$i"; done
for i in $(seq 0 "$naa"); do pair plainA plainB "$i"; done
if [ "${TRAIN_SELFTIME:-1}" != 0 ]; then
  selftime ""
  selftime -nosample PTXMIG_SAMPLE_FIRST=0 PTXMIG_SAMPLE_EVERY=0
fi
{ summarize plain shim "$npairs"; echo "pairing $pairing"; } >"$out/train-bench.txt" 2>&1
{ summarize plainA plainB "$naa"; echo "pairing $pairing"; } >"$out/train-aa.txt" 2>&1
cat "$out/train-bench.txt"
echo "A/A control:"
cat "$out/train-aa.txt"
[ "${TRAIN_SELFTIME:-1}" != 0 ] || exit 0
echo "in-process (PTXMIG_SELF_TIME=1):"
cat "$out/train-selftime.txt"
echo "in-process, GPU-time sampling off:"
cat "$out/train-selftime-nosample.txt"
