/*
 * The engine: sets up a backend, its weights, the paged cache and the
 * step scratch for a loaded model, and turns a batch of requests (tokens
 * appended to sequences) into one step: it checks every request, reserves
 * cache pages (all or nothing), fills the step metadata (positions, slots,
 * block tables; SPEC §4), runs the forward, and only then commits the new
 * sequence lengths, so a failed step changes nothing.
 */
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "decode/engine.h"

m3_engine_opts m3_engine_defaults(void) {
    m3_engine_opts o = {0};
    o.device = M3_DEVICE_CPU;
    o.threads = 0;
    o.max_tokens = 0; /* min(max_position_embeddings, 32768) */
    o.max_rows = 256;
    o.max_seqs = 8;
    return o;
}

static void free_scratch(m3_engine *e) {
    void **ptrs = (void **)&e->s;
    for (size_t i = 0; i < sizeof e->s / sizeof(void *); i++)
        if (ptrs[i])
            e->be->ops->release(e->be, ptrs[i]);
    memset(&e->s, 0, sizeof e->s);
}

static m3_status alloc_scratch(m3_engine *e) {
    const m3_config *c = &e->cfg;
    size_t R = (size_t)e->opts.max_rows, H = (size_t)c->hidden_size, D = (size_t)c->head_dim;
    size_t Ni = (size_t)c->index_heads, Di = (size_t)c->index_dim;
    size_t F = (size_t)(c->dense_dim > 0 ? c->dense_dim : 1);
    m3_scratch *s = &e->s;
    struct {
        void **ptr;
        size_t bytes;
    } want[] = {
        {(void **)&s->hidden, R * H * 2},
        {(void **)&s->residual, R * H * 2},
        {(void **)&s->x, R * H * 2},
        {(void **)&s->o, R * H * 2},
        {(void **)&s->q, R * (size_t)c->num_q_heads * D * 2},
        {(void **)&s->k, R * (size_t)c->num_kv_heads * D * 2},
        {(void **)&s->v, R * (size_t)c->num_kv_heads * D * 2},
        {(void **)&s->iq, R * Ni * Di * 2 + 2},
        {(void **)&s->ik, R * Di * 2 + 2},
        {(void **)&s->scores, R * Ni * (size_t)e->max_blocks * 4 + 4},
        {(void **)&s->selected, R * Ni * (size_t)(c->topk_blocks + 1) * 4},
        {(void **)&s->attn, R * (size_t)c->num_q_heads * D * 2},
        {(void **)&s->gate, R * F * 2},
        {(void **)&s->up, R * F * 2},
        {(void **)&s->act, R * F * 2},
        {(void **)&s->out_hidden, R * H * 2},
        {(void **)&s->out_residual, R * H * 2},
        {(void **)&s->final, R * H * 2},
        {(void **)&s->out_rows, R * 4},
        {(void **)&s->logits, R * (size_t)c->vocab_size * 4},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        M3_TRY(e->be->ops->alloc(e->be, want[i].bytes, want[i].ptr));
    return M3_OK;
}

static void free_step(m3_engine *e) {
    m3_step_arrays *h = &e->step.host, *d = &e->step.dev;
    void *hp[] = {h->tokens, h->positions, h->slots, h->row_req,
                  h->seq_lens, h->query_start, h->block_table};
    void *dp[] = {d->tokens, d->positions, d->slots, d->row_req,
                  d->seq_lens, d->query_start, d->block_table};
    for (int i = 0; i < 7; i++) {
        free(hp[i]);
        if (dp[i])
            e->be->ops->release(e->be, dp[i]);
    }
    memset(&e->step, 0, sizeof e->step);
}

/* Host and backend copies of the step arrays, sized for the limits. */
static m3_status alloc_step(m3_engine *e) {
    size_t R = (size_t)e->opts.max_rows, B = (size_t)e->opts.max_seqs;
    size_t sizes[7] = {R * 4, R * 8, R * 8, R * 4, B * 4, (B + 1) * 4, B * (size_t)e->max_blocks * 4};
    m3_step_arrays *h = &e->step.host, *d = &e->step.dev;
    void **hp[] = {(void **)&h->tokens, (void **)&h->positions, (void **)&h->slots,
                   (void **)&h->row_req, (void **)&h->seq_lens, (void **)&h->query_start,
                   (void **)&h->block_table};
    void **dp[] = {(void **)&d->tokens, (void **)&d->positions, (void **)&d->slots,
                   (void **)&d->row_req, (void **)&d->seq_lens, (void **)&d->query_start,
                   (void **)&d->block_table};
    for (int i = 0; i < 7; i++) {
        *hp[i] = m3_calloc(1, sizes[i], "step metadata");
        if (!*hp[i])
            return M3_ERR_NO_MEMORY;
        M3_TRY(e->be->ops->alloc(e->be, sizes[i], dp[i]));
    }
    return M3_OK;
}

static m3_status alloc_cache(m3_engine *e, int32_t n_pages) {
    const m3_config *c = &e->cfg;
    size_t kv_bytes = (size_t)n_pages * (size_t)c->num_kv_heads * M3_PAGE_TOKENS *
                      (size_t)c->head_dim * 2;
    size_t index_bytes = (size_t)n_pages * M3_PAGE_TOKENS * (size_t)c->index_dim * 2;
    for (int i = 0; i < c->num_layers; i++) {
        m3_cache_layer *l = &e->cache.layers[i];
        M3_TRY(e->be->ops->alloc(e->be, kv_bytes, &l->k));
        M3_TRY(e->be->ops->alloc(e->be, kv_bytes, &l->v));
        if (c->layer_sparse[i])
            M3_TRY(e->be->ops->alloc(e->be, index_bytes, &l->index));
    }
    return M3_OK;
}

static m3_status check_opts(const m3_config *c, m3_engine_opts *o) {
    if (o->device != M3_DEVICE_CPU)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "device %d is not available in this build (only cpu)", (int)o->device);
    if (o->max_rows < 1 || o->max_rows > 1 << 16)
        return m3_fail(M3_ERR_INVALID_ARG, "max_rows = %d: must be in [1, 65536]", o->max_rows);
    if (o->max_seqs < 1 || o->max_seqs > 1 << 16)
        return m3_fail(M3_ERR_INVALID_ARG, "max_seqs = %d: must be in [1, 65536]", o->max_seqs);
    if (o->max_tokens < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "max_tokens = %lld: must be >= 0",
                       (long long)o->max_tokens);
    if (o->max_tokens == 0)
        o->max_tokens = c->max_position_embeddings < 32768 ? c->max_position_embeddings : 32768;
    if (o->max_tokens > (int64_t)M3_PAGE_TOKENS * (1 << 30))
        return m3_fail(M3_ERR_INVALID_ARG, "max_tokens = %lld is too large",
                       (long long)o->max_tokens);
    return M3_OK;
}

