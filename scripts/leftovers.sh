#!/usr/bin/env bash
# leftovers.sh — what a test run left behind: processes started since a mark that are CRIU, a
# ptxmig guardian, a test victim (ptxmig-testproc), or stopped (state T or t: frozen by a CRIU or
# a test and never resumed). `make test` fails on any; they are listed, then killed.
#
# Usage: scripts/leftovers.sh --mark           print the mark (clock ticks since boot)
#        scripts/leftovers.sh --since MARK     list and kill leftovers; exit 1 when there were any
set -euo pipefail

ticks=$(getconf CLK_TCK)
now_ticks() { awk -v t="$ticks" '{ printf "%d\n", $1 * t }' /proc/uptime; }

case "${1:-}" in
  --mark) now_ticks; exit 0 ;;
  --since) since=${2:?--since needs a mark} ;;
  *) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

found=()
for stat in /proc/[0-9]*/stat; do
  pid=${stat#/proc/}; pid=${pid%/stat}
  [ "$pid" -ne $$ ] || continue
  line=$(cat "$stat" 2>/dev/null) || continue
  comm=${line#*(}; comm=${comm%)*}
  # Fields after the command name: state is the 1st, starttime the 20th.
  read -r -a f <<<"${line##*) }"
  state=${f[0]} start=${f[19]}
  [ "$start" -ge "$since" ] || continue
  case "$state" in Z|X) continue ;; esac
  if [ "$comm" = criu ] || [ "$comm" = ptxmig-guardian ] || [ "$comm" = ptxmig-testproc ] || [ "$state" = T ] || [ "$state" = t ]; then
    found+=("$pid")
    echo "leftover: pid $pid ($comm), state $state: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-160)" >&2
  fi
done
[ ${#found[@]} -eq 0 ] && exit 0
kill -KILL "${found[@]}" 2>/dev/null || true
echo "leftovers: ${#found[@]} process(es) left behind by the tests (killed now)" >&2
exit 1
