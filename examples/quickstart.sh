#!/usr/bin/env bash
# The bundled example: a digit classifier (examples/digits/, trained on scikit-learn's
# 8x8 handwritten digits) run on three held-out images. Builds onnxc on first use.
#
# The native back end (object file + header, linked into a C or Rust program) is not
# built yet; until it is, this runs the model with onnxc's reference evaluator.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "needs a Rust toolchain (https://rustup.rs)"; exit 1; }
cargo build --release --quiet --bin onnxc
onnxc=./target/release/onnxc
$onnxc inspect examples/digits/model.onnx
out=$(mktemp -d)
for label in 0 3 7; do
  echo "== image of a $label"
  $onnxc run examples/digits/model.onnx --input image=examples/digits/digit_$label.npy --output-dir "$out" --print |
    awk -v label="$label" '/^  float/ {
      s = $0; sub(/.*\[/, "", s); sub(/\].*/, "", s); n = split(s, v, ", ");
      best = 1; for (i = 2; i <= n; i++) if (v[i] + 0 > v[best] + 0) best = i;
      printf "predicted digit: %d (true label %s)\n", best - 1, label }'
done
