/*
 * The DSpark drafter's two passes (docs/DSPARK.md "The math"), on the bound
 * engine's backend ops, so they round exactly where the target's dense
 * layers do: the context (the rows a target step kept, through fc, the
 * hidden norm and each draft layer's k/v projections into its paged cache)
 * and the draft step (B rows of the anchor and mask tokens through the
 * draft layers, the target's lm_head, then the Markov head row by row).
 * The attention is the backend's draft_attention op: non-causal over
 * [context | block], optionally windowed. A draft step serves up to
 * M3_MAX_DRAFT_REQS requests: their rows share every launch but the
 * attention's and the Markov head's argmax, which run per request.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/bf16.h"
#include "core/status.h"
#include "spec/drafter.h"

/* The slots the context writes: the step's own when every row is kept
 * (and no graph is to hold the pointer), else a copy with -1 for the rows
 * dropped (the cache_write op skips them), in backend memory. */
static m3_status context_slots(m3_draft_run *r, const m3_step *st, int rows, const uint8_t *keep,
                               bool copy, const int64_t **slots) {
    bool all = true;
    for (int t = 0; t < rows; t++) {
        bool kept = !keep || keep[t];
        if (kept && st->host.slots[t] < 0)
            return m3_fail(M3_ERR_INVALID_ARG, "drafter context: row %d is padding", t);
        all = all && kept;
    }
    *slots = st->dev.slots;
    if (all && !copy)
        return M3_OK;
    for (int t = 0; t < rows; t++)
        r->host_slots[t] = !keep || keep[t] ? st->host.slots[t] : -1;
    *slots = r->ctx_slots;
    m3_backend *be = r->eng->be;
    return be->ops->upload(be, r->ctx_slots, r->host_slots, (size_t)rows * sizeof(int64_t));
}

/* The context's ops for `rows` rows of the engine's step, writing at
 * slots (backend memory). */
static m3_status context_ops(m3_drafter *d, int rows, const int64_t *slots) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    const m3_step *st = &e->step;
    const m3_backend_ops *op = e->be->ops;
    m3_backend *be = e->be;
    const m3_config *a = &d->cfg.attn;
    int H = a->hidden_size, D = a->head_dim, Nkv = a->num_kv_heads;
    m3_rope rope = {a->rotary_dim, a->rope_theta};
    /* the step's taps [rows, k*H], on this backend already; rows dropped
     * are computed too (one launch shape) and written nowhere */
    M3_TRY(op->linear(be, rows, e->taps, &d->bw.fc, M3_DT_BF16, r->ctx_u));
    M3_TRY(op->add_rmsnorm(be, rows, H, NULL, r->ctx_u, &d->bw.hidden_norm, a->rms_norm_eps,
                           r->ctx_h));
    for (int i = 0; i < a->num_layers; i++) {
        const m3_draft_layer *L = &d->bw.layers[i];
        const m3_linear *kv[2] = {&L->k_proj, &L->v_proj};
        void *kv_out[2] = {r->ctx_k, r->ctx_v};
        M3_TRY(m3_linear_group(be, rows, r->ctx_h, 2, kv, M3_DT_BF16, kv_out));
        M3_TRY(op->head_norm_rope(be, rows, Nkv, D, r->ctx_k, (int64_t)Nkv * D, &L->k_norm,
                                  a->rms_norm_eps, st->dev.positions, &rope));
        M3_TRY(op->cache_write(be, rows, slots, Nkv, D, r->ctx_k, (int64_t)Nkv * D,
                               r->k_cache[i]));
        M3_TRY(op->cache_write(be, rows, slots, Nkv, D, r->ctx_v, (int64_t)Nkv * D,
                               r->v_cache[i]));
    }
    return M3_OK;
}

