/*
 * onnxc_pool.h: a small pthreads thread pool that implements onnxc_threads_t, so that a
 * C program can spread a compiled model's run over several cores:
 *
 *     onnxc_pool_t *pool = onnxc_pool_create(4);     // the caller plus 3 workers
 *     onnxc_threads_t threads = onnxc_pool_threads(pool);
 *     int32_t rc = model_run_parallel(inputs, outputs, arena, &threads);
 *     ...
 *     onnxc_pool_destroy(pool);
 *
 * Header-only (every function is static inline), C11 (atomics, _Alignas, aligned_alloc)
 * plus pthreads; link with -pthread. This file is the application's side of the contract:
 * it allocates and creates threads, which the compiled model itself never does. One pool
 * serves one run at a time (parallel_for is not reentrant per pool); use a pool per
 * concurrently running thread.
 */
#ifndef ONNXC_POOL_H
#define ONNXC_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "onnxc_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A thread's cursor, alone in its cache line: each claim of a task writes it, and two
 * cursors in one line made every claim move the line between the cores. */
struct onnxc_pool__cursor {
  _Alignas(64) atomic_uint next;
  char pad_[64 - sizeof(atomic_uint)];
};

typedef struct onnxc_pool {
  pthread_mutex_t mu;
  pthread_cond_t wake;  /* workers wait here for a new job */
  pthread_cond_t idle;  /* the caller waits here for the job's end */
  pthread_t *workers;
  int n_workers;
  /* The current job, written under mu. */
  onnxc_task_fn task;
  void *ctx;
  uint32_t n;
  atomic_ulong gen;     /* job number (changed under mu); a worker runs each job once */
  atomic_int active;    /* workers inside the current job (changed under mu) */
  int stop;
  /* Indices finished, alone in its cache line (each thread adds its count once per job,
   * and the workers poll `gen` beside the fields above). */
  _Alignas(64) atomic_uint done;
  char pad_[64 - sizeof(atomic_uint)];
  /* Per thread (0: the caller, 1..: workers): the next index of its share of the job,
   * shares being contiguous runs of n / threads. A thread runs its own share, then takes
   * what is left of the others'. The same thread runs the same indices on every call of
   * one shape, so the data a task reads (a split GEMM's weight columns) stays in that
   * core's cache from run to run. */
  struct onnxc_pool__cursor *cursor;
  struct onnxc_pool__arg *args;  /* each worker's (pool, thread number) */
} onnxc_pool_t;

/* How many times a thread polls for a new job (workers) or for the job's end (the caller)
 * before sleeping on a condition variable: a model makes one parallel_for call per split
 * GEMM, often less than a millisecond apart, and waking a sleeping thread costs tens of
 * microseconds. About 0.2-1 ms of polling; define it before including to change it. */
#ifndef ONNXC_POOL_SPIN
#define ONNXC_POOL_SPIN 8192
#endif

static inline void onnxc_pool__relax_(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* The end of thread t's share of n indices among `threads`. */
static inline uint32_t onnxc_pool__end_(uint32_t n, int threads, int t) {
  return (uint32_t)(((uint64_t)n * (uint64_t)(t + 1)) / (uint64_t)threads);
}

/* Runs thread `tid`'s share of the current job, then what is left of the others'. */
static inline void onnxc_pool__drain_(onnxc_pool_t *p, int tid, onnxc_task_fn task, void *ctx, uint32_t n) {
  int threads = p->n_workers + 1;
  unsigned ran = 0;
  for (int k = 0; k < threads; k++) {
    int t = (tid + k) % threads;
    uint32_t end = onnxc_pool__end_(n, threads, t);
    for (;;) {
      unsigned i = atomic_fetch_add(&p->cursor[t].next, 1u);
      if (i >= end) break;
      task(ctx, i);
      ran++;
    }
  }
  /* The tasks this thread ran, counted in once after its last (a shared count bumped
   * per task moved its cache line between the cores each time): `done` reaches n only
   * when every task has returned. */
  if (ran && atomic_fetch_add(&p->done, ran) + ran == n) {
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->idle);
    pthread_mutex_unlock(&p->mu);
  }
}

/* A worker's argument: its thread number, inside the pool's `ids`. */
typedef struct onnxc_pool__arg {
  struct onnxc_pool *p;
  int tid;
} onnxc_pool__arg_t;

