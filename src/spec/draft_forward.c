/*
 * The DSpark drafter's two passes (docs/DSPARK.md "The math"), on the bound
 * engine's backend ops, so they round exactly where the target's dense
 * layers do: the context (the rows a target step kept, through fc, the
 * hidden norm and each draft layer's k/v projections into its paged cache)
 * and the draft step (B rows of the anchor and mask tokens through the
 * draft layers, the target's lm_head, then the Markov head row by row).
 * The attention is the backend's draft_attention op: non-causal over
 * [context | block], optionally windowed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/bf16.h"
#include "core/status.h"
#include "spec/drafter.h"

m3_status m3_drafter_extend(m3_drafter *d, int rows) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    if (!e)
        return m3_fail(M3_ERR_INVALID_ARG, "the drafter is not bound to an engine");
    const m3_step *st = &e->step;
    if (rows < 0 || rows > st->rows || rows > r->rows)
        return m3_fail(M3_ERR_INVALID_ARG, "drafter context: %d rows of a %d-row step", rows,
                       st->rows);
    if (!rows)
        return M3_OK;
    for (int t = 0; t < rows; t++)
        if (st->host.slots[t] < 0)
            return m3_fail(M3_ERR_INVALID_ARG, "drafter context: row %d is padding", t);
    const m3_backend_ops *op = e->be->ops;
    m3_backend *be = e->be;
    const m3_config *a = &d->cfg.attn;
    int H = a->hidden_size, D = a->head_dim, Nkv = a->num_kv_heads;
    m3_rope rope = {a->rotary_dim, a->rope_theta};
    /* the step's taps [rows, k*H], on this backend already */
    M3_TRY(op->linear(be, rows, e->taps, &d->bw.fc, M3_DT_BF16, r->ctx_u));
    M3_TRY(op->add_rmsnorm(be, rows, H, NULL, r->ctx_u, &d->bw.hidden_norm, a->rms_norm_eps,
                           r->ctx_h));
    for (int i = 0; i < a->num_layers; i++) {
        const m3_draft_layer *L = &d->bw.layers[i];
        M3_TRY(op->linear(be, rows, r->ctx_h, &L->k_proj, M3_DT_BF16, r->ctx_k));
        M3_TRY(op->linear(be, rows, r->ctx_h, &L->v_proj, M3_DT_BF16, r->ctx_v));
        M3_TRY(op->head_norm_rope(be, rows, Nkv, D, r->ctx_k, (int64_t)Nkv * D, &L->k_norm,
                                  a->rms_norm_eps, st->dev.positions, &rope));
        M3_TRY(op->cache_write(be, rows, st->dev.slots, Nkv, D, r->ctx_k, (int64_t)Nkv * D,
                               r->k_cache[i]));
        M3_TRY(op->cache_write(be, rows, st->dev.slots, Nkv, D, r->ctx_v, (int64_t)Nkv * D,
                               r->v_cache[i]));
    }
    return M3_OK;
}

/* The B rows through the draft layers and the target's final head:
 * r->logits [B, V] (backend memory), before the Markov bias. */
static m3_status draft_rows(m3_drafter *d) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    const m3_backend_ops *op = e->be->ops;
    m3_backend *be = e->be;
    const m3_config *a = &d->cfg.attn;
    int B = d->cfg.block, H = a->hidden_size, D = a->head_dim;
    int Nq = a->num_q_heads, Nkv = a->num_kv_heads;
    float eps = a->rms_norm_eps;
    m3_rope rope = {a->rotary_dim, a->rope_theta};
    m3_swiglu act = {a->swiglu_alpha, a->swiglu_limit};
    M3_TRY(op->embed(be, B, r->tokens, &r->target->embed, 0, r->residual));
    for (int i = 0; i < a->num_layers; i++) {
        const m3_draft_layer *L = &d->bw.layers[i];
        M3_TRY(op->add_rmsnorm(be, B, H, i ? r->hidden : NULL, r->residual, &L->input_norm, eps,
                               r->x));
        M3_TRY(op->linear(be, B, r->x, &L->q_proj, M3_DT_BF16, r->q));
        M3_TRY(op->linear(be, B, r->x, &L->k_proj, M3_DT_BF16, r->k));
        M3_TRY(op->linear(be, B, r->x, &L->v_proj, M3_DT_BF16, r->v));
        M3_TRY(op->head_norm_rope(be, B, Nq, D, r->q, (int64_t)Nq * D, &L->q_norm, eps,
                                  r->positions, &rope));
        M3_TRY(op->head_norm_rope(be, B, Nkv, D, r->k, (int64_t)Nkv * D, &L->k_norm, eps,
                                  r->positions, &rope));
        M3_TRY(op->draft_attention(be, B, Nq, Nkv, D, r->q, r->k, r->v, r->k_cache[i],
                                   r->v_cache[i], r->pages, r->positions, d->cfg.window,
                                   (float)(1.0 / sqrt((double)D)), r->attn));
        M3_TRY(op->linear(be, B, r->attn, &L->o_proj, M3_DT_BF16, r->o));
        M3_TRY(op->add_rmsnorm(be, B, H, r->o, r->residual, &L->post_norm, eps, r->x));
        M3_TRY(op->linear(be, B, r->x, &L->gate, M3_DT_BF16, r->gate));
        M3_TRY(op->linear(be, B, r->x, &L->up, M3_DT_BF16, r->up));
        M3_TRY(op->swiglu(be, (int64_t)B * d->ffn_dim, r->gate, r->up, &act, r->act));
        M3_TRY(op->linear(be, B, r->act, &L->down, M3_DT_BF16, r->hidden));
    }
    M3_TRY(op->add_rmsnorm(be, B, H, r->hidden, r->residual, &d->bw.final_norm, eps, r->final));
    m3_linear head = {r->target->lm_head, {0}, 0, 0};
    return op->linear(be, B, r->final, &head, M3_DT_F32, r->logits);
}

