#!/usr/bin/env bash
# One core's read bandwidth from L2, L3 and memory (tests/bench/read_bw.c): the ceiling of
# a batch-1 matrix-vector product such as the zoo MLP's.
#   bash tests/bench/read_bw.sh [BYTES...]
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gcc -O2 -mavx512f read_bw.c -o "$out/read_bw"
if [ $# -eq 0 ]; then set -- 262144 1048576 2700000 8000000 64000000; fi
"$out/read_bw" "$@"