static inline void *onnxc_pool__worker_(void *arg) {
  onnxc_pool_t *p = ((onnxc_pool__arg_t *)arg)->p;
  int tid = ((onnxc_pool__arg_t *)arg)->tid;
  unsigned long seen = 0;
  for (;;) {
    /* Poll for the next job before taking the lock and sleeping. */
    for (int s = 0; s < ONNXC_POOL_SPIN && atomic_load(&p->gen) == seen; s++) onnxc_pool__relax_();
    pthread_mutex_lock(&p->mu);
    while (!p->stop && atomic_load(&p->gen) == seen) pthread_cond_wait(&p->wake, &p->mu);
    if (p->stop) break;
    seen = atomic_load(&p->gen);
    onnxc_task_fn task = p->task;
    void *ctx = p->ctx;
    uint32_t n = p->n;
    atomic_fetch_add(&p->active, 1);
    pthread_mutex_unlock(&p->mu);
    onnxc_pool__drain_(p, tid, task, ctx, n);
    pthread_mutex_lock(&p->mu);
    if (atomic_fetch_sub(&p->active, 1) == 1) pthread_cond_broadcast(&p->idle);
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* The onnxc_threads_t.parallel_for of a pool: the calling thread takes part. */
static inline void onnxc_pool_parallel_for(void *pool, onnxc_task_fn task, void *ctx, uint32_t n) {
  onnxc_pool_t *p = (onnxc_pool_t *)pool;
  if (n == 0) return;
  if (p->n_workers == 0 || n == 1) {
    for (uint32_t i = 0; i < n; i++) task(ctx, i);
    return;
  }
  /* A worker still inside the previous job (claiming nothing) must leave it before the
   * counters are reset, or it could run an index of this job with the old task. It is
   * usually a few instructions from leaving: poll before sleeping (a sleep and its
   * wake-up cost tens of microseconds, and came once per job). */
  for (int s = 0; s < ONNXC_POOL_SPIN && atomic_load(&p->active) > 0; s++) onnxc_pool__relax_();
  pthread_mutex_lock(&p->mu);
  while (atomic_load(&p->active) > 0) pthread_cond_wait(&p->idle, &p->mu);
  p->task = task;
  p->ctx = ctx;
  p->n = n;
  for (int t = 0; t <= p->n_workers; t++)
    atomic_store(&p->cursor[t].next, t == 0 ? 0u : onnxc_pool__end_(n, p->n_workers + 1, t - 1));
  atomic_store(&p->done, 0u);
  atomic_fetch_add(&p->gen, 1ul);
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  onnxc_pool__drain_(p, 0, task, ctx, n);
  for (int s = 0; s < ONNXC_POOL_SPIN && atomic_load(&p->done) < n; s++) onnxc_pool__relax_();
  pthread_mutex_lock(&p->mu);
  while (atomic_load(&p->done) < n) pthread_cond_wait(&p->idle, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

/* A pool of `threads` threads in all: the caller of parallel_for and threads - 1 workers.
 * Returns NULL when out of memory or threads cannot be created. */
static inline onnxc_pool_t *onnxc_pool_create(int threads) {
  onnxc_pool_t *p = (onnxc_pool_t *)aligned_alloc(64, sizeof *p);
  if (!p) return NULL;
  memset(p, 0, sizeof *p);
  int want = threads > 1 ? threads - 1 : 0;
  p->workers = want ? (pthread_t *)calloc((size_t)want, sizeof(pthread_t)) : NULL;
  p->args = want ? (onnxc_pool__arg_t *)calloc((size_t)want, sizeof(onnxc_pool__arg_t)) : NULL;
  p->cursor = (struct onnxc_pool__cursor *)aligned_alloc(
      64, ((size_t)want + 1) * sizeof(struct onnxc_pool__cursor));
  if ((want && (!p->workers || !p->args)) || !p->cursor) {
    free(p->workers);
    free(p->args);
    free(p->cursor);
    free(p);
    return NULL;
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->idle, NULL);
  for (int t = 0; t <= want; t++) atomic_init(&p->cursor[t].next, 0u);
  atomic_init(&p->done, 0u);
  atomic_init(&p->gen, 0ul);
  atomic_init(&p->active, 0);
  for (int i = 0; i < want; i++) {
    p->args[i].p = p;
    p->args[i].tid = i + 1;
    if (pthread_create(&p->workers[i], NULL, onnxc_pool__worker_, &p->args[i]) != 0) break;
    p->n_workers++;
  }
  if (p->n_workers < want) {
    /* Fewer threads than asked: stop the ones made and fail. */
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++) pthread_join(p->workers[i], NULL);
    free(p->workers);
    free(p->args);
    free(p->cursor);
    free(p);
    return NULL;
  }
  return p;
}

/* The pool as the model's onnxc_threads_t. */
static inline onnxc_threads_t onnxc_pool_threads(onnxc_pool_t *p) {
  onnxc_threads_t t;
  t.parallel_for = onnxc_pool_parallel_for;
  t.pool = p;
  return t;
}

static inline void onnxc_pool_destroy(onnxc_pool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_workers; i++) pthread_join(p->workers[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->wake);
  pthread_cond_destroy(&p->idle);
  free(p->workers);
  free(p->args);
  free(p->cursor);
  free(p);
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ONNXC_POOL_H */
