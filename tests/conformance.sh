#!/usr/bin/env bash
# Runs the ONNX backend node tests (and the wheel's other suites) through the reference
# evaluator and prints passed/failed/unsupported.
#   bash tests/conformance.sh            # run and print failures
#   bash tests/conformance.sh --write    # also rewrite docs/conformance.md and the pass list
#   bash tests/conformance.sh --filter '^test_conv'   # extra args go to `onnxc conformance`
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f tests/onnx-node/COUNT ] || [ ! -d tests/onnx-other/light ]; then
  python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
  python3 tests/conformance/gen_node_cases.py tests/onnx-node --other tests/onnx-other
fi
cargo build --release --quiet --bin onnxc
args=()
if [ "${1:-}" = "--write" ]; then
  shift
  args=(--write-doc docs/conformance.md --write-pass-list tests/conformance/reference-pass.txt)
fi
exec ./target/release/onnxc conformance tests/onnx-node --other tests/onnx-other "${args[@]}" "$@"
