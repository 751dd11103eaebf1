/*
 * Loading a DSpark drafter (docs/DSPARK.md): its config.json, checked
 * against the target it drafts for (hidden and vocabulary sizes, tap
 * layers, mask token), then every tensor bound to a view with its shape and
 * dtype checked, so the forward (draft_forward.c) can trust them. Then
 * attaching it to one engine: its context cache and activations in that
 * engine's backend, and the engine's layer taps switched on.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/bind.h"
#include "spec/drafter.h"

#define NAME_CAP 256

/* The draft config against the target's. */
static m3_status check_against(const m3_draft_config *d, const m3_config *t) {
    const m3_config *a = &d->attn;
    if (a->hidden_size != t->hidden_size)
        return m3_fail(M3_ERR_CONFIG, "drafter hidden_size = %d but the target's is %d",
                       a->hidden_size, t->hidden_size);
    if (d->vocab_size != t->vocab_size)
        return m3_fail(M3_ERR_CONFIG, "drafter vocab_size = %d but the target's is %d",
                       d->vocab_size, t->vocab_size);
    if (d->mask_token >= t->vocab_size)
        return m3_fail(M3_ERR_CONFIG, "drafter mask token %d is outside the vocabulary of %d",
                       d->mask_token, t->vocab_size);
    for (int i = 0; i < d->n_taps; i++) {
        if (d->taps[i] >= t->num_layers)
            return m3_fail(M3_ERR_CONFIG, "drafter tap layer %d: the target has %d layers",
                           d->taps[i], t->num_layers);
        for (int j = 0; j < i; j++)
            if (d->taps[j] == d->taps[i])
                return m3_fail(M3_ERR_CONFIG, "drafter tap layer %d is listed twice",
                               d->taps[i]);
    }
    if (a->num_q_heads % a->num_kv_heads)
        return m3_fail(M3_ERR_CONFIG,
                       "drafter num_attention_heads = %d is not a multiple of "
                       "num_key_value_heads = %d",
                       a->num_q_heads, a->num_kv_heads);
    return M3_OK;
}

/* Layer i's tensors, under "layers.{i}.decoder_layer." (the release) or
 * "layers.{i}.". */
static m3_status bind_layer(const m3_binder *root, int i, const m3_draft_config *d, int F,
                            m3_draft_layer *L) {
    char pre[NAME_CAP], s[NAME_CAP];
    snprintf(pre, sizeof pre, "%slayers.%d.decoder_layer.", root->prefix, i);
    m3_binder b = {root->files, pre};
    if (!m3_bind_find(&b, "input_layernorm.weight"))
        snprintf(pre, sizeof pre, "%slayers.%d.", root->prefix, i);
    const m3_config *a = &d->attn;
    int64_t H = a->hidden_size, D = a->head_dim, Nq = a->num_q_heads, Nkv = a->num_kv_heads;
    M3_TRY(m3_bind_plain(&b, "input_layernorm.weight", M3_DT_BF16, H, 0, &L->input_norm));
    M3_TRY(m3_bind_plain(&b, "post_attention_layernorm.weight", M3_DT_BF16, H, 0, &L->post_norm));
    M3_TRY(m3_bind_linear(&b, "self_attn.q_proj", Nq * D, H, &L->q_proj));
    M3_TRY(m3_bind_linear(&b, "self_attn.k_proj", Nkv * D, H, &L->k_proj));
    M3_TRY(m3_bind_linear(&b, "self_attn.v_proj", Nkv * D, H, &L->v_proj));
    M3_TRY(m3_bind_linear(&b, "self_attn.o_proj", H, Nq * D, &L->o_proj));
    M3_TRY(m3_bind_plain(&b, "self_attn.q_norm.weight", M3_DT_BF16, D, 0, &L->q_norm));
    M3_TRY(m3_bind_plain(&b, "self_attn.k_norm.weight", M3_DT_BF16, D, 0, &L->k_norm));
    snprintf(s, sizeof s, "mlp.gate_up_proj");
    M3_TRY(m3_bind_gate_up(&b, "mlp.gate_proj", "mlp.up_proj", s, F, H, &L->gate, &L->up));
    return m3_bind_linear(&b, "mlp.down_proj", H, F, &L->down);
}

