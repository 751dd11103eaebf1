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

#endif