m3_status m3_drafter_extend(m3_drafter *d, int rows, const uint8_t *keep) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    if (!e)
        return m3_fail(M3_ERR_INVALID_ARG, "the drafter is not bound to an engine");
    M3_TRY(m3_engine_bind_thread(e)); /* TP > 1 on GPUs: rank 0's */
    const m3_step *st = &e->step;
    if (rows < 0 || rows > st->rows || rows > r->rows)
        return m3_fail(M3_ERR_INVALID_ARG, "drafter context: %d rows of a %d-row step", rows,
                       st->rows);
    if (!rows)
        return M3_OK;
    /* where the engine replays graphs, a context of up to a verify step's
     * rows is a graph per row count too (its inputs sit in fixed buffers:
     * the taps, the step's positions, the slots copied into ctx_slots);
     * the first of a count runs eagerly, sizing every workspace */
    bool graph = e->graphs && rows <= M3_GRAPH_MAX_VERIFY_ROWS;
    const int64_t *slots = NULL;
    M3_TRY(context_slots(r, st, rows, keep, graph, &slots));
    if (!graph)
        return context_ops(d, rows, slots);
    m3_backend *be = e->be;
    if (r->ctx_graph[rows]) {
        M3_TRY(be->ops->graph_launch(be, r->ctx_graph[rows]));
        r->ctx_replays++;
        return M3_OK;
    }
    M3_TRY(context_ops(d, rows, slots));
    M3_TRY(be->ops->graph_begin(be));
    m3_status cap = context_ops(d, rows, slots);
    m3_status end = be->ops->graph_end(be, cap == M3_OK, &r->ctx_graph[rows]);
    M3_TRY(cap);
    return end;
}

/* Each request's B rows attend to its own context and block: one op call
 * for the n requests, each on its slices of the step's rows and its own
 * block table and positions (the op's request strides are these arrays'). */
static m3_status draft_attention(m3_drafter *d, int n, int layer) {
    m3_draft_run *r = &d->run;
    m3_backend *be = r->eng->be;
    const m3_config *a = &d->cfg.attn;
    int B = d->cfg.block, D = a->head_dim, Nq = a->num_q_heads, Nkv = a->num_kv_heads;
    float scale = (float)(1.0 / sqrt((double)D));
    return be->ops->draft_attention(be, n, B, Nq, Nkv, D, r->q, r->k, r->v, r->k_cache[layer],
                                    r->v_cache[layer], r->pages, r->max_blocks, r->positions,
                                    d->cfg.window, scale, r->attn);
}

/* The n*B rows from their embedding in r->residual through the draft
 * layers and the final norm, op by op: r->final [n*B, H] (backend memory). */
static m3_status draft_layers_ops(m3_drafter *d, int n) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    const m3_backend_ops *op = e->be->ops;
    m3_backend *be = e->be;
    const m3_config *a = &d->cfg.attn;
    int T = n * d->cfg.block, H = a->hidden_size, D = a->head_dim;
    int Nq = a->num_q_heads, Nkv = a->num_kv_heads;
    float eps = a->rms_norm_eps;
    m3_rope rope = {a->rotary_dim, a->rope_theta};
    m3_swiglu act = {a->swiglu_alpha, a->swiglu_limit};
    for (int i = 0; i < a->num_layers; i++) {
        const m3_draft_layer *L = &d->bw.layers[i];
        M3_TRY(op->add_rmsnorm(be, T, H, i ? r->hidden : NULL, r->residual, &L->input_norm, eps,
                               r->x));
        const m3_linear *qkv[3] = {&L->q_proj, &L->k_proj, &L->v_proj};
        void *qkv_out[3] = {r->q, r->k, r->v};
        M3_TRY(m3_linear_group(be, T, r->x, 3, qkv, M3_DT_BF16, qkv_out));
        M3_TRY(op->head_norm_rope(be, T, Nq, D, r->q, (int64_t)Nq * D, &L->q_norm, eps,
                                  r->positions, &rope));
        M3_TRY(op->head_norm_rope(be, T, Nkv, D, r->k, (int64_t)Nkv * D, &L->k_norm, eps,
                                  r->positions, &rope));
        M3_TRY(draft_attention(d, n, i));
        M3_TRY(op->linear(be, T, r->attn, &L->o_proj, M3_DT_BF16, r->o));
        M3_TRY(op->add_rmsnorm(be, T, H, r->o, r->residual, &L->post_norm, eps, r->x));
        const m3_linear *gate_up[2] = {&L->gate, &L->up};
        void *gate_up_out[2] = {r->gate, r->up};
        M3_TRY(m3_linear_group(be, T, r->x, 2, gate_up, M3_DT_BF16, gate_up_out));
        M3_TRY(op->swiglu(be, (int64_t)T * d->ffn_dim, r->gate, r->up, &act, r->act));
        M3_TRY(op->linear(be, T, r->act, &L->down, M3_DT_BF16, r->hidden));
    }
    return op->add_rmsnorm(be, T, H, r->hidden, r->residual, &d->bw.final_norm, eps, r->final);
}

