/* Times a compiled model `mm` (one f32 input, one f32 output): warm-up, then the
 * median and the best of RUNS calls. Usage: bench FLOPS RUNS. Prints "median best" in
 * GFLOP/s, then the median in ms. */
#include "mm.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    double flops = argc > 1 ? atof(argv[1]) : 1;
    int runs = argc > 2 ? atoi(argv[2]) : 200;
    if (!mm_cpu_supported()) { printf("unsupported\n"); return 0; }
    float *in = aligned_alloc(64, ((MM_INPUT_0_ELEMS * 4 + 63) / 64) * 64);
    float *out = aligned_alloc(64, ((MM_OUTPUT_0_ELEMS * 4 + 63) / 64) * 64);
    void *arena = aligned_alloc(64, MM_ARENA_BYTES + 64);
    for (long i = 0; i < MM_INPUT_0_ELEMS; i++) in[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    for (int i = 0; i < 20; i++) mm_run(in, out, arena);
    double *t = malloc(sizeof(double) * runs);
    for (int r = 0; r < runs; r++) {
        double t0 = now();
        mm_run(in, out, arena);
        t[r] = now() - t0;
    }
    qsort(t, runs, sizeof(double), cmp);
    printf("%.1f %.1f %.4f\n", flops / t[runs / 2] / 1e9, flops / t[0] / 1e9, t[runs / 2] * 1e3);
    return 0;
}
