#!/usr/bin/env bash
# How each kernel of a compiled model uses two or more threads, from exact times: builds
# the benchmark harness with a pool header that reads the time stamp counter around every
# task, runs the model kernel by kernel (`onnxc bench --profile`'s order) RUNS times,
# and prints per kernel the median of: its time, the time the calling thread spent
# outside the pool's jobs (serial code: the other threads wait), and the summed gaps
# between the threads' last task ends in its jobs (imbalance: one thread waits). Also
# the median time of each task by (job, index, thread) for the kernels named with --tasks
# (their indices, as listed).
# x86_64 only (rdtsc). Not a test: a tool for finding serial work and uneven parts
# (tests/bench/idle_profile.sh samples the same question with perf).
# Usage: tests/bench/task_timeline.sh MODEL.onnx [THREADS] [RUNS] [TOP] [--tasks K,K...]
#   (env ONNXC: the onnxc binary)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
onnxc="${ONNXC:-$root/target/release/onnxc}"
model="${1:?usage: task_timeline.sh MODEL.onnx [THREADS] [RUNS] [TOP] [--tasks K,K...]}"
threads="${2:-2}" runs="${3:-300}" top="${4:-25}" tasks="${6:-}"
[ "${5:-}" = "--tasks" ] || tasks=""
[ "$(uname -m)" = x86_64 ] || { echo "task_timeline.sh: x86_64 only (rdtsc)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$onnxc" bench "$model" --no-ort --iters 3 --profile 1 --keep "$work" >/dev/null
prefix="$(nm "$work/model.o" | awk '$3 ~ /_model$/ { sub(/_model$/, "", $3); print $3; exit }')"
python3 - "$work" <<'PY'
import sys
d = sys.argv[1]
pool = open(d + "/onnxc_pool.h").read()
pool = pool.replace('#include "onnxc_runtime.h"', '''#include "onnxc_runtime.h"
#include <x86intrin.h>
/* task_timeline.sh: one record per task, one per job. */
#define TL_TASKS 4000000
#define TL_JOBS 1000000
struct tl_task { unsigned job, i, tid; uint64_t t0, t1; };
static struct tl_task tl_task[TL_TASKS];
static atomic_uint tl_ntask;
static unsigned tl_job, tl_kernel;
static uint64_t tl_jstart[TL_JOBS], tl_jend[TL_JOBS];
static unsigned tl_jkernel[TL_JOBS];''', 1)
old = '''      task(ctx, i);
      ran++;'''
assert old in pool, "onnxc_pool.h changed: update task_timeline.sh"
pool = pool.replace(old, '''      uint64_t tl0 = __rdtsc();
      task(ctx, i);
      uint64_t tl1 = __rdtsc();
      unsigned tls = atomic_fetch_add(&tl_ntask, 1u);
      if (tls < TL_TASKS) tl_task[tls] = (struct tl_task){tl_job, i, (unsigned)tid, tl0, tl1};
      ran++;''')
old = '''  atomic_store(&p->done, 0u);
  atomic_fetch_add(&p->gen, 1ul);'''
assert old in pool, "onnxc_pool.h changed: update task_timeline.sh"
pool = pool.replace(old, '''  atomic_store(&p->done, 0u);
  if (++tl_job < TL_JOBS) { tl_jstart[tl_job] = __rdtsc(); tl_jkernel[tl_job] = tl_kernel; }
  atomic_fetch_add(&p->gen, 1ul);''')
old = '''  while (atomic_load(&p->done) < n) pthread_cond_wait(&p->idle, &p->mu);
  pthread_mutex_unlock(&p->mu);
}'''
assert old in pool, "onnxc_pool.h changed: update task_timeline.sh"
pool = pool.replace(old, '''  while (atomic_load(&p->done) < n) pthread_cond_wait(&p->idle, &p->mu);
  pthread_mutex_unlock(&p->mu);
  if (tl_job < TL_JOBS) tl_jend[tl_job] = __rdtsc();
}''')
open(d + "/onnxc_pool.h", "w").write(pool)
bench = open(d + "/bench.c").read()
old = '''                uint64_t t0 = now_ns();
                ks[k].fn(ins, (void *const *)outs, arena, th);
                kt[k] += now_ns() - t0;'''
assert old in bench, "bench.c changed: update task_timeline.sh"
bench = bench.replace(old, '''                tl_kernel = (unsigned)k;
                uint64_t t0 = now_ns(), c0 = __rdtsc();
                ks[k].fn(ins, (void *const *)outs, arena, th);
                uint64_t c1 = __rdtsc();
                kt[k] += now_ns() - t0;
                if (tl_f) fprintf(tl_f, "k %ld %llu %llu %llu\\n", r, (unsigned long long)k,
                                  (unsigned long long)c0, (unsigned long long)c1);''')
old = '''        for (long r = 0; r < profile; r++) {'''
assert old in bench, "bench.c changed: update task_timeline.sh"
bench = bench.replace(old, '''        FILE *tl_f = fopen("timeline.txt", "w");
        uint64_t tl_ns0 = now_ns(), tl_c0 = __rdtsc();
        for (long r = 0; r < profile; r++) {''', 1)
old = '''        snprintf(path, sizeof path, "%s/kernels_ns.txt", argv[1]);'''
assert old in bench, "bench.c changed: update task_timeline.sh"
bench = bench.replace(old, '''        if (tl_f) {
            fprintf(tl_f, "hz %f\\n", (double)(__rdtsc() - tl_c0) * 1e9 / (double)(now_ns() - tl_ns0));
            for (unsigned q = 1; q <= tl_job && q < TL_JOBS; q++)
                fprintf(tl_f, "j %u %llu %llu %u\\n", q, (unsigned long long)tl_jstart[q],
                        (unsigned long long)tl_jend[q], tl_jkernel[q]);
            unsigned nt = atomic_load(&tl_ntask);
            for (unsigned q = 0; q < nt && q < TL_TASKS; q++)
                fprintf(tl_f, "t %u %u %u %llu %llu\\n", tl_task[q].job, tl_task[q].i, tl_task[q].tid,
                        (unsigned long long)tl_task[q].t0, (unsigned long long)tl_task[q].t1);
            fclose(tl_f);
        }
        snprintf(path, sizeof path, "%s/kernels_ns.txt", argv[1]);''', 1)
open(d + "/bench.c", "w").write(bench)
PY
(cd "$work" && gcc -O2 -DONNXC_MODEL="${prefix}_model" -DONNXC_KERNELS="${prefix}_kernels" -I . bench.c model.o -lm -pthread -o bench_tl)
(cd "$work" && ./bench_tl "$work" 5 5 "$threads" "$runs" >/dev/null)
python3 - "$work" "$top" "$tasks" "$threads" <<'PY'
import bisect, collections, statistics, sys
d, top, want, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
names = [l.split(None, 1)[1].strip() for l in open(d + "/kernels_ns.txt")]
kern, jobs, tasks, hz = {}, [], collections.defaultdict(list), 1.0
for line in open(d + "/timeline.txt"):
    p = line.split()
    if p[0] == "hz":
        hz = float(p[1])
    elif p[0] == "k":
        kern[(int(p[1]), int(p[2]))] = (int(p[3]), int(p[4]))
    elif p[0] == "j":
        jobs.append((int(p[2]), int(p[3]), int(p[1])))
    else:
        tasks[int(p[1])].append((int(p[2]), int(p[3]), int(p[4]), int(p[5])))
us = lambda c: c / hz * 1e6
jobs.sort()
starts = [j[0] for j in jobs]
runs = max(r for r, _ in kern) + 1
per = collections.defaultdict(lambda: collections.defaultdict(list))
per_task = collections.defaultdict(lambda: collections.defaultdict(list))
want = {int(x) for x in want.split(",") if x}
for r in range(min(10, runs // 2), runs):
    for k in range(len(names)):
        a, b = kern[(r, k)]
        i, inside, gap, nth = bisect.bisect_left(starts, a), 0, 0, 0
        while i < len(jobs) and jobs[i][0] < b:
            ja, jb, q = jobs[i]
            inside += jb - ja
            ends = collections.defaultdict(int)
            for ti, tid, t0, t1 in tasks[q]:
                ends[tid] = max(ends[tid], t1)
                if k in want:
                    per_task[k][(nth, ti, tid)].append(us(t1 - t0))
            nth += 1
            if len(ends) > 1:
                gap += max(ends.values()) - min(ends.values())
            i += 1
        s = per[k]
        s["time"].append(us(b - a))
        s["serial"].append(us(b - a - inside))
        s["imbalance"].append(us(gap))
med = {k: {n: statistics.median(v) for n, v in s.items()} for k, s in per.items()}
tot = collections.Counter()
for m in med.values():
    tot.update(m)
print(f"{len(names)} kernels, {runs} runs on {threads} threads; medians per kernel, us "
      f"(sums: time {tot['time']:.0f}, serial {tot['serial']:.0f}, imbalance {tot['imbalance']:.0f})")
print("     time   serial  imbalance  kernel (by serial + imbalance / 2)")
for k in sorted(med, key=lambda k: -(med[k]["serial"] + med[k]["imbalance"] / 2))[:top]:
    m = med[k]
    print(f"  {m['time']:7.1f}  {m['serial']:7.1f}  {m['imbalance']:9.1f}  {names[k]}")
for k in sorted(per_task):
    for j in sorted({key[0] for key in per_task[k]}):
        cells = " ".join(
            f"{ti}@{tid}:{statistics.median(v):.1f}"
            for (jj, ti, tid), v in sorted(per_task[k].items())
            if jj == j
        )
        print(f"tasks of {names[k]}, job {j} (index@thread: median us): {cells}")
PY
