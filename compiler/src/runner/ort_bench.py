#!/usr/bin/env python3
"""Times a model with ONNX Runtime for `onnxc bench`.

    ort_bench.py MODEL DIR THREADS ITERS WARMUP [PROFILE]

Reads DIR/in_K.npy (graph input order), builds a session with ORT_ENABLE_ALL and THREADS
intra-op threads (inter-op 1, sequential execution), runs WARMUP untimed (and at least
200 ms) and ITERS timed runs, writes one time in nanoseconds per line to DIR/ort_times_ns.txt and the outputs of
the last run to DIR/ort_out_K.npy. Prints the onnxruntime version. With PROFILE > 0, a
second session with ONNX Runtime's profiler on runs PROFILE more times and writes
"mean_ns op_type node" per node of its optimised graph to DIR/ort_nodes_ns.txt.
"""
import collections
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort


def main():
    model, d, threads, iters, warmup = sys.argv[1:6]
    threads, iters, warmup = int(threads), int(iters), int(warmup)
    profile = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    so = options(threads)
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    feeds = {}
    for k, i in enumerate(sess.get_inputs()):
        feeds[i.name] = np.load(os.path.join(d, f"in_{k}.npy"))
    # Warm-up: WARMUP runs and at least 200 ms, as the compiled model's harness does.
    w0 = time.perf_counter_ns()
    r = 0
    while r < warmup or time.perf_counter_ns() - w0 < 200_000_000:
        sess.run(None, feeds)
        r += 1
    times = []
    outs = None
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        outs = sess.run(None, feeds)
        times.append(time.perf_counter_ns() - t0)
    with open(os.path.join(d, "ort_times_ns.txt"), "w") as f:
        f.write("\n".join(str(t) for t in times) + "\n")
    for k, v in enumerate(outs):
        np.save(os.path.join(d, f"ort_out_{k}.npy"), np.ascontiguousarray(v))
    if profile > 0:
        write_profile(model, d, threads, feeds, profile)
    print(ort.__version__)


def options(threads):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads == 1:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def write_profile(model, d, threads, feeds, runs):
    """Per-node kernel times from ONNX Runtime's profiler: the mean of each node's last
    `runs` runs, after as many warm-up runs again."""
    so = options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(d, "ort_profile")
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    for _ in range(2 * runs):
        sess.run(None, feeds)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    durs = collections.defaultdict(list)
    op = {}
    for e in sorted(events, key=lambda e: e.get("ts", 0)):
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            durs[name].append(e["dur"])
            op[name] = e.get("args", {}).get("op_name", "?")
    with open(os.path.join(d, "ort_nodes_ns.txt"), "w") as f:
        for name, us in durs.items():
            last = us[-runs:]
            f.write(f"{sum(last) * 1000 // len(last)} {op[name]} {name}\n")


if __name__ == "__main__":
    main()
