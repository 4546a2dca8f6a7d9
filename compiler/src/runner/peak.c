/* Single-core FP32 FMA peak: `peak ISA` with ISA avx512, avx2 or sse prints GFLOP/s.
 * Twelve independent accumulators hide the FMA latency. Best of 300 short runs: short,
 * so that a run on a shared machine fits in one time slice.
 * With PEAK_NO_MAIN defined, the file provides the loops only (`peak_loop(isa)`, each
 * `iters` steps of 12 FMAs, returning GFLOP/s), for a harness that times them beside
 * something else (tests/bench/gemm_side.c). */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N_ITERS 200000L

#define BODY(T, FMA, SET1, LANES, STORE, ITERS)                                       \
    T a0 = SET1(1.0f), a1 = SET1(1.01f), a2 = SET1(1.02f), a3 = SET1(1.03f),           \
      a4 = SET1(1.04f), a5 = SET1(1.05f), a6 = SET1(1.06f), a7 = SET1(1.07f),          \
      a8 = SET1(1.08f), a9 = SET1(1.09f), a10 = SET1(1.1f), a11 = SET1(1.11f);         \
    T x = SET1(0.999999f), y = SET1(1e-7f);                                            \
    double t0 = now();                                                                 \
    for (long i = 0; i < ITERS; i++) {                                                 \
        a0 = FMA(a0, x, y); a1 = FMA(a1, x, y); a2 = FMA(a2, x, y);                    \
        a3 = FMA(a3, x, y); a4 = FMA(a4, x, y); a5 = FMA(a5, x, y);                    \
        a6 = FMA(a6, x, y); a7 = FMA(a7, x, y); a8 = FMA(a8, x, y);                    \
        a9 = FMA(a9, x, y); a10 = FMA(a10, x, y); a11 = FMA(a11, x, y);                \
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4),        \
                         "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10),  \
                         "+x"(a11));                                                   \
    }                                                                                  \
    double dt = now() - t0;                                                            \
    T s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;                  \
    float out[LANES];                                                                  \
    STORE(out, s);                                                                     \
    sink = out[0];                                                                     \
    return 12.0 * 2.0 * LANES * ITERS / dt / 1e9;

static volatile float sink;

__attribute__((target("avx512f"))) static double peak_avx512(long iters) {
    BODY(__m512, _mm512_fmadd_ps, _mm512_set1_ps, 16, _mm512_storeu_ps, iters)
}
__attribute__((target("avx2,fma"))) static double peak_avx2(long iters) {
    BODY(__m256, _mm256_fmadd_ps, _mm256_set1_ps, 8, _mm256_storeu_ps, iters)
}
static double peak_sse(long iters) {
#define SSE_FMA(a, b, c) _mm_add_ps(_mm_mul_ps(a, b), c)
    BODY(__m128, SSE_FMA, _mm_set1_ps, 4, _mm_storeu_ps, iters)
}

typedef double (*peak_fn)(long iters);

/* The loop for `isa` (avx512, avx2 or sse), or NULL where this CPU cannot run it. */
static peak_fn peak_loop(const char *isa) {
    __builtin_cpu_init();
    if (!strcmp(isa, "avx512") && __builtin_cpu_supports("avx512f")) return peak_avx512;
    if (!strcmp(isa, "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return peak_avx2;
    if (!strcmp(isa, "sse")) return peak_sse;
    return 0;
}

#ifndef PEAK_NO_MAIN
int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: peak avx512|avx2|sse\n"); return 2; }
    peak_fn f = peak_loop(argv[1]);
    if (!f) { fprintf(stderr, "this CPU cannot run %s\n", argv[1]); return 3; }
    double best = 0;
    for (int r = 0; r < 300; r++) { double g = f(N_ITERS); if (g > best) best = g; }
    printf("%.1f\n", best);
    return 0;
}
#endif
