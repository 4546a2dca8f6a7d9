#!/usr/bin/env bash
# Single ops against ONNX Runtime (`onnxc bench`, one run each, the engines alternating
# three times), as a Markdown table: the models of tests/bench/make_ops.py, built into
# target/ops when missing.
#   bash tests/bench/ops.sh [--threads N] [NAME...]
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=1 names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    -h|--help) sed -n 2,5p "$0"; exit 0 ;;
    *) names+=("$1"); shift ;;
  esac
done
[ -f target/ops/cast_from_u8.onnx ] || { mkdir -p target/ops; python3 tests/bench/make_ops.py target/ops; }
cargo build --release --quiet --bin onnxc
[ ${#names[@]} -gt 0 ] || names=($(ls target/ops/*.onnx | xargs -n1 basename | sed 's/\.onnx$//'))
echo "| op | onnxc ms | ORT ms | ratio |"
echo "|---|---:|---:|---:|"
for n in "${names[@]}"; do
  json=$(./target/release/onnxc bench "target/ops/$n.onnx" --threads "$threads" --iters 30 \
           --rounds 3 --json) || { echo "| $n | failed | | |"; continue; }
  python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("| %s | %.3f | %.3f | %.2f |" % (sys.argv[2], r["onnxc"]["median_ms"], r["ort"]["median_ms"], r["ratio"]))' "$json" "$n"
done
