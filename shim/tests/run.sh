#!/usr/bin/env bash
# Shim tests: the library loads into an unrelated program, which behaves exactly as without it.
set -euo pipefail
lib=$(realpath "$1")
out=$(LD_PRELOAD="$lib" /bin/echo shim-loaded)
[ "$out" = shim-loaded ] || { echo "shim test: echo under LD_PRELOAD printed '$out'" >&2; exit 1; }
nm -D --defined-only "$lib" | grep -q ptxmig_shim_info || { echo "shim test: ptxmig_shim_info not exported" >&2; exit 1; }
echo "shim tests: ok"