/* The MLP width: dspark_ffn_hidden_size, else layer 0's gate rows. */
static m3_status ffn_width(const m3_binder *b, const m3_draft_config *d, int *F) {
    static const char *const names[] = {"layers.0.decoder_layer.mlp.gate_proj.weight",
                                        "layers.0.mlp.gate_proj.weight",
                                        "layers.0.decoder_layer.mlp.gate_up_proj.weight",
                                        "layers.0.mlp.gate_up_proj.weight"};
    for (int i = 0; i < 4; i++) {
        const m3_st_entry *e = m3_bind_find(b, names[i]);
        if (!e || e->ndim != 2)
            continue;
        int64_t rows = i < 2 ? e->shape[0] : e->shape[0] / 2;
        if (d->ffn_dim && rows != d->ffn_dim)
            return m3_fail(M3_ERR_FORMAT, "tensor %s has %lld rows; dspark_ffn_hidden_size is %d",
                           e->name, (long long)e->shape[0], d->ffn_dim);
        if (rows < 1 || rows > (1 << 20))
            return m3_fail(M3_ERR_FORMAT, "tensor %s: an MLP width of %lld", e->name,
                           (long long)rows);
        *F = (int)rows;
        return M3_OK;
    }
    return m3_fail(M3_ERR_FORMAT, "drafter checkpoint is missing %slayers.0.decoder_layer."
                   "mlp.gate_proj.weight (or layers.0.mlp.gate_proj.weight)", b->prefix);
}

static const char *const prefixes[] = {"language_model.model.dspark.", "model.dspark.", "dspark.",
                                       ""};

static m3_status bind_drafter(m3_drafter *d) {
    const m3_draft_config *c = &d->cfg;
    m3_binder b = {d->files, NULL};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes && !b.prefix; i++) {
        m3_binder probe = {d->files, prefixes[i]};
        if (m3_bind_find(&probe, "fc.weight"))
            b.prefix = prefixes[i];
    }
    if (!b.prefix)
        return m3_fail(M3_ERR_FORMAT, "drafter checkpoint has no fc.weight (under "
                       "language_model.model.dspark., model.dspark., dspark. or no prefix)");
    if (c->markov_rank < 0) { /* not in config.json: markov_w1's columns, or no head */
        const m3_st_entry *w1 = m3_bind_find(&b, "markov_head.markov_w1.weight");
        d->cfg.markov_rank = w1 && w1->ndim == 2 && w1->shape[1] <= (1 << 16) ? (int)w1->shape[1]
                                                                              : 0;
    }
    int64_t H = c->attn.hidden_size, V = c->vocab_size, r = c->markov_rank;
    M3_TRY(m3_bind_linear(&b, "fc", H, c->n_taps * H, &d->w.fc));
    M3_TRY(m3_bind_plain(&b, "hidden_norm.weight", M3_DT_BF16, H, 0, &d->w.hidden_norm));
    const char *fin = m3_bind_find(&b, "final_norm.weight") ? "final_norm.weight" : "norm.weight";
    M3_TRY(m3_bind_plain(&b, fin, M3_DT_BF16, H, 0, &d->w.final_norm));
    if (r) {
        M3_TRY(m3_bind_plain(&b, "markov_head.markov_w1.weight", M3_DT_BF16, V, r,
                             &d->w.markov_w1));
        M3_TRY(m3_bind_plain(&b, "markov_head.markov_w2.weight", M3_DT_BF16, V, r,
                             &d->w.markov_w2));
    }
    M3_TRY(ffn_width(&b, c, &d->ffn_dim));
    d->w.layers = calloc((size_t)c->attn.num_layers, sizeof *d->w.layers);
    if (!d->w.layers)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory binding the drafter's layers");
    for (int i = 0; i < c->attn.num_layers; i++) {
        m3_status st = bind_layer(&b, i, c, d->ffn_dim, &d->w.layers[i]);
        if (st)
            return m3_fail_context(st, "drafter layer %d", i);
    }
    return M3_OK;
}

m3_status m3_drafter_load(const char *dir, const m3_model *target, const m3_model_opts *opts,
                          m3_drafter **out) {
    if (out)
        *out = NULL;
    if (!dir || !dir[0] || !target || !out)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_drafter_load: a folder, a target model and an "
                       "output are required");
    m3_drafter *d = calloc(1, sizeof *d);
    if (!d)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory loading the drafter %s", dir);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = NULL;
    size_t len = 0;
    d->dir = m3_strdup(dir, "the drafter's path");
    m3_status st = d->dir ? m3_read_text_file(path, 16u << 20, &text, &len) : M3_ERR_NO_MEMORY;
    if (!st) {
        st = m3_draft_config_parse(text, len, &d->cfg);
        if (st)
            m3_fail_context(st, "%s", path);
    }
    free(text);
    if (!st)
        st = check_against(&d->cfg, m3_model_config(target));
    if (!st)
        st = m3_st_open_dir(dir, opts && opts->progress, &d->files);
    if (!st)
        st = bind_drafter(d);
    if (st) {
        m3_fail_context(st, "loading the drafter %s", dir);
        m3_drafter_free(d);
        return st;
    }
    *out = d;
    return M3_OK;
}

