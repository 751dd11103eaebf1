/*
 * m3_generate: prefill a prompt into a fresh sequence in chunks of at most
 * max_rows rows, then decode one token per step until max_new_tokens or an
 * end-of-sequence token. Timing covers prefill and decode separately.
 */
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

/* Prefill in chunks; logits of the prompt's last row into logits. */
static m3_status prefill(m3_engine *e, m3_seq seq, const int32_t *prompt, int n_prompt,
                         float *logits) {
    for (int first = 0; first < n_prompt; first += e->opts.max_rows) {
        int n = n_prompt - first < e->opts.max_rows ? n_prompt - first : e->opts.max_rows;
        m3_request rq = {seq, prompt + first, n};
        M3_TRY(m3_engine_step(e, &rq, 1, logits, NULL));
    }
    return M3_OK;
}

/* The first token comes from the prefill's logits; each later one from a
 * decode step that samples on the device where the backend can. logits
 * holds the logits of the token just chosen (for on_token). */
static m3_status run(m3_engine *e, m3_seq seq, const int32_t *prompt, int n_prompt,
                     const m3_gen_opts *o, float *logits, m3_gen_result *res) {
    int V = e->cfg.vocab_size;
    m3_rng rng;
    m3_rng_seed(&rng, o->sampler.seed);
    double t0 = m3_now_seconds();
    M3_TRY(prefill(e, seq, prompt, n_prompt, logits));
    int32_t tok = 0;
    if (o->max_new_tokens > 0)
        M3_TRY(m3_sample(&o->sampler, &rng, logits, V, &tok));
    double t1 = m3_now_seconds();
    res->prefill_seconds = t1 - t0;
    for (int i = 0; i < o->max_new_tokens; i++) {
        res->tokens[res->n_tokens++] = tok;
        if (o->on_token && o->on_token(o->user, tok, logits, V))
            break;
        if (o->stop_at_eos && m3_config_is_eos(&e->cfg, tok)) {
            res->stopped_at_eos = true;
            break;
        }
        if (i + 1 == o->max_new_tokens)
            break; /* the last token needs no forward */
        m3_request rq = {seq, &tok, 1};
        int32_t next;
        /* the logits travel to the host only when someone reads them */
        M3_TRY(m3_engine_decode(e, &rq, 1, &o->sampler, &rng, i, &next,
                                o->on_token ? logits : NULL));
        tok = next;
    }
    res->decode_seconds = m3_now_seconds() - t1;
    return M3_OK;
}

m3_status m3_generate(m3_engine *e, const int32_t *prompt, int n_prompt, const m3_gen_opts *opts,
                      m3_gen_result *res) {
    memset(res, 0, sizeof *res);
    if (!e || !prompt || !opts)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_generate: engine, prompt and options are required");
    M3_TRY(m3_gen_check(e, n_prompt, opts));
    res->n_prompt = n_prompt;
    res->tokens = m3_malloc((size_t)(opts->max_new_tokens + 1) * sizeof *res->tokens, "tokens");
    float *logits = m3_malloc((size_t)e->cfg.vocab_size * sizeof *logits, "logits");
    m3_seq seq = -1;
    m3_status st = (!res->tokens || !logits) ? M3_ERR_NO_MEMORY : m3_seq_create(e, &seq);
    if (!st)
        st = run(e, seq, prompt, n_prompt, opts, logits, res);
    if (seq >= 0)
        m3_seq_free(e, seq);
    free(logits);
    if (st) {
        free(res->tokens);
        res->tokens = NULL;
        res->n_tokens = 0;
    }
    return st;
}
