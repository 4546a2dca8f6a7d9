#!/usr/bin/env bash
# Median time of one call of a compiled single-input, single-output model, for two onnxc
# binaries (before / after a change), in one run.
# Usage: tests/bench/model_time.sh MODEL.onnx "--shape x=1x3x64x64" ONNXC_BEFORE ONNXC_AFTER [TARGET]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model="$1" opts="$2" before="$3" after="$4" target="${5:-host}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for which in before after; do
    bin="$before"; [ "$which" = after ] && bin="$after"
    # shellcheck disable=SC2086
    "$bin" "$model" $opts --target "$target" --name mm -o "$work/mm.o" > /dev/null 2>&1
    cc -O2 -I"$work" -o "$work/bench" "$here/bench_model.c" "$work/mm.o" -lm
    read -r _ _ ms < <("$work/bench" 1 "${RUNS:-200}")
    echo "$which: $ms ms"
done
