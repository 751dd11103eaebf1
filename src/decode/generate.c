/*
 * m3_generate and m3_generate_batch: prefill each prompt into a fresh
 * sequence in chunks of at most max_rows rows, then decode one token per
 * request and step, the live requests together (up to max_rows, and 16, a
 * step),
 * until each reaches max_new_tokens or an end-of-sequence token. One
 * prompt is a batch of one. Timing covers prefill (each request's own)
 * and decode (the batch's) separately.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/progress.h"
#include "core/status.h"
#include "decode/engine.h"

m3_gen_opts m3_gen_defaults(void) {
    m3_gen_opts o = {0};
    o.max_new_tokens = 32;
    o.sampler.temperature = 0;
    o.sampler.top_k = 0;
    o.sampler.top_p = 1;
    o.sampler.seed = 0;
    o.stop_at_eos = true;
    return o;
}

bool m3_config_is_eos(const m3_config *c, int32_t token) {
    for (int i = 0; i < c->num_eos; i++)
        if (c->eos_ids[i] == token)
            return true;
    return false;
}

m3_status m3_gen_check(const m3_engine *e, int n_prompt, const m3_gen_opts *o) {
    M3_TRY(m3_sampler_check(&o->sampler)); /* now, not after a long prefill */
    if (n_prompt < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "the prompt is empty: at least one token is needed");
    if (o->max_new_tokens < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "max_new_tokens = %d: must be >= 0",
                       o->max_new_tokens);
    int64_t need = (int64_t)n_prompt + (o->max_new_tokens > 0 ? o->max_new_tokens - 1 : 0);
    if (need > m3_engine_max_context(e))
        return m3_fail(M3_ERR_INVALID_ARG,
                       "prompt of %d tokens plus %d new tokens needs a context of %lld; the "
                       "limit is %lld",
                       n_prompt, o->max_new_tokens, (long long)need,
                       (long long)m3_engine_max_context(e));
    return M3_OK;
}

