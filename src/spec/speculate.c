/*
 * Speculative decoding's loop (SPEC §7 "Verify", docs/DSPARK.md): prefill
 * each prompt, then repeatedly let a proposer draft up to B tokens after
 * each request's anchor (the last token chosen), up to G requests in one
 * draft step, run the target over every request's [anchor, drafts] in one
 * step (or in steps of whole requests where the backend rounds a row of a
 * larger step differently from a one-row step: m3_engine_exact_rows, 16
 * rows on CUDA), keep a request's drafts while they equal the target's
 * greedy choice, emit the target's token at its first mismatch (or after
 * all B), cut each sequence back to its kept rows and hand those rows to
 * the proposer as context. The emitted tokens and the logits they were
 * chosen from are exactly plain greedy decoding's (for a batch: plain
 * batched decoding's, whose steps stay within those rows too).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/progress.h"
#include "core/status.h"
#include "spec/drafter.h"
#include "spec/speculate.h"

static m3_status check_opts(const m3_engine *e, const m3_proposer *pr, int n,
                            const int32_t *const *prompts, const int *n_prompts,
                            const m3_gen_opts *o) {
    M3_TRY(m3_gen_check_batch(e, n, prompts, n_prompts, o));
    if (o->sampler.temperature != 0)
        return m3_fail(M3_ERR_UNSUPPORTED, "speculative decoding is greedy only: temperature "
                       "%g must be 0", (double)o->sampler.temperature);
    if (pr->block < 1 || pr->block > M3_MAX_DRAFT_BLOCK || pr->block + 1 > e->opts.max_rows)
        return m3_fail(M3_ERR_INVALID_ARG, "a draft block of %d rows (the verify step's %d "
                       "rows must fit max_rows %d)", pr->block, pr->block + 1, e->opts.max_rows);
    if (pr->max_reqs < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "a proposer of %d requests a step", pr->max_reqs);
    return M3_OK;
}

typedef struct req {
    m3_seq seq;
    int64_t p;      /* the anchor's position */
    int32_t anchor; /* the last token chosen */
    bool live;
} req;

typedef struct loop {
    m3_engine *e;
    const m3_proposer *pr;
    const m3_gen_opts *o;
    m3_gen_result *res;   /* [n] */
    m3_spec_stats *stats;
    int n, G, B, V;       /* G: requests a cycle */
    req *rq;              /* [n] */
    bool read;            /* a callback reads the tokens' logits */
    float *logits;        /* [G * (B + 1), V]: a verify step's rows (a prefill's last: row 0) */
    float *draft_logits;  /* [G * B, V] when the steps' logits are kept */
} loop;

/* Keep a record of request r's part of a draft step (its drafts' logits
 * at draft_logits, [B, V]) in the stats. */
static m3_status record(loop *l, int r, const int32_t *drafts, const float *draft_logits, int nb,
                        int n_acc) {
    m3_spec_stats *s = l->stats;
    s->cycles++;
    s->drafted += nb;
    s->accepted += n_acc;
    if (!s->keep_steps)
        return M3_OK;
    int B = l->B;
    size_t n = (size_t)s->n_steps + 1;
    m3_spec_step *steps = realloc(s->steps, n * sizeof *steps);
    if (!steps)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory recording draft steps");
    s->steps = steps;
    m3_spec_step *st = &steps[n - 1];
    memset(st, 0, sizeof *st);
    st->request = r;
    st->pos = l->rq[r].p;
    st->anchor = l->rq[r].anchor;
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
        memcpy(all + (n - 1) * row, draft_logits, row * sizeof *all);
    }
    s->n_steps = (int)n;
    return M3_OK;
}

/* A cycle's requests: who[q] the request, nb[q] its drafts verified,
 * slot[q] its place in the draft step (-1: nothing drafted, one token
 * left), first[q] its first row in the verify step. */
typedef struct group {
    int m, rows;
    int who[M3_MAX_DRAFT_REQS], nb[M3_MAX_DRAFT_REQS], slot[M3_MAX_DRAFT_REQS];
    int first[M3_MAX_DRAFT_REQS + 1];
    int n_acc[M3_MAX_DRAFT_REQS];
    int32_t target[M3_MAX_DRAFT_REQS];
    int32_t drafts[M3_MAX_DRAFT_REQS * M3_MAX_DRAFT_BLOCK];
    int32_t rows_tok[M3_MAX_DRAFT_REQS * (M3_MAX_DRAFT_BLOCK + 1)];
} group;

