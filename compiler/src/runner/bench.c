/* Benchmark harness for any model compiled by onnxc, driven by its descriptor.
 *   bench DIR ITERS WARMUP [THREADS]
 * reads DIR/in_K.bin, runs the model WARMUP times (and at least 200 ms) untimed and
 * ITERS times timed
 * (on THREADS threads through onnxc_pool.h and run_parallel when THREADS > 1)
 * (CLOCK_MONOTONIC around each call), writes one time in nanoseconds per line to
 * DIR/times_ns.txt and the last run's outputs to DIR/out_K.bin.
 * Built with -DONNXC_MODEL=<prefix>_model.
 *   bench DIR ITERS WARMUP THREADS PROFILE
 * with the model compiled with its kernel table and -DONNXC_KERNELS=<prefix>_kernels
 * then runs the model PROFILE more times kernel by kernel, timing each kernel, and writes
 * "mean_ns name" per kernel to DIR/kernels_ns.txt. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WARMUP_MIN_NS 200000000ull
#include <time.h>
#include "onnxc_runtime.h"
#include "onnxc_pool.h"

extern const onnxc_model_t ONNXC_MODEL;
#ifdef ONNXC_KERNELS
/* The kernel table: u64 count, then per kernel its function and its name. */
typedef struct {
    void (*fn)(const void *const *inputs, void *const *outputs, void *arena, const onnxc_threads_t *threads);
    const char *name;
} onnxc_kernel_t;
extern const uint64_t ONNXC_KERNELS[];
#endif

static void *alloc64(uint64_t n) {
    void *p = NULL;
    size_t sz = (size_t)((n + 63) / 64 * 64);
    if (sz == 0) sz = 64;
    if (posix_memalign(&p, 64, sz) != 0) return NULL;
    memset(p, 0, sz);
    return p;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    const onnxc_model_t *m = &ONNXC_MODEL;
    char path[4096];
    if (argc < 4 || argc > 6) { fprintf(stderr, "usage: bench DIR ITERS WARMUP [THREADS [PROFILE]]\n"); return 2; }
    long iters = atol(argv[2]), warmup = atol(argv[3]);
    int n_threads = argc >= 5 ? atoi(argv[4]) : 1;
    long profile = argc == 6 ? atol(argv[5]) : 0;
    onnxc_pool_t *pool = NULL;
    onnxc_threads_t threads;
    if (n_threads > 1) {
        if (m->abi_version < 2 || !m->run_parallel) { fprintf(stderr, "the model has no run_parallel\n"); return 2; }
        pool = onnxc_pool_create(n_threads);
        if (!pool) { fprintf(stderr, "cannot create %d threads\n", n_threads); return 2; }
        threads = onnxc_pool_threads(pool);
    }
#define RUN() (pool ? m->run_parallel(ins, outs, arena, &threads) : m->run(ins, outs, arena))
    if (iters < 1) iters = 1;
    if (!m->cpu_supported()) { fprintf(stderr, "this CPU lacks features the model was compiled for\n"); return 3; }
    const void **ins = calloc(m->n_inputs + 1, sizeof(void *));
    void **outs = calloc(m->n_outputs + 1, sizeof(void *));
    for (uint32_t i = 0; i < m->n_inputs; i++) {
        uint64_t n = m->inputs[i].bytes;
        void *buf = alloc64(n);
        snprintf(path, sizeof path, "%s/in_%u.bin", argv[1], i);
        FILE *f = fopen(path, "rb");
        if (!f || !buf) { fprintf(stderr, "cannot read %s\n", path); return 2; }
        if (n && fread(buf, 1, (size_t)n, f) != n) { fprintf(stderr, "%s: short\n", path); return 2; }
        fclose(f);
        ins[i] = buf;
    }
    for (uint32_t i = 0; i < m->n_outputs; i++) outs[i] = alloc64(m->outputs[i].bytes);
    void *arena = alloc64(m->arena_bytes);
    /* Warm-up: WARMUP runs, and at least WARMUP_MIN_NS in all (idle cores and a pool's
     * sleeping workers take a millisecond or more to come up to speed; a few runs of a
     * 20-microsecond model would leave the timed runs in that). */
    {
        uint64_t w0 = now_ns();
        for (long r = 0; r < warmup || now_ns() - w0 < WARMUP_MIN_NS; r++) {
            int32_t rc = RUN();
            if (rc != ONNXC_OK) { fprintf(stderr, "run failed: %s\n", onnxc_status_str(rc)); return 4; }
        }
    }
    uint64_t *t = calloc((size_t)iters, sizeof(uint64_t));
    for (long r = 0; r < iters; r++) {
        uint64_t t0 = now_ns();
        int32_t rc = RUN();
        t[r] = now_ns() - t0;
        if (rc != ONNXC_OK) { fprintf(stderr, "run failed: %s\n", onnxc_status_str(rc)); return 4; }
    }
    snprintf(path, sizeof path, "%s/times_ns.txt", argv[1]);
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "cannot write %s\n", path); return 2; }
    for (long r = 0; r < iters; r++) fprintf(f, "%llu\n", (unsigned long long)t[r]);
    fclose(f);
    if (profile > 0) {
#ifdef ONNXC_KERNELS
        /* The kernels in order, as run_parallel calls them (the pointers were checked by
         * the runs above), each timed on its own. */
        uint64_t nk = ONNXC_KERNELS[0];
        const onnxc_kernel_t *ks = (const onnxc_kernel_t *)(const void *)&ONNXC_KERNELS[1];
        uint64_t *kt = calloc((size_t)nk + 1, sizeof(uint64_t));
        const onnxc_threads_t *th = pool ? &threads : NULL;
        /* Nothing left from the timed runs: the outputs written below are these runs'. */
        memset(arena, 0, (size_t)m->arena_bytes);
        for (uint32_t i = 0; i < m->n_outputs; i++) memset(outs[i], 0, (size_t)m->outputs[i].bytes);
        for (long r = 0; r < profile; r++) {
            for (uint64_t k = 0; k < nk; k++) {
                uint64_t t0 = now_ns();
                ks[k].fn(ins, (void *const *)outs, arena, th);
                kt[k] += now_ns() - t0;
            }
        }
        snprintf(path, sizeof path, "%s/kernels_ns.txt", argv[1]);
        FILE *kf = fopen(path, "w");
        if (!kf) { fprintf(stderr, "cannot write %s\n", path); return 2; }
        for (uint64_t k = 0; k < nk; k++)
            fprintf(kf, "%llu %s\n", (unsigned long long)(kt[k] / (uint64_t)profile), ks[k].name);
        fclose(kf);
#else
        fprintf(stderr, "profiling needs the kernel table (-DONNXC_KERNELS)\n");
        return 2;
#endif
    }
    onnxc_pool_destroy(pool);
    for (uint32_t i = 0; i < m->n_outputs; i++) {
        snprintf(path, sizeof path, "%s/out_%u.bin", argv[1], i);
        FILE *o = fopen(path, "wb");
        if (!o) { fprintf(stderr, "cannot write %s\n", path); return 2; }
        fwrite(outs[i], 1, (size_t)m->outputs[i].bytes, o);
        fclose(o);
    }
    return 0;
}
