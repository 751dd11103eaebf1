/*
 * Tensor-parallel shards: what one rank of a TP group holds, as zero-copy
 * views into the full model's weights (the layout a real deployment loads).
 * Attention is split by heads: each rank owns num_q_heads/tp query heads
 * and the KV head (and index head) of their group; when tp exceeds the KV
 * heads, tp/kv_heads ranks share a group and each holds its KV and index
 * head (replicated, as vLLM does). q/k/v/index_q projections are
 * column-parallel (rows of the weight), o_proj row-parallel (a column slice:
 * a strided view). Every FFN (experts, shared expert, dense MLP) is split on
 * its intermediate dimension: gate/up rows, down columns. The router, the
 * index key projection and all norms are replicated; the embedding and
 * lm_head are vocab-parallel (rows of the vocabulary).
 */
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/shard.h"

m3_status m3_tp_check(const m3_config *c, int tp) {
    if (tp < 1 || tp > 8)
        return m3_fail(M3_ERR_UNSUPPORTED, "tp = %d: must be in [1, 8]", tp);
    if (tp == 1)
        return M3_OK;
    if (c->num_q_heads % tp)
        return m3_fail(M3_ERR_UNSUPPORTED, "tp = %d does not divide num_attention_heads = %d", tp,
                       c->num_q_heads);
    if (c->num_kv_heads % tp && tp % c->num_kv_heads)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "tp = %d and num_key_value_heads = %d: one must divide the other", tp,
                       c->num_kv_heads);
    if (c->vocab_size % tp)
        return m3_fail(M3_ERR_UNSUPPORTED, "tp = %d does not divide vocab_size = %d", tp,
                       c->vocab_size);
    /* FFN slices; MXFP8 down weights split on whole scale blocks (32 columns) */
    struct {
        const char *name;
        int width;
    } ffn[] = {{"intermediate_size (expert width)", c->num_experts ? c->expert_dim : 0},
               {"shared expert width", c->shared_dim},
               {"dense_intermediate_size", c->dense_dim}};
    for (size_t i = 0; i < sizeof ffn / sizeof *ffn; i++) {
        if (!ffn[i].width)
            continue;
        if (ffn[i].width % tp)
            return m3_fail(M3_ERR_UNSUPPORTED, "tp = %d does not divide %s = %d", tp,
                           ffn[i].name, ffn[i].width);
        if (c->mxfp8 && (ffn[i].width / tp) % 32)
            return m3_fail(M3_ERR_UNSUPPORTED,
                           "tp = %d: %s = %d splits into slices of %d columns, not whole MXFP8 "
                           "scale blocks of 32",
                           tp, ffn[i].name, ffn[i].width, ffn[i].width / tp);
    }
    return M3_OK;
}

m3_config m3_tp_config(const m3_config *c, int tp) {
    m3_config r = *c;
    if (tp <= 1)
        return r;
    r.num_q_heads = c->num_q_heads / tp;
    r.num_kv_heads = c->num_kv_heads >= tp ? c->num_kv_heads / tp : 1;
    if (c->index_heads)
        r.index_heads = r.num_kv_heads;
    r.expert_dim = c->expert_dim / tp;
    r.shared_dim = c->shared_dim / tp;
    r.dense_dim = c->dense_dim / tp;
    r.vocab_size = c->vocab_size / tp;
    return r;
}

/* Columns [first, first + count) of a linear weight: a strided view (the
 * row stride stays the full row's). */
static m3_linear cols_view(const m3_linear *l, int64_t first, int64_t count) {
    m3_linear v = *l;
    if (!l->w.data)
        return v;
    v.w.ne[1] = count;
    /* a row-parallel slice: its share of the full weight's chunks (when the
     * world divides them; else its sums are its own, not TP 1's) */
    int64_t tp = count > 0 && l->w.ne[1] % count == 0 ? l->w.ne[1] / count : 0;
    v.k_chunks = tp > 0 && l->k_chunks % tp == 0 ? (int)(l->k_chunks / tp) : 0;
    v.w.data = (char *)l->w.data + first * (int64_t)m3_dtype_size(l->w.dtype);
    if (l->scale.data) {
        v.scale.ne[1] = count / 32;
        v.scale.data = (char *)l->scale.data + first / 32;
    }
    return v;
}