int m3_drafter_block(const m3_drafter *d) { return d ? d->cfg.block : 0; }

void m3_drafter_free(m3_drafter *d) {
    if (!d)
        return;
    m3_drafter_detach(d);
    free(d->w.layers);
    m3_st_close(d->files);
    free(d->dir);
    free(d);
}

/* ------------------------------------------------------------ attach */

static m3_status alloc_run(m3_drafter *d, m3_backend *be) {
    m3_draft_run *r = &d->run;
    const m3_config *a = &d->cfg.attn;
    size_t R = (size_t)r->rows, G = (size_t)r->max_reqs, B = (size_t)d->cfg.block;
    size_t H = (size_t)a->hidden_size, GB = G * B;
    size_t D = (size_t)a->head_dim, Nq = (size_t)a->num_q_heads, Nkv = (size_t)a->num_kv_heads;
    size_t F = (size_t)d->ffn_dim, V = (size_t)d->cfg.vocab_size, L = (size_t)a->num_layers;
    size_t page = (size_t)M3_PAGE_TOKENS * Nkv * D * 2;
    r->k_cache = calloc(2 * L, sizeof *r->k_cache);
    r->host_slots = m3_malloc(R * sizeof *r->host_slots, "the drafter's context slots");
    if (!r->k_cache || !r->host_slots)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory for the drafter's cache table");
    r->v_cache = r->k_cache + L;
    for (size_t i = 0; i < L; i++) {
        M3_TRY(be->ops->alloc(be, (size_t)r->n_pages * page, (void **)&r->k_cache[i]));
        M3_TRY(be->ops->alloc(be, (size_t)r->n_pages * page, (void **)&r->v_cache[i]));
    }
    struct {
        void **p;
        size_t bytes;
    } bufs[] = {
        {(void **)&r->ctx_slots, R * 8},     {(void **)&r->ctx_u, R * H * 2},
        {(void **)&r->ctx_h, R * H * 2},     {(void **)&r->ctx_k, R * Nkv * D * 2},
        {(void **)&r->ctx_v, R * Nkv * D * 2}, {(void **)&r->tokens, GB * 4},
        {(void **)&r->positions, GB * 8},    {(void **)&r->hidden, GB * H * 2},
        {(void **)&r->residual, GB * H * 2}, {(void **)&r->x, GB * H * 2},
        {(void **)&r->o, GB * H * 2},        {(void **)&r->final, GB * H * 2},
        {(void **)&r->q, GB * Nq * D * 2},   {(void **)&r->attn, GB * Nq * D * 2},
        {(void **)&r->k, GB * Nkv * D * 2},  {(void **)&r->v, GB * Nkv * D * 2},
        {(void **)&r->gate, GB * F * 2},     {(void **)&r->up, GB * F * 2},
        {(void **)&r->act, GB * F * 2},      {(void **)&r->logits, GB * V * 4},
        {(void **)&r->w1_rows, G * (size_t)(d->cfg.markov_rank + 1) * 2},
        {(void **)&r->bias, G * V * 4},
        {(void **)&r->pages, G * (size_t)r->max_blocks * 4},
        {(void **)&r->drafts, (B + 1) * G * 4},
    };
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        M3_TRY(be->ops->alloc(be, bufs[i].bytes, bufs[i].p));
    return M3_OK;
}

/* One tensor where the backend reads it: the view itself on a host-memory
 * backend, else a copy (dense, as the views are). */
static m3_status place_tensor(m3_drafter *d, m3_backend *be, const m3_tensor *h, m3_tensor *out) {
    *out = *h;
    if (!h->data || be->ops->host_memory)
        return M3_OK;
    size_t bytes = (size_t)h->ne[0] * (size_t)h->nb[0];
    void **owned = realloc(d->owned, (size_t)(d->n_owned + 1) * sizeof *owned);
    if (!owned)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory placing the drafter's weights");
    d->owned = owned;
    M3_TRY(be->ops->alloc(be, bytes, &out->data));
    d->owned[d->n_owned++] = out->data;
    return be->ops->upload(be, out->data, h->data, bytes);
}

