/*
 * Ranks as threads: the communicator of a TP group whose ranks are threads
 * of one process (the CPU backend's tensor parallelism). A collective is
 * "publish my buffer, barrier, read everyone's, barrier": the second barrier
 * keeps a fast rank from reusing its buffer while a slow one still reads
 * it. Sums run over ranks in rank order into private scratch, so every rank
 * computes the same bits. Every wait is bounded; an expired wait, or a rank
 * that calls abort after a failure, poisons the group so every peer's
 * collective returns an error naming the cause instead of hanging.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/bf16.h"
#include "core/status.h"
#include "dist/comm.h"

typedef struct group {
    int world;
    int64_t timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t generation;
    bool aborted;
    char why[256];
    const void *slot[M3_MAX_TP]; /* each rank's published buffer */
    int64_t value[M3_MAX_TP];
    int refs;
} group;

typedef struct rank_impl {
    group *g;
    void *tmp; /* private sums */
    size_t tmp_bytes;
} rank_impl;

static group *group_of(m3_comm *c) { return ((rank_impl *)c->impl)->g; }

static m3_status aborted_status(m3_comm *c, const group *g) {
    return m3_fail(M3_ERR_FAULT, "TP rank %d: the group was aborted: %s", c->rank, g->why);
}

static void abort_locked(group *g, const char *msg) {
    if (!g->aborted) {
        g->aborted = true;
        snprintf(g->why, sizeof g->why, "%s", msg);
    }
    pthread_cond_broadcast(&g->cv);
}

/* Wait until every rank arrives, the group is aborted, or the wait expires. */
static m3_status barrier(m3_comm *c) {
    group *g = group_of(c);
    pthread_mutex_lock(&g->mu);
    if (g->aborted) {
        m3_status st = aborted_status(c, g);
        pthread_mutex_unlock(&g->mu);
        return st;
    }
    uint64_t gen = g->generation;
    if (++g->arrived == g->world) {
        g->arrived = 0;
        g->generation++;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return M3_OK;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += g->timeout_ms / 1000;
    until.tv_nsec += (long)(g->timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (g->generation == gen && !g->aborted) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &until) == ETIMEDOUT &&
            g->generation == gen && !g->aborted) {
            char msg[128];
            snprintf(msg, sizeof msg, "rank %d waited %lld ms for its peers", c->rank,
                     (long long)g->timeout_ms);
            abort_locked(g, msg);
        }
    }
    m3_status st = g->generation != gen ? M3_OK : aborted_status(c, g);
    pthread_mutex_unlock(&g->mu);
    return st;
}

static m3_status ensure_tmp(m3_comm *c, size_t bytes) {
    rank_impl *ri = c->impl;
    if (bytes <= ri->tmp_bytes)
        return M3_OK;
    free(ri->tmp);
    ri->tmp = malloc(bytes);
    ri->tmp_bytes = ri->tmp ? bytes : 0;
    if (!ri->tmp)
        return m3_fail(M3_ERR_NO_MEMORY, "TP rank %d: out of memory for %zu reduction bytes",
                       c->rank, bytes);
    return M3_OK;
}

enum sum_kind { SUM_F32, SUM_F64, SUM_BF16 };

/* Publish buf, wait for every rank, sum everyone's in rank order into tmp
 * (fp32 sums for F32 and BF16, fp64 for F64), wait again so no buffer is
 * reused early. */
static m3_status reduce_to_tmp(m3_comm *c, const void *buf, int64_t n, enum sum_kind kind) {
    group *g = group_of(c);
    M3_TRY(ensure_tmp(c, (size_t)n * (kind == SUM_F64 ? 8 : 4)));
    void *tmp = ((rank_impl *)c->impl)->tmp;
    g->slot[c->rank] = buf;
    M3_TRY(barrier(c));
    for (int64_t i = 0; i < n; i++) {
        if (kind == SUM_F64) {
            double acc = 0;
            for (int r = 0; r < g->world; r++)
                acc += ((const double *)g->slot[r])[i];
            ((double *)tmp)[i] = acc;
            continue;
        }
        float acc = 0;
        for (int r = 0; r < g->world; r++)
            acc += kind == SUM_BF16 ? m3_bf16_to_f32(((const uint16_t *)g->slot[r])[i])
                                    : ((const float *)g->slot[r])[i];
        ((float *)tmp)[i] = acc;
    }
    return barrier(c);
}

