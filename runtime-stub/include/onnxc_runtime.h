/*
 * onnxc_runtime.h: the C ABI that every model compiled by onnxc targets.
 *
 * A compiled model is an object file (model.o) plus a per-model header (model.h). Besides
 * its typed entry point (e.g. `int resnet18_run(const float *input_0, float *output_0,
 * void *arena)`), every model exports one `onnxc_model_t` descriptor so that a single
 * harness can drive any compiled model: names, dtypes, shapes, arena size and the entry
 * point.
 *
 * Contract of every compiled model:
 *   - No allocation: the model never calls malloc or any other allocator. All scratch
 *     memory is the caller's `arena`, of at least `arena_bytes` bytes, aligned to
 *     `arena_align` bytes (a power of two; 64 unless the descriptor says otherwise).
 *   - Reentrant: the model writes no globals and takes no locks. Two threads may run the
 *     same model at once as long as each passes its own arena (and its own outputs).
 *   - No aborts: what can fail at run time (a null or misaligned pointer, a CPU without a
 *     required feature) is reported as an onnxc_status_t code; 0 (ONNXC_OK) is success.
 *   - Tensors are dense, row-major (C order), in the element type given by `dtype`, and
 *     naturally aligned for that type. Weights are const data inside the object.
 *   - String tensors (ONNXC_STRING) are arrays of `const char *`, one pointer per element
 *     in the same row-major order, each to a NUL-terminated UTF-8 string; `bytes` is
 *     elems * sizeof(const char *). A model only reads the strings of its inputs (up to
 *     their NUL) and never writes them. It writes into a string output only pointers it
 *     already has: an input string's pointer (valid while the caller keeps that input
 *     alive and unchanged) or a constant string in the object (valid for the life of the
 *     program). It never allocates new strings, so ops that create string bytes at run
 *     time (StringConcat, StringNormalizer, StringSplit) are refused at compile time.
 *
 * ABI versioning: `abi_version` in the descriptor is ONNXC_ABI_VERSION of the compiler
 * that emitted it. A harness must refuse a descriptor whose version it does not know.
 * Fields are only ever added at the end of a struct in a new ABI version.
 *   1: the first layout.
 *   2: adds `run_parallel` (threads through the application's parallel_for) at the end
 *      of onnxc_model_t.
 *
 * Threads: the object creates none and calls no OS. A caller that wants a run spread over
 * several cores passes an onnxc_threads_t to `run_parallel`: the model hands the parts of
 * its large GEMMs and convolutions to `parallel_for`, which must call task(ctx, i) once
 * for every i in [0, n_tasks), on any threads, and return only when all have returned.
 * The parts write disjoint memory, so the results are bit-identical to a serial run.
 * onnxc_pool.h is a ready pthreads implementation; with a NULL onnxc_threads_t (or a
 * NULL parallel_for) the model runs on the caller's thread.
 */
#ifndef ONNXC_RUNTIME_H
#define ONNXC_RUNTIME_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the layout of the types below. */
#define ONNXC_ABI_VERSION 2

/* Status codes returned (as int32_t) by a model's run function. */
typedef enum {
  ONNXC_OK = 0,                  /* success; outputs are written */
  ONNXC_ERR_NULL_POINTER = 1,    /* an input, output or the arena pointer is NULL */
  ONNXC_ERR_MISALIGNED = 2,      /* the arena (or a tensor) is not aligned as required */
  ONNXC_ERR_CPU_UNSUPPORTED = 3  /* this CPU lacks an instruction-set feature the code uses */
} onnxc_status_t;

