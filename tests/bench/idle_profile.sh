#!/usr/bin/env bash
# Where the threads of a compiled model wait on each other: runs MODEL on N threads
# (default 2) under `perf record` with time stamps, charges each sample of a worker
# thread that was idle (in the pool, waiting for a job) to the kernel the calling thread
# was in at that moment, and prints the kernels that kept the workers idle longest.
# Needs `perf` (Debian: linux-perf). Not a test: a tool for finding serial work.
# Usage: tests/bench/idle_profile.sh MODEL.onnx [THREADS] [ITERS] [TOP]
#   (env ONNXC: the onnxc binary)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
onnxc="${ONNXC:-$root/target/release/onnxc}"
model="${1:?usage: idle_profile.sh MODEL.onnx [THREADS] [ITERS] [TOP]}"
threads="${2:-2}" iters="${3:-200}" top="${4:-25}"
command -v perf >/dev/null || { echo "idle_profile.sh: needs perf (apt-get install linux-perf)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$onnxc" bench "$model" --no-ort --iters 3 --keep "$work" >/dev/null
(cd "$work" && perf record -q -F 20000 -o "$work/perf.data" -- ./bench "$work" "$iters" 10 "$threads" >/dev/null)
perf script -i "$work/perf.data" -F tid,time,ip,sym 2>/dev/null | awk '{print $1, $2, $4}' >"$work/samples.txt"
python3 - "$work/samples.txt" "$top" <<'PY'
import bisect, collections, re, sys
rows = []
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) >= 2:
        rows.append((int(p[0]), float(p[1].rstrip(':')), p[2] if len(p) > 2 else '?'))
tids = {r[0] for r in rows}
caller = min(tids)  # the bench harness's main thread is created first
main = [(t, s) for tid, t, s in rows if tid == caller]
times = [t for t, _ in main]
def caller_at(t):
    i = bisect.bisect_left(times, t)
    j = min((j for j in (i - 1, i) if 0 <= j < len(times)), key=lambda j: abs(times[j] - t))
    return main[j][1]
idle, n = collections.Counter(), 0
for tid, t, s in rows:
    if tid == caller or not main:
        continue
    n += 1
    if 'onnxc_pool__worker_' in s:  # spinning or about to sleep: no task to run
        idle[caller_at(t)] += 1
print(f"worker samples {n}, idle {sum(idle.values())} ({100 * sum(idle.values()) / max(n, 1):.1f}%); "
      "by the caller's kernel at the time:")
for s, c in idle.most_common(int(sys.argv[2])):
    print(f"{100 * c / max(n, 1):6.2f}%  {re.sub(r'^[A-Za-z0-9_]+?__', '', s)}")
PY
