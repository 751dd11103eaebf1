/*
 * The communicator: every cross-rank operation of the engine goes through
 * it (the stock path's all-reduces after o_proj and after the FFN, the
 * `tp_agree` MIN over ranks for decisions, all-gathers for the indexer's
 * context parallelism). World 1 is the trivial communicator; ranks as
 * threads (CPU) and as GPUs (NCCL, peer memory) implement the same table.
 * Reductions sum in rank order so every rank gets bit-identical results.
 */
#ifndef M3_DIST_COMM_H
#define M3_DIST_COMM_H

#include <stdint.h>

#include "m3.h"

typedef struct m3_comm m3_comm;

typedef struct m3_comm_ops {
    /* buf [n] fp32 (backend memory) <- sum over ranks, in rank order */
    m3_status (*all_reduce_sum_f32)(m3_comm *c, float *buf, int64_t n);
    /* out [world * n] <- every rank's in [n] bytes, rank-major */
    m3_status (*all_gather)(m3_comm *c, const void *in, void *out, int64_t bytes);
    /* *global = min over ranks of local (tp_agree) */
    m3_status (*agree_min)(m3_comm *c, int64_t local, int64_t *global);
    void (*destroy)(m3_comm *c);
} m3_comm_ops;

struct m3_comm {
    const m3_comm_ops *ops;
    int rank, world;
    void *impl;
};

/* The world-1 communicator. */
m3_status m3_comm_create_single(m3_comm **out);
void m3_comm_free(m3_comm *c);

/* true on every rank iff ok on every rank. */
m3_status m3_comm_agree(m3_comm *c, bool ok, bool *all_ok);

#endif