/* Element types use ONNX TensorProto.DataType codes. */
typedef enum {
  ONNXC_FLOAT = 1,
  ONNXC_UINT8 = 2,
  ONNXC_INT8 = 3,
  ONNXC_UINT16 = 4,
  ONNXC_INT16 = 5,
  ONNXC_INT32 = 6,
  ONNXC_INT64 = 7,
  ONNXC_STRING = 8,   /* one `const char *` per element, to a NUL-terminated UTF-8 string */
  ONNXC_BOOL = 9,     /* one byte per element, 0 or 1 */
  ONNXC_FLOAT16 = 10,
  ONNXC_DOUBLE = 11,
  ONNXC_UINT32 = 12,
  ONNXC_UINT64 = 13,
  ONNXC_BFLOAT16 = 16
  /* others by their ONNX code */
} onnxc_dtype_t;

/* One input or output of a model. All pointers point into the model's const data. */
typedef struct {
  const char *name;      /* the ONNX graph input/output name, NUL-terminated */
  int32_t dtype;         /* an onnxc_dtype_t (ONNX TensorProto.DataType code) */
  int32_t rank;          /* number of dimensions; 0 for a scalar */
  const int64_t *shape;  /* `rank` dimensions, all static; may be NULL when rank is 0 */
  uint64_t elems;        /* product of the dimensions (1 for a scalar) */
  uint64_t bytes;        /* size of the dense buffer in bytes (strings: elems pointers) */
} onnxc_tensor_info_t;

/*
 * A model's entry point. `inputs` holds n_inputs pointers and `outputs` n_outputs
 * pointers, both in graph order; `arena` is the caller's scratch memory (see
 * onnxc_model_t.arena_bytes / arena_align). Returns an onnxc_status_t code.
 * Reentrant: concurrent calls are safe given distinct arenas and outputs.
 */
typedef int32_t (*onnxc_run_fn)(const void *const *inputs, void *const *outputs, void *arena);

/* One part of a parallel loop: called with the context the model passed and an index. */
typedef void (*onnxc_task_fn)(void *ctx, uint32_t index);

/* The application's thread pool, as the model sees it. */
typedef struct {
  /* Calls task(ctx, i) for every i in [0, n_tasks), in any order and on any threads, and
   * returns when all calls have returned. May be NULL: the model then runs serially. */
  void (*parallel_for)(void *pool, onnxc_task_fn task, void *ctx, uint32_t n_tasks);
  void *pool;  /* passed back to parallel_for unchanged */
} onnxc_threads_t;

/* As onnxc_run_fn, spreading the work over `threads` (which may be NULL). */
typedef int32_t (*onnxc_run_parallel_fn)(const void *const *inputs, void *const *outputs,
                                         void *arena, const onnxc_threads_t *threads);

/* The generic descriptor that every compiled model exports. */
typedef struct {
  uint32_t abi_version;   /* ONNXC_ABI_VERSION of the emitting compiler */
  uint32_t n_inputs;
  uint32_t n_outputs;
  uint32_t reserved0;     /* zero */
  const char *name;       /* the model name given to the compiler (--name), NUL-terminated */
  const onnxc_tensor_info_t *inputs;   /* n_inputs entries, graph order */
  const onnxc_tensor_info_t *outputs;  /* n_outputs entries, graph order */
  uint64_t arena_bytes;   /* exact scratch size; the arena may be NULL only when this is 0 */
  uint64_t arena_align;   /* required arena alignment in bytes, a power of two */
  onnxc_run_fn run;                 /* inputs/outputs in graph order */
  int32_t (*cpu_supported)(void);   /* 1 if this CPU has every feature the code assumes */
  onnxc_run_parallel_fn run_parallel; /* ABI 2: run with the caller's threads */
} onnxc_model_t;

/*
 * A short English description of a status code. Not part of the stub (so that no symbol
 * is needed to use it): header-only.
 */
static inline const char *onnxc_status_str(int32_t status) {
  switch (status) {
    case ONNXC_OK: return "ok";
    case ONNXC_ERR_NULL_POINTER: return "null pointer";
    case ONNXC_ERR_MISALIGNED: return "misaligned pointer";
    case ONNXC_ERR_CPU_UNSUPPORTED: return "CPU lacks a required instruction-set feature";
    default: return "unknown status";
  }
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ONNXC_RUNTIME_H */
