#!/usr/bin/env bash
# run.sh — ptxstate GPU suite: twins equal their originals bit for bit (straight and under random
# preemption with relaunch), and their speed and preemption latency. Needs nvcc/ptxas (CUDA 13)
# and an NVIDIA GPU; about 4-6 minutes on an H200 with the defaults (the large sizes need ~6 GiB of
# GPU memory: every buffer and a device copy of its initial contents), well under a minute with
# PTXSTATE_RUNS=5 PTXSTATE_PREEMPT_RUNS=2 PTXSTATE_TUNE="1,16,4".
#
# Environment: PTXMIG_BIN (ptxmig binary; default: ptxmig on PATH, then ../../bin/ptxmig),
# PTXMIG_OUT (results directory, default ./results), PTXSTATE_CORPUS (directory of the nvcc PTX
# corpus; default: ./corpus in a gpu bundle, else ../testdata/corpus in the repository).
# PTXSTATE_RUNS (timed runs, default 15), PTXSTATE_PREEMPT_RUNS (default 3), PTXSTATE_TUNE
# (claim-size settings timed besides the defaults, "MIN,MAX,DIV;...").
# PTXSTATE_SPECS (default "kernels kernels-small": the block-granular specs to run; "" for none).
# PTXSTATE_MID (default 1): also the mid-block twins (`ptx instrument --mid-block`) of
# ../testdata/nvcc12/midblock.sm_90.ptx and threadloop.sm_90.ptx (./mid in a gpu bundle) on kernels-mid.spec and, with long
# blocks, kernels-mid-long.spec: forced stops at site votes, random preemption, and their cost
# against the block-granular twin; and, unless PTXSTATE_MID_CORPUS=0, the corpus of kernels.spec
# and the public PTX of kernels-public.spec instrumented with --mid-block, the same checks for
# the kernels that get sites.
# Writes $PTXMIG_OUT/ptxstate-twins.md (kernels.spec: large sizes), ptxstate-twins-small.md
# (kernels-small.spec), ptxstate-midblock.md, ptxstate-midblock-long.md, ptxstate-midblock-corpus.md,
# ptxstate-midblock-public.md and
# ptxstate-instrument.txt; exits non-zero on any mismatch, ptxas failure or setup error.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${PTXMIG_OUT:-$here/results}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bin=${PTXMIG_BIN:-$(command -v ptxmig || echo "$here/../../bin/ptxmig")}
[ -x "$bin" ] || { echo "run.sh: ptxmig binary not found (set PTXMIG_BIN)" >&2; exit 2; }
corpus=${PTXSTATE_CORPUS:-}
if [ -z "$corpus" ]; then
  for d in "$here/corpus" "$here/../testdata/corpus"; do [ -f "$d/vecadd.ptx" ] && corpus=$d && break; done
fi
if [ -z "$corpus" ] || [ ! -f "$corpus/vecadd.ptx" ]; then echo "run.sh: nvcc PTX corpus not found (set PTXSTATE_CORPUS)" >&2; exit 2; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# PTX of public programs (../testdata/public; ./public in a gpu bundle): kernels-public.spec.
public=
for d in "$here/public" "$here/../testdata/public"; do [ -d "$d" ] && public=$d && break; done

