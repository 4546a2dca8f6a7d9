#!/usr/bin/env bash
# The main job on the bundled model: compile examples/digits/model.onnx to an object file
# and header, link it into a small C program, and classify three held-out digits.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v cargo >/dev/null || { echo "needs a Rust toolchain (https://rustup.rs)"; exit 1; }
command -v cc >/dev/null || { echo "needs a C compiler (apt-get install gcc)"; exit 1; }
build=target/examples/c
mkdir -p "$build"
cargo build --release --quiet --bin onnxc
./target/release/onnxc examples/digits/model.onnx --target "${TARGET:-host}" --name digits -o "$build/digits.o"
cc -O2 -std=c99 -Wall -I"$build" examples/c/main.c "$build/digits.o" -lm -o "$build/digits"
for label in 0 3 7; do
  # The .npy files hold 64 floats after a 128-byte header.
  tail -c 256 "examples/digits/digit_$label.npy" > "$build/digit_$label.bin"
  printf 'image of a %s -> ' "$label"
  "$build/digits" "$build/digit_$label.bin"
done
