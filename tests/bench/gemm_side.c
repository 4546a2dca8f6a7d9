/* A compiled model and the core's FMA loop timed side by side (tests/bench/gemm_peak.sh):
 *   gemm_side ISA FLOPS PAIRS
 * runs the model (one input, one output, f32; built with -DONNXC_MODEL=<prefix>_model)
 * and the FMA loop of ISA (compiler/src/runner/peak.c) alternately, PAIRS times each
 * after a warm-up, the loop sized to take about as long as one model run, and prints
 * one line per pair: the model's GFLOP/s (FLOPS per run) and the loop's.
 *
 * Both see the same machine in the same moments: on a shared VM whose speed drifts by
 * 10-20% over seconds, the fastest of many short FMA loops (what `onnxc bench` reports as
 * the peak) is a luckier moment than a typical GEMM run gets, and each pair's ratio is
 * not. */
#define _POSIX_C_SOURCE 200809L
#define PEAK_NO_MAIN
#include "peak.c"

#include <stdint.h>
#include <stdlib.h>
#include "onnxc_runtime.h"

extern const onnxc_model_t ONNXC_MODEL;

static void *alloc64(uint64_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, (size_t)((n + 63) / 64 * 64 + 64)) != 0) return NULL;
    memset(p, 0, (size_t)((n + 63) / 64 * 64 + 64));
    return p;
}

int main(int argc, char **argv) {
    const onnxc_model_t *m = &ONNXC_MODEL;
    if (argc != 4) { fprintf(stderr, "usage: gemm_side ISA FLOPS PAIRS\n"); return 2; }
    peak_fn loop = peak_loop(argv[1]);
    double flops = atof(argv[2]);
    long pairs = atol(argv[3]);
    if (!loop) { fprintf(stderr, "this CPU cannot run %s\n", argv[1]); return 3; }
    if (!m->cpu_supported()) { fprintf(stderr, "this CPU lacks the model's features\n"); return 3; }
    if (m->n_inputs != 1 || m->n_outputs != 1) { fprintf(stderr, "one input, one output\n"); return 2; }
    float *in = alloc64(m->inputs[0].bytes);
    void *out = alloc64(m->outputs[0].bytes);
    void *arena = alloc64(m->arena_bytes);
    if (!in || !out || !arena) { fprintf(stderr, "out of memory\n"); return 2; }
    for (uint64_t i = 0; i < m->inputs[0].bytes / 4; i++) in[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    const void *ins[1] = {in};
    void *outs[1] = {out};
    /* Warm-up (about half a second), which also sizes the loop: its GFLOP/s at the
     * fastest seen, so that a loop of `iters` steps lasts about one model run. */
    double model_s = 1e9;
    for (int r = 0; r < 1000; r++) {
        double t0 = now();
        if (m->run(ins, outs, arena) != ONNXC_OK) { fprintf(stderr, "run failed\n"); return 4; }
        double dt = now() - t0;
        if (dt < model_s) model_s = dt;
        if (r >= 20 && r * model_s > 0.5) break;
    }
    double lanes = !strcmp(argv[1], "avx512") ? 16 : !strcmp(argv[1], "avx2") ? 8 : 4;
    double step_flops = 12.0 * 2.0 * lanes;
    double g = 0;
    for (int r = 0; r < 20; r++) { double x = loop(20000); if (x > g) g = x; }
    long iters = (long)(model_s * g * 1e9 / step_flops);
    if (iters < 1000) iters = 1000;
    for (long p = 0; p < pairs; p++) {
        double t0 = now();
        if (m->run(ins, outs, arena) != ONNXC_OK) { fprintf(stderr, "run failed\n"); return 4; }
        double dt = now() - t0;
        double peak = loop(iters);
        printf("%.3f %.3f\n", flops / dt / 1e9, peak);
    }
    return 0;
}
