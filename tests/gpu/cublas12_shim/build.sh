#!/usr/bin/env bash
# Builds the cuBLAS 12 -> 13 forwarding shim into $1 (default: this folder's lib/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"; out="${1:-$here/lib}"; mkdir -p "$out"
gcc -O2 -shared -fPIC -Wl,-soname,libcublas.so.12 -Wl,--version-script="$here/libcublas.map" \
  -o "$out/libcublas.so.12" "$here/shim.c" -ldl
gcc -shared -fPIC -Wl,-soname,libcublasLt.so.12 -o "$out/libcublasLt.so.12" "$here/empty.c"
