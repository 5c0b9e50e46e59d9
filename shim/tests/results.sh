# shellcheck shell=bash
# results.sh — sourced by the shim's test harnesses (all.sh, run.sh). Every test ends as one line
# "STATUS<TAB>NAME<TAB>DETAIL" (STATUS: PASS, SKIP or FAIL) appended to the file $SHIM_RESULTS;
# unit_test.c and drive.py append theirs themselves. results_summary counts them.
# PTXMIG_REQUIRE (comma-separated, as for the Go tests): a skip for a listed requirement fails.

# results_init: use $SHIM_RESULTS, or a fresh file when unset (a harness run on its own).
results_init() {
  if [ -z "${SHIM_RESULTS:-}" ]; then
    SHIM_RESULTS=$(mktemp "${TMPDIR:-/tmp}/shim-results.XXXXXX")
    results_own=1
  fi
  export SHIM_RESULTS
}

# result STATUS NAME [DETAIL]
result() {
  printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >>"$SHIM_RESULTS"
  case $1 in
    PASS) ;;
    *) echo "$1 $2${3:+: $3}" ;;
  esac
}

# required NEED: whether PTXMIG_REQUIRE lists NEED (or "all").
required() {
  local r
  local -a reqs
  IFS=, read -ra reqs <<<"${PTXMIG_REQUIRE:-}"
  for r in "${reqs[@]}"; do
    r=${r// /}
    if [ "$r" = "$1" ] || [ "$r" = all ]; then return 0; fi
  done
  return 1
}

# skip NEED NAME REASON: SKIP, or FAIL when PTXMIG_REQUIRE lists NEED ("" for none).
skip() {
  if [ -n "$1" ] && required "$1"; then
    result FAIL "$2" "required $1 unavailable: $3 (PTXMIG_REQUIRE=$PTXMIG_REQUIRE)"
  else
    result SKIP "$2" "$3"
  fi
}

# check NAME CMD...: PASS when CMD succeeds, else FAIL with the last lines of its output.
check() {
  local name=$1 out rc=0; shift
  out=$("$@" 2>&1) || rc=$?
  if [ "$rc" -eq 0 ]; then result PASS "$name"
  else result FAIL "$name" "exit $rc${out:+: $(tail -n 3 <<<"$out" | tr '\n' ' ')}"
  fi
}

# harness NAME CMD...: run a harness that records its own results; if it fails without
# recording a failure (a crash, a sanitizer abort), that is one failed test NAME.
harness() {
  local name=$1 before rc=0; shift
  before=$(grep -c '^FAIL' "$SHIM_RESULTS" || true)
  "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$(grep -c '^FAIL' "$SHIM_RESULTS" || true)" = "$before" ]; then
    result FAIL "$name" "exited with status $rc without reporting a failed test"
  fi
  return "$rc"
}

# results_summary [FILE]: list skips (with reasons) and failures, then print
# "shim: N passed, M skipped, K failed" (also into FILE); non-zero when any test failed.
results_summary() {
  local line rc
  line=$(awk -F'\t' '
    $1 == "PASS" { p++ }
    $1 == "SKIP" { s++; skips[s] = "    " $2 ": " $3 }
    $1 == "FAIL" { f++; fails[f] = "    " $2 (($3 != "") ? ": " $3 : "") }
    END {
      if (s) { print "\nskipped (" s "):"; for (i = 1; i <= s; i++) print skips[i] }
      if (f) { print "\nfailed (" f "):"; for (i = 1; i <= f; i++) print fails[i] }
      printf "\nshim: %d passed, %d skipped, %d failed\n", p, s, f
    }' "$SHIM_RESULTS")
  echo "$line"
  line=${line##*$'\n'}
  if [ -n "${1:-}" ]; then echo "$line" >"$1"; fi
  [ "${results_own:-0}" = 1 ] && rm -f "$SHIM_RESULTS"
  rc=0; [[ "$line" == *", 0 failed" ]] || rc=1
  return "$rc"
}
