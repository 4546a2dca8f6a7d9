/* Single-core FP32 FMA peak: independent accumulators, so throughput (not latency)
 * bounds the loop. Prints GFLOP/s for AVX-512 (zmm) or AVX2+FMA (ymm): the best of 300 short runs
 * (short, so that a run on a shared machine fits in one time slice). */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERS 200000L

__attribute__((target("avx512f"))) static double peak512(void) {
    __m512 a0 = _mm512_set1_ps(1.0f + 0 * 1e-3f);
    __m512 a1 = _mm512_set1_ps(1.0f + 1 * 1e-3f);
    __m512 a2 = _mm512_set1_ps(1.0f + 2 * 1e-3f);
    __m512 a3 = _mm512_set1_ps(1.0f + 3 * 1e-3f);
    __m512 a4 = _mm512_set1_ps(1.0f + 4 * 1e-3f);
    __m512 a5 = _mm512_set1_ps(1.0f + 5 * 1e-3f);
    __m512 a6 = _mm512_set1_ps(1.0f + 6 * 1e-3f);
    __m512 a7 = _mm512_set1_ps(1.0f + 7 * 1e-3f);
    __m512 a8 = _mm512_set1_ps(1.0f + 8 * 1e-3f);
    __m512 a9 = _mm512_set1_ps(1.0f + 9 * 1e-3f);
    __m512 a10 = _mm512_set1_ps(1.0f + 10 * 1e-3f);
    __m512 a11 = _mm512_set1_ps(1.0f + 11 * 1e-3f);
    __m512 a12 = _mm512_set1_ps(1.0f + 12 * 1e-3f);
    __m512 a13 = _mm512_set1_ps(1.0f + 13 * 1e-3f);
    __m512 a14 = _mm512_set1_ps(1.0f + 14 * 1e-3f);
    __m512 a15 = _mm512_set1_ps(1.0f + 15 * 1e-3f);
    __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    double t0 = now();
    for (long it = 0; it < ITERS; it++) {
        a0 = _mm512_fmadd_ps(a0, x, y); a1 = _mm512_fmadd_ps(a1, x, y); a2 = _mm512_fmadd_ps(a2, x, y); a3 = _mm512_fmadd_ps(a3, x, y); a4 = _mm512_fmadd_ps(a4, x, y); a5 = _mm512_fmadd_ps(a5, x, y); a6 = _mm512_fmadd_ps(a6, x, y); a7 = _mm512_fmadd_ps(a7, x, y); a8 = _mm512_fmadd_ps(a8, x, y); a9 = _mm512_fmadd_ps(a9, x, y); a10 = _mm512_fmadd_ps(a10, x, y); a11 = _mm512_fmadd_ps(a11, x, y); a12 = _mm512_fmadd_ps(a12, x, y); a13 = _mm512_fmadd_ps(a13, x, y); a14 = _mm512_fmadd_ps(a14, x, y); a15 = _mm512_fmadd_ps(a15, x, y);
    }
    double t = now() - t0;
    float s = 0, o[16];
    _mm512_storeu_ps(o, a0); s += o[0]; _mm512_storeu_ps(o, a1); s += o[0]; _mm512_storeu_ps(o, a2); s += o[0]; _mm512_storeu_ps(o, a3); s += o[0]; _mm512_storeu_ps(o, a4); s += o[0]; _mm512_storeu_ps(o, a5); s += o[0]; _mm512_storeu_ps(o, a6); s += o[0]; _mm512_storeu_ps(o, a7); s += o[0]; _mm512_storeu_ps(o, a8); s += o[0]; _mm512_storeu_ps(o, a9); s += o[0]; _mm512_storeu_ps(o, a10); s += o[0]; _mm512_storeu_ps(o, a11); s += o[0]; _mm512_storeu_ps(o, a12); s += o[0]; _mm512_storeu_ps(o, a13); s += o[0]; _mm512_storeu_ps(o, a14); s += o[0]; _mm512_storeu_ps(o, a15); s += o[0];
    if (s == 12345.0f) printf("!");
    return ITERS * 16.0 * 16 * 2 / t / 1e9;
}

__attribute__((target("avx2,fma"))) static double peak256(void) {
    __m256 a0 = _mm256_set1_ps(1.0f + 0 * 1e-3f);
    __m256 a1 = _mm256_set1_ps(1.0f + 1 * 1e-3f);
    __m256 a2 = _mm256_set1_ps(1.0f + 2 * 1e-3f);
    __m256 a3 = _mm256_set1_ps(1.0f + 3 * 1e-3f);
    __m256 a4 = _mm256_set1_ps(1.0f + 4 * 1e-3f);
    __m256 a5 = _mm256_set1_ps(1.0f + 5 * 1e-3f);
    __m256 a6 = _mm256_set1_ps(1.0f + 6 * 1e-3f);
    __m256 a7 = _mm256_set1_ps(1.0f + 7 * 1e-3f);
    __m256 a8 = _mm256_set1_ps(1.0f + 8 * 1e-3f);
    __m256 a9 = _mm256_set1_ps(1.0f + 9 * 1e-3f);
    __m256 a10 = _mm256_set1_ps(1.0f + 10 * 1e-3f);
    __m256 a11 = _mm256_set1_ps(1.0f + 11 * 1e-3f);
    __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    double t0 = now();
    for (long it = 0; it < ITERS; it++) {
        a0 = _mm256_fmadd_ps(a0, x, y); a1 = _mm256_fmadd_ps(a1, x, y); a2 = _mm256_fmadd_ps(a2, x, y); a3 = _mm256_fmadd_ps(a3, x, y); a4 = _mm256_fmadd_ps(a4, x, y); a5 = _mm256_fmadd_ps(a5, x, y); a6 = _mm256_fmadd_ps(a6, x, y); a7 = _mm256_fmadd_ps(a7, x, y); a8 = _mm256_fmadd_ps(a8, x, y); a9 = _mm256_fmadd_ps(a9, x, y); a10 = _mm256_fmadd_ps(a10, x, y); a11 = _mm256_fmadd_ps(a11, x, y);
    }
    double t = now() - t0;
    float s = 0, o[8];
    _mm256_storeu_ps(o, a0); s += o[0]; _mm256_storeu_ps(o, a1); s += o[0]; _mm256_storeu_ps(o, a2); s += o[0]; _mm256_storeu_ps(o, a3); s += o[0]; _mm256_storeu_ps(o, a4); s += o[0]; _mm256_storeu_ps(o, a5); s += o[0]; _mm256_storeu_ps(o, a6); s += o[0]; _mm256_storeu_ps(o, a7); s += o[0]; _mm256_storeu_ps(o, a8); s += o[0]; _mm256_storeu_ps(o, a9); s += o[0]; _mm256_storeu_ps(o, a10); s += o[0]; _mm256_storeu_ps(o, a11); s += o[0];
    if (s == 12345.0f) printf("!");
    return ITERS * 12.0 * 8 * 2 / t / 1e9;
}

int main(int argc, char **argv) {
    int zmm = argc > 1 && strcmp(argv[1], "avx512") == 0;
    double best = 0;
    for (int r = 0; r < 300; r++) {
        double g = zmm ? peak512() : peak256();
        if (g > best) best = g;
    }
    printf("%.1f\n", best);
    return 0;
}
