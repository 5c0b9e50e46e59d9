#!/usr/bin/env bash
# bench-anotherhost.sh — a CUDA process moved to another host (and GPU model) with ptxmig's own
# commands only, in two calls on two machines:
#
#   bench/bench-anotherhost.sh source DIR [MIB]   (host A: checkpoint --carry-files, image export to DIR)
#   bench/bench-anotherhost.sh target DIR         (host B: image import from DIR, restore, check)
#
# source starts `counter --mib MIB --steps 60 --interval-ms 100` (default MIB 64) with its output
# appended to /tmp/ptxmig-anotherhost/counter.log, checkpoints it at step 10 with --carry-files
# (the log goes along), exports the image to DIR/anotherhost.ptxmig and writes DIR/source.json
# (GPU, driver, timings). target imports the image into a fresh store, checks that the log's
# directory is absent (another host), prints the restore plan (model change, files to place),
# restores, waits for the counter to finish and compares its final checksum with an uninterrupted
# run of the same counter on this host (the checksum is a pure function of MIB and the steps).
# Carry DIR between the calls. Results: $PTXMIG_OUT/bench-anotherhost.md (a markdown row) and the
# raw JSON in DIR. Environment: PTXMIG_BIN, PTXMIG_WORKLOADS (the compiled counter), PTXMIG_OUT.
set -euo pipefail
mode=${1:?usage: bench-anotherhost.sh source|target DIR [MIB]}
dir=${2:?usage: bench-anotherhost.sh source|target DIR [MIB]}
mib=${3:-64}
# In a `make gpu-bundle` directory (bench/ beside ptxmig, criu/ and workloads/, the workloads built
# by `./gpu-e2e.sh --only workloads`) everything is found by itself.
bundle=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$bundle/criu/criu" ] && export PTXMIG_CRIU=${PTXMIG_CRIU:-$bundle/criu/criu}
bin=${PTXMIG_BIN:-$( [ -x "$bundle/ptxmig" ] && echo "$bundle/ptxmig" || command -v ptxmig || echo ./bin/ptxmig)}
W=${PTXMIG_WORKLOADS:-$bundle/workloads/bin}
[ -x "$W/counter" ] || { echo "bench-anotherhost: no counter in $W: build the workloads (./gpu-e2e.sh --only workloads) or set PTXMIG_WORKLOADS" >&2; exit 1; }
OUT=${PTXMIG_OUT:-$PWD/results}
steps=60
logdir=/tmp/ptxmig-anotherhost
# The application is installed at the same path on both hosts, as an operator deploys one build
# everywhere: source copies its counter binary into DIR and target installs that very file (the
# image records the executable, its working directory and the executable's build-ID, which
# restore's preflight and CRIU require). Before that, target installs its own build of the same
# source and checks that preflight refuses it by its build-ID (nvcc's output differs per build).
app=/opt/ptxmig-anotherhost
install_app() { install -D -m 0755 "$1" "$app/counter"; }
[ "$(id -u)" -eq 0 ] || { echo "bench-anotherhost: run as root" >&2; exit 1; }
mkdir -p "$dir" "$OUT"
gpu() { nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader -i 0; }
ms() { echo "$(( ($(date +%s%N) - $1) / 1000000 ))"; }
final() { sed -n 's/^final checksum \([0-9a-f]*\).*/\1/p' "$1" | tail -1; }

case $mode in
source)
  # The driver pairs every GPU of the host on restore, so an image made here restores only on a
  # host with as many GPUs of the same chip (restore refuses it otherwise, before touching
  # anything): say so up front rather than after the second call.
  ngpu=$(nvidia-smi -L | grep -c '^GPU' || true)
  [ "$ngpu" -le 1 ] || echo "bench-anotherhost: warning: this host has $ngpu GPUs: the target host needs $ngpu GPUs of the same chip" >&2
  rm -rf "$logdir"; mkdir -p "$logdir"; install_app "$W/counter"; cp "$W/counter" "$dir/counter"
  store=$(mktemp -d /var/tmp/ptxmig-anotherhost-src.XXXXXX)
  (cd "$app" && exec setsid ./counter --mib "$mib" --steps "$steps" --interval-ms 100 --device 0 </dev/null >>"$logdir/counter.log" 2>&1) &
  pid=$!
  for _ in $(seq 600); do grep -q '^step 10 ' "$logdir/counter.log" && break; sleep 0.1; done
  grep -q '^step 10 ' "$logdir/counter.log" || { echo "counter did not reach step 10" >&2; cat "$logdir/counter.log" >&2; exit 1; }
  t=$(date +%s%N)
  "$bin" --store "$store" --json checkpoint --carry-files --name anotherhost "$pid" >"$dir/checkpoint.json"
  ck=$(ms "$t")
  t=$(date +%s%N)
  "$bin" --store "$store" image export anotherhost -o "$dir/anotherhost.ptxmig"
  ex=$(ms "$t")
  rm -rf "$store" "$logdir" "$app" # host A keeps nothing: the image and its carried log are all there is
  python3 - "$dir" "$(gpu)" "$ck" "$ex" "$mib" <<'PY'
import json, sys
d, g, ck, ex, mib = sys.argv[1:]
json.dump({"gpu": g, "checkpoint_ms": int(ck), "export_ms": int(ex), "mib": int(mib)}, open(f"{d}/source.json", "w"))
PY
  echo "source: $(gpu); checkpoint $ck ms, export $ex ms, image $(du -h "$dir/anotherhost.ptxmig" | cut -f1)"
  ;;
