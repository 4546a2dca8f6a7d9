/* One core's read bandwidth over a buffer of each given size (bytes), read again and
 * again with 64-byte AVX-512 loads, best of 2000 passes: what a matrix-vector product
 * whose weights live in that level of the cache hierarchy can reach at most.
 *   bash tests/bench/read_bw.sh [BYTES...]   (default: 256 KiB, 1 MiB, 2.7 MB, 8 MB) */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    for (int a = 1; a < argc; a++) {
        size_t n = (size_t)atol(argv[a]) / 256 * 64; /* floats, a multiple of 64 */
        float *x = aligned_alloc(64, n * 4);
        if (!x || n == 0) return 1;
        for (size_t i = 0; i < n; i++) x[i] = (float)(i % 7);
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        double best = 1e9;
        for (int r = 0; r < 2000; r++) {
            double t = now();
            for (size_t i = 0; i < n; i += 64) {
                s0 = _mm512_add_ps(s0, _mm512_load_ps(x + i));
                s1 = _mm512_add_ps(s1, _mm512_load_ps(x + i + 16));
                s2 = _mm512_add_ps(s2, _mm512_load_ps(x + i + 32));
                s3 = _mm512_add_ps(s3, _mm512_load_ps(x + i + 48));
            }
            t = now() - t;
            if (t < best) best = t;
        }
        float o[16];
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        printf("%10zu bytes: %6.2f us, %5.1f GB/s (checksum %g)\n", n * 4, best * 1e6,
               n * 4 / best / 1e9, (double)o[0]);
        free(x);
    }
    return 0;
}
