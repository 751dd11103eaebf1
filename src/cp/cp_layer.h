/*
 * Indexer context parallelism inside a sparse layer of the stock path (CPU,
 * ranks as threads): the TP group's index queries are all-gathered, every
 * rank scores every index head over the blocks it owns, the ranks' local
 * top-k keys are all-gathered and merged, and each rank keeps the selection
 * of the heads it owns. The selection equals the single-rank one bit for
 * bit (src/cp/indexer_cp.h), so the layer's output does too.
 */
#ifndef M3_CP_CP_LAYER_H
#define M3_CP_CP_LAYER_H

#include <stdbool.h>

#include "backend/backend.h"
#include "decode/step.h"
#include "dist/comm.h"
#include "m3.h"

struct m3_engine;

/* Whether the step has the shape indexer CP takes: every request has the
 * same number of rows (decode: 1, verify: 8, or a single prefill chunk).
 * Other steps select the usual way. */
bool m3_cp_step_ok(const m3_step *st);

/* One sparse layer's rows as indexer CP takes them: rows = n_reqs x q
 * (each request's q rows consecutive), host memory. */
typedef struct m3_cp_rows {
    int rows, n_reqs, heads, dim; /* heads: this rank's index heads */
    const uint16_t *iq;           /* bf16 [rows, heads, dim], normed and roped */
    const void *icache;           /* bf16 [n_pages, 128, dim] */
    int64_t n_pages;
    const int32_t *table; /* [n_reqs, table_width] */
    int table_width;      /* >= ceil(max_seq_len / 128) */
    const int32_t *lens;  /* [n_reqs] */
    int64_t max_seq_len;  /* the capture-stable bound, the same on every rank */
} m3_cp_rows;

/* Every rank of comm calls it: the rows' index queries are all-gathered,
 * this rank scores every head over its blocks, the keys are all-gathered
 * and merged; selected [rows, heads, topk] gets this rank's heads. A
 * failure on one rank aborts the group (no peer hangs). */
m3_status m3_cp_select_rows(m3_comm *comm, const m3_cp_rows *r, float scale,
                            const m3_select_params *p, int32_t *selected);

/* Whether this engine's sparse layers take the step through indexer CP:
 * m3_cp_step_ok, and on the GPU rows per request x index heads within the
 * score program's limit (M3_CUDA_CP_MAX_QH; prefill chunks usually are not). */
bool m3_cp_layer_ok(const struct m3_engine *eng, const m3_step *st);

/* Scores and selection of one sparse layer: reads eng->s.iq [T, Ni, Di]
 * (this rank's heads), writes eng->s.selected [T, Ni, topk]. */
m3_status m3_cp_layer_select(struct m3_engine *eng, const m3_step *st, const void *icache,
                             float scale, const m3_select_params *p);

#endif
