#!/usr/bin/env bash
# bench-p2.sh — what running an application under `ptxmig run` costs it (the default --preempt
# auto: twins for long or untimed kernels, submissions held behind them), against the same
# application run plain in the same run; and module-load time with a cold and a warm
# instrumentation cache.
#
#   bench/bench-p2.sh [ROUNDS]          (default 4; run as root on a GPU host)
#   bench/bench-p2.sh --list-samples    (the cuda-samples it builds; gpu-bundle.sh copies them)
#
# Apps: the workloads (longgrid with fixed work: one ~3.5 s many-block hashgrid kernel, twin under
# auto; counter; train.py, CPU-bound PyTorch) and public NVIDIA/cuda-samples programs built here
# with nvcc for sm_90 *with PTX* (so that the shim can instrument them), from the bundle's
# samples/ (gpu-bundle.sh with PTXMIG_CUDA_SAMPLES=DIR). BENCH_APPS="a b ..." picks some;
# BENCH_LOAD=0 skips the module-load part. BENCH_BLOCKONLY=1 adds a fourth way, `blockonly`:
# `ptxmig run --mid-block=false` (block twins only: the default before mid-block twins were chosen
# per launch), to price the default's mid-block twins side by side.
# Method: an untimed round first (it also fills the instrumentation cache), then ROUNDS rounds;
# each round runs every app three ways back to back in an order that rotates between rounds:
# plain, `ptxmig run --preempt off` (interception alone) and `ptxmig run` (auto). The metric is
# the wall time of the whole run. Per app and way: the median ratio to plain over the rounds
# (each round's ratio uses that round's plain run) with a 90 % bootstrap interval; a way is
# within the 3 % target when the whole interval is. Every run's result must equal the plain
# run's: the samples' verdict lines ("Test passed", "Result = PASS", ...) and exit status, the
# workloads' checksum or final-loss lines; the script exits 1 when one differs (after a bisect:
# such an app runs again under always, always without holding, always with one-block claims).
# Module load: train.py --steps 1, counter --steps 1 and matrixMul at its default size, plain / auto with an empty
# cache / auto with the cache filled, 3 runs each (median wall time); the shim's helper runs
# and time for the cold case come from its PTXMIG_DEBUG log.
# Output: $PTXMIG_OUT/bench-p2.md (tables), bench-p2.raw (one line per run), bench-p2-logs/.
set -euo pipefail
samples=(matrixMul BlackScholes binomialOptions MonteCarloMultiGPU mergeSort sortingNetworks fastWalshTransform convolutionSeparable reduction scan histogram)
if [ "${1:-}" = --list-samples ]; then printf '%s\n' "${samples[@]}"; exit 0; fi
rounds=${1:-4}
here=$(cd "$(dirname "$0")/.." && pwd)
PTXMIG_BIN=${PTXMIG_BIN:-$here/ptxmig}
PTXMIG_SHIM=${PTXMIG_SHIM:-$here/libptxmig.so}
W=${PTXMIG_WORKLOADS:-$here/workloads/bin}
OUT=${PTXMIG_OUT:-$PWD/results}
[ "$(id -u)" -eq 0 ] || { echo "bench-p2: run as root" >&2; exit 1; }
{ [ -x "$PTXMIG_BIN" ] && [ -f "$PTXMIG_SHIM" ]; } || { echo "bench-p2: need PTXMIG_BIN and PTXMIG_SHIM" >&2; exit 1; }
[ -x "$W/longgrid" ] || { echo "bench-p2: no workloads in $W (./gpu-e2e.sh --only workloads)" >&2; exit 1; }
logs=$OUT/bench-p2-logs raw=$OUT/bench-p2.raw
mkdir -p "$logs"; : >"$raw"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cache=$work/cache sock=$work/sock
mkdir -p "$cache" "$sock"