static m3_status place_linear(m3_drafter *d, m3_backend *be, const m3_linear *h, m3_linear *out) {
    *out = *h;
    M3_TRY(place_tensor(d, be, &h->w, &out->w));
    return place_tensor(d, be, &h->scale, &out->scale);
}

static m3_status place_weights(m3_drafter *d, m3_backend *be) {
    const m3_draft_weights *h = &d->w;
    m3_draft_weights *b = &d->bw;
    int L = d->cfg.attn.num_layers;
    *b = *h;
    b->layers = calloc((size_t)L, sizeof *b->layers);
    if (!b->layers)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory placing the drafter's layers");
    M3_TRY(place_linear(d, be, &h->fc, &b->fc));
    M3_TRY(place_tensor(d, be, &h->hidden_norm, &b->hidden_norm));
    M3_TRY(place_tensor(d, be, &h->final_norm, &b->final_norm));
    M3_TRY(place_tensor(d, be, &h->markov_w1, &b->markov_w1));
    M3_TRY(place_tensor(d, be, &h->markov_w2, &b->markov_w2));
    for (int i = 0; i < L; i++) {
        const m3_draft_layer *hl = &h->layers[i];
        m3_draft_layer *bl = &b->layers[i];
        M3_TRY(place_tensor(d, be, &hl->input_norm, &bl->input_norm));
        M3_TRY(place_tensor(d, be, &hl->post_norm, &bl->post_norm));
        M3_TRY(place_linear(d, be, &hl->q_proj, &bl->q_proj));
        M3_TRY(place_linear(d, be, &hl->k_proj, &bl->k_proj));
        M3_TRY(place_linear(d, be, &hl->v_proj, &bl->v_proj));
        M3_TRY(place_linear(d, be, &hl->o_proj, &bl->o_proj));
        M3_TRY(place_tensor(d, be, &hl->q_norm, &bl->q_norm));
        M3_TRY(place_tensor(d, be, &hl->k_norm, &bl->k_norm));
        M3_TRY(place_linear(d, be, &hl->gate, &bl->gate));
        M3_TRY(place_linear(d, be, &hl->up, &bl->up));
        M3_TRY(place_linear(d, be, &hl->down, &bl->down));
    }
    return M3_OK;
}

/* The target's embedding and lm_head where the drafter runs: the
 * engine's own at TP 1; at TP > 1 the model's whole ones, copied into rank
 * 0's memory where that is not the host's (once when they are tied). */
static m3_status place_target(m3_drafter *d, const m3_engine *e, m3_engine *r0) {
    m3_draft_run *r = &d->run;
    if (!e->ranks[0]) {
        r->embed = r0->w.embed;
        r->lm_head = r0->w.lm_head;
        return M3_OK;
    }
    const m3_weights *w = &e->model->w;
    M3_TRY(place_tensor(d, r0->be, &w->embed, &r->embed));
    if (w->lm_head.data == w->embed.data) {
        r->lm_head = w->lm_head;
        r->lm_head.data = r->embed.data;
        return M3_OK;
    }
    return place_tensor(d, r0->be, &w->lm_head, &r->lm_head);
}

/* Taps on every rank of engine e (n = 0: off): each rank runs every layer
 * stock while they are on, so their in-layer exchanges stay in step; the
 * drafter reads rank 0's (every rank holds the same hidden states). */
static m3_status set_taps_all(m3_engine *e, const int *layers, int n) {
    if (!e->ranks[0])
        return m3_engine_set_taps(e, layers, n);
    m3_status first = M3_OK;
    for (int r = 0; r < e->tp_size; r++) {
        m3_status st = m3_engine_set_taps(e->ranks[r], layers, n);
        if (st && !first)
            first = st;
    }
    return first;
}

m3_status m3_draft_switch(const char *name, int *fused) {
    const char *env = getenv(name);
    *fused = -1;
    if (!env || !*env)
        return M3_OK;
    if (strcmp(env, "ops") && strcmp(env, "fused"))
        return m3_fail(M3_ERR_INVALID_ARG, "%s=%s: expected ops or fused", name, env);
    *fused = !strcmp(env, "fused");
    return M3_OK;
}

/* The Markov head's step as the backend's one op where it takes the
 * weights (the same bits as its three ops), unless M3_DRAFT_MARKOV=ops
 * asks for the three (tests and A/B runs compare them). */