void m3_engine_free(m3_engine *e) {
    if (!e)
        return;
    if (e->be) {
        free_scratch(e);
        free_step(e);
        for (int i = 0; e->cache.layers && i < e->cfg.num_layers; i++) {
            m3_cache_layer *l = &e->cache.layers[i];
            void *ptrs[3] = {l->k, l->v, l->index};
            for (int k = 0; k < 3; k++)
                if (ptrs[k])
                    e->be->ops->release(e->be, ptrs[k]);
        }
        e->be->ops->unload_weights(e->be, &e->cfg, &e->w);
        e->be->ops->destroy(e->be);
    }
    m3_cache_destroy(&e->cache);
    m3_comm_free(e->comm);
    free(e);
}

m3_status m3_engine_create(m3_model *model, const m3_engine_opts *opts, m3_engine **out) {
    *out = NULL;
    if (!model)
        return m3_fail(M3_ERR_INVALID_ARG, "model is NULL");
    m3_engine *e = m3_calloc(1, sizeof *e, "engine");
    if (!e)
        return M3_ERR_NO_MEMORY;
    e->model = model;
    e->cfg = model->cfg;
    e->opts = opts ? *opts : m3_engine_defaults();
    m3_status st = check_opts(&e->cfg, &e->opts);
    int64_t max_context = e->opts.max_tokens < e->cfg.max_position_embeddings
                              ? e->opts.max_tokens
                              : e->cfg.max_position_embeddings;
    int32_t n_pages = (int32_t)((e->opts.max_tokens + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
    e->max_blocks = (int)((max_context + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
    if (!st)
        st = m3_cpu_backend_create(e->opts.threads, &e->be);
    if (!st)
        st = m3_comm_create_single(&e->comm);
    if (!st)
        st = e->be->ops->load_weights(e->be, &e->cfg, &model->w, &e->w);
    if (!st)
        st = m3_cache_init(&e->cache, e->cfg.num_layers, n_pages, max_context, e->opts.max_seqs);
    if (!st)
        st = alloc_cache(e, n_pages);
    if (!st)
        st = alloc_scratch(e);
    if (!st)
        st = alloc_step(e);
    if (st) {
        m3_engine_free(e);
        return m3_fail_context(st, "creating the engine");
    }
    *out = e;
    return M3_OK;
}

int64_t m3_engine_max_context(const m3_engine *e) { return e->cache.max_context; }

m3_status m3_seq_create(m3_engine *e, m3_seq *out) { return m3_cache_seq_create(&e->cache, out); }

m3_status m3_seq_free(m3_engine *e, m3_seq seq) { return m3_cache_seq_free(&e->cache, seq); }

int64_t m3_seq_len(const m3_engine *e, m3_seq seq) {
    if (m3_cache_seq_check(&e->cache, seq))
        return -1;
    return e->cache.seqs[seq].len;
}

/* Every request valid, rows within the limits, no sequence twice. */
static m3_status check_requests(const m3_engine *e, const m3_request *reqs, int n_reqs,
                                int *rows) {
    if (n_reqs < 1 || n_reqs > e->opts.max_seqs)
        return m3_fail(M3_ERR_INVALID_ARG, "a step needs 1 to %d requests, got %d",
                       e->opts.max_seqs, n_reqs);
    int64_t total = 0;
    for (int r = 0; r < n_reqs; r++) {
        const m3_request *q = &reqs[r];
        M3_TRY(m3_cache_seq_check(&e->cache, q->seq));
        for (int k = 0; k < r; k++)
            if (reqs[k].seq == q->seq)
                return m3_fail(M3_ERR_INVALID_ARG, "sequence %d appears twice in one step",
                               q->seq);
        if (q->n_tokens < 1 || !q->tokens)
            return m3_fail(M3_ERR_INVALID_ARG, "request %d has no tokens", r);
        for (int i = 0; i < q->n_tokens; i++)
            if (q->tokens[i] < 0 || q->tokens[i] >= e->cfg.vocab_size)
                return m3_fail(M3_ERR_INVALID_ARG,
                               "token id %d (request %d, position %d) is outside the vocabulary "
                               "[0, %d)",
                               q->tokens[i], r, i, e->cfg.vocab_size);
        int64_t new_len = e->cache.seqs[q->seq].len + q->n_tokens;
        if (new_len > e->cache.max_context)
            return m3_fail(M3_ERR_INVALID_ARG,
                           "sequence %d would reach %lld tokens; the context limit is %lld",
                           q->seq, (long long)new_len, (long long)e->cache.max_context);
        total += q->n_tokens;
    }
    if (total > e->opts.max_rows)
        return m3_fail(M3_ERR_INVALID_ARG, "a step of %lld rows exceeds max_rows = %d",
                       (long long)total, e->opts.max_rows);
    *rows = (int)total;
    return M3_OK;
}

/* Fill the host step arrays (pages already reserved) and upload them. */
static m3_status build_step(m3_engine *e, const m3_request *reqs, int n_reqs, int rows) {
    m3_step *st = &e->step;
    m3_step_arrays *h = &st->host;
    st->rows = rows;
    st->n_reqs = n_reqs;
    st->n_prefill = st->n_decode = 0;
    st->max_query_len = 0;
    st->n_pages = e->cache.n_pages;
    st->graph_mode = M3_GRAPH_NONE;
    st->capturing = false;
    int t = 0, width = 1;
    for (int r = 0; r < n_reqs; r++) {
        const m3_seq_state *sq = &e->cache.seqs[reqs[r].seq];
        int64_t n = reqs[r].n_tokens, len0 = sq->len;
        int blocks = (int)((len0 + n + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
        width = blocks > width ? blocks : width;
        if (n > 1 || len0 == 0)
            st->n_prefill++;
        else
            st->n_decode++;
        st->max_query_len = n > st->max_query_len ? (int)n : st->max_query_len;
        h->query_start[r] = t;
        h->seq_lens[r] = (int32_t)(len0 + n);
        for (int i = 0; i < n; i++, t++) {
            h->tokens[t] = reqs[r].tokens[i];
            h->positions[t] = len0 + i;
            h->slots[t] = m3_cache_slot(&e->cache, reqs[r].seq, len0 + i);
            h->row_req[t] = r;
        }
    }
    h->query_start[n_reqs] = t;
    /* the table is as wide as the step's longest sequence needs */
    st->max_blocks = width;
    for (int r = 0; r < n_reqs; r++) {
        const m3_seq_state *sq = &e->cache.seqs[reqs[r].seq];
        for (int b = 0; b < width; b++)
            h->block_table[r * width + b] = b < sq->n_blocks ? sq->pages[b] : -1;
    }
    const m3_backend_ops *op = e->be->ops;
    m3_step_arrays *d = &st->dev;
    M3_TRY(op->upload(e->be, d->tokens, h->tokens, (size_t)rows * 4));
    M3_TRY(op->upload(e->be, d->positions, h->positions, (size_t)rows * 8));
    M3_TRY(op->upload(e->be, d->slots, h->slots, (size_t)rows * 8));
    M3_TRY(op->upload(e->be, d->row_req, h->row_req, (size_t)rows * 4));
    M3_TRY(op->upload(e->be, d->seq_lens, h->seq_lens, (size_t)n_reqs * 4));
    M3_TRY(op->upload(e->be, d->query_start, h->query_start, (size_t)(n_reqs + 1) * 4));
    return op->upload(e->be, d->block_table, h->block_table, (size_t)n_reqs * width * 4);
}

m3_status m3_engine_step(m3_engine *e, const m3_request *reqs, int n_reqs, float *logits,
                         float *all_logits) {
    if (!e || !reqs || (!logits && !all_logits))
        return m3_fail(M3_ERR_INVALID_ARG, "m3_engine_step: engine, requests and an output "
                       "buffer are required");
    int rows = 0;
    M3_TRY(check_requests(e, reqs, n_reqs, &rows));
    int r = 0;
    m3_status st = M3_OK;
    for (; r < n_reqs && !st; r++)
        st = m3_cache_reserve(&e->cache, reqs[r].seq,
                              e->cache.seqs[reqs[r].seq].len + reqs[r].n_tokens);
    if (!st)
        st = build_step(e, reqs, n_reqs, rows);
    int32_t *out_rows = NULL;
    if (!st && !(out_rows = m3_malloc((size_t)rows * sizeof *out_rows, "logit rows")))
        st = M3_ERR_NO_MEMORY;
    if (!st && all_logits) {
        for (int i = 0; i < rows; i++)
            out_rows[i] = i;
        st = m3_forward(e, &e->step, rows, out_rows, all_logits);
        for (int q = 0; !st && logits && q < n_reqs; q++)
            memcpy(logits + (size_t)q * e->cfg.vocab_size,
                   all_logits + (size_t)(e->step.host.query_start[q + 1] - 1) * e->cfg.vocab_size,
                   (size_t)e->cfg.vocab_size * sizeof *logits);
    } else if (!st) {
        for (int q = 0; q < n_reqs; q++)
            out_rows[q] = e->step.host.query_start[q + 1] - 1;
        st = m3_forward(e, &e->step, n_reqs, out_rows, logits);
    }
    free(out_rows);
    if (st) {
        /* give back the pages this step took; lengths never moved */
        for (int q = 0; q < r; q++)
            m3_cache_trim(&e->cache, reqs[q].seq, e->cache.seqs[reqs[q].seq].len);
        return st;
    }
    for (int q = 0; q < n_reqs; q++)
        e->cache.seqs[reqs[q].seq].len += reqs[q].n_tokens;
    return M3_OK;
}