# Build the samples (in parallel); a sample that does not build is reported and left out.
declare -A cmd
if [ -d "$here/samples/Common" ]; then
  mkdir -p "$work/samples"
  for s in "${samples[@]}"; do
    [ -d "$here/samples/$s" ] || continue
    ( cd "$here/samples/$s" && shopt -s nullglob && nvcc -O3 -std=c++17 -I../Common -gencode arch=compute_90,code=sm_90 \
        -gencode arch=compute_90,code=compute_90 -o "$work/samples/$s" ./*.cu ./*.cpp -lpthread \
        >"$logs/build-$s.log" 2>&1 || echo "bench-p2: sample $s did not build (see bench-p2-logs/build-$s.log)" >&2 ) &
  done
  wait
  for s in "${samples[@]}"; do [ -x "$work/samples/$s" ] && cmd[$s]="$work/samples/$s"; done
  [ -n "${cmd[matrixMul]:-}" ] && cmd[matrixMul]="${cmd[matrixMul]} -wA=2048 -hA=2048 -wB=2048 -hB=2048"
else
  echo "bench-p2: no samples/ in the bundle (gpu-bundle.sh with PTXMIG_CUDA_SAMPLES): workloads only" >&2
fi
cmd[longgrid]="$W/longgrid --blocks 2000000 --work 16384"
cmd[counter]="$W/counter --mib 1024 --steps 200 --interval-ms 0"
cmd[train]="python3 $W/train.py --steps 1500 --log-every 500"
if [ -n "${BENCH_APPS:-}" ]; then read -ra apps <<<"$BENCH_APPS"; else apps=(longgrid counter train "${samples[@]}"); fi

# verdict FILE: the lines of a run's output that must not change between ways (results, not
# timings); the report below applies the same two patterns.
export VERDICT_KEEP='^(final|checksum|result|part )|Test passed|Test failed|PASS|FAIL|[Pp]assed|[Ff]ailed|[Ee]rror'
export VERDICT_DROP='time|[Tt]hroughput|GFlop|GB/s|[0-9]+\.[0-9]+ *(ms|s|sec)\b|msec|MOptions|Gops'
verdict() { { grep -aE "$VERDICT_KEEP" "$1" || true; } | { grep -avE "$VERDICT_DROP" || true; } | sed 's/^pid [0-9]*//'; }
# run1 APP WAY TAG: one run; appends "APP WAY TAG seconds rc" to the raw file.
run1() {
  local app=$1 way=$2 tag=$3 pre=() log="$logs/$1.$2.$3.log" a b rc=0
  case $way in
    plain) ;;
    off) pre=(env PTXMIG_PTX_CACHE="$cache" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sock" --preempt off --) ;;
    auto) pre=(env PTXMIG_PTX_CACHE="$cache" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sock" --) ;;
    blockonly) pre=(env PTXMIG_PTX_CACHE="$cache" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sock" --mid-block=false --) ;;
    always|nohold|batch1) local v=(PTXMIG_PREEMPT=always)
      [ "$way" = nohold ] && v=(PTXMIG_PREEMPT=always PTXMIG_PREEMPT_HOLD=0)
      [ "$way" = batch1 ] && v=(PTXMIG_PREEMPT=always PTXMIG_PREEMPT_BATCH_MAX=1)
      pre=(env PTXMIG_PTX_CACHE="$cache" "${v[@]}" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sock" --preempt always --) ;;
    cold) pre=(env PTXMIG_PTX_CACHE="$work/cold" "$PTXMIG_BIN" run --shim "$PTXMIG_SHIM" --socket-dir "$sock" --) ;;
  esac
  [ "$way" = cold ] && rm -rf "$work/cold" && mkdir -p "$work/cold"
  a=$(date +%s%N)
  # shellcheck disable=SC2086  # cmd holds a command line
  "${pre[@]}" ${cmd[$app]} >"$log" 2>&1 </dev/null || rc=$?
  b=$(date +%s%N)
  echo "$app $way $tag $(( (b - a) / 1000000 )) $rc" >>"$raw"
  [ "$way" != cold ] || echo "$app $tag $(find "$work/cold" -type f | wc -l)" >>"$work/cold-entries"
}

ways=(plain off auto)
[ "${BENCH_BLOCKONLY:-0}" = 1 ] && ways+=(blockonly)
export BENCH_WAYS="${ways[*]}"
for r in $(seq 0 "$rounds"); do
  for app in "${apps[@]}"; do
    [ -n "${cmd[$app]:-}" ] || continue
    for i in "${!ways[@]}"; do run1 "$app" "${ways[$(( (i + r) % ${#ways[@]} ))]}" "r$r"; done
  done
  echo "bench-p2: round $r of $rounds done" >&2
done
# An app whose result differed under auto in the first round is run again, to narrow the cause:
# plain, then every kernel with a twin (always), always without holding, always with one-block
# claims; the verdicts go to the "bisect" table.
bisect=()
for app in "${apps[@]}"; do
  [ -n "${cmd[$app]:-}" ] || continue
  [ "$(verdict "$logs/$app.plain.r0.log")" = "$(verdict "$logs/$app.auto.r0.log")" ] && continue
  bisect+=("$app")
  for way in plain always nohold batch1; do run1 "$app" "$way" b1; done
done
# Module load: train.py --steps 1, counter --steps 1 and matrixMul (default size), plain / cold / warm.
cmd[train1]="python3 $W/train.py --steps 1 --log-every 1"
cmd[counter1]="$W/counter --mib 64 --steps 1 --interval-ms 0"
[ -n "${cmd[matrixMul]:-}" ] && cmd[mm1]="$work/samples/matrixMul"
for app in train1 counter1 mm1; do
  if [ -z "${cmd[$app]:-}" ] || [ "${BENCH_LOAD:-1}" = 0 ]; then continue; fi
  for r in 1 2 3; do for way in plain cold auto; do run1 "$app" "$way" "l$r"; done; done
