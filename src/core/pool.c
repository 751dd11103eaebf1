/*
 * Worker pool (see pool.h). Workers sleep on a condition variable between
 * jobs; a job is published by bumping a generation counter. Chunks are
 * claimed with an atomic counter, so a slow core does not hold the job up.
 * A run_all job instead runs one function once on every thread, whose
 * phases meet at the pool's barrier.
 */
#include "core/pool.h"

#include <pthread.h>
#include <sched.h>
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
    m3_pool_all_fn all_fn; /* set: the job runs all_fn once per thread */
    /* the barrier of run_all jobs: arrivals of the current generation, the
     * generation (bumped by the last arrival), threads asleep on bar_cv */
    atomic_int bar_count;
    atomic_uint bar_gen;
    atomic_int bar_sleepers;
    pthread_mutex_t bar_mu;
    pthread_cond_t bar_cv;
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
        m3_pool_all_fn all = p->all_fn;
        void *ctx = p->ctx;
        pthread_mutex_unlock(&p->mu);
        if (all)
            all(ctx, index, p->n_threads);
        else
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
    pthread_mutex_init(&p->bar_mu, NULL);
    pthread_cond_init(&p->bar_cv, NULL);
    atomic_init(&p->bar_count, 0);
    atomic_init(&p->bar_gen, 0);
    atomic_init(&p->bar_sleepers, 0);
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
    pthread_mutex_destroy(&p->bar_mu);
    pthread_cond_destroy(&p->bar_cv);
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
    p->all_fn = NULL;
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

void m3_pool_run_all(m3_pool *p, m3_pool_all_fn fn, void *ctx) {
    if (!p || p->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->all_fn = fn;
    p->ctx = ctx;
    p->busy = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0, p->n_threads);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    p->all_fn = NULL;
    pthread_mutex_unlock(&p->mu);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spins, then yields, before a waiter sleeps: a phase of a decode layer
 * usually ends within microseconds of another, but a thread may wait long
 * (a TP peer's push), and cores may be shared (ranks as threads). */
#define BARRIER_SPINS 2000
#define BARRIER_YIELDS 100

void m3_pool_barrier(m3_pool *p) {
    if (!p || p->n_threads == 1)
        return;
    /* the generation of this episode: it cannot end before this arrival */
    unsigned gen = atomic_load_explicit(&p->bar_gen, memory_order_acquire);
    /* acq_rel: the last arrival acquires every earlier arrival's writes
     * (the increments form one release sequence) */
    if (atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) == p->n_threads - 1) {
        /* nobody arrives again before seeing the new generation */
        atomic_store_explicit(&p->bar_count, 0, memory_order_relaxed);
        /* seq_cst store then load, against the sleepers' seq_cst increment
         * then load: either the last arrival sees a sleeper (and wakes it
         * under the mutex) or the sleeper sees the new generation */
        atomic_store(&p->bar_gen, gen + 1);
        if (atomic_load(&p->bar_sleepers) > 0) {
            pthread_mutex_lock(&p->bar_mu);
            pthread_cond_broadcast(&p->bar_cv);
            pthread_mutex_unlock(&p->bar_mu);
        }
        return;
    }
    for (int i = 0; i < BARRIER_SPINS + BARRIER_YIELDS; i++) {
        if (atomic_load_explicit(&p->bar_gen, memory_order_acquire) != gen)
            return;
        if (i < BARRIER_SPINS)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_lock(&p->bar_mu);
    atomic_fetch_add(&p->bar_sleepers, 1);
    while (atomic_load(&p->bar_gen) == gen)
        pthread_cond_wait(&p->bar_cv, &p->bar_mu);
    atomic_fetch_sub(&p->bar_sleepers, 1);
    pthread_mutex_unlock(&p->bar_mu);
}