/* The drafts of the group's requests that have room for any. */
static m3_status propose(loop *l, group *g) {
    m3_seq seqs[M3_MAX_DRAFT_REQS];
    int64_t p[M3_MAX_DRAFT_REQS];
    int32_t anchors[M3_MAX_DRAFT_REQS];
    int k = 0;
    for (int q = 0; q < g->m; q++) {
        const req *r = &l->rq[g->who[q]];
        int remaining = l->o->max_new_tokens - l->res[g->who[q]].n_tokens;
        g->nb[q] = l->B < remaining - 1 ? l->B : remaining - 1; /* emits <= nb + 1 */
        g->slot[q] = g->nb[q] > 0 ? k : -1;
        if (g->nb[q] > 0) {
            seqs[k] = r->seq;
            p[k] = r->p;
            anchors[k++] = r->anchor;
        }
    }
    if (!k)
        return M3_OK;
    return l->pr->propose(l->pr->self, k, seqs, p, anchors, g->drafts, l->draft_logits);
}

/* Each request's verify rows, [anchor, drafts], laid out one after the
 * other: first[q] its first row, vr[q] its request. */
static void verify_rows(loop *l, group *g, m3_request *vr) {
    int rows = 0;
    for (int q = 0; q < g->m; q++) {
        const req *r = &l->rq[g->who[q]];
        g->first[q] = rows;
        g->rows_tok[rows] = r->anchor;
        if (g->nb[q] > 0)
            memcpy(g->rows_tok + rows + 1, g->drafts + (size_t)g->slot[q] * l->B,
                   (size_t)g->nb[q] * sizeof(int32_t));
        vr[q] = (m3_request){r->seq, g->rows_tok + rows, g->nb[q] + 1};
        rows += g->nb[q] + 1;
    }
    g->first[g->m] = g->rows = rows;
}

/* The target's step over requests [q0, q1)'s rows; n_acc and the target's
 * token at the first mismatch (or after every draft). Row i of a request
 * has the target's greedy token for position p + 1 + i; the rows' logits
 * come to the host (into l->logits at the requests' rows) only when a
 * callback reads them or the backend cannot choose tokens. */
static m3_status verify(loop *l, group *g, const m3_request *vr, int q0, int q1) {
    int32_t targets[M3_MAX_DRAFT_REQS * (M3_MAX_DRAFT_BLOCK + 1)];
    bool host = l->read || !m3_engine_greedy_on_device(l->e);
    int row0 = g->first[q0];
    if (host)
        M3_TRY(m3_engine_step(l->e, vr + q0, q1 - q0, NULL, l->logits + (size_t)row0 * l->V));
    else
        M3_TRY(m3_engine_step_greedy(l->e, vr + q0, q1 - q0, targets + row0));
    m3_sampler greedy = {0, 0, 1, 0}; /* temperature 0: argmax, lowest id on ties */
    for (int q = q0; q < q1; q++) {
        const int32_t *d = g->rows_tok + g->first[q] + 1;
        int32_t *t = targets + g->first[q];
        /* rows after the first mismatch are not read */
        for (int n_acc = 0;; n_acc++) {
            if (host)
                M3_TRY(m3_sample(&greedy, NULL, l->logits + (size_t)(g->first[q] + n_acc) * l->V,
                                 l->V, &t[n_acc]));
            if (t[n_acc] < 0)
                return m3_fail(M3_ERR_FAULT, "every logit is NaN");
            if (n_acc == g->nb[q] || t[n_acc] != d[n_acc]) {
                g->n_acc[q] = n_acc;
                g->target[q] = t[n_acc];
                break;
            }
        }
    }
    return M3_OK;
}

/* Requests [q0, q1) of the group (q1 returned): as many as fit one target step whose
 * rows each get a one-row step's bits (m3_engine_exact_rows; at least one
 * request), so the verify step's tokens are plain greedy decoding's. */
static int verify_part(const loop *l, const group *g, int q0) {
    int cap = m3_engine_exact_rows(l->e), q1 = q0 + 1;
    while (q1 < g->m && (cap <= 0 || g->first[q1 + 1] - g->first[q0] <= cap))
        q1++;
    return q1;
}

/* One draft-and-verify cycle of the group's requests: one draft step,
 * then the target's steps over their rows (one where the backend's rows
 * do not depend on the step's row count, else parts of at most that many
 * rows), each part's kept rows cut back to and handed to the proposer as
 * context before the next part runs. */