done

touch "$work/cold-entries"
python3 - "$raw" "$logs" "$OUT/bench-p2.md" "$rounds" "$work/cold-entries" <<'PY'
import collections, os, random, re, statistics, sys
raw, logs, md, rounds, coldf = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
cold = {}
for l in open(coldf):
    a, t, n = l.split()
    cold[a] = n
runs = collections.defaultdict(dict)
for l in open(raw):
    app, way, tag, ms, rc = l.split()
    runs[(app, tag)][way] = (int(ms), int(rc))
def verdict(app, way, tag):  # as the script's verdict(): the same two patterns
    keep, drop = re.compile(os.environ["VERDICT_KEEP"]), re.compile(os.environ["VERDICT_DROP"])
    lines = open(f"{logs}/{app}.{way}.{tag}.log", errors="replace").read().splitlines()
    return "\n".join(re.sub(r"^pid [0-9]*", "", l) for l in lines if keep.search(l) and not drop.search(l))
extra = [w for w in os.environ.get("BENCH_WAYS", "").split() if w not in ("plain", "off", "auto")]
lines = ["| app | plain s (median) | off / plain | 90 % CI | auto / plain | 90 % CI | auto within 3 % | " +
         "".join(f"{w} / plain | 90 % CI | " for w in extra) + "results |", "|---|---|---|---|---|---|---|---|" + "---|---|" * len(extra)]
rnd = random.Random(1)
def ci(rs):
    if len(rs) < 2: return float("nan"), float("nan")
    meds = sorted(statistics.median(rnd.choices(rs, k=len(rs))) for _ in range(5000))
    return meds[int(0.05 * len(meds))], meds[int(0.95 * len(meds))]
apps = sorted({a for a, t in runs if t.startswith("r")}, key=lambda a: list(runs).index((a, "r0")))
differ = False
allr = {w: [] for w in ["off", "auto"] + extra}
for app in apps:
    tags = [f"r{r}" for r in range(1, rounds + 1) if (app, f"r{r}") in runs]
    plain = [runs[(app, t)]["plain"][0] / 1000 for t in tags]
    row = [app, f"{statistics.median(plain):.2f}"]
    ok = True
    for way in ["off", "auto"] + extra:
        rs = [runs[(app, t)][way][0] / runs[(app, t)]["plain"][0] for t in tags]
        allr[way] += rs
        lo, hi = ci(rs)
        row += [f"{statistics.median(rs):.3f}", f"[{lo:.3f}, {hi:.3f}]"]
        if way == "auto":
            row.append("yes" if hi <= 1.03 else "no" if lo > 1.03 else "undecided")
    bad = []
    for t in ["r0"] + tags:
        ref = verdict(app, "plain", t)
        for way in ["plain", "off", "auto"] + extra:
            rc = runs[(app, t)][way][1]
            if rc != 0 or verdict(app, way, t) != ref:
                bad.append(f"{way}/{t} rc {rc}")
    row.append("identical, exit 0" if not bad else "DIFFER: " + ", ".join(bad))
    differ = differ or bool(bad)
    lines.append("| " + " | ".join(row) + " |")
for way in ["off", "auto"] + extra:
    rs = allr[way]
    if rs:
        g = statistics.geometric_mean(rs)
        lines.append(f"\nAll apps, {way} / plain: geometric mean {g:.3f} over {len(rs)} runs")
lines += ["", "Module load (wall s, median of 3):", "", "| app | plain | auto, empty cache | auto, cache filled | files the cold run cached |", "|---|---|---|---|---|"]
for app in ("train1", "counter1", "mm1"):
    tags = [t for a, t in runs if a == app]
    if not tags: continue
    med = {w: statistics.median(runs[(app, t)][w][0] / 1000 for t in tags) for w in ("plain", "cold", "auto")}
    lines.append(f"| {app} | {med['plain']:.2f} | {med['cold']:.2f} | {med['auto']:.2f} | {cold.get(app, '?')} |")
bis = sorted({a for a, t in runs if t == "b1"})
if bis:
    lines += ["", "Bisect of apps whose result differed under auto (same result as plain?):", "",
              "| app | always | always, holding off | always, one-block claims |", "|---|---|---|---|"]
    for app in bis:
        ref = verdict(app, "plain", "b1")
        cells = [("same" if verdict(app, w, "b1") == ref and runs[(app, "b1")][w][1] == 0 else "DIFFERS") for w in ("always", "nohold", "batch1")]
        lines.append(f"| {app} | " + " | ".join(cells) + " |")
open(md, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(1 if differ else 0)
PY
