#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need (a C compiler,
# the aarch64 cross toolchain and qemu for the ARM tests, valgrind, and the ONNX and ONNX
# Runtime Python packages used as oracles), generates the ONNX node test cases, builds
# once in release mode and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc libc6-dev)
command -v nm >/dev/null || need_apt+=(binutils)
command -v aarch64-linux-gnu-gcc >/dev/null || need_apt+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null || need_apt+=(qemu-user-static)
command -v valgrind >/dev/null || need_apt+=(valgrind)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need_apt[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${need_apt[@]}" >/dev/null
fi

# The style checks need rustfmt and clippy; a toolchain installed without them gets them.
for comp in rustfmt clippy; do
  sub=${comp/rustfmt/fmt}
  if ! cargo "$sub" --version >/dev/null 2>&1; then
    echo "== installing the Rust component $comp"
    rustup component add "$comp"
  fi
done

echo "== installing the Python oracles (onnx, onnxruntime, numpy)"
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt

if [ ! -f tests/onnx-node/COUNT ] || [ ! -d tests/onnx-other/light ]; then
  echo "== generating the ONNX node test cases"
  python3 tests/conformance/gen_node_cases.py tests/onnx-node --other tests/onnx-other
fi

echo "== building (release)"
cargo build --release --workspace --all-targets

echo "== style (rustfmt, clippy)"
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings

echo "== testing"
mkdir -p target
cargo test --release --workspace 2>&1 | tee target/test-output.log

echo "== the C example (compile the bundled model, link, run)"
bash examples/c/run.sh

# One closing line over every cargo test binary (unit, integration and doc tests).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1); if ($(i) ~ /^ignored;?$/) s += $(i-1) } }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' target/test-output.log
