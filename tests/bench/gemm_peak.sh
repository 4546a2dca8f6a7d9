#!/usr/bin/env bash
# FP32 GEMM against the core's FMA peak: a 512x512x512 MatMul (B constant) compiled for
# x86_64-avx512 and x86_64-avx2, timed by a C harness (warm-up, median of many runs),
# and the single-core FMA peak of each ISA measured by an intrinsics loop, twice:
#  1. `onnxc bench`: the GEMM's median and fastest run against the fastest of 300 short
#     FMA loops;
#  2. side by side (tests/bench/gemm_side.c): GEMM runs and FMA loops of the same length
#     alternate, and each pair gives a ratio; the median ratio is the GEMM's share of
#     the peak in the same moments (on a shared VM the fastest short loop is a luckier
#     moment than a typical 1.5 ms GEMM run gets).
# Usage: tests/bench/gemm_peak.sh [M K N]   (env ONNXC: the onnxc binary; RUNS, PAIRS)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
onnxc="${ONNXC:-$root/target/release/onnxc}"
M="${1:-512}" K="${2:-512}" N="${3:-512}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 - "$work/mm.onnx" "$M" "$K" "$N" <<'PY'
import sys, numpy as np, onnx
from onnx import helper, TensorProto, numpy_helper
path, m, k, n = sys.argv[1], *map(int, sys.argv[2:5])
b = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "b")
g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "mm",
    [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [b])
onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
PY
printf "%-14s %12s %10s %10s %12s %12s\n" target "GFLOP/s med" "best" "peak" "% med" "% best"
for t in x86_64-avx512 x86_64-avx2; do
    # onnxc bench: the compiled model timed after warm-up, and the core's FMA peak for the
    # target's vectors (compiler/src/runner/peak.c, best of 300 short loops).
    "$onnxc" bench "$work/mm.onnx" --target "$t" --no-ort --json --iters "${RUNS:-300}" \
        --warmup 20 > "$work/r.json"
    python3 - "$work/r.json" "$t" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
g = r["flops"] / (r["onnxc"]["median_ms"] * 1e-3) / 1e9
b = r["flops"] / (r["onnxc"]["min_ms"] * 1e-3) / 1e9
p = r["peak_gflops"]
print(f"{sys.argv[2]:14} {g:12.1f} {b:10.1f} {p:10.1f} {100 * g / p:11.1f}% {100 * b / p:11.1f}%")
PY
done
echo "(${M}x${K}x${N} MatMul, B constant; single thread; median and fastest of ${RUNS:-300} runs;"
echo " the peak is the fastest of 300 FMA loops, so '% best' compares like with like)"
echo
flops=$((2 * M * K * N))
runner="$root/compiler/src/runner"
printf "%-14s %12s %12s %12s %12s %12s\n" target "GEMM med" "loop med" "% med pair" "GEMM best" "loop best"
for t in x86_64-avx512 x86_64-avx2; do
    isa=avx512
    [ "$t" = x86_64-avx2 ] && isa=avx2
    "$onnxc" "$work/mm.onnx" --target "$t" -o "$work/mm_$isa.o" 2> "$work/log" || {
        cat "$work/log" >&2
        exit 1
    }
    cc -O2 -I"$runner" -I"$work" -DONNXC_MODEL=mm_model -o "$work/side_$isa" \
        "$here/gemm_side.c" "$work/mm_$isa.o" -lm
    "$work/side_$isa" "$isa" "$flops" "${PAIRS:-300}" > "$work/pairs_$isa.txt"
    python3 - "$work/pairs_$isa.txt" "$t" <<'PY'
import statistics as st, sys
pairs = [tuple(map(float, l.split())) for l in open(sys.argv[1])]
g = [a for a, _ in pairs]
p = [b for _, b in pairs]
r = st.median(a / b for a, b in pairs)
print(f"{sys.argv[2]:14} {st.median(g):12.1f} {st.median(p):12.1f} {100 * r:11.1f}% "
      f"{max(g):12.1f} {max(p):12.1f}")
PY
done
echo "(side by side: ${PAIRS:-300} pairs of one GEMM run and one FMA loop of about the same"
echo " length, GFLOP/s; '% med pair' is the median of the pairs' GEMM / loop ratios)"