static m3_status threads_all_reduce_f32(m3_comm *c, float *buf, int64_t n) {
    M3_TRY(reduce_to_tmp(c, buf, n, SUM_F32));
    memcpy(buf, ((rank_impl *)c->impl)->tmp, (size_t)n * sizeof *buf);
    return M3_OK;
}

static m3_status threads_all_reduce_f64(m3_comm *c, double *buf, int64_t n) {
    M3_TRY(reduce_to_tmp(c, buf, n, SUM_F64));
    memcpy(buf, ((rank_impl *)c->impl)->tmp, (size_t)n * sizeof *buf);
    return M3_OK;
}

static m3_status threads_all_reduce_bf16(m3_comm *c, uint16_t *buf, int64_t n) {
    M3_TRY(reduce_to_tmp(c, buf, n, SUM_BF16));
    const float *tmp = ((rank_impl *)c->impl)->tmp;
    for (int64_t i = 0; i < n; i++)
        buf[i] = m3_f32_to_bf16(tmp[i]);
    return M3_OK;
}

static m3_status threads_all_gather(m3_comm *c, const void *in, void *out, int64_t bytes) {
    group *g = group_of(c);
    g->slot[c->rank] = in;
    M3_TRY(barrier(c));
    for (int r = 0; r < g->world; r++)
        memcpy((char *)out + (size_t)r * (size_t)bytes, g->slot[r], (size_t)bytes);
    return barrier(c);
}

static m3_status threads_agree_min(m3_comm *c, int64_t local, int64_t *global) {
    group *g = group_of(c);
    g->value[c->rank] = local;
    M3_TRY(barrier(c));
    int64_t m = g->value[0];
    for (int r = 1; r < g->world; r++)
        m = g->value[r] < m ? g->value[r] : m;
    *global = m;
    return barrier(c);
}

static void threads_abort(m3_comm *c, const char *msg) {
    group *g = group_of(c);
    char buf[200];
    snprintf(buf, sizeof buf, "rank %d: %s", c->rank, msg ? msg : "aborted");
    pthread_mutex_lock(&g->mu);
    abort_locked(g, buf);
    pthread_mutex_unlock(&g->mu);
}

static void threads_destroy(m3_comm *c) {
    rank_impl *ri = c->impl;
    group *g = ri->g;
    pthread_mutex_lock(&g->mu);
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last) {
        pthread_mutex_destroy(&g->mu);
        pthread_cond_destroy(&g->cv);
        free(g);
    }
    free(ri->tmp);
    free(ri);
    free(c);
}

static const m3_comm_ops threads_ops = {
    threads_all_reduce_f32, threads_all_reduce_f64, threads_all_reduce_bf16, threads_all_gather,
    threads_agree_min,      threads_abort,          threads_destroy};

void m3_comm_threads_reset(m3_comm *any_rank) {
    if (!any_rank || any_rank->ops != &threads_ops)
        return;
    group *g = group_of(any_rank);
    pthread_mutex_lock(&g->mu);
    g->aborted = false;
    g->why[0] = 0;
    g->arrived = 0;
    pthread_mutex_unlock(&g->mu);
}

m3_status m3_comm_create_threads(int world, int64_t timeout_ms, m3_comm **comms) {
    if (world < 1 || world > M3_MAX_TP)
        return m3_fail(M3_ERR_INVALID_ARG, "TP world size %d: must be in [1, %d]", world,
                       M3_MAX_TP);
    if (timeout_ms < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "TP wait timeout %lld ms is negative",
                       (long long)timeout_ms);
    group *g = calloc(1, sizeof *g);
    if (!g)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating a TP group");
    g->world = world;
    g->timeout_ms = timeout_ms ? timeout_ms : 60000;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (int r = 0; r < world; r++) {
        m3_comm *c = calloc(1, sizeof *c);
        rank_impl *ri = calloc(1, sizeof *ri);
        if (!c || !ri) {
            free(c);
            free(ri);
            for (int k = 0; k < r; k++)
                m3_comm_free(comms[k]);
            if (r == 0) {
                pthread_mutex_destroy(&g->mu);
                pthread_cond_destroy(&g->cv);
                free(g);
            }
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating a TP group");
        }
        ri->g = g;
        g->refs++;
        c->ops = &threads_ops;
        c->rank = r;
        c->world = world;
        c->impl = ri;
        comms[r] = c;
    }
    return M3_OK;
}
