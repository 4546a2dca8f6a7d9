/* Single-core FP32 FMA peak: `peak ISA` with ISA avx512, avx2 or sse prints GFLOP/s.
 * Twelve independent accumulators hide the FMA latency. Best of 300 short runs: short,
 * so that a run on a shared machine fits in one time slice. */
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

#define BODY(T, FMA, SET1, LANES, STORE)                                              \
    T a0 = SET1(1.0f), a1 = SET1(1.01f), a2 = SET1(1.02f), a3 = SET1(1.03f),           \
      a4 = SET1(1.04f), a5 = SET1(1.05f), a6 = SET1(1.06f), a7 = SET1(1.07f),          \
      a8 = SET1(1.08f), a9 = SET1(1.09f), a10 = SET1(1.1f), a11 = SET1(1.11f);         \
    T x = SET1(0.999999f), y = SET1(1e-7f);                                            \
    double t0 = now();                                                                 \
    for (long i = 0; i < N_ITERS; i++) {                                               \
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
    return 12.0 * 2.0 * LANES * N_ITERS / dt / 1e9;

static volatile float sink;

__attribute__((target("avx512f"))) static double peak_avx512(void) {
    BODY(__m512, _mm512_fmadd_ps, _mm512_set1_ps, 16, _mm512_storeu_ps)
}
__attribute__((target("avx2,fma"))) static double peak_avx2(void) {
    BODY(__m256, _mm256_fmadd_ps, _mm256_set1_ps, 8, _mm256_storeu_ps)
}
static double peak_sse(void) {
#define SSE_FMA(a, b, c) _mm_add_ps(_mm_mul_ps(a, b), c)
    BODY(__m128, SSE_FMA, _mm_set1_ps, 4, _mm_storeu_ps)
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: peak avx512|avx2|sse\n"); return 2; }
    double (*f)(void) = 0;
    __builtin_cpu_init();
    if (!strcmp(argv[1], "avx512") && __builtin_cpu_supports("avx512f")) f = peak_avx512;
    else if (!strcmp(argv[1], "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f = peak_avx2;
    else if (!strcmp(argv[1], "sse")) f = peak_sse;
    if (!f) { fprintf(stderr, "this CPU cannot run %s\n", argv[1]); return 3; }
    double best = 0;
    for (int r = 0; r < 300; r++) { double g = f(); if (g > best) best = g; }
    printf("%.1f\n", best);
    return 0;
}
