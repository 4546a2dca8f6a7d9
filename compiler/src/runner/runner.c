/* Generic harness for any model compiled by onnxc: drives it through its descriptor.
 *   runner DIR   reads DIR/in_K.bin (raw little-endian tensors, graph order), runs the
 *                model once, writes DIR/out_K.bin. With ONNXC_THREADS=N (N > 1) in the
 *                environment it runs through run_parallel on an onnxc_pool.h pool.
 *                A string tensor's file holds its strings one after another, each
 *                NUL-terminated; the harness passes an array of pointers into them.
 * Built with -DONNXC_MODEL=<prefix>_model. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "onnxc_runtime.h"
#include "onnxc_pool.h"

extern const onnxc_model_t ONNXC_MODEL;

/* Reads a whole file into a fresh buffer (one NUL past its end); NULL on failure. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *b = realloc(buf, 2 * cap + 1);
            if (!b) { free(buf); buf = NULL; break; }
            buf = b;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[n] = 0;
    *len = n;
    return buf;
}

static void *alloc64(uint64_t n) {
    void *p = NULL;
    size_t sz = (size_t)((n + 63) / 64 * 64);
    if (sz == 0) sz = 64;
    if (posix_memalign(&p, 64, sz) != 0) return NULL;
    memset(p, 0, sz);
    return p;
}

int main(int argc, char **argv) {
    const onnxc_model_t *m = &ONNXC_MODEL;
    char path[4096];
    if (argc != 2) { fprintf(stderr, "usage: runner DIR\n"); return 2; }
    if (m->abi_version != ONNXC_ABI_VERSION) { fprintf(stderr, "ABI version %u\n", m->abi_version); return 2; }
    if (!m->cpu_supported()) { fprintf(stderr, "this CPU lacks features the model was compiled for\n"); return 3; }
    const void **ins = calloc(m->n_inputs + 1, sizeof(void *));
    void **outs = calloc(m->n_outputs + 1, sizeof(void *));
    for (uint32_t i = 0; i < m->n_inputs; i++) {
        uint64_t n = m->inputs[i].bytes;
        void *buf = alloc64(n);
        snprintf(path, sizeof path, "%s/in_%u.bin", argv[1], i);
        if (m->inputs[i].dtype == ONNXC_STRING) {
            /* The strings, then one pointer to each. */
            size_t len = 0;
            char *text = read_file(path, &len);
            if (!text || !buf) { fprintf(stderr, "cannot read %s\n", path); return 2; }
            const char **ptrs = buf;
            size_t at = 0;
            for (uint64_t k = 0; k < m->inputs[i].elems; k++) {
                if (at >= len) { fprintf(stderr, "%s: expected %llu strings\n", path, (unsigned long long)m->inputs[i].elems); return 2; }
                ptrs[k] = text + at;
                at += strlen(text + at) + 1;
            }
            ins[i] = buf;
            continue;
        }
        FILE *f = fopen(path, "rb");
        if (!f || !buf) { fprintf(stderr, "cannot read %s\n", path); return 2; }
        if (n && fread(buf, 1, (size_t)n, f) != n) { fprintf(stderr, "%s: expected %llu bytes\n", path, (unsigned long long)n); return 2; }
        fclose(f);
        ins[i] = buf;
    }
    for (uint32_t i = 0; i < m->n_outputs; i++) outs[i] = alloc64(m->outputs[i].bytes);
    void *arena = alloc64(m->arena_bytes);
    /* The arena starts as garbage (every f32 a NaN), as an application's reused arena
     * holds the last run's values: a kernel reading scratch it did not write shows. */
    if (arena) memset(arena, 0xff, (size_t)((m->arena_bytes + 63) / 64 * 64));
    const char *nt = getenv("ONNXC_THREADS");
    int n_threads = nt ? atoi(nt) : 1;
    int32_t rc;
    if (n_threads > 1) {
        onnxc_pool_t *pool = onnxc_pool_create(n_threads);
        if (!pool) { fprintf(stderr, "cannot create %d threads\n", n_threads); return 2; }
        onnxc_threads_t threads = onnxc_pool_threads(pool);
        rc = m->run_parallel(ins, outs, arena, &threads);
        onnxc_pool_destroy(pool);
    } else {
        rc = m->run(ins, outs, arena);
    }
    if (rc != ONNXC_OK) { fprintf(stderr, "run failed: %s\n", onnxc_status_str(rc)); return 4; }
    for (uint32_t i = 0; i < m->n_outputs; i++) {
        snprintf(path, sizeof path, "%s/out_%u.bin", argv[1], i);
        FILE *f = fopen(path, "wb");
        if (!f) { fprintf(stderr, "cannot write %s\n", path); return 2; }
        if (m->outputs[i].dtype == ONNXC_STRING) {
            const char *const *ptrs = outs[i];
            for (uint64_t k = 0; k < m->outputs[i].elems; k++) {
                if (!ptrs[k]) { fprintf(stderr, "output %u: element %llu is a null pointer\n", i, (unsigned long long)k); return 5; }
                fwrite(ptrs[k], 1, strlen(ptrs[k]) + 1, f);
            }
        } else {
            fwrite(outs[i], 1, (size_t)m->outputs[i].bytes, f);
        }
        fclose(f);
    }
    return 0;
}
