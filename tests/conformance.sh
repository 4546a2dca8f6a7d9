#!/usr/bin/env bash
# Runs the ONNX backend node tests (and the wheel's other suites) through the reference
# evaluator, then compiled for the host and for aarch64 (under qemu), and prints
# passed/failed/unsupported.
#   bash tests/conformance.sh            # run and print failures
#   bash tests/conformance.sh --write    # also rewrite docs/conformance.md and the pass lists
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f tests/onnx-node/COUNT ] || [ ! -d tests/onnx-other/light ]; then
  python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
  python3 tests/conformance/gen_node_cases.py tests/onnx-node --other tests/onnx-other
fi
cargo build --release --quiet --bin onnxc
onnxc=./target/release/onnxc
write=0
if [ "${1:-}" = "--write" ]; then write=1; shift; fi
if [ $write = 1 ]; then
  $onnxc conformance tests/onnx-node --other tests/onnx-other \
    --write-doc docs/conformance.md --write-pass-list tests/conformance/reference-pass.txt "$@"
  for t in host aarch64-neon; do
    $onnxc conformance tests/onnx-node --compiled --target $t \
      --append-doc docs/conformance.md --write-pass-list tests/conformance/compiled-$t-pass.txt "$@"
  done
else
  $onnxc conformance tests/onnx-node --other tests/onnx-other "$@"
  for t in host aarch64-neon; do
    echo "== compiled for $t"
    $onnxc conformance tests/onnx-node --compiled --target $t "$@"
  done
fi
