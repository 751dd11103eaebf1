/*
 * Worker pool (see pool.h). Workers sleep on a condition variable between
 * jobs; a job is published by bumping a generation counter. Chunks are
 * claimed with an atomic counter, so a slow core does not hold the job up.
 */
#include "core/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/status.h"

struct m3_pool {
    int n_threads; /* including the caller */
    pthread_t *workers;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    uint64_t generation;
    int busy;      /* workers still inside the current job */
    bool stop;
    /* the current job */
    m3_pool_fn fn;
    void *ctx;
    int64_t n, chunk;
    atomic_int_fast64_t next;
};

typedef struct {
    m3_pool *pool;
    int index;
} worker_arg;

static void run_chunks(m3_pool *p, int thread) {
    for (;;) {
        int64_t begin = atomic_fetch_add(&p->next, p->chunk);
        if (begin >= p->n)
            break;
        int64_t end = begin + p->chunk < p->n ? begin + p->chunk : p->n;
        p->fn(p->ctx, begin, end, thread);
    }
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    m3_pool *p = wa->pool;
    int index = wa->index;
    free(wa);
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_chunks(p, index);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int m3_pool_default_threads(void) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

m3_status m3_pool_create(int n_threads, m3_pool **out) {
    *out = NULL;
    if (n_threads <= 0)
        n_threads = m3_pool_default_threads();
    if (n_threads > 1024)
        return m3_fail(M3_ERR_INVALID_ARG, "threads = %d: at most 1024", n_threads);
    m3_pool *p = m3_calloc(1, sizeof *p, "thread pool");
    if (!p)
        return M3_ERR_NO_MEMORY;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->workers = m3_calloc((size_t)n_threads, sizeof *p->workers, "thread pool");
    if (!p->workers) {
        m3_pool_free(p);
        return M3_ERR_NO_MEMORY;
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa || (wa->pool = p, wa->index = i,
                    pthread_create(&p->workers[i], NULL, worker_main, wa) != 0)) {
            free(wa);
            p->n_threads = i; /* join only the started ones */
            m3_pool_free(p);
            return m3_fail(M3_ERR_NO_MEMORY, "could not start worker thread %d of %d", i,
                           n_threads);
        }
    }
    *out = p;
    return M3_OK;
}

void m3_pool_free(m3_pool *p) {
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads && p->workers; i++)
        pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->workers);
    free(p);
}

int m3_pool_size(const m3_pool *p) { return p ? p->n_threads : 1; }

void m3_pool_for(m3_pool *p, int64_t n, int64_t grain, m3_pool_fn fn, void *ctx) {
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    if (!p || p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    /* about four chunks a thread balances load without much claiming */
    int64_t chunk = (n + (int64_t)p->n_threads * 4 - 1) / ((int64_t)p->n_threads * 4);
    if (chunk < grain)
        chunk = grain;
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk;
    atomic_store(&p->next, 0);
    p->busy = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
