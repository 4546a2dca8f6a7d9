"""ONNX Runtime's time per node of a model, to set beside onnxc's per kernel
(`tests/bench/task_timeline.sh`):

    python3 tests/bench/ort_profile.py MODEL.onnx [THREADS] [TOP] [RUNS]

Runs the model RUNS times (default 50) with ONNX Runtime's profiler on (same options as
`onnxc bench`: ORT_ENABLE_ALL, THREADS intra-op threads, default 1), and prints the
median time of each node's kernel, largest first (TOP rows, default 30), after the sum
of the medians. Node names are ONNX Runtime's after its own fusions (a Conv with its
Clip is one node, `..._nchwc` in its blocked channel layout).

The sum of the medians leaves out the time between nodes; the median time of a plain
run (a session without the profiler, RUNS runs before the profiled ones) is printed
beside it. On a noisy machine compare each node's share of the whole with onnxc's
kernel's share rather than the microseconds of separate runs. The profile's JSON file
goes to a temporary folder and is removed.
"""

import collections
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    model = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    runs = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    def options(profile):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.enable_profiling = profile
        return so

    def session(so):
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    plain = session(options(False))
    rng = np.random.default_rng(0)
    feeds = {}
    for i in plain.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if "float" not in i.type:
            sys.exit(f"input {i.name} is {i.type}: only float inputs are generated")
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    plain_us = []
    for _ in range(runs):
        t0 = time.perf_counter()
        plain.run(None, feeds)
        plain_us.append((time.perf_counter() - t0) * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        so = options(True)
        so.profile_file_prefix = os.path.join(tmp, "ort")
        sess = session(so)
        for _ in range(runs):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    times = collections.defaultdict(list)
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "Node" and name.endswith("_kernel_time"):
            times[name[: -len("_kernel_time")]].append(e["dur"])
    rows = sorted(((float(np.median(v)), k) for k, v in times.items()), reverse=True)
    total = sum(t for t, _ in rows)
    print(f"{model}: {len(rows)} nodes, {runs} runs on {threads} threads; "
          f"sum of medians {total:.1f} us profiled, a plain run "
          f"{float(np.median(plain_us)):.1f} us (median)")
    print("      us   share  node")
    for t, k in rows[:top]:
        print(f"{t:8.1f}  {100 * t / total:5.1f}%  {k}")


if __name__ == "__main__":
    main()