/* SPEC §7's drafter dispatch: the fused drafter layers where they are
 * asked for (M3_DRAFT_LAYERS=fused: off by default, as they are slower
 * than the stock ops on the shapes measured so far, docs/PERF.md,
 * forty-fifth session), the deployment fits (the backend has them, a
 * drafter of 7 speculative tokens) and the backend's kernels take the
 * shapes; tried once per attach, at the first draft step (never inside a
 * graph capture: draft_inputs runs before any), and off with the reason
 * otherwise. Every step a runner can take (1..max_reqs requests of B
 * rows, int64 positions, its context and block tables in place:
 * draft_inputs checks them) then runs it. */
static m3_status pick_kernels(m3_drafter *d) {
    m3_draft_run *r = &d->run;
    if (r->kernels != M3_DRAFT_KERNELS_UNTRIED)
        return M3_OK;
    m3_backend *be = r->eng->be;
    int fused;
    M3_TRY(m3_draft_switch("M3_DRAFT_LAYERS", &fused));
    r->kernels = M3_DRAFT_KERNELS_OFF;
    if (!be->ops->draft_layers_build) {
        snprintf(r->kernels_off, sizeof r->kernels_off, "the %s backend has no fused drafter "
                 "kernels", be->ops->name);
        return M3_OK;
    }
    if (fused != 1) {
        snprintf(r->kernels_off, sizeof r->kernels_off, "%s", fused == 0
                 ? "switched off by M3_DRAFT_LAYERS=ops"
                 : "off by default (slower than the stock ops so far; M3_DRAFT_LAYERS=fused "
                   "runs them)");
        return M3_OK;
    }
    if (d->cfg.block != 7) {
        snprintf(r->kernels_off, sizeof r->kernels_off, "the fused drafter kernels serve 7 "
                 "speculative tokens; this drafter proposes %d", d->cfg.block);
        return M3_OK;
    }
    const m3_config *a = &d->cfg.attn;
    m3_draft_layers_args args = {
        .n_layers = a->num_layers, .hidden_size = a->hidden_size, .q_heads = a->num_q_heads,
        .kv_heads = a->num_kv_heads, .head_dim = a->head_dim, .ffn = d->ffn_dim,
        .block = d->cfg.block, .max_reqs = r->max_reqs, .max_blocks = r->max_blocks,
        .eps = a->rms_norm_eps, .scale = (float)(1.0 / sqrt((double)a->head_dim)),
        .rope = {a->rotary_dim, a->rope_theta}, .swiglu = {a->swiglu_alpha, a->swiglu_limit},
        .window = d->cfg.window, .layers = d->bw.layers, .final_norm = &d->bw.final_norm,
        .k_cache = r->k_cache, .v_cache = r->v_cache, .positions = r->positions,
        .pages = r->pages, .residual = r->residual, .hidden = r->hidden, .x = r->x,
        .o = r->o, .final = r->final, .q = r->q, .attn = r->attn, .k = r->k, .v = r->v,
        .act = r->act};
    m3_status st = be->ops->draft_layers_build(be, &args, &r->kernels_runner);
    if (st == M3_ERR_UNSUPPORTED) { /* these shapes: op by op, and say why */
        snprintf(r->kernels_off, sizeof r->kernels_off, "%s", m3_last_error());
        return M3_OK;
    }
    M3_TRY(st);
    r->kernels = M3_DRAFT_KERNELS_ON;
    return M3_OK;
}

/* The n*B rows through the draft layers and the final norm: r->final
 * [n*B, H] (backend memory), in the fused kernels where pick_kernels
 * switched them on, else op by op. */
static m3_status draft_layers(m3_drafter *d, int n) {
    m3_draft_run *r = &d->run;
    m3_backend *be = r->eng->be;
    M3_TRY(be->ops->embed(be, n * d->cfg.block, r->tokens, &r->embed, 0, r->residual));
    if (r->kernels != M3_DRAFT_KERNELS_ON)
        return draft_layers_ops(d, n);
    return be->ops->draft_layers_run(be, r->kernels_runner, n);
}

/* The target's lm_head over the n*B final rows: r->logits [n*B, V]
 * (backend memory), before the Markov bias. */
static m3_status draft_head(m3_drafter *d, int n) {
    m3_draft_run *r = &d->run;
    m3_backend *be = r->eng->be;
    m3_linear head = {r->lm_head, {0}, 0, 0};
    return be->ops->linear(be, n * d->cfg.block, r->final, &head, M3_DT_F32, r->logits);
}

