/*
 * Indexer context parallelism in the stock path's sparse layers (see
 * cp_layer.h). On the CPU the communicator's buffers are host memory and
 * the core is cp/indexer_cp.c; on GPU ranks the same steps run on the
 * device (cuda/cuda_cp_layer.cu).
 */
#include "cp/cp_layer.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "cp/indexer_cp.h"
#include "cuda/cuda_cp.h"
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

m3_status m3_cp_select_rows(m3_comm *comm, const m3_cp_rows *r, float scale,
                            const m3_select_params *p, int32_t *selected) {
    int T = r->rows, Nl = r->heads, Di = r->dim, W = comm->world;
    if (r->n_reqs < 1 || T % r->n_reqs)
        return m3_fail(M3_ERR_INVALID_ARG, "indexer CP: %d rows over %d requests", T, r->n_reqs);
    int H = Nl * W, q = T / r->n_reqs, topk = p->topk;
    size_t q_bytes = (size_t)T * Nl * Di * 2;
    uint16_t *all = m3_malloc((size_t)W * q_bytes, "CP index queries");
    uint16_t *qt = m3_malloc((size_t)W * q_bytes, "CP index queries");
    int32_t *sel = m3_malloc((size_t)H * T * topk * 4, "CP selection");
    m3_tensor scores = {0};
    m3_status st_ = all && qt && sel ? M3_OK : M3_ERR_NO_MEMORY;
    if (st_) /* the peers wait in the gather: end it for them */
        comm->ops->abort(comm, m3_last_error());
    /* every rank's index queries, then [T, heads, Di] with head r * Nl + i */
    if (!st_)
        st_ = comm->ops->all_gather(comm, r->iq, all, (int64_t)q_bytes);
    for (int k = 0; !st_ && k < W; k++)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < Nl; i++)
                memcpy(qt + ((size_t)t * H + (size_t)k * Nl + i) * Di,
                       all + (((size_t)k * T + t) * Nl + i) * Di, (size_t)Di * 2);
    if (!st_) {
        m3_cp_score_inputs in = m3_cp_host_inputs(T, H, Di, r->n_pages, r->n_reqs, r->table_width,
                                                  qt, r->icache, r->table, r->lens);
        st_ = m3_cp_context_scores(&in, r->max_seq_len, comm->rank, W, q, scale, &scores);
        if (st_) /* the peers wait in the key gather */
            comm->ops->abort(comm, m3_last_error());
        else
            st_ = m3_cp_select_blocks(comm, &scores, r->lens, r->n_reqs, q, r->max_seq_len, p,
                                      sel);
    }
    /* this rank's heads: selected [T, Nl, topk] */
    for (int t = 0; !st_ && t < T; t++)
        for (int i = 0; i < Nl; i++)
            memcpy(selected + ((size_t)t * Nl + i) * topk,
                   sel + (((size_t)comm->rank * Nl + i) * T + t) * topk, (size_t)topk * 4);
    free(all);
    free(qt);
    free(sel);
    free(scores.data);
    return st_ ? m3_fail_context(st_, "indexer context parallelism") : M3_OK;
}

bool m3_cp_layer_ok(const m3_engine *eng, const m3_step *st) {
    if (!m3_cp_step_ok(st))
        return false;
    if (eng->opts.device != M3_DEVICE_CUDA)
        return true;
    /* the GPU score program keeps query rows x heads in shared memory */
    int q = st->rows / st->n_reqs;
    return (int64_t)q * eng->cfg.index_heads * eng->tp_size <= M3_CUDA_CP_MAX_QH;
}

m3_status m3_cp_layer_select(m3_engine *eng, const m3_step *st, const void *icache, float scale,
                             const m3_select_params *p) {
    const m3_config *c = &eng->cfg;
    if (eng->opts.device == M3_DEVICE_CUDA) {
        m3_cuda_cp_layer l = {eng->s.iq,       st->rows,       st->n_reqs,
                              c->index_heads,  icache,         st->n_pages,
                              st->dev.block_table, st->max_blocks, st->dev.seq_lens,
                              eng->cache.max_context, eng->cp_err};
        return m3_cuda_cp_layer_select(eng->be, eng->comm, &l, scale, p, eng->s.selected);
    }
    m3_cp_rows r = {st->rows,
                    st->n_reqs,
                    c->index_heads,
                    c->index_dim,
                    eng->s.iq,
                    icache,
                    st->n_pages,
                    st->host.block_table,
                    st->max_blocks,
                    st->host.seq_lens,
                    /* the capture-stable bound: the engine's context limit */
                    eng->cache.max_context};
    return m3_cp_select_rows(eng->comm, &r, scale, p, eng->s.selected);
}
