#!/usr/bin/env bash
# Median time of one call of a compiled model (onnxc bench --no-ort), for two onnxc
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
    "$bin" bench "$model" $opts --target "$target" --no-ort --json --iters "${RUNS:-200}" \
        > "$work/r.json"
    python3 -c 'import json,sys; print(sys.argv[2] + ":", json.load(open(sys.argv[1]))["onnxc"]["median_ms"], "ms")' \
        "$work/r.json" "$which"
done