/* The Markov head, from the head's logits and the anchors in drafts[0, *]
 * to the drafts in r->drafts[1.., *], row by row, every request's row j at
 * once: row j += W2 . W1[prev_j] (fp32), its argmax is prev_{j+1}; the
 * drafts stay in backend memory until all are chosen (a GPU step does not
 * wait for the host between rows). */
static m3_status draft_markov(m3_drafter *d, int n) {
    m3_draft_run *r = &d->run;
    const m3_backend_ops *op = r->eng->be->ops;
    m3_backend *be = r->eng->be;
    int B = d->cfg.block, V = d->cfg.vocab_size, R = d->cfg.markov_rank, G = r->max_reqs;
    if (r->fused_markov) { /* one launch a row: the same bits as the ops below */
        for (int j = 0; j < B; j++)
            M3_TRY(op->draft_markov(be, n, &d->bw.markov_w1, &d->bw.markov_w2,
                                    r->drafts + (size_t)j * G, r->logits + (size_t)j * V,
                                    (int64_t)B * V, r->drafts + (size_t)(j + 1) * G));
        return M3_OK;
    }
    m3_linear w2 = {d->bw.markov_w2, {0}, 0, 0};
    for (int j = 0; j < B; j++) {
        const int32_t *prev = r->drafts + (size_t)j * G;
        if (R) {
            M3_TRY(op->gather_rows(be, n, prev, R, (const uint16_t *)d->bw.markov_w1.data,
                                   r->w1_rows));
            M3_TRY(op->linear(be, n, r->w1_rows, &w2, M3_DT_F32, r->bias));
        }
        for (int g = 0; g < n; g++)
            M3_TRY(op->draft_argmax(be, V, r->logits + ((size_t)g * B + j) * V,
                                    R ? r->bias + (size_t)g * V : NULL,
                                    r->drafts + (size_t)(j + 1) * G + g));
    }
    return M3_OK;
}

/* The draft step of n requests from its inputs in backend memory
 * (r->tokens, positions, pages and the anchors in drafts[0, *]) to the
 * drafts: the rows through the draft layers, the head, the Markov head. */
static m3_status draft_step(m3_drafter *d, int n) {
    M3_TRY(draft_layers(d, n));
    M3_TRY(draft_head(d, n));
    return draft_markov(d, n);
}

/* The draft step, from a graph where the engine replays its steps from
 * graphs: its launches do not change from step to step at one request
 * count (the positions are read from r->positions), so the first step of
 * a count runs eagerly (sizing every workspace), is then captured, and
 * later steps of that count replay the capture. */
static m3_status run_draft_step(m3_drafter *d, int n) {
    m3_draft_run *r = &d->run;
    m3_backend *be = r->eng->be;
    if (!r->eng->graphs)
        return draft_step(d, n);
    if (r->graph[n]) {
        M3_TRY(be->ops->graph_launch(be, r->graph[n]));
        r->replays++;
        return M3_OK;
    }
    M3_TRY(draft_step(d, n));
    M3_TRY(be->ops->graph_begin(be));
    m3_status cap = draft_step(d, n);
    m3_status end = be->ops->graph_end(be, cap == M3_OK, &r->graph[n]);
    M3_TRY(cap);
    return end;
}

/* Request g's sequence (not another request's too), position and anchor. */
static m3_status check_request(const m3_drafter *d, const m3_engine *e, const m3_seq *seqs, int g,
                               int64_t p, int32_t anchor) {
    M3_TRY(m3_cache_seq_check(&e->cache, seqs[g]));
    for (int h = 0; h < g; h++)
        if (seqs[h] == seqs[g])
            return m3_fail(M3_ERR_INVALID_ARG, "draft step: sequence %d is requests %d and %d",
                           seqs[g], h, g);
    const m3_seq_state *ss = &e->cache.seqs[seqs[g]];
    if (p < 0 || p > ss->len)
        return m3_fail(M3_ERR_INVALID_ARG, "draft step at position %lld: the sequence holds %lld",
                       (long long)p, (long long)ss->len);
    if (anchor < 0 || anchor >= d->cfg.vocab_size)
        return m3_fail(M3_ERR_INVALID_ARG, "draft anchor token %d is outside the vocabulary",
                       anchor);
    return M3_OK;
}