static m3_status cycle(loop *l, group *g) {
    double t0 = m3_now_seconds();
    M3_TRY(propose(l, g));
    l->stats->draft_seconds += m3_now_seconds() - t0;
    m3_request vr[M3_MAX_DRAFT_REQS];
    verify_rows(l, g, vr);
    uint8_t keep[M3_MAX_DRAFT_REQS * (M3_MAX_DRAFT_BLOCK + 1)];
    memset(keep, 0, sizeof keep);
    for (int q0 = 0, q1; q0 < g->m; q0 = q1) {
        q1 = verify_part(l, g, q0);
        double t1 = m3_now_seconds();
        M3_TRY(verify(l, g, vr, q0, q1));
        double t2 = m3_now_seconds();
        for (int q = q0; q < q1; q++) {
            req *r = &l->rq[g->who[q]];
            if (g->nb[q] > 0)
                M3_TRY(record(l, g->who[q], g->drafts + (size_t)g->slot[q] * l->B,
                              l->draft_logits
                                  ? l->draft_logits + (size_t)g->slot[q] * l->B * l->V
                                  : NULL,
                              g->nb[q], g->n_acc[q]));
            /* the kept rows: the anchor and the accepted drafts */
            M3_TRY(m3_engine_set_len(l->e, r->seq, r->p + g->n_acc[q] + 1));
            memset(keep + g->first[q], 1, (size_t)g->n_acc[q] + 1);
        }
        double t3 = m3_now_seconds();
        M3_TRY(l->pr->extend(l->pr->self, g->first[q1] - g->first[q0], keep + g->first[q0]));
        l->stats->draft_seconds += m3_now_seconds() - t3;
        l->stats->verify_seconds += t2 - t1;
        l->stats->verify_steps++;
    }
    l->stats->batch_steps++;
    for (int q = 0; q < g->m; q++) {
        int i = g->who[q];
        req *r = &l->rq[i];
        const float *rows = l->read ? l->logits + (size_t)g->first[q] * l->V : NULL;
        const int32_t *d = g->rows_tok + g->first[q] + 1;
        bool live = true;
        for (int a = 0; a < g->n_acc[q] && live; a++)
            live = m3_gen_emit(l->e, l->o, i, &l->res[i], d[a], rows ? rows + (size_t)a * l->V
                                                                     : NULL);
        if (live)
            live = m3_gen_emit(l->e, l->o, i, &l->res[i], g->target[q],
                               rows ? rows + (size_t)g->n_acc[q] * l->V : NULL);
        r->live = live;
        r->p += g->n_acc[q] + 1;
        r->anchor = l->res[i].tokens[l->res[i].n_tokens - 1];
    }
    return M3_OK;
}

/* Prefill request i in chunks, handing each chunk to the proposer as
 * context; its first token, greedy from the last row. */
static m3_status prefill(loop *l, int i, const int32_t *prompt, int n_prompt) {
    m3_engine *e = l->e;
    double t0 = m3_now_seconds();
    for (int first = 0; first < n_prompt; first += e->opts.max_rows) {
        int n = n_prompt - first < e->opts.max_rows ? n_prompt - first : e->opts.max_rows;
        m3_request rq = {l->rq[i].seq, prompt + first, n};
        M3_TRY(m3_engine_step(e, &rq, 1, l->logits, NULL));
        M3_TRY(l->pr->extend(l->pr->self, n, NULL));
    }
    l->res[i].prefill_seconds = m3_now_seconds() - t0;
    l->rq[i].p = n_prompt;
    if (l->o->max_new_tokens > 0) {
        m3_sampler greedy = {0, 0, 1, 0};
        M3_TRY(m3_sample(&greedy, NULL, l->logits, l->V, &l->rq[i].anchor));
        l->rq[i].live = m3_gen_emit(e, l->o, i, &l->res[i], l->rq[i].anchor, l->logits);
    }
    return M3_OK;
}

static m3_status run(loop *l, const int32_t *const *prompts, const int *n_prompts) {
    for (int i = 0; i < l->n; i++)
        M3_TRY(prefill(l, i, prompts[i], n_prompts[i]));
    double t0 = m3_now_seconds();
    for (;;) {
        /* every live request takes one cycle, G of them at once */
        group g = {0};
        bool any = false;
        for (int i = 0; i <= l->n; i++) {
            if (i < l->n && l->rq[i].live)
                g.who[g.m++] = i;
            if (g.m == l->G || (i == l->n && g.m)) {
                M3_TRY(cycle(l, &g));
                any = true;
                g.m = 0;
            }
        }
        if (!any)
            break;
    }
    double decode = m3_now_seconds() - t0;
    for (int i = 0; i < l->n; i++)
        l->res[i].decode_seconds = decode;
    return M3_OK;
}