# Instrument the corpus and assemble every module with the real ptxas for sm_80 and sm_90.
: >"$out/ptxstate-instrument.txt"
for f in "$corpus"/*.ptx; do
  name=$(basename "$f")
  "$bin" ptx instrument --report -o "$work/$name" "$f" >>"$out/ptxstate-instrument.txt"
  for arch in sm_80 sm_90; do
    if [[ "$name" == *.sm_80.ptx || "$arch" == sm_90 ]] || grep -q '^\.target sm_80' "$f"; then
      ptxas -arch=$arch -c -o /dev/null "$work/$name" || { echo "run.sh: ptxas $arch failed on instrumented $name" >&2; exit 1; }
    fi
  done
done
echo "instrumented and assembled $(find "$work" -maxdepth 1 -name '*.ptx' | wc -l) modules"

command -v nvcc >/dev/null || { echo "run.sh: nvcc not found (CUDA 13 in /usr/local/cuda/bin)" >&2; exit 2; }
nvcc -O2 -std=c++17 -o "$work/twin_harness" "$here/twin_harness.cu" -lcuda
# Large sizes (every original >= ~0.2 ms: the headline numbers), then the sizes of the first run.
# Both check bit for bit; the exit status is non-zero if either finds a mismatch or fails.
status=0
# mid_run SPEC DIR V2DIR MD HARNESS-ARGS...: the harness on the mid-block twins in DIR (their
# block-granular twins in V2DIR); a CUDA error (exit >= 2) ends the suite.
mid_run() {
  local spec=$1 dir=$2 v2=$3 md=$4 rc
  shift 4
  set +e
  "$work/twin_harness" "$here/$spec.spec" "$dir" "$md" --mid 1 --v2dir "$v2" "$@"
  rc=$?
  set -e
  echo "== $md (exit $rc)"
  [ -f "$md" ] && cat "$md"
  [ $rc -eq 0 ] || status=$rc
  [ $rc -lt 2 ] || { echo "run.sh: twin_harness stopped on $spec.spec with mid-block twins (exit $rc)" >&2; exit $rc; }
}
if [ "${PTXSTATE_MID:-1}" != 0 ]; then
  midsrc=
  for d in "$here/mid" "$here/../testdata/nvcc12"; do [ -f "$d/midblock.sm_90.ptx" ] && midsrc=$d && break; done
  [ -n "$midsrc" ] || { echo "run.sh: midblock.sm_90.ptx not found" >&2; exit 2; }
  mkdir -p "$work/mid" "$work/mid2"
  for f in midblock.sm_90.ptx threadloop.sm_90.ptx; do
    [ -f "$midsrc/$f" ] || { echo "run.sh: $midsrc/$f not found" >&2; exit 2; }
    "$bin" ptx instrument --mid-block --report -o "$work/mid/$f" "$midsrc/$f" >>"$out/ptxstate-instrument.txt"
    "$bin" ptx instrument -o "$work/mid2/$f" "$midsrc/$f"
    ptxas -arch=sm_90 -c -o /dev/null "$work/mid/$f" || { echo "run.sh: ptxas failed on the mid-block twins of $f" >&2; exit 1; }
  done
  for spec in kernels-mid kernels-mid-long; do
    md="$out/ptxstate-midblock${spec#kernels-mid}.md"
    args=(--runs "${PTXSTATE_RUNS:-15}" --preempt-runs "${PTXSTATE_PREEMPT_RUNS:-3}" --tune "")
    [ $spec = kernels-mid-long ] && args=(--runs 3 --preempt-runs 3 --tune "" --force 2)
    mid_run "$spec" "$work/mid" "$work/mid2" "$md" "${args[@]}"
  done
  # The corpus (kernels.spec) as mid-block twins: the kernels with sites get the same forced,
  # random and other-CTA-count checks and their cost against the block-granular twin and the
  # original; the others are listed as having no site.
  if [ "${PTXSTATE_MID_CORPUS:-1}" != 0 ]; then
    mkdir -p "$work/cmid" "$work/cv2"
    # As the shim asks for them: each twin capped to fit as many CTAs per SM as its original
    # (PTXSTATE_MID_CAPS="" for uncapped twins).
    caps=${PTXSTATE_MID_CAPS-sm_90}
    for f in "$corpus"/*.ptx ${public:+"$public"/*.ptx}; do
      "$bin" ptx instrument --mid-block ${caps:+--match-registers "$caps"} -o "$work/cmid/$(basename "$f")" "$f"
      "$bin" ptx instrument ${caps:+--match-registers "$caps"} -o "$work/cv2/$(basename "$f")" "$f"
    done
    for spec in kernels ${public:+kernels-public}; do
      md="$out/ptxstate-midblock-${spec#kernels-}.md"
      [ "$spec" = kernels ] && md="$out/ptxstate-midblock-corpus.md"
      mid_run "$spec" "$work/cmid" "$work/cv2" "$md" --runs "${PTXSTATE_RUNS:-15}" \
        --preempt-runs "${PTXSTATE_PREEMPT_RUNS:-3}" --tune ""
    done
  fi
fi
for spec in ${PTXSTATE_SPECS-kernels kernels-small}; do
  md="$out/ptxstate-twins${spec#kernels}.md"
  set +e
  "$work/twin_harness" "$here/$spec.spec" "$work" "$md" --runs "${PTXSTATE_RUNS:-15}" \
    --preempt-runs "${PTXSTATE_PREEMPT_RUNS:-3}" --tune "${PTXSTATE_TUNE:-1,1,1;1,16,4;4,32,4}"
  rc=$?
  set -e
  echo "== $md (exit $rc)"
  [ -f "$md" ] && cat "$md"
  if [ $rc -ge 2 ]; then
    # A CUDA error (a faulting kernel) kills the context: the harness names the kernel and phase on
    # stderr above and stops; the kernels after it in $spec.spec were not run.
    echo "run.sh: twin_harness stopped on $spec.spec (exit $rc): see the 'kernel ... (phase)' line above; later kernels were not run" >&2
    status=$rc
    break
  fi
  [ $rc -eq 0 ] || status=$rc
done
exit $status
