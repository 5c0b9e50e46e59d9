#!/usr/bin/env bash
# bench-midblock.sh — what mid-block twins cost applications under `ptxmig run`: each app run
# plain, under `ptxmig run` with block-granular twins only (--mid-block=false) and with mid-block twins
# (--mid-block), in a rotating order, ROUNDS times (after an untimed round that fills the
# instrumentation caches). Metric: the whole run's wall time; per app and way the median ratio to
# the same round's plain run. Every run's verdict lines must equal the plain run's (exit 1
# otherwise). MODE (default always; auto for what operators get: only kernels sampled over
# PTXMIG_PREEMPT_MIN_US get twins).
#
#   bench/bench-midblock.sh [ROUNDS]        (default 3; root on a GPU host, from a gpu bundle)
#
# Apps: longgrid with fixed work (hashgrid: a mid-block twin with 3 sites) and public
# NVIDIA/cuda-samples built here for sm_90 with PTX (the bundle's samples/): matrixMul 4096^2
# (barriers in a tile loop), fastWalshTransform, convolutionSeparable, histogram. BENCH_APPS picks.
# Output: $PTXMIG_OUT/bench-midblock.md, bench-midblock.raw, bench-midblock-logs/.
set -euo pipefail
rounds=${1:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
PTXMIG_BIN=${PTXMIG_BIN:-$here/ptxmig}
PTXMIG_SHIM=${PTXMIG_SHIM:-$here/libptxmig.so}
W=${PTXMIG_WORKLOADS:-$here/workloads/bin}
OUT=${PTXMIG_OUT:-$PWD/results}
MODE=${MODE:-always}
[ "$(id -u)" -eq 0 ] || { echo "bench-midblock: run as root" >&2; exit 1; }
[ -x "$W/longgrid" ] || { echo "bench-midblock: no workloads in $W (./gpu-e2e.sh --only workloads)" >&2; exit 1; }
export PATH=/usr/local/cuda/bin:$PATH
logs=$OUT/bench-midblock-logs raw=$OUT/bench-midblock.raw
mkdir -p "$logs"; : >"$raw"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
declare -A cmd
cmd[longgrid]="$W/longgrid --blocks 2000000 --work 16384"
for s in matrixMul fastWalshTransform convolutionSeparable histogram; do
  [ -d "$here/samples/$s" ] || continue
  ( cd "$here/samples/$s" && shopt -s nullglob && nvcc -O3 -std=c++17 -I../Common -gencode arch=compute_90,code=sm_90 \
      -gencode arch=compute_90,code=compute_90 -o "$work/$s" ./*.cu ./*.cpp -lpthread >"$logs/build-$s.log" 2>&1 ) &&
    cmd[$s]="$work/$s" || echo "bench-midblock: sample $s did not build (bench-midblock-logs/build-$s.log)" >&2
done
[ -n "${cmd[matrixMul]:-}" ] && cmd[matrixMul]="${cmd[matrixMul]} -wA=4096 -hA=4096 -wB=4096 -hB=4096"
if [ -n "${BENCH_APPS:-}" ]; then read -ra apps <<<"$BENCH_APPS"; else apps=(longgrid matrixMul fastWalshTransform convolutionSeparable histogram); fi
export VERDICT_KEEP='^(final|checksum|result|part )|^\s*\.\.\.|Test passed|Test failed|PASS|FAIL|[Pp]assed|[Ff]ailed|[Ee]rror'
export VERDICT_DROP='time|[Tt]hroughput|GFlop|GB/s|[0-9]+\.[0-9]+ *(ms|s|sec)\b|msec|MOptions|Gops'
run1() {  # APP WAY TAG
  local app=$1 way=$2 tag=$3 pre=() a b rc=0
  case $way in
    plain) ;;
    block) pre=(env PTXMIG_PTX_CACHE="$work/cache-block" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$work/sock" --preempt "$MODE" --mid-block=false --) ;;
    mid) pre=(env PTXMIG_PTX_CACHE="$work/cache-mid" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$work/sock" --preempt "$MODE" --mid-block --) ;;
  esac
  a=$(date +%s%N)
  # shellcheck disable=SC2086  # cmd holds a command line
  "${pre[@]}" ${cmd[$app]} >"$logs/$app.$way.$tag.log" 2>&1 </dev/null || rc=$?
  b=$(date +%s%N)
  echo "$app $way $tag $(( (b - a) / 1000000 )) $rc" >>"$raw"
}
ways=(plain block mid)
for r in $(seq 0 "$rounds"); do
  for app in "${apps[@]}"; do
    [ -n "${cmd[$app]:-}" ] || continue
    for i in 0 1 2; do run1 "$app" "${ways[$(( (i + r) % 3 ))]}" "r$r"; done
  done
  echo "bench-midblock: round $r of $rounds done" >&2
done
python3 - "$raw" "$logs" "$OUT/bench-midblock.md" "$MODE" <<'PY'
import collections, os, re, statistics, sys
raw, logs, md, mode = sys.argv[1:5]
keep, drop = re.compile(os.environ["VERDICT_KEEP"]), re.compile(os.environ["VERDICT_DROP"])
def verdict(app, way, tag):
    ls = open(f"{logs}/{app}.{way}.{tag}.log", errors="replace").read().splitlines()
    return "\n".join(l for l in ls if keep.search(l) and not drop.search(l))
runs = collections.defaultdict(dict)
for l in open(raw):
    app, way, tag, ms, rc = l.split()
    runs[(app, tag)][way] = (int(ms), int(rc))
apps = list(dict.fromkeys(a for a, _ in runs))
out = [f"Mode `--preempt {mode}`; ratios: median over timed rounds of (way / the same round's plain), wall time of the whole run.", "",
       "| app | plain s (median) | block-granular / plain | mid-block / plain | mid-block / block-granular | results |", "|---|---|---|---|---|---|"]
bad = False
for a in apps:
    tags = sorted(t for (x, t) in runs if x == a and t != "r0")
    p = [runs[(a, t)]["plain"][0] for t in tags]
    rb = [runs[(a, t)]["block"][0] / runs[(a, t)]["plain"][0] for t in tags]
    rm = [runs[(a, t)]["mid"][0] / runs[(a, t)]["plain"][0] for t in tags]
    mb = [runs[(a, t)]["mid"][0] / runs[(a, t)]["block"][0] for t in tags]
    same = all(verdict(a, w, t) == verdict(a, "plain", t) and runs[(a, t)][w][1] == runs[(a, t)]["plain"][1]
               for t in ["r0"] + tags for w in ("block", "mid"))
    bad |= not same
    out.append(f"| {a} | {statistics.median(p) / 1000:.2f} | {statistics.median(rb):.3f} | {statistics.median(rm):.3f} | {statistics.median(mb):.3f} | {'same' if same else 'DIFFER'} |")
open(md, "w").write("\n".join(out) + "\n")
print("\n".join(out))
sys.exit(1 if bad else 0)
PY
