/*
 * Indexer context parallelism on the GPU (SPEC §6; the CPU core and the
 * rules it follows are in cp/indexer_cp.h): the owned-block scores, the
 * local top-k as packed 64-bit keys, and the merge of the all-gathered keys,
 * as three kernels on the backend's stream, callable from C. Every result
 * has the bits the CPU core computes (tests/gpu/test_cuda_cp.c checks it).
 *
 * Launch shapes depend only on (batch, query_len, heads, max_seq_len,
 * world, topk), never on the lengths, which the kernels read from device
 * memory: a CUDA graph captured with a one-token dummy batch replays on any
 * lengths up to max_seq_len (the capture-stable bound, max_model_len).
 *
 * Bad values are never faults. A length outside [0, max_seq_len] is
 * clamped to 0 (the request sees nothing: -inf scores, an empty selection);
 * a visible block whose page is outside the pool scores NaN without being
 * read. Each is recorded in a device error word err[4] = {code, request,
 * block, value} (the first one wins); m3_cuda_cp_error reads it back and
 * turns it into M3_ERR_INVALID_ARG naming the value. In a build without
 * CUDA these refuse with M3_ERR_UNSUPPORTED.
 */
#ifndef M3_CUDA_CUDA_CP_H
#define M3_CUDA_CUDA_CP_H

#include <stdint.h>

#include "backend/backend.h"

/* The score inputs, all device pointers. */
typedef struct m3_cuda_cp_inputs {
    const uint16_t *q;      /* bf16 [tokens, heads, 128], head stride 128 */
    int64_t q_row;          /* elements from one row to the next (>= heads * 128) */
    const uint16_t *icache; /* bf16 [pages, 128, 128] */
    int64_t pages;
    const int32_t *table; /* int32 [batch, table_row] */
    int64_t table_row;    /* >= ceil(max_seq_len / 128) */
    const int32_t *lens;  /* int32 [batch], this step's rows included */
    int batch, query_len, heads;
} m3_cuda_cp_inputs;

enum { M3_CUDA_CP_ERR_LEN = 1, M3_CUDA_CP_ERR_PAGE = 2 };

/* query_len x heads one score program takes (its queries sit in shared
 * memory as fp64) */
#define M3_CUDA_CP_MAX_QH 64

/* Host-side checks of everything the kernels assume (no device reads):
 * shapes, rank / world, the select params, and the shared memory one score
 * program needs (query_len x heads <= 64). */
m3_status m3_cuda_cp_check(const m3_cuda_cp_inputs *in, int64_t max_seq_len, int rank, int world,
                           const m3_select_params *p);

/* Scores of the owned blocks into out, dense fp32 [heads, tokens, local]
 * (local = ceil(ceil(max_seq_len / 128) / world)); every entry written.
 * err: device int[4], zeroed by the caller before the first call. */
m3_status m3_cuda_cp_scores(m3_backend *be, const m3_cuda_cp_inputs *in, int64_t max_seq_len,
                            int rank, int world, float scale, float *out, int *err);

/* Local top-k keys [heads, tokens, topk] (best first, padded with 0) from
 * the scores m3_cuda_cp_scores wrote, forced blocks pinned (as
 * m3_cp_local_topk). */
m3_status m3_cuda_cp_local_topk(m3_backend *be, const m3_cuda_cp_inputs *in, int64_t max_seq_len,
                                int rank, int world, const m3_select_params *p,
                                const float *scores, uint64_t *keys, int *err);

/* Merge gathered keys [world][items][topk] into out [items, topk]: the
 * topk best over all ranks as ascending block ids padded with -1 (as
 * m3_cp_merge_topk). world * topk <= 4096. */
m3_status m3_cuda_cp_merge(m3_backend *be, const uint64_t *gathered, int world, int64_t items,
                           int topk, int32_t *out);

/* Synchronise and read err: M3_OK, or M3_ERR_INVALID_ARG naming the bad
 * length or page. */
m3_status m3_cuda_cp_error(m3_backend *be, const int *err);

/* One sparse layer's block selection under indexer CP on GPU TP ranks (the
 * stock path, cp/cp_layer.c; every rank of comm calls it): the ranks' index
 * queries are all-gathered (NCCL) into [rows, world * heads_local, 128],
 * this rank scores every head over the blocks it owns and keeps its local
 * top-k keys, the keys are all-gathered and merged, and this rank's heads'
 * selections land in selected [rows, heads_local, topk]. Scratch comes
 * from the backend's workspace, so the layer captures into a graph. */
typedef struct m3_cuda_cp_layer {
    const uint16_t *iq; /* this rank's index queries [rows, heads_local, 128] */
    int rows, n_reqs, heads_local;
    const uint16_t *icache; /* [pages, 128, 128] */
    int64_t pages;
    const int32_t *table; /* [n_reqs, table_row] */
    int64_t table_row;
    const int32_t *lens; /* [n_reqs] */
    int64_t max_seq_len; /* the capture-stable bound */
    int *err;            /* device int[4] (m3_cuda_cp_error reads it) */
} m3_cuda_cp_layer;

m3_status m3_cuda_cp_layer_select(m3_backend *be, m3_comm *comm, const m3_cuda_cp_layer *l,
                                  float scale, const m3_select_params *p, int32_t *selected);

/* `m3 bench indexer`: one rank's scores + local top-k + merge (the
 * all-gather emulated by copies of the rank's keys) for batch requests of
 * `context` tokens, query_len 1, replayed from a CUDA graph; *us the median
 * of iters replays, *bytes the index cache bytes the rank must read. */
m3_status m3_cuda_bench_indexer(m3_backend *be, int batch, int64_t context, int world, int heads,
                                const m3_select_params *p, int iters, double *us, double *bytes);

#endif