static m3_status pick_markov(m3_drafter *d, m3_backend *be) {
    int fused;
    M3_TRY(m3_draft_switch("M3_DRAFT_MARKOV", &fused));
    d->run.fused_markov = false;
    if (!d->cfg.markov_rank || !be->ops->draft_markov || fused == 0)
        return M3_OK;
    m3_status st = be->ops->draft_markov(be, 0, &d->bw.markov_w1, &d->bw.markov_w2, NULL, NULL,
                                         0, NULL);
    if (st == M3_ERR_UNSUPPORTED)
        return M3_OK; /* these weights: the three ops */
    d->run.fused_markov = st == M3_OK;
    return st;
}

m3_status m3_drafter_attach(m3_drafter *d, m3_engine *e) {
    if (d->run.front == e)
        return M3_OK;
    if (d->run.front)
        return m3_fail(M3_ERR_INVALID_ARG, "the drafter is bound to another engine");
    /* at TP > 1 the drafter runs whole on rank 0's backend, with the
     * model's own embedding and lm_head (the ranks hold vocabulary slices) */
    m3_engine *r0 = e->ranks[0] ? e->ranks[0] : e;
    if (!r0->be->ops->draft_attention || !r0->be->ops->draft_argmax)
        return m3_fail(M3_ERR_UNSUPPORTED, "speculative decoding (--draft) needs the drafter's "
                       "attention and Markov step ops, which the %s backend does not have",
                       r0->be->ops->name);
    if (d->cfg.block + 1 > r0->opts.max_rows)
        return m3_fail(M3_ERR_INVALID_ARG, "the drafter's verify steps have %d rows; the "
                       "engine's max_rows is %d", d->cfg.block + 1, r0->opts.max_rows);
    d->run.front = e;
    d->run.eng = r0;
    d->run.rows = r0->opts.max_rows;
    /* a draft step's requests are verified in one target step */
    int G = r0->opts.max_rows / (d->cfg.block + 1);
    G = G < r0->opts.max_seqs ? G : r0->opts.max_seqs;
    d->run.max_reqs = G < M3_MAX_DRAFT_REQS ? G : M3_MAX_DRAFT_REQS;
    d->run.n_pages = r0->cache.n_pages;
    d->run.max_blocks = r0->cache.max_blocks;
    m3_status st = m3_engine_bind_thread(r0);
    if (!st)
        st = place_target(d, e, r0);
    if (!st)
        st = place_weights(d, r0->be);
    if (!st)
        st = alloc_run(d, r0->be);
    if (!st)
        st = set_taps_all(e, d->cfg.taps, d->cfg.n_taps);
    if (!st)
        st = pick_markov(d, r0->be);
    if (st) {
        m3_drafter_detach(d);
        return st;
    }
    return M3_OK;
}

void m3_drafter_detach(m3_drafter *d) {
    m3_draft_run *r = &d->run;
    if (!r->eng)
        return;
    m3_backend *be = r->eng->be;
    (void)m3_engine_bind_thread(r->eng); /* its buffers are on rank 0's GPU */
    for (int g = 0; g <= M3_MAX_DRAFT_REQS; g++)
        if (r->graph[g]) /* (they hold the buffers below) */
            be->ops->graph_free(be, r->graph[g]);
    for (int n = 0; n <= M3_GRAPH_MAX_VERIFY_ROWS; n++)
        if (r->ctx_graph[n])
            be->ops->graph_free(be, r->ctx_graph[n]);
    if (r->kernels_runner) /* (it holds the cache below) */
        be->ops->draft_layers_free(be, r->kernels_runner);
    free(r->host_slots);
    for (int i = 0; r->k_cache && i < 2 * d->cfg.attn.num_layers; i++)
        if (r->k_cache[i])
            be->ops->release(be, r->k_cache[i]);
    free(r->k_cache);
    for (int i = 0; i < d->n_owned; i++)
        be->ops->release(be, d->owned[i]);
    free(d->owned);
    d->owned = NULL;
    d->n_owned = 0;
    free(d->bw.layers);
    memset(&d->bw, 0, sizeof d->bw);
    void *bufs[] = {r->ctx_slots, r->ctx_u, r->ctx_h, r->ctx_k, r->ctx_v, r->tokens,
                    r->positions, r->hidden, r->residual, r->x, r->o, r->final, r->q,
                    r->attn, r->k, r->v, r->gate, r->up, r->act, r->logits, r->w1_rows,
                    r->bias, r->pages, r->drafts};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        if (bufs[i])
            be->ops->release(be, bufs[i]);
    set_taps_all(r->front, NULL, 0);
    memset(r, 0, sizeof *r);
}