/* The draft step from its inputs in backend memory (r->tokens, positions,
 * pages and drafts[0], the anchor) to the B drafts in r->drafts + 1: the
 * rows through the draft layers and the head, then the Markov head row by
 * row: row j += W2 . W1[prev_j] (fp32), its argmax is prev_{j+1}; the
 * drafts stay in backend memory until all B are chosen (a GPU step does
 * not wait for the host between rows). */
static m3_status draft_step(m3_drafter *d) {
    m3_draft_run *r = &d->run;
    const m3_backend_ops *op = r->eng->be->ops;
    m3_backend *be = r->eng->be;
    int B = d->cfg.block, V = d->cfg.vocab_size, R = d->cfg.markov_rank;
    M3_TRY(draft_rows(d));
    m3_linear w2 = {d->bw.markov_w2, {0}, 0, 0};
    for (int j = 0; j < B; j++) {
        float *row = r->logits + (size_t)j * V;
        if (R) {
            M3_TRY(op->gather_rows(be, 1, r->drafts + j, R,
                                   (const uint16_t *)d->bw.markov_w1.data, r->w1_row));
            M3_TRY(op->linear(be, 1, r->w1_row, &w2, M3_DT_F32, r->bias));
        }
        M3_TRY(op->draft_argmax(be, V, row, R ? r->bias : NULL, r->drafts + j + 1));
    }
    return M3_OK;
}

/* The draft step, from a graph where the engine replays its steps from
 * graphs: its launches do not change from step to step (the position is
 * read from r->positions), so the first step runs eagerly (sizing every
 * workspace), is then captured, and later steps replay the capture. */
static m3_status run_draft_step(m3_drafter *d) {
    m3_draft_run *r = &d->run;
    m3_backend *be = r->eng->be;
    if (!r->eng->graphs)
        return draft_step(d);
    if (r->graph) {
        M3_TRY(be->ops->graph_launch(be, r->graph));
        r->replays++;
        return M3_OK;
    }
    M3_TRY(draft_step(d));
    M3_TRY(be->ops->graph_begin(be));
    m3_status cap = draft_step(d);
    m3_status end = be->ops->graph_end(be, cap == M3_OK, &r->graph);
    M3_TRY(cap);
    return end;
}

m3_status m3_drafter_propose(m3_drafter *d, m3_seq seq, int64_t p, int32_t anchor,
                             int32_t *drafts, float *logits) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    if (!e)
        return m3_fail(M3_ERR_INVALID_ARG, "the drafter is not bound to an engine");
    M3_TRY(m3_cache_seq_check(&e->cache, seq));
    const m3_seq_state *ss = &e->cache.seqs[seq];
    int B = d->cfg.block, V = d->cfg.vocab_size;
    if (p < 0 || p > ss->len)
        return m3_fail(M3_ERR_INVALID_ARG, "draft step at position %lld: the sequence holds %lld",
                       (long long)p, (long long)ss->len);
    if (anchor < 0 || anchor >= V)
        return m3_fail(M3_ERR_INVALID_ARG, "draft anchor token %d is outside the vocabulary",
                       anchor);
    const m3_backend_ops *op = e->be->ops;
    m3_backend *be = e->be;
    int32_t tokens[M3_MAX_DRAFT_BLOCK];
    int64_t positions[M3_MAX_DRAFT_BLOCK];
    for (int j = 0; j < B; j++) {
        tokens[j] = j ? d->cfg.mask_token : anchor;
        positions[j] = p + j;
    }
    M3_TRY(op->upload(be, r->tokens, tokens, (size_t)B * sizeof *tokens));
    M3_TRY(op->upload(be, r->positions, positions, (size_t)B * sizeof *positions));
    M3_TRY(op->upload(be, r->pages, ss->pages, (size_t)ss->n_blocks * sizeof *ss->pages));
    M3_TRY(op->upload(be, r->drafts, &anchor, sizeof anchor));
    M3_TRY(run_draft_step(d));
    M3_TRY(op->download(be, drafts, r->drafts + 1, (size_t)B * sizeof *drafts));
    if (logits)
        M3_TRY(op->download(be, logits, r->logits, (size_t)B * V * sizeof *logits));
    return M3_OK;
}
