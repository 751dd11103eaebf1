/*
 * The communicator: every cross-rank operation of the engine goes through
 * it (the stock path's all-reduces after o_proj and after the FFN, the
 * `tp_agree` MIN over ranks for decisions, all-gathers for the indexer's
 * context parallelism). World 1 is the trivial communicator; ranks as
 * threads (CPU) and as GPUs (NCCL, peer memory) implement the same table.
 * Reductions sum in a fixed order (CPU: rank order; GPUs: a pairwise tree
 * over rank ids) so every rank gets bit-identical results.
 */
#ifndef M3_DIST_COMM_H
#define M3_DIST_COMM_H

#include <stdint.h>

#include "m3.h"

typedef struct m3_comm m3_comm;

typedef struct m3_comm_ops {
    /* buf [n] fp32 (backend memory) <- sum over ranks, in a fixed order */
    m3_status (*all_reduce_sum_f32)(m3_comm *c, float *buf, int64_t n);
    /* buf [n] fp64 <- sum over ranks, in a fixed order (CPU TP partials) */
    m3_status (*all_reduce_sum_f64)(m3_comm *c, double *buf, int64_t n);
    /* buf [n] bf16 <- sum over ranks in fp32, in a fixed order, rounded once */
    m3_status (*all_reduce_sum_bf16)(m3_comm *c, uint16_t *buf, int64_t n);
    /* out [world * n] <- every rank's in [n] bytes, rank-major */
    m3_status (*all_gather)(m3_comm *c, const void *in, void *out, int64_t bytes);
    /* *global = min over ranks of local (tp_agree) */
    m3_status (*agree_min)(m3_comm *c, int64_t local, int64_t *global);
    /* end every peer's current and next wait with an error naming msg (a
     * failure on this rank); idempotent */
    void (*abort)(m3_comm *c, const char *msg);
    void (*destroy)(m3_comm *c);
} m3_comm_ops;

struct m3_comm {
    const m3_comm_ops *ops;
    int rank, world;
    void *impl;
};

/* The world-1 communicator. */
m3_status m3_comm_create_single(m3_comm **out);

/* Ranks as threads of one process: comms[0..world) share one group; rank
 * r's calls must come from one thread at a time. Buffers are host memory.
 * Every wait is bounded by timeout_ms (0: 60 s); an expired wait aborts the
 * group, so every rank's collective fails instead of hanging. */
m3_status m3_comm_create_threads(int world, int64_t timeout_ms, m3_comm **comms);
/* Clear an aborted group (every rank idle: between steps). */
void m3_comm_threads_reset(m3_comm *any_rank);

#define M3_MAX_TP 8
void m3_comm_free(m3_comm *c);

/* true on every rank iff ok on every rank. */
m3_status m3_comm_agree(m3_comm *c, bool ok, bool *all_ok);

#endif
