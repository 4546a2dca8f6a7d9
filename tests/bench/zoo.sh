#!/usr/bin/env bash
# Benchmarks the zoo against ONNX Runtime, in one run per model, and prints the Markdown
# table the README shows.
#   bash tests/bench/zoo.sh [--threads N] [--iters N] [--rounds R] [--target T] [MODEL_NAME...]
# (--rounds: `onnxc bench --rounds`, the engines alternating R times, --iters runs each
# per round, each engine's best round reported; default 3, so that a slow spell of a
# shared machine costs both engines a round instead of skewing one.)
# Builds the zoo (tests/bench/make_zoo.py, needs torch + torchvision) into target/zoo
# when missing, builds onnxc in release, runs `onnxc bench --json` on every model and
# writes target/zoo/results-<threads>t.json next to the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=1 iters=20 rounds=3 target=host names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --target) target=$2; shift 2 ;;
    -h|--help) sed -n 2,9p "$0"; exit 0 ;;
    *) names+=("$1"); shift ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(resnet18 mobilenet_v2 squeezenet1_1 efficientnet_b0 vit_tiny bert6_seq128 mlp small_cnn)
for n in "${names[@]}"; do
  if [ ! -f "target/zoo/$n.onnx" ]; then
    python3 -c 'import torch, torchvision' 2>/dev/null || pip install --quiet torch torchvision
    python3 tests/bench/make_zoo.py target/zoo
    break
  fi
done
cargo build --release --quiet --bin onnxc
out=target/zoo/results-${threads}t.json
echo "[" > "$out"
first=1
for n in "${names[@]}"; do
  echo "== $n" >&2
  if json=$(./target/release/onnxc bench "target/zoo/$n.onnx" --threads "$threads" \
              --iters "$iters" --rounds "$rounds" --warmup 3 --target "$target" --json); then
    [ $first = 1 ] || echo "," >> "$out"
    first=0
    echo "$json" >> "$out"
  else
    echo "$n: benchmark failed" >&2
  fi
done
echo "]" >> "$out"
python3 - "$out" <<'PY'
import json, math, os, sys
rows = json.load(open(sys.argv[1]))
print("| model | GFLOP | onnxc ms | ORT ms | ratio | onnxc % peak | ORT % peak | max rel err |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
ratios = []
for r in rows:
    name = os.path.basename(r["model"]).removesuffix(".onnx")
    f = r["flops"] or 0
    o, t = r["onnxc"]["median_ms"], r["ort"]["median_ms"]
    peak = r["peak_gflops"] or float("nan")
    pct = lambda ms: 100 * f / (ms * 1e-3) / 1e9 / peak
    ratios.append(r["ratio"])
    err = max(r["max_rel_err"] or [0])
    print(f"| {name} | {f/1e9:.3f} | {o:.3f} | {t:.3f} | {r['ratio']:.2f} | {pct(o):.0f}% | {pct(t):.0f}% | {err:.1e} |")
if ratios:
    g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print(f"\ngeometric mean ratio (onnxc / ONNX Runtime, below 1 = onnxc faster): {g:.2f}; "
          f"threads {rows[0]['threads']}, onnxruntime {rows[0]['ort_version']}, "
          f"core peak {rows[0]['peak_gflops']:.0f} GFLOP/s")
    # The machine, since the ratios depend on it (the CI machines are of more than one
    # kind): the CPU's model name and family/model numbers from /proc/cpuinfo.
    try:
        info = {}
        for line in open("/proc/cpuinfo"):
            if not line.strip():
                break  # the first processor's block is enough
            key, _, val = line.partition(":")
            info[key.strip()] = val.strip()
        print(f"cpu: {info.get('model name', '?')} (family {info.get('cpu family', '?')}, "
              f"model {info.get('model', '?')}), {os.cpu_count()} cores")
    except OSError:
        pass
PY