target)
  [ -e "$logdir" ] && { echo "bench-anotherhost: $logdir exists here: not another host (or a leftover): remove it" >&2; exit 1; }
  mib=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['mib'])" "$dir/source.json")
  [ -f "$dir/counter" ] || { echo "bench-anotherhost: no $dir/counter (the source's build): run source first" >&2; exit 1; }
  store=$(mktemp -d /var/tmp/ptxmig-anotherhost-dst.XXXXXX)/store
  t=$(date +%s%N)
  "$bin" --store "$store" image import "$dir/anotherhost.ptxmig"
  im=$(ms "$t")
  # This host's own build of the same source: preflight must refuse it (exit 3), naming the build-ID.
  # The build-ID CRIU compares (the GNU build-ID note; empty when the file has none).
  buildid() { python3 - "$1" <<'PY'
import struct, sys
b = open(sys.argv[1], "rb").read()
if b[:4] != b"\x7fELF" or b[4] != 2: sys.exit(0)
shoff, = struct.unpack_from("<Q", b, 0x28); shentsize, shnum = struct.unpack_from("<HH", b, 0x3a)
for i in range(shnum):
    typ, = struct.unpack_from("<I", b, shoff + i * shentsize + 4)
    off, size = struct.unpack_from("<QQ", b, shoff + i * shentsize + 0x18)
    p = off
    while typ == 7 and p + 12 <= off + size:  # SHT_NOTE
        nsz, dsz, t = struct.unpack_from("<III", b, p)
        name = b[p + 12:p + 12 + nsz]; d = p + 12 + (nsz + 3) // 4 * 4
        if name == b"GNU\0" and t == 3: print(b[d:d + dsz].hex()); sys.exit(0)
        p = d + (dsz + 3) // 4 * 4
PY
  }
  rebuilt=refused
  if cmp -s "$W/counter" "$dir/counter"; then
    rebuilt="same bytes as the source's build (not checked)"
  else
    install_app "$W/counter"
    set +e
    "$bin" --store "$store" restore --dry-run anotherhost >"$dir/plan-rebuilt.txt" 2>&1
    rc=$?
    set -e
    src_id=$(buildid "$dir/counter"); own_id=$(buildid "$W/counter")
    if [ -n "$src_id" ] && [ "$src_id" = "$own_id" ] && [ "$(stat -c %s "$W/counter")" = "$(stat -c %s "$dir/counter")" ]; then
      # Other bytes, same size and build-ID: CRIU accepts this file, so preflight must too.
      [ $rc -eq 0 ] || { echo "bench-anotherhost: preflight refused this host's rebuild although its size and build-ID ($own_id) match (exit $rc):" >&2; cat "$dir/plan-rebuilt.txt" >&2; exit 1; }
      rebuilt="accepted by preflight: other bytes, same size and build-ID $own_id (CRIU checks no more)"
    elif [ $rc -ne 3 ] || ! grep -q 'build-ID' "$dir/plan-rebuilt.txt"; then
      echo "bench-anotherhost: preflight did not refuse this host's rebuild of counter (exit $rc; build-IDs: source $src_id, here $own_id):" >&2
      cat "$dir/plan-rebuilt.txt" >&2
      exit 1
    else
      grep -m1 'build-ID' "$dir/plan-rebuilt.txt"
    fi
  fi
  install_app "$dir/counter"
  "$bin" --store "$store" restore --dry-run anotherhost | tee "$dir/plan.txt"
  t=$(date +%s%N)
  "$bin" --store "$store" --json restore anotherhost >"$dir/restore.json"
  rs=$(ms "$t")
  pid=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$dir/restore.json")
  for _ in $(seq 1200); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
  got=$(final "$logdir/counter.log")
  ref=$(mktemp)
  "$app/counter" --mib "$mib" --steps "$steps" --interval-ms 0 --device 0 >"$ref" 2>&1
  want=$(final "$ref"); rm -f "$ref"
  verdict=FAIL; [ -n "$got" ] && [ "$got" = "$want" ] && verdict="exact ($got)"
  model=$(python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
print('; '.join(f\"{p['from'].get('name','?')} -> {p['to'].get('name','?')}\" + (' (model change, measured)' if p.get('model_change_measured') else ' (model change)' if p.get('model_change') else '') for p in d.get('gpu_pairs', []) if p.get('used')) or 'no pairs (same GPU)')
" "$dir/restore.json")
  src=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['gpu'], '| checkpoint', d['checkpoint_ms'], 'ms, export', d['export_ms'], 'ms')" "$dir/source.json")
  row="| $(date -u +%F) | $src | $(gpu) | import $im ms, restore $rs ms | $model | $verdict | $rebuilt |"
  { echo "| date | source GPU, driver | source timings | target GPU, driver | target timings | pairs | result | this host's rebuild of counter |"
    echo "|---|---|---|---|---|---|---|---|"
    echo "$row"; } | tee "$OUT/bench-anotherhost.md"
  rm -rf "$(dirname "$store")" "$logdir" "$app"
  [ "$verdict" != FAIL ] || { echo "bench-anotherhost: final checksum $got, uninterrupted run $want" >&2; exit 1; }
  ;;
*) echo "usage: bench-anotherhost.sh source|target DIR [MIB]" >&2; exit 2 ;;
esac
