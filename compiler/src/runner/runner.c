/* Generic harness for any model compiled by onnxc: drives it through its descriptor.
 *   runner DIR   reads DIR/in_K.bin (raw little-endian tensors, graph order), runs the
 *                model once, writes DIR/out_K.bin. With ONNXC_THREADS=N (N > 1) in the
 *                environment it runs through run_parallel on an onnxc_pool.h pool.
 * Built with -DONNXC_MODEL=<prefix>_model. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "onnxc_runtime.h"
#include "onnxc_pool.h"

extern const onnxc_model_t ONNXC_MODEL;

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
        FILE *f = fopen(path, "rb");
        if (!f || !buf) { fprintf(stderr, "cannot read %s\n", path); return 2; }
        if (n && fread(buf, 1, (size_t)n, f) != n) { fprintf(stderr, "%s: expected %llu bytes\n", path, (unsigned long long)n); return 2; }
        fclose(f);
        ins[i] = buf;
    }
    for (uint32_t i = 0; i < m->n_outputs; i++) outs[i] = alloc64(m->outputs[i].bytes);
    void *arena = alloc64(m->arena_bytes);
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
        fwrite(outs[i], 1, (size_t)m->outputs[i].bytes, f);
        fclose(f);
    }
    return 0;
}
