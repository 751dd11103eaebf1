/*
 * A persistent worker pool for the CPU backend. m3_pool_for splits [0, n)
 * into chunks handed out dynamically to the workers and the calling thread,
 * and returns when all are done. Every output element of the CPU ops is
 * computed wholly inside one chunk, so results never depend on the thread
 * count or the schedule.
 */
#ifndef M3_CORE_POOL_H
#define M3_CORE_POOL_H

#include <stdint.h>

#include "m3.h"

typedef struct m3_pool m3_pool;

/* fn handles [begin, end); thread is in [0, m3_pool_size). */
typedef void (*m3_pool_fn)(void *ctx, int64_t begin, int64_t end, int thread);

/* n_threads <= 0: one per online core. */
m3_status m3_pool_create(int n_threads, m3_pool **out);
/* The cores online (the thread count of a pool created with 0). */
int m3_pool_default_threads(void);
void m3_pool_free(m3_pool *pool);
int m3_pool_size(const m3_pool *pool);
/* Run fn over [0, n) in chunks of at least grain items. */
void m3_pool_for(m3_pool *pool, int64_t n, int64_t grain, m3_pool_fn fn, void *ctx);

/* fn(ctx, thread, n_threads) once on every thread of the pool at the same
 * time (the caller is thread 0), returning when all have returned: one
 * threaded pass whose phases are separated by m3_pool_barrier. fn must not
 * call m3_pool_for or m3_pool_run_all on the same pool. */
typedef void (*m3_pool_all_fn)(void *ctx, int thread, int n_threads);
void m3_pool_run_all(m3_pool *pool, m3_pool_all_fn fn, void *ctx);
/* Inside m3_pool_run_all only, called by every thread the same number of
 * times: returns once every thread of the pool has arrived. Everything a
 * thread wrote before the barrier is visible to every thread after it. A
 * generation barrier: it spins briefly, then yields, then sleeps on a
 * condition variable. With one thread it returns at once. */
void m3_pool_barrier(m3_pool *pool);

#endif
