#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need (the ONNX and
# ONNX Runtime Python packages used as oracles), generates the ONNX node test cases,
# builds once in release mode and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing the Python oracles (onnx, onnxruntime, numpy)"
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
if [ ! -f tests/onnx-node/COUNT ] || [ ! -d tests/onnx-other/light ]; then
  echo "== generating the ONNX node test cases"
  python3 tests/conformance/gen_node_cases.py tests/onnx-node --other tests/onnx-other
fi
echo "== building (release)"
cargo build --release --workspace --all-targets
echo "== testing"
cargo test --release --workspace