m3_status m3_speculate(m3_engine *e, const m3_proposer *pr, int n, const int32_t *const *prompts,
                       const int *n_prompts, const m3_gen_opts *o, m3_gen_result *res,
                       m3_spec_stats *stats) {
    bool keep_steps = stats->keep_steps, keep_logits = stats->keep_draft_logits;
    memset(stats, 0, sizeof *stats);
    stats->keep_steps = keep_steps || keep_logits;
    stats->keep_draft_logits = keep_logits;
    if (n > 0)
        memset(res, 0, (size_t)n * sizeof *res);
    M3_TRY(check_opts(e, pr, n, prompts, n_prompts, o));
    loop l = {.e = e, .pr = pr, .o = o, .res = res, .stats = stats, .n = n, .B = pr->block,
              .V = e->cfg.vocab_size, .read = o->on_token || o->on_request_token};
    l.G = e->opts.max_rows / (pr->block + 1);
    l.G = l.G < pr->max_reqs ? l.G : pr->max_reqs;
    l.G = l.G < n ? l.G : n;
    l.G = l.G < M3_MAX_DRAFT_REQS ? l.G : M3_MAX_DRAFT_REQS;
    l.rq = m3_malloc((size_t)n * sizeof *l.rq, "requests");
    l.logits = m3_malloc((size_t)l.G * (pr->block + 1) * l.V * sizeof *l.logits,
                         "verify logits");
    if (keep_logits)
        l.draft_logits = m3_malloc((size_t)l.G * pr->block * l.V * sizeof *l.draft_logits,
                                   "draft logits");
    m3_status st = (!l.rq || !l.logits || (keep_logits && !l.draft_logits)) ? M3_ERR_NO_MEMORY
                                                                            : M3_OK;
    m3_seq *seqs = st ? NULL : m3_malloc((size_t)n * sizeof *seqs, "sequences");
    if (!st)
        st = seqs ? m3_gen_begin(e, n, n_prompts, o, res, seqs) : M3_ERR_NO_MEMORY;
    if (!st) {
        for (int i = 0; i < n; i++)
            l.rq[i] = (req){seqs[i], 0, 0, false};
        st = run(&l, prompts, n_prompts);
        m3_gen_end(e, n, seqs, res, st);
    }
    free(seqs);
    free(l.rq);
    free(l.logits);
    free(l.draft_logits);
    if (st)
        m3_spec_stats_free(stats);
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

static m3_status drafter_extend(void *self, int rows, const uint8_t *keep) {
    return m3_drafter_extend(self, rows, keep);
}

static m3_status drafter_propose(void *self, int n, const m3_seq *seqs, const int64_t *p,
                                 const int32_t *anchors, int32_t *drafts, float *logits) {
    return m3_drafter_propose(self, n, seqs, p, anchors, drafts, logits);
}

m3_status m3_generate_speculative_batch(m3_engine *e, m3_drafter *d, int n,
                                        const int32_t *const *prompts, const int *n_prompts,
                                        const m3_gen_opts *opts, m3_gen_result *res,
                                        m3_spec_stats *stats) {
    m3_spec_stats local = {0};
    if (!stats)
        stats = &local;
    if (res && n > 0)
        memset(res, 0, (size_t)n * sizeof *res);
    if (!e || !d || !opts || !res)
        return m3_fail(M3_ERR_INVALID_ARG, "speculative decoding: engine, drafter, options and "
                       "results are required");
    M3_TRY(m3_drafter_attach(d, e));
    m3_proposer pr = {d->cfg.block, d->run.max_reqs, d, drafter_extend, drafter_propose};
    int64_t replays = d->run.replays, kernel_steps = d->run.kernel_steps;
    m3_status st = m3_speculate(e, &pr, n, prompts, n_prompts, opts, res, stats);
    stats->draft_replays = d->run.replays - replays;
    stats->kernel_draft_steps = d->run.kernel_steps - kernel_steps;
    snprintf(stats->draft_kernels_off, sizeof stats->draft_kernels_off, "%s",
             d->run.kernels == M3_DRAFT_KERNELS_ON ? "" : d->run.kernels_off);
    m3_drafter_detach(d);
    return st;
}

m3_status m3_generate_speculative(m3_engine *e, m3_drafter *d, const int32_t *prompt,
                                  int n_prompt, const m3_gen_opts *opts, m3_gen_result *res,
                                  m3_spec_stats *stats) {
    if (res)
        memset(res, 0, sizeof *res);
    if (!prompt)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_generate_speculative: the prompt is required");
    return m3_generate_speculative_batch(e, d, 1, &prompt, &n_prompt, opts, res, stats);
}