static m3_linear rows_view(const m3_linear *l, int64_t first, int64_t count) {
    if (!l->w.data)
        return *l;
    /* a column-parallel slice: its share of the full weight's row blocks */
    m3_linear v = m3_linear_rows_view(l, first, count);
    int64_t tp = count > 0 && l->w.ne[0] % count == 0 ? l->w.ne[0] / count : 0;
    v.n_chunks = tp > 0 && l->n_chunks % tp == 0 ? (int)(l->n_chunks / tp) : 0;
    return v;
}

/* gate/up rows and down columns [rank * w, (rank + 1) * w) of one FFN */
static void shard_ffn(const m3_linear *gate, const m3_linear *up, const m3_linear *down,
                      int rank, int tp, m3_linear *g, m3_linear *u, m3_linear *d) {
    if (!gate->w.data) {
        *g = *gate;
        *u = *up;
        *d = *down;
        return;
    }
    int64_t w = m3_linear_rows(gate) / tp;
    *g = rows_view(gate, rank * w, w);
    *u = rows_view(up, rank * w, w);
    *d = cols_view(down, rank * w, w);
}

m3_status m3_tp_shard(const m3_config *c, const m3_weights *full, int rank, int tp,
                      m3_weights *out) {
    memset(out, 0, sizeof *out);
    M3_TRY(m3_tp_check(c, tp));
    if (rank < 0 || rank >= tp)
        return m3_fail(M3_ERR_INVALID_ARG, "TP rank %d is outside [0, %d)", rank, tp);
    m3_config rc = m3_tp_config(c, tp);
    int D = c->head_dim, Di = c->index_dim;
    int64_t V = rc.vocab_size;
    out->embed = m3_tensor_rows(&full->embed, rank * V, V);
    out->lm_head = m3_tensor_rows(&full->lm_head, rank * V, V);
    out->norm = full->norm;
    out->layers = calloc((size_t)c->num_layers, sizeof *out->layers);
    if (!out->layers)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory sharding layers for TP rank %d", rank);
    /* the KV (and index) head of this rank's query heads */
    int kv = (int)((int64_t)rank * rc.num_q_heads / (c->num_q_heads / c->num_kv_heads));
    if (c->num_kv_heads >= tp)
        kv = rank * rc.num_kv_heads;
    for (int i = 0; i < c->num_layers; i++) {
        const m3_layer_weights *f = &full->layers[i];
        m3_layer_weights *l = &out->layers[i];
        *l = *f;
        l->exp_gate = l->exp_up = l->exp_down = NULL; /* the full model's; sharded below */
        int64_t nq = (int64_t)rc.num_q_heads * D;
        l->q_proj = rows_view(&f->q_proj, rank * nq, nq);
        l->k_proj = rows_view(&f->k_proj, (int64_t)kv * D, (int64_t)rc.num_kv_heads * D);
        l->v_proj = rows_view(&f->v_proj, (int64_t)kv * D, (int64_t)rc.num_kv_heads * D);
        l->o_proj = cols_view(&f->o_proj, rank * nq, nq);
        if (f->sparse)
            l->iq_proj = rows_view(&f->iq_proj, (int64_t)kv * Di, (int64_t)rc.index_heads * Di);
        shard_ffn(&f->mlp_gate, &f->mlp_up, &f->mlp_down, rank, tp, &l->mlp_gate, &l->mlp_up,
                  &l->mlp_down);
        shard_ffn(&f->sh_gate, &f->sh_up, &f->sh_down, rank, tp, &l->sh_gate, &l->sh_up,
                  &l->sh_down);
        if (f->moe && c->num_experts) {
            int E = c->num_experts;
            l->exp_gate = calloc((size_t)E * 3, sizeof *l->exp_gate);
            if (!l->exp_gate) {
                m3_tp_shard_free(c, out);
                return m3_fail(M3_ERR_NO_MEMORY, "out of memory sharding experts");
            }
            l->exp_up = l->exp_gate + E;
            l->exp_down = l->exp_gate + 2 * E;
            for (int e = 0; e < E; e++)
                shard_ffn(&f->exp_gate[e], &f->exp_up[e], &f->exp_down[e], rank, tp,
                          &l->exp_gate[e], &l->exp_up[e], &l->exp_down[e]);
        }
    }
    return M3_OK;
}

void m3_tp_shard_free(const m3_config *c, m3_weights *w) {
    if (w->layers)
        for (int i = 0; i < c->num_layers; i++)
            if (w->layers[i].moe)
                free(w->layers[i].exp_gate);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
