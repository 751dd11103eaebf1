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
    const m3_request *reqs;
    int n_reqs;
    float *logits, *all_logits; /* this rank's vocabulary slice */
    m3_status st;
    char msg[512];
} rank_job;

static void *rank_main(void *arg) {
    rank_job *j = arg;
    j->st = m3_engine_step(j->e, j->reqs, j->n_reqs, j->logits, j->all_logits);
    if (j->st)
        snprintf(j->msg, sizeof j->msg, "%s", m3_last_error());
    return NULL;
}

/* A message caused by a peer's failure rather than this rank's own. */
static bool from_peer(const char *msg) {
    return strstr(msg, "failed on another TP rank") || strstr(msg, "group was aborted");
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
    rank_job jobs[M3_MAX_TP];
    float *slices[M3_MAX_TP] = {0};
    pthread_t threads[M3_MAX_TP];
    bool started[M3_MAX_TP] = {0};
    m3_status st = M3_OK;
    for (int r = 0; r < tp && !st; r++) {
        slices[r] = m3_malloc(slice * sizeof(float), "TP logits slice");
        if (!slices[r])
            st = M3_ERR_NO_MEMORY;
    }
    for (int r = 0; r < tp && !st; r++) {
        jobs[r] = (rank_job){f->ranks[r], reqs, n_reqs, all_logits ? NULL : slices[r],
                             all_logits ? slices[r] : NULL, M3_OK, ""};
        if (r > 0 && pthread_create(&threads[r], NULL, rank_main, &jobs[r]) == 0)
            started[r] = true;
        else if (r > 0) {
            /* ranks already started wait for this one: end their waits */
            f->rank_comms[0]->ops->abort(f->rank_comms[0], "could not start a rank thread");
            st = m3_fail(M3_ERR_INTERNAL, "could not start the thread of TP rank %d", r);
        }
    }
    if (!st)
        rank_main(&jobs[0]);
    else
        jobs[0].st = st;
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
    if (st)
        m3_comm_threads_reset(f->rank_comms[0]);
    if (!st && all_logits) {
        interleave(f, slices, n_out, all_logits);
        if (logits) {
            int64_t V = f->vocab_full;
            for (int q = 0, t = 0; q < n_reqs; q++) {
                t += reqs[q].n_tokens;
                memcpy(logits + q * V, all_logits + (t - 1) * V, (size_t)V * sizeof *logits);
            }
        }
    } else if (!st) {
        interleave(f, slices, n_out, logits);
    }
    for (int r = 0; r < tp; r++)
        free(slices[r]);
    return st;
}
