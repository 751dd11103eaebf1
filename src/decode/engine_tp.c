/*
 * The TP front: a step of a tensor-parallel engine runs on every rank at
 * once, one thread per rank (rank 0 on the caller's thread). Each rank
 * builds the same step from the same requests (their caches are replicas),
 * runs its shard of every layer with the all-reduces going through the
 * group's communicator, and computes the logits of its vocabulary slice;
 * the front then lays the slices side by side. A failure on any rank fails
 * the step on every rank (engine.c agrees before committing), and the
 * caller gets the message of the rank where it began.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "decode/engine.h"

typedef struct rank_job {
    m3_engine *e;
    m3_status (*fn)(m3_engine *rank, void *arg);
    void *arg;
    m3_status st;
    char msg[512];
} rank_job;

static void *rank_main(void *p) {
    rank_job *j = p;
    j->st = m3_engine_bind_thread(j->e); /* its GPU */
    if (!j->st)
        j->st = j->fn(j->e, j->arg);
    if (j->st)
        snprintf(j->msg, sizeof j->msg, "%s", m3_last_error());
    return NULL;
}

/* A message caused by a peer's failure rather than this rank's own. */
static bool from_peer(const char *msg) {
    return strstr(msg, "another TP rank") || strstr(msg, "group was aborted");
}

m3_status m3_tp_run_all(m3_engine *f, m3_status (*fn)(m3_engine *rank, void *arg), void *arg) {
    int tp = f->tp_size;
    rank_job jobs[M3_MAX_TP] = {{0}};
    pthread_t threads[M3_MAX_TP];
    bool started[M3_MAX_TP] = {0};
    m3_status st = M3_OK;
    if (tp < 1 || tp > M3_MAX_TP)
        return m3_fail(M3_ERR_INTERNAL, "TP front with %d ranks", tp);
    for (int r = 0; r < tp; r++)
        jobs[r] = (rank_job){f->ranks[r], fn, arg, M3_OK, ""};
    for (int r = 1; r < tp && !st; r++) {
        if (pthread_create(&threads[r], NULL, rank_main, &jobs[r]) == 0) {
            started[r] = true;
        } else {
            /* ranks already started may wait for this one: end their waits */
            f->rank_comms[0]->ops->abort(f->rank_comms[0], "could not start a rank thread");
            st = m3_fail(M3_ERR_INTERNAL, "could not start the thread of TP rank %d", r);
        }
    }
    if (!st)
        rank_main(&jobs[0]);
    for (int r = 1; r < tp; r++)
        if (started[r])
            pthread_join(threads[r], NULL);
    if (!st) {
        /* the first failing rank whose failure was its own, else the first */
        int root = -1;
        for (int r = 0; r < tp; r++)
            if (jobs[r].st && (root < 0 || (from_peer(jobs[root].msg) && !from_peer(jobs[r].msg))))
                root = r;
        if (root >= 0)
            st = m3_fail(jobs[root].st, "TP rank %d: %s", root, jobs[root].msg);
    }
    if (st) /* every rank is idle again: the group may be used afresh */
        m3_comm_threads_reset(f->rank_comms[0]);
    return st;
}

typedef struct step_args {
    const m3_request *reqs;
    int n_reqs;
    float *slices[M3_MAX_TP]; /* each rank's vocabulary slice of the logits */
    bool all;
} step_args;

static m3_status rank_step(m3_engine *e, void *p) {
    step_args *a = p;
    float *slice = a->slices[e->tp_rank];
    return m3_engine_step(e, a->reqs, a->n_reqs, a->all ? NULL : slice, a->all ? slice : NULL);
}

/* out [n, V] <- the ranks' slices [n, V/tp] side by side */
static void interleave(m3_engine *f, float *const *slices, int n, float *out) {
    int64_t Vl = f->ranks[0]->cfg.vocab_size, V = f->vocab_full;
    for (int r = 0; r < f->tp_size; r++)
        for (int q = 0; q < n; q++)
            memcpy(out + q * V + r * Vl, slices[r] + q * Vl, (size_t)Vl * sizeof *out);
}

m3_status m3_tp_front_step(m3_engine *f, const m3_request *reqs, int n_reqs, float *logits,
                           float *all_logits) {
    int tp = f->tp_size, rows = 0;
    for (int q = 0; q < n_reqs && reqs; q++)
        rows += reqs[q].n_tokens > 0 ? reqs[q].n_tokens : 0;
    int n_out = all_logits ? rows : n_reqs;
    if (n_reqs < 1 || n_out < 1)
        return m3_engine_step(f->ranks[0], reqs, n_reqs, logits, all_logits); /* its message */
    size_t slice = (size_t)n_out * (size_t)f->ranks[0]->cfg.vocab_size;
    step_args a = {reqs, n_reqs, {0}, all_logits != NULL};
    m3_status st = M3_OK;
    for (int r = 0; r < tp && !st; r++) {
        a.slices[r] = m3_malloc(slice * sizeof(float), "TP logits slice");
        if (!a.slices[r])
            st = M3_ERR_NO_MEMORY;
    }
    if (!st)
        st = m3_tp_run_all(f, rank_step, &a);
    if (!st && all_logits) {
        interleave(f, a.slices, n_out, all_logits);
        if (logits) {
            int64_t V = f->vocab_full;
            for (int q = 0, t = 0; q < n_reqs; q++) {
                t += reqs[q].n_tokens;
                memcpy(logits + q * V, all_logits + (t - 1) * V, (size_t)V * sizeof *logits);
            }
        }
    } else if (!st) {
        interleave(f, a.slices, n_out, logits);
    }
    for (int r = 0; r < tp; r++)
        free(a.slices[r]);
    return st;
}
