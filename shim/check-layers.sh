#!/usr/bin/env bash
# The shim's modules form floors, not a circle: module A depends on module B when A's object has
# an undefined symbol that B's object defines (nm), and that graph must have no cycle, so every
# module uses only modules on floors below its own. The ground floor uses no module at all.
#   check-layers.sh GROUND OBJECT...    (make -C shim layers: GROUND base, one object per src/*.c)
# Prints the floors, or each cycle with the symbols that close it; exit status 1 on a violation.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 GROUND OBJECT..." >&2; exit 2; }
ground=$1
shift

# One line per reference from one module to another: "USER DEFINER SYMBOL".
edges() {
  local o
  for o in "$@"; do
    nm -P "$o" | awk -v m="$(basename "$o" .o)" '{ print m, $1, $2 }'
  done | awk '
    { seen[$1] = 1 }
    $3 == "U" { n++; user[n] = $1; sym[n] = $2; next }
    $3 ~ /^[A-Z]$/ { def[$2] = $1 }  # upper case: a global definition (lower case: local)
    END {
      for (m in seen) print m, m, "-"  # every module, with or without dependencies
      for (i = 1; i <= n; i++)
        if ((sym[i] in def) && def[sym[i]] != user[i]) print user[i], def[sym[i]], sym[i]
    }'
}

edges "$@" | sort -u | awk -v ground="$ground" '
  $1 == $2 { mods[++nm] = $1; next }
  {
    if (!(($1, $2) in why)) { deps[$1] = deps[$1] " " $2; why[$1, $2] = $3 }
    else if (split(why[$1, $2], w, " ") < 3) why[$1, $2] = why[$1, $2] " " $3
  }
  function edge(a, b) { return a " -> " b " (" why[a, b] ")" }
  # visit: depth-first; an edge back to a module on the stack closes a cycle.
  function visit(m,   i, k, n, d, list, path) {
    state[m] = 1
    stack[++sp] = m
    n = split(deps[m], list, " ")
    for (i = 1; i <= n; i++) {
      d = list[i]
      if (state[d] == 1) {
        for (k = sp; stack[k] != d; k--) {}
        path = ""
        for (; k < sp; k++) path = path "\n    " edge(stack[k], stack[k + 1])
        print "shim layers: cycle" path "\n    " edge(m, d)
        bad = 1
      } else if (!state[d]) {
        visit(d)
      }
      if (floor[d] + 1 > floor[m]) floor[m] = floor[d] + 1
    }
    sp--
    state[m] = 2
  }
  END {
    found = 0
    for (i = 1; i <= nm; i++) found = found || mods[i] == ground
    if (!found) { print "shim layers: no ground floor module " ground; exit 1 }
    n = split(deps[ground], list, " ")
    for (i = 1; i <= n; i++) {
      print "shim layers: the ground floor " edge(ground, list[i])
      bad = 1
    }
    for (i = 1; i <= nm; i++) if (!state[mods[i]]) visit(mods[i])
    if (bad) exit 1
    top = 0
    for (i = 1; i <= nm; i++) if (floor[mods[i]] > top) top = floor[mods[i]]
    print "shim layers: ok (each module uses only those on lower floors)"
    for (f = 0; f <= top; f++) {
      line = ""
      for (i = 1; i <= nm; i++) if (floor[mods[i]] == f) line = line " " mods[i]
      print "  floor " f ":" line
    }
  }'