/* Check a draft step's requests and upload its inputs (the rows' tokens
 * and positions, the block tables, the anchors). */
static m3_status draft_inputs(m3_drafter *d, int n, const m3_seq *seqs, const int64_t *p,
                              const int32_t *anchors) {
    m3_draft_run *r = &d->run;
    m3_engine *e = r->eng;
    if (!e)
        return m3_fail(M3_ERR_INVALID_ARG, "the drafter is not bound to an engine");
    if (n < 1 || n > r->max_reqs || !seqs || !p || !anchors)
        return m3_fail(M3_ERR_INVALID_ARG, "a draft step of %d requests: 1 to %d, with their "
                       "sequences, positions and anchors", n, r->max_reqs);
    M3_TRY(m3_engine_bind_thread(e));
    M3_TRY(pick_kernels(d));
    int B = d->cfg.block;
    int32_t tokens[M3_MAX_DRAFT_REQS * M3_MAX_DRAFT_BLOCK];
    int64_t positions[M3_MAX_DRAFT_REQS * M3_MAX_DRAFT_BLOCK];
    const m3_backend_ops *op = e->be->ops;
    m3_backend *be = e->be;
    for (int g = 0; g < n; g++) {
        M3_TRY(check_request(d, e, seqs, g, p[g], anchors[g]));
        for (int j = 0; j < B; j++) {
            tokens[g * B + j] = j ? d->cfg.mask_token : anchors[g];
            positions[g * B + j] = p[g] + j;
        }
        const m3_seq_state *ss = &e->cache.seqs[seqs[g]];
        M3_TRY(op->upload(be, r->pages + (size_t)g * r->max_blocks, ss->pages,
                          (size_t)ss->n_blocks * sizeof *ss->pages));
    }
    M3_TRY(op->upload(be, r->tokens, tokens, (size_t)n * B * sizeof *tokens));
    M3_TRY(op->upload(be, r->positions, positions, (size_t)n * B * sizeof *positions));
    return op->upload(be, r->drafts, anchors, (size_t)n * sizeof *anchors);
}

m3_status m3_drafter_propose(m3_drafter *d, int n, const m3_seq *seqs, const int64_t *p,
                             const int32_t *anchors, int32_t *drafts, float *logits) {
    if (!drafts)
        return m3_fail(M3_ERR_INVALID_ARG, "a draft step needs a drafts array");
    M3_TRY(draft_inputs(d, n, seqs, p, anchors));
    m3_draft_run *r = &d->run;
    m3_backend *be = r->eng->be;
    const m3_backend_ops *op = be->ops;
    int B = d->cfg.block, V = d->cfg.vocab_size, G = r->max_reqs;
    M3_TRY(run_draft_step(d, n));
    if (r->kernels == M3_DRAFT_KERNELS_ON)
        r->kernel_steps++;
    int32_t all[(M3_MAX_DRAFT_BLOCK + 1) * M3_MAX_DRAFT_REQS];
    M3_TRY(op->download(be, all, r->drafts, (size_t)(B + 1) * G * sizeof *all));
    for (int g = 0; g < n; g++)
        for (int j = 0; j < B; j++)
            drafts[g * B + j] = all[(j + 1) * G + g];
    if (logits)
        M3_TRY(op->download(be, logits, r->logits, (size_t)n * B * V * sizeof *logits));
    return M3_OK;
}

m3_status m3_drafter_bench_inputs(m3_drafter *d, int n, const m3_seq *seqs, const int64_t *p,
                                  const int32_t *anchors) {
    return draft_inputs(d, n, seqs, p, anchors);
}

m3_status m3_drafter_bench_part(m3_drafter *d, int n, m3_draft_part part) {
    if (!d->run.eng || n < 1 || n > d->run.max_reqs)
        return m3_fail(M3_ERR_INVALID_ARG, "a draft part of %d requests on a drafter %s", n,
                       d->run.eng ? "bound" : "not bound");
    switch (part) {
    case M3_DRAFT_PART_STEP:
        return draft_step(d, n);
    case M3_DRAFT_PART_LAYERS:
        return draft_layers(d, n);
    case M3_DRAFT_PART_HEAD:
        return draft_head(d, n);
    case M3_DRAFT_PART_MARKOV:
        return draft_markov(d, n);
    }
    return m3_fail(M3_ERR_INVALID_ARG, "no draft part %d", (int)part);
}
