/*
 * Indexer context parallelism in the stock path's sparse layers (see
 * cp_layer.h). CPU only: the communicator's buffers are host memory.
 */
#include "cp/cp_layer.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "cp/indexer_cp.h"
#include "decode/engine.h"

bool m3_cp_step_ok(const m3_step *st) {
    if (st->n_reqs < 1 || !st->host.query_start)
        return false;
    int q = st->host.query_start[1] - st->host.query_start[0];
    for (int r = 0; r < st->n_reqs; r++)
        if (st->host.query_start[r + 1] - st->host.query_start[r] != q)
            return false;
    return q >= 1 && st->rows == st->n_reqs * q; /* no padded rows */
}

m3_status m3_cp_layer_select(m3_engine *eng, const m3_step *st, const void *icache, float scale,
                             const m3_select_params *p) {
    const m3_config *c = &eng->cfg;
    m3_comm *comm = eng->comm;
    int T = st->rows, Nl = c->index_heads, Di = c->index_dim, W = comm->world;
    int H = Nl * W, q = T / st->n_reqs, topk = p->topk;
    size_t q_bytes = (size_t)T * Nl * Di * 2;
    uint16_t *all = m3_malloc((size_t)W * q_bytes, "CP index queries");
    uint16_t *qt = m3_malloc((size_t)W * q_bytes, "CP index queries");
    int32_t *sel = m3_malloc((size_t)H * T * topk * 4, "CP selection");
    m3_tensor scores = {0};
    m3_status st_ = all && qt && sel ? M3_OK : M3_ERR_NO_MEMORY;
    /* every rank's index queries, then [T, heads, Di] with head r * Nl + i */
    if (!st_)
        st_ = comm->ops->all_gather(comm, eng->s.iq, all, (int64_t)q_bytes);
    for (int r = 0; !st_ && r < W; r++)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < Nl; i++)
                memcpy(qt + ((size_t)t * H + (size_t)r * Nl + i) * Di,
                       all + (((size_t)r * T + t) * Nl + i) * Di, (size_t)Di * 2);
    if (!st_) {
        m3_cp_score_inputs in;
        int64_t ne_q[3] = {T, H, Di}, ne_c[3] = {st->n_pages, M3_CP_BLOCK, Di};
        int64_t ne_t[2] = {st->n_reqs, st->max_blocks}, ne_l[1] = {st->n_reqs};
        in.q = m3_tensor_make(M3_DT_BF16, 3, ne_q, qt);
        in.icache = m3_tensor_make(M3_DT_BF16, 3, ne_c, (void *)icache);
        in.table = m3_tensor_make(M3_DT_I32, 2, ne_t, st->host.block_table);
        in.lens = m3_tensor_make(M3_DT_I32, 1, ne_l, st->host.seq_lens);
        in.q_device = in.icache_device = in.table_device = in.lens_device = M3_CP_HOST;
        /* the capture-stable bound: the engine's context limit */
        int64_t max_seq_len = eng->cache.max_context;
        st_ = m3_cp_context_scores(&in, max_seq_len, comm->rank, W, q, scale, &scores);
        if (!st_)
            st_ = m3_cp_select_blocks(comm, &scores, st->host.seq_lens, st->n_reqs, q,
                                      max_seq_len, p, sel);
    }
    /* this rank's heads: selected [T, Nl, topk] */
    for (int t = 0; !st_ && t < T; t++)
        for (int i = 0; i < Nl; i++)
            memcpy(eng->s.selected + ((size_t)t * Nl + i) * topk,
                   sel + (((size_t)comm->rank * Nl + i) * T + t) * topk, (size_t)topk * 4);
    free(all);
    free(qt);
    free(sel);
    free(scores.data);
    return st_ ? m3_fail_context(st_, "indexer context parallelism") : M3_OK;
}
