/*
 * Speculative decoding's loop (SPEC §7 "Verify", docs/DSPARK.md): prefill
 * the prompt, then repeatedly let a proposer draft up to B tokens after the
 * anchor (the last token chosen), run the target over [anchor, drafts] in
 * one step with every row's logits, keep the drafts while they equal the
 * target's greedy choice, emit the target's token at the first mismatch
 * (or after all B), cut the sequence back to the kept rows and hand those
 * rows to the proposer as context. The emitted tokens and the logits they
 * were chosen from are exactly plain greedy decoding's.
 */
#include <stdlib.h>
#include <string.h>

#include "core/progress.h"
#include "core/status.h"
#include "spec/drafter.h"
#include "spec/speculate.h"

static m3_status check_opts(const m3_engine *e, const m3_proposer *pr, int n_prompt,
                            const m3_gen_opts *o) {
    M3_TRY(m3_gen_check(e, n_prompt, o));
    if (o->sampler.temperature != 0)
        return m3_fail(M3_ERR_UNSUPPORTED, "speculative decoding is greedy only: temperature "
                       "%g must be 0", (double)o->sampler.temperature);
    if (pr->block < 1 || pr->block > M3_MAX_DRAFT_BLOCK || pr->block + 1 > e->opts.max_rows)
        return m3_fail(M3_ERR_INVALID_ARG, "a draft block of %d rows (the verify step's %d "
                       "rows must fit max_rows %d)", pr->block, pr->block + 1, e->opts.max_rows);
    return M3_OK;
}

typedef struct loop {
    m3_engine *e;
    const m3_proposer *pr;
    const m3_gen_opts *o;
    m3_gen_result *res;
    m3_spec_stats *stats;
    m3_seq seq;
    int V;
    float *logits;        /* [B + 1, V]: the verify step's rows */
    float *draft_logits;  /* [B, V] when the steps' logits are kept */
    bool done;
} loop;

/* Emit token (chosen from row_logits); false when generation ends here. */
static bool emit(loop *l, int32_t token, const float *row_logits) {
    m3_gen_result *res = l->res;
    res->tokens[res->n_tokens++] = token;
    if (l->o->on_token && l->o->on_token(l->o->user, token, row_logits, l->V))
        return false;
    if (l->o->stop_at_eos && m3_config_is_eos(&l->e->cfg, token)) {
        res->stopped_at_eos = true;
        return false;
    }
    return res->n_tokens < l->o->max_new_tokens;
}

/* Keep a record of one draft step (and its logits) in the stats. */
static m3_status record(loop *l, int64_t p, int32_t anchor, const int32_t *drafts, int nb,
                        int n_acc) {
    m3_spec_stats *s = l->stats;
    s->cycles++;
    s->drafted += nb;
    s->accepted += n_acc;
    if (!s->keep_steps)
        return M3_OK;
    int B = l->pr->block;
    size_t n = (size_t)s->n_steps + 1;
    m3_spec_step *steps = realloc(s->steps, n * sizeof *steps);
    if (!steps)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory recording draft steps");
    s->steps = steps;
    m3_spec_step *st = &steps[n - 1];
    memset(st, 0, sizeof *st);
    st->pos = p;
    st->anchor = anchor;
    st->n_drafts = B;
    st->verified = nb;
    st->accepted = n_acc;
    memcpy(st->drafts, drafts, (size_t)B * sizeof *drafts);
    if (s->keep_draft_logits) {
        size_t row = (size_t)B * l->V;
        float *all = realloc(s->draft_logits, n * row * sizeof *all);
        if (!all)
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory keeping draft logits");
        s->draft_logits = all;
        memcpy(all + (n - 1) * row, l->draft_logits, row * sizeof *all);
    }
    s->n_steps = (int)n;
    return M3_OK;
}

/* One draft-and-verify cycle from anchor token a at position p. */
static m3_status cycle(loop *l, int64_t *p, int32_t *anchor) {
    const m3_proposer *pr = l->pr;
    int B = pr->block, V = l->V;
    int remaining = l->o->max_new_tokens - l->res->n_tokens;
    int nb = B < remaining - 1 ? B : remaining - 1; /* drafts verified: emits <= nb + 1 */
    int32_t rows[M3_MAX_DRAFT_BLOCK + 1], drafts[M3_MAX_DRAFT_BLOCK];
    rows[0] = *anchor;
    double t0 = m3_now_seconds();
    if (nb > 0) {
        M3_TRY(pr->propose(pr->self, l->seq, *p, *anchor, drafts, l->draft_logits));
        memcpy(rows + 1, drafts, (size_t)nb * sizeof *drafts);
    }
    double t1 = m3_now_seconds();
    m3_request rq = {l->seq, rows, nb + 1};
    /* row i's greedy token is the target's for position p + 1 + i; the
     * rows' logits come to the host only when on_token reads them or the
     * backend cannot choose tokens */
    int n_acc = 0;
    int32_t target = 0;
    if (l->o->on_token || !m3_engine_greedy_on_device(l->e)) {
        M3_TRY(m3_engine_step(l->e, &rq, 1, NULL, l->logits));
        m3_sampler greedy = {0, 0, 1, 0}; /* temperature 0: argmax, lowest id on ties */
        for (;;) {
            M3_TRY(m3_sample(&greedy, NULL, l->logits + (size_t)n_acc * V, V, &target));
            if (n_acc == nb || target != drafts[n_acc])
                break;
            n_acc++;
        }
    } else {
        int32_t targets[M3_MAX_DRAFT_BLOCK + 1];
        M3_TRY(m3_engine_step_greedy(l->e, &rq, 1, targets));
        while (n_acc < nb && targets[n_acc] == drafts[n_acc])
            n_acc++;
        target = targets[n_acc];
        if (target < 0) /* (rows after the first mismatch are not read) */
            return m3_fail(M3_ERR_FAULT, "every logit is NaN");
    }
    double t2 = m3_now_seconds();
    if (nb > 0)
        M3_TRY(record(l, *p, *anchor, drafts, nb, n_acc));
    /* the kept rows: the anchor and the accepted drafts */
    M3_TRY(m3_engine_set_len(l->e, l->seq, *p + n_acc + 1));
    double t3 = m3_now_seconds();
    M3_TRY(pr->extend(pr->self, n_acc + 1));
    l->stats->draft_seconds += (t1 - t0) + (m3_now_seconds() - t3);
    l->stats->verify_seconds += t2 - t1;
    for (int i = 0; i < n_acc && !l->done; i++)
        l->done = !emit(l, drafts[i], l->logits + (size_t)i * V);
    if (!l->done)
        l->done = !emit(l, target, l->logits + (size_t)n_acc * V);
    *p += n_acc + 1;
    *anchor = l->res->tokens[l->res->n_tokens - 1];
    return M3_OK;
}

