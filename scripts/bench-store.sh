#!/usr/bin/env bash
# Benchmark ptxmig's image store against cp and zstd on three 1 GiB inputs: zeros, random bytes,
# and float32 data resembling model weights (normal, sigma 0.02). Drives the ptxmig binary (no Go
# needed), so it runs on the GPU host too.
#
# usage: scripts/bench-store.sh [SIZE_MIB]        (default 1024)
# env:   PTXMIG_BIN  ptxmig binary (default: ./ptxmig, then `ptxmig` on PATH)
#        BENCH_DIR   scratch directory on the disk to measure (default /var/tmp/ptxmig-bench)
#        PTXMIG_OUT  if set, results are also written to $PTXMIG_OUT/bench-store.md
# Needs: bash, python3 (JSON parsing), cc (float generator), zstd (installed from Debian/Ubuntu
# with apt-get when missing and running as root).
#
# Every tool reads its input from the page cache (inputs are read once first). "cp+sync" is cp
# followed by `sync -f` (syncfs), the fair anchor for ptxmig, which makes every chunk durable
# (one syncfs before the chunks are renamed into place, one after) before it commits an image;
# plain cp (page cache only) is listed too.
set -euo pipefail

size_mib=${1:-1024}
bin=${PTXMIG_BIN:-}
if [[ -z $bin ]]; then
	if [[ -x ./ptxmig ]]; then bin=./ptxmig; else bin=$(command -v ptxmig || true); fi
fi
[[ -x $bin ]] || { echo "bench-store: ptxmig binary not found; set PTXMIG_BIN" >&2; exit 2; }
work=${BENCH_DIR:-/var/tmp/ptxmig-bench}

if ! command -v zstd >/dev/null; then
	if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
		apt-get install -y -q zstd >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q zstd >/dev/null; }
	fi
	command -v zstd >/dev/null || { echo "bench-store: zstd missing (apt-get install zstd)" >&2; exit 2; }
fi
command -v python3 >/dev/null || { echo "bench-store: python3 missing" >&2; exit 2; }
command -v cc >/dev/null || { echo "bench-store: cc missing (needed to generate float data)" >&2; exit 2; }

rm -rf "$work"
mkdir -p "$work/in" "$work/gen"
trap 'rm -rf "$work"' EXIT

cat >"$work/gen/floats.c" <<'C'
/* float32 samples of N(0, 0.02), like freshly initialised weights; deterministic. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
static uint64_t s = 0x9E3779B97F4A7C15ull;
static double uni(void) { s ^= s >> 12; s ^= s << 25; s ^= s >> 27; return ((s * 2685821657736338717ull) >> 11) * 0x1.0p-53; }
int main(int argc, char **argv) {
	long long n = atoll(argv[1]) / 4;
	static float buf[1 << 18];
	while (n > 0) {
		int k = n < (1 << 18) ? (int)n : (1 << 18);
		for (int i = 0; i < k; i += 2) {
			double u1 = uni(), u2 = uni(), r = sqrt(-2 * log(u1 + 1e-300));
			buf[i] = (float)(0.02 * r * cos(2 * M_PI * u2));
			if (i + 1 < k) buf[i + 1] = (float)(0.02 * r * sin(2 * M_PI * u2));
		}
		fwrite(buf, 4, k, stdout);
		n -= k;
	}
	return 0;
}
C
cc -O2 -o "$work/gen/floats" "$work/gen/floats.c" -lm

bytes=$((size_mib << 20))
head -c "$bytes" /dev/zero >"$work/in/zeros"
head -c "$bytes" /dev/urandom >"$work/in/random"
"$work/gen/floats" "$bytes" >"$work/in/floats"

now() { date +%s.%N; }
mbps() { python3 -c "import sys; print(f'{$bytes/1e6/($2-$1):.0f}')" "$@"; }

cpus=$(nproc)
host=$(hostname)
out=$(mktemp)
{
	echo "### $(date -u +%Y-%m-%d) on $host ($cpus CPUs, $(uname -r))"
	echo
	echo "Command: \`PTXMIG_BIN=$bin scripts/bench-store.sh $size_mib\` (inputs: $size_mib MiB each; scratch: $work on $(df -P "$work" | awk 'NR==2{print $1}'))"
	echo
	echo "| input | cp MB/s | cp+sync MB/s | zstd -1 -T0 MB/s | zstd -1 ratio | ptxmig add MB/s | ptxmig ratio | ptxmig extract MB/s |"
	echo "|---|---|---|---|---|---|---|---|"
} >"$out"

for kind in zeros random floats; do
	in="$work/in/$kind"
	cat "$in" >/dev/null # warm the page cache for every tool alike
	store="$work/store-$kind"

	t0=$(now); cp "$in" "$work/cp-$kind"; t1=$(now); sync -f "$work/cp-$kind"; t2=$(now)
	cp_mbps=$(mbps "$t0" "$t1"); cps_mbps=$(mbps "$t0" "$t2")
	rm -f "$work/cp-$kind"

	t0=$(now); zstd -1 -T0 -q -f "$in" -o "$work/z-$kind.zst"; t1=$(now)
	z_mbps=$(mbps "$t0" "$t1")
	z_ratio=$(python3 -c "import os; print(f'{$bytes/os.path.getsize(\"$work/z-$kind.zst\"):.3f}')")
	rm -f "$work/z-$kind.zst"

	mkdir -p "$work/src-$kind"
	ln "$in" "$work/src-$kind/pages-1.img"
	add=$("$bin" --store "$store" --json image add "bench-$kind" "$work/src-$kind")
	a_mbps=$(python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"{s['mb_per_s']:.0f}\")" <<<"$add")
	a_ratio=$(python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"{s['logical_bytes']/max(s['stored_bytes'],1):.3f}\" if s['stored_bytes'] else 'all zero')" <<<"$add")

	ext=$("$bin" --store "$store" --json image extract "bench-$kind" "$work/out-$kind")
	e_mbps=$(python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"{s['mb_per_s']:.0f}\")" <<<"$ext")
	cmp "$in" "$work/out-$kind/pages-1.img" || { echo "bench-store: extracted $kind differs" >&2; exit 1; }
	rm -rf "$work/out-$kind" "$work/src-$kind" "$store"

	echo "| $kind | $cp_mbps | $cps_mbps | $z_mbps | $z_ratio | $a_mbps | $a_ratio | $e_mbps |" >>"$out"
done
cat "$out"
if [[ -n ${PTXMIG_OUT:-} ]]; then
	mkdir -p "$PTXMIG_OUT"
	cp "$out" "$PTXMIG_OUT/bench-store.md"
fi
rm -f "$out"
