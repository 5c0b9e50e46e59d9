#!/usr/bin/env bash
# All of the shim's tests, as `make test` runs them: the module layers (check-layers.sh), the unit
# tests (plain, then under ASan+UBSan), then the integration tests (tests/run.sh). Ends with the
# skipped tests and their reasons, the failed ones, and "shim: N passed, M skipped, K failed" (also
# written to BUILD_DIR/test-summary). Exit status non-zero when a test failed.
#   tests/all.sh SHIM BUILD_DIR
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shim=$1 build=$2
export SHIM_RESULTS
SHIM_RESULTS=$(realpath "$build")/test-results.tsv
: >"$SHIM_RESULTS"
# shellcheck source=shim/tests/results.sh
. "$here/results.sh"

# One object per source file of today's tree (make builds them), never a stale one.
layer_objs=()
for c in "$here"/../src/*.c; do layer_objs+=("$build/layers/$(basename "$c" .c).o"); done
check layers "$here/../check-layers.sh" base "${layer_objs[@]}"
harness unit_test "$build/unit_test" testdata/fatbin testdata/fatbin-cu12
harness unit_test_san env ASAN_OPTIONS=detect_leaks=1 "$build/unit_test_san" testdata/fatbin testdata/fatbin-cu12
harness integration "$here/run.sh" "$shim" "$build"
results_summary "$build/test-summary"