static m3_status run(loop *l, const int32_t *prompt, int n_prompt) {
    m3_engine *e = l->e;
    double t0 = m3_now_seconds();
    for (int first = 0; first < n_prompt; first += e->opts.max_rows) {
        int n = n_prompt - first < e->opts.max_rows ? n_prompt - first : e->opts.max_rows;
        m3_request rq = {l->seq, prompt + first, n};
        M3_TRY(m3_engine_step(e, &rq, 1, l->logits, NULL));
        M3_TRY(l->pr->extend(l->pr->self, n));
    }
    l->res->prefill_seconds = m3_now_seconds() - t0;
    double t1 = m3_now_seconds();
    if (l->o->max_new_tokens > 0) {
        m3_sampler greedy = {0, 0, 1, 0}; /* temperature 0: argmax, lowest id on ties */
        int32_t tok;
        M3_TRY(m3_sample(&greedy, NULL, l->logits, l->V, &tok));
        l->done = !emit(l, tok, l->logits);
        int64_t p = n_prompt;
        while (!l->done)
            M3_TRY(cycle(l, &p, &tok));
    }
    l->res->decode_seconds = m3_now_seconds() - t1;
    return M3_OK;
}

m3_status m3_speculate(m3_engine *e, const m3_proposer *pr, const int32_t *prompt, int n_prompt,
                       const m3_gen_opts *o, m3_gen_result *res, m3_spec_stats *stats) {
    bool keep_steps = stats->keep_steps, keep_logits = stats->keep_draft_logits;
    memset(stats, 0, sizeof *stats);
    stats->keep_steps = keep_steps || keep_logits;
    stats->keep_draft_logits = keep_logits;
    memset(res, 0, sizeof *res);
    M3_TRY(check_opts(e, pr, n_prompt, o));
    loop l = {e, pr, o, res, stats, -1, e->cfg.vocab_size, NULL, NULL, false};
    res->n_prompt = n_prompt;
    res->tokens = m3_malloc((size_t)(o->max_new_tokens + 1) * sizeof *res->tokens, "tokens");
    l.logits = m3_malloc((size_t)(pr->block + 1) * l.V * sizeof *l.logits, "verify logits");
    if (keep_logits)
        l.draft_logits = m3_malloc((size_t)pr->block * l.V * sizeof *l.draft_logits,
                                   "draft logits");
    m3_status st = (!res->tokens || !l.logits || (keep_logits && !l.draft_logits))
                       ? M3_ERR_NO_MEMORY
                       : m3_seq_create(e, &l.seq);
    if (!st)
        st = run(&l, prompt, n_prompt);
    if (l.seq >= 0)
        m3_seq_free(e, l.seq);
    free(l.logits);
    free(l.draft_logits);
    if (st) {
        free(res->tokens);
        res->tokens = NULL;
        res->n_tokens = 0;
        m3_spec_stats_free(stats);
    }
    return st;
}

void m3_spec_stats_free(m3_spec_stats *s) {
    if (!s)
        return;
    free(s->steps);
    free(s->draft_logits);
    s->steps = NULL;
    s->draft_logits = NULL;
    s->n_steps = 0;
}

/* ------------------------------------------------------------ the drafter */

static m3_status drafter_extend(void *self, int rows) { return m3_drafter_extend(self, rows); }

static m3_status drafter_propose(void *self, m3_seq seq, int64_t p, int32_t anchor,
                                 int32_t *drafts, float *logits) {
    return m3_drafter_propose(self, seq, p, anchor, drafts, logits);
}

m3_status m3_generate_speculative(m3_engine *e, m3_drafter *d, const int32_t *prompt,
                                  int n_prompt, const m3_gen_opts *opts, m3_gen_result *res,
                                  m3_spec_stats *stats) {
    m3_spec_stats local = {0};
    if (!stats)
        stats = &local;
    if (res)
        memset(res, 0, sizeof *res);
    if (!e || !d || !prompt || !opts || !res)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_generate_speculative: engine, drafter, prompt, "
                       "options and result are required");
    M3_TRY(m3_drafter_attach(d, e));
    m3_proposer pr = {d->cfg.block, d, drafter_extend, drafter_propose};
    int64_t replays = d->run.replays;
    m3_status st = m3_speculate(e, &pr, prompt, n_prompt, opts, res, stats);
    stats->draft_replays = d->run.replays - replays;
    m3_drafter_detach(d);
    return st;
}