m3_status m3_gen_check_batch(const m3_engine *e, int n, const int32_t *const *prompts,
                             const int *n_prompts, const m3_gen_opts *o) {
    if (n < 1 || n > e->opts.max_seqs)
        return m3_fail(M3_ERR_INVALID_ARG, "a batch of %d prompts: the engine holds 1 to %d "
                       "sequences (max_seqs)", n, e->opts.max_seqs);
    if (!prompts || !n_prompts)
        return m3_fail(M3_ERR_INVALID_ARG, "a batch needs its prompts and their lengths");
    if (n > 1 && o->on_token)
        return m3_fail(M3_ERR_INVALID_ARG, "on_token serves one prompt: a batch of %d calls "
                       "on_request_token, which names the request", n);
    int64_t pages = 0;
    for (int i = 0; i < n; i++) {
        if (!prompts[i])
            return m3_fail(M3_ERR_INVALID_ARG, "prompt %d of the batch is missing", i);
        m3_status st = m3_gen_check(e, n_prompts[i], o);
        if (st && n > 1) { /* (the message is copied: m3_fail writes where it lies) */
            char why[512];
            snprintf(why, sizeof why, "%s", m3_last_error());
            return m3_fail(st, "prompt %d of the batch: %s", i, why);
        }
        if (st)
            return st;
        int64_t need = (int64_t)n_prompts[i] + (o->max_new_tokens > 0 ? o->max_new_tokens - 1 : 0);
        pages += (need + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS;
    }
    if (pages > m3_engine_free_pages(e))
        return m3_fail(M3_ERR_OUT_OF_PAGES, "a batch of %d prompts with %d new tokens each needs "
                       "%lld pages of cache; %d are free (raise max_tokens)", n,
                       o->max_new_tokens, (long long)pages, m3_engine_free_pages(e));
    return M3_OK;
}

bool m3_gen_emit(const m3_engine *e, const m3_gen_opts *o, int request, m3_gen_result *res,
                 int32_t token, const float *row_logits) {
    int V = e->cfg.vocab_size;
    res->tokens[res->n_tokens++] = token;
    if (o->on_token && o->on_token(o->user, token, row_logits, V))
        return false;
    if (o->on_request_token && o->on_request_token(o->user, request, token, row_logits, V))
        return false;
    if (o->stop_at_eos && m3_config_is_eos(&e->cfg, token)) {
        res->stopped_at_eos = true;
        return false;
    }
    return res->n_tokens < o->max_new_tokens;
}

typedef struct batch {
    m3_engine *e;
    const m3_gen_opts *o;
    int n;
    m3_gen_result *res; /* [n] */
    m3_seq *seqs;       /* [n] */
    int32_t *tok;       /* [n]: each request's last token */
    bool *live;         /* [n] */
    float *logits;      /* [n, V]: each request's prefill logits */
    /* a decode step's: G = min(n, max_rows, 16) requests */
    int group;          /* G */
    m3_request *rq;     /* [G] */
    int *who;           /* [G]: the request of each */
    int32_t *next;      /* [G]: their tokens */
    float *step_logits; /* [G, V] when a callback reads them, else NULL */
    m3_rng rng;
} batch;

/* Prefill request i in chunks; the logits of its last row into its row
 * of b->logits. */
static m3_status prefill(batch *b, int i, const int32_t *prompt, int n_prompt) {
    m3_engine *e = b->e;
    double t0 = m3_now_seconds();
    float *row = b->logits + (size_t)i * e->cfg.vocab_size;
    for (int first = 0; first < n_prompt; first += e->opts.max_rows) {
        int n = n_prompt - first < e->opts.max_rows ? n_prompt - first : e->opts.max_rows;
        m3_request rq = {b->seqs[i], prompt + first, n};
        M3_TRY(m3_engine_step(e, &rq, 1, row, NULL));
    }
    b->res[i].prefill_seconds = m3_now_seconds() - t0;
    return M3_OK;
}

/* One decode step of the live requests from `first` on, at most max_rows
 * of them; *after = the request after the last one taken. */
static m3_status decode_group(batch *b, int first, int64_t step, int *after) {
    m3_engine *e = b->e;
    size_t V = (size_t)e->cfg.vocab_size;
    int k = 0, i = first;
    for (; i < b->n && k < b->group; i++)
        if (b->live[i]) {
            b->who[k] = i;
            b->rq[k++] = (m3_request){b->seqs[i], &b->tok[i], 1};
        }
    *after = i;
    if (!k)
        return M3_OK;
    /* the logits travel to the host only when someone reads them */
    M3_TRY(m3_engine_decode(e, b->rq, k, &b->o->sampler, &b->rng, step, b->next,
                            b->step_logits));
    for (int q = 0; q < k; q++) {
        int r = b->who[q];
        b->tok[r] = b->next[q];
        b->live[r] = m3_gen_emit(e, b->o, r, &b->res[r], b->next[q],
                                 b->step_logits ? b->step_logits + q * V : NULL);
    }
    return M3_OK;
}

/* The first token of each request comes from its prefill's logits; each
 * later one from a decode step that samples on the device where the
 * backend can. */
static m3_status run(batch *b, const int32_t *const *prompts, const int *n_prompts) {
    m3_engine *e = b->e;
    size_t V = (size_t)e->cfg.vocab_size;
    m3_rng_seed(&b->rng, b->o->sampler.seed);
    for (int i = 0; i < b->n; i++) {
        M3_TRY(prefill(b, i, prompts[i], n_prompts[i]));
        if (b->o->max_new_tokens > 0)
            M3_TRY(m3_sample(&b->o->sampler, &b->rng, b->logits + i * V, (int)V, &b->tok[i]));
    }
    double t0 = m3_now_seconds();
    for (int i = 0; i < b->n; i++)
        b->live[i] = b->o->max_new_tokens > 0 &&
                     m3_gen_emit(e, b->o, i, &b->res[i], b->tok[i], b->logits + i * V);
    /* each decode step its own index: the device's sampler keys its draws
     * by (seed, step, row), so two groups of one round must not share one */
    for (int64_t step = 0;;) {
        int first = 0, any = 0;
        for (int i = 0; i < b->n; i++)
            any |= b->live[i];
        if (!any)
            break;
        while (first < b->n)
            M3_TRY(decode_group(b, first, step++, &first));
    }
    double decode = m3_now_seconds() - t0;
    for (int i = 0; i < b->n; i++)
        b->res[i].decode_seconds = decode;
    return M3_OK;
}

m3_status m3_gen_begin(m3_engine *e, int n, const int *n_prompts, const m3_gen_opts *o,
                       m3_gen_result *res, m3_seq *seqs) {
    m3_status st = M3_OK;
    int made = 0;
    for (int i = 0; !st && i < n; i++) {
        res[i].n_prompt = n_prompts[i];
        res[i].tokens = m3_malloc((size_t)(o->max_new_tokens + 1) * sizeof *res[i].tokens,
                                  "tokens");
        st = res[i].tokens ? m3_seq_create(e, &seqs[i]) : M3_ERR_NO_MEMORY;
        made += !st;
    }
    if (st) {
        for (int i = made; i < n; i++)
            seqs[i] = -1;
        m3_gen_end(e, n, seqs, res, st);
    }
    return st;
}

void m3_gen_end(m3_engine *e, int n, const m3_seq *seqs, m3_gen_result *res, m3_status st) {
    for (int i = 0; i < n; i++) {
        if (seqs[i] >= 0)
            m3_seq_free(e, seqs[i]);
        if (st) {
            free(res[i].tokens);
            res[i].tokens = NULL;
            res[i].n_tokens = 0;
        }
    }
}

m3_status m3_generate_batch(m3_engine *e, int n, const int32_t *const *prompts,
                            const int *n_prompts, const m3_gen_opts *opts, m3_gen_result *res) {
    if (res && n > 0)
        memset(res, 0, (size_t)n * sizeof *res);
    if (!e || !opts || !res)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_generate_batch: engine, options and results "
                       "are required");
    M3_TRY(m3_gen_check_batch(e, n, prompts, n_prompts, opts));
    /* a decode step's requests: up to max_rows, and up to the 16 rows a
     * step that samples on the device takes */
    int G = n < e->opts.max_rows ? n : e->opts.max_rows;
    G = G < M3_GRAPH_MAX_ROWS ? G : M3_GRAPH_MAX_ROWS;
    size_t V = (size_t)e->cfg.vocab_size;
    batch b = {.e = e, .o = opts, .n = n, .res = res, .group = G};
    b.seqs = m3_malloc((size_t)n * sizeof *b.seqs, "sequences");
    b.tok = m3_malloc((size_t)n * sizeof *b.tok, "tokens");
    b.live = m3_malloc((size_t)n * sizeof *b.live, "requests");
    b.logits = m3_malloc((size_t)n * V * sizeof *b.logits, "logits");
    b.rq = m3_malloc((size_t)G * sizeof *b.rq, "decode requests");
    b.who = m3_malloc((size_t)G * sizeof *b.who, "decode requests");
    b.next = m3_malloc((size_t)G * sizeof *b.next, "decode tokens");
    bool read = opts->on_token || opts->on_request_token;
    if (read)
        b.step_logits = m3_malloc((size_t)G * V * sizeof *b.step_logits, "decode logits");
    m3_status st = (!b.seqs || !b.tok || !b.live || !b.logits || !b.rq || !b.who || !b.next ||
                    (read && !b.step_logits))
                       ? M3_ERR_NO_MEMORY
                       : M3_OK;
    if (!st)
        st = m3_gen_begin(e, n, n_prompts, opts, res, b.seqs);
    if (!st) {
        st = run(&b, prompts, n_prompts);
        m3_gen_end(e, n, b.seqs, res, st);
    }
    void *bufs[] = {b.seqs, b.tok, b.live, b.logits, b.rq, b.who, b.next, b.step_logits};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        free(bufs[i]);
    return st;
}

m3_status m3_generate(m3_engine *e, const int32_t *prompt, int n_prompt, const m3_gen_opts *opts,
                      m3_gen_result *res) {
    if (res)
        memset(res, 0, sizeof *res);
    if (!e || !prompt || !opts || !res)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_generate: engine, prompt, options and result "
                       "are required");
    return m3_generate_batch(e, 1, &prompt, &n_prompt, opts, res);
}
