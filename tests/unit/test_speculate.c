/*
 * Speculative decoding's verify loop (spec/speculate.c), plain batched
 * generation (decode/generate.c) and the DSpark drafter's plumbing, on the
 * tiny preset on the CPU.
 *
 * A random drafter almost never agrees with a random target, so the loop's
 * acceptance rule is driven here by an oracle proposer that knows plain
 * greedy decoding's tokens and makes a planned number of them right in
 * each of a request's steps (0..B, cycling), then one wrong. Checked,
 * against plain m3_generate of each prompt on a fresh engine, for one
 * prompt and for batches of three (several requests a draft step, and
 * more requests than a step takes): the same tokens and bitwise the same
 * logits for every token; the accepted counts the plan implies; the
 * context the proposer was given (each sequence's kept rows, positions
 * contiguous); the end at max_new_tokens inside a block, at an
 * end-of-sequence token inside an accepted run and where a callback stops
 * one request; a proposer failure ending the run with its message. Then
 * the real drafter (m3 synth --draft-for's weights): the same tokens as
 * plain greedy, with and without a key window, at TP 1 and TP 2 (bitwise
 * the same draft logits), a batch's draft steps bitwise those of each
 * prompt alone, its context written only at the rows the target kept, and
 * its refusals (temperature, a too-small max_rows, a
 * mismatched target, a callback without the request, too many prompts).
 * With M3_TEST_QUICK set (the sanitizer build) the cases that repeat
 * another's path are left out.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/cache.h"
#include "check.h"
#include "core/status.h"
#include "spec/drafter.h"
#include "spec/speculate.h"

#define N_PROMPT 200
#define MAX_NEW 40
#define NREQ 3

static char g_tmp[] = "/tmp/m3_test_speculate_XXXXXX";

/* A prompt of the batch: request r's is shorter and different. */
static int prompt_len(int r) { return N_PROMPT - 37 * r; }
static void make_prompt(int r, int V, int32_t *out) {
    for (int i = 0; i < prompt_len(r); i++)
        out[i] = (int32_t)((i * 37 + 11 + 5 * r) % V);
}

typedef struct plain_run {
    int32_t tokens[MAX_NEW];
    float *logits; /* [MAX_NEW, V] */
    int n, V;
} plain_run;

/* Every request's tokens' logits, in the order they come. */
typedef struct logit_sink {
    plain_run *runs; /* [requests] */
    int stop_request, stop_after; /* a callback stop (-1: none) */
} logit_sink;

static int keep_request_logits(void *user, int request, int32_t token, const float *logits,
                               int vocab) {
    logit_sink *k = user;
    plain_run *p = &k->runs[request];
    (void)token;
    if (p->n < MAX_NEW)
        memcpy(p->logits + (size_t)p->n * vocab, logits, (size_t)vocab * sizeof *logits);
    p->n++;
    return request == k->stop_request && p->n == k->stop_after;
}

/* Options whose callback records n requests' logits into got (fresh
 * buffers of MAX_NEW rows of V) through sink: max_new tokens each, no stop
 * at end-of-sequence. */
static m3_gen_opts recording_opts(plain_run *got, int n, int V, int max_new, logit_sink *sink) {
    for (int r = 0; r < n; r++)
        got[r] = (plain_run){.logits = malloc((size_t)MAX_NEW * V * sizeof(float)), .V = V};
    *sink = (logit_sink){got, -1, 0};
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = max_new;
    go.stop_at_eos = false;
    go.on_request_token = keep_request_logits;
    go.user = sink;
    return go;
}

static int keep_logits(void *user, int32_t token, const float *logits, int vocab) {
    plain_run *p = user;
    (void)token;
    memcpy(p->logits + (size_t)p->n++ * vocab, logits, (size_t)vocab * sizeof *logits);
    return 0;
}

static m3_engine *make_engine_tp(m3_model *m, int max_rows, int tp, int max_seqs) {
    m3_engine_opts o = m3_engine_defaults();
    o.threads = 2;
    o.tp = tp;
    o.tp_timeout_ms = 20000;
    o.max_rows = max_rows;
    o.max_seqs = max_seqs;
    o.max_tokens = (int64_t)max_seqs * (N_PROMPT + MAX_NEW + 128);
    m3_engine *e = NULL;
    if (m3_engine_create(m, &o, &e))
        fprintf(stderr, "engine: %s\n", m3_last_error());
    return e;
}

static m3_engine *make_engine(m3_model *m, int max_rows, int max_seqs) {
    return make_engine_tp(m, max_rows, 1, max_seqs);
}

/* The sequence a step's request q extends: the one whose first page its
 * block table starts with. */
static int step_seq(const m3_engine *e, int q) {
    const m3_step *st = &e->step;
    int32_t page = st->host.block_table[(size_t)q * st->max_blocks];
    for (int s = 0; s < e->cache.max_seqs; s++)
        if (e->cache.seqs[s].live && e->cache.seqs[s].n_blocks &&
            e->cache.seqs[s].pages[0] == page)
            return s;
    return -1;
}

/* The oracle: drafts for request r's anchor at position p are its plain
 * run's tokens for p + 1.. (token k at position prompt_len(r) + k), the
 * first plan[its step % n_plan] of them right and the next one wrong. A
 * fresh engine gives the batch's requests sequences 0, 1, ... in order. */
typedef struct oracle {
    const m3_engine *e;
    const plain_run *plain; /* [requests] */
    int block;
    int calls;                 /* propose calls */
    int steps[NREQ];           /* each request's draft steps */
    const int *plan;
    int n_plan;
    int64_t expect_accepted;
    int64_t ctx[NREQ];         /* positions handed to extend, per sequence */
    bool ctx_ok;
    int most;                  /* the most requests one call had */
    int fail_at;               /* propose fails at this call (-1: never) */
    int max_new;               /* the run's max_new_tokens */
} oracle;

static m3_status oracle_extend(void *self, int rows, const uint8_t *keep) {
    oracle *o = self;
    const m3_step *st = &o->e->step;
    for (int t = 0; t < rows; t++) {
        if (keep && !keep[t])
            continue;
        int s = step_seq(o->e, st->host.row_req[t]);
        /* each sequence's kept rows come in order, none skipped */
        if (s < 0 || s >= NREQ || st->host.positions[t] != o->ctx[s])
            o->ctx_ok = false;
        else
            o->ctx[s]++;
    }
    return M3_OK;
}

static m3_status oracle_propose(void *self, int n, const m3_seq *seqs, const int64_t *p,
                                const int32_t *anchors, int32_t *drafts, float *logits) {
    oracle *o = self;
    (void)logits;
    if (o->calls++ == o->fail_at)
        return m3_fail(M3_ERR_INTERNAL, "oracle failure at call %d", o->calls - 1);
    o->most = n > o->most ? n : o->most;
    for (int g = 0; g < n; g++) {
        int r = seqs[g];
        CHECK(r >= 0 && r < NREQ);
        if (r < 0 || r >= NREQ)
            continue;
        const plain_run *pl = &o->plain[r];
        int right = o->plan[o->steps[r]++ % o->n_plan];
        int64_t k0 = p[g] - prompt_len(r); /* anchor = plain token k0 */
        CHECK(k0 >= 0 && k0 < pl->n && pl->tokens[k0] == anchors[g]);
        CHECK(o->ctx[r] == p[g]); /* the context holds every position below the anchor */
        for (int j = 0; j < o->block; j++) {
            int64_t k = k0 + 1 + j;
            int32_t t = k < pl->n ? pl->tokens[k] : 0;
            drafts[g * o->block + j] = j < right ? t : (t + 1) % pl->V;
        }
        /* drafts the loop verifies: tokens 0..k0 are out, one is left for the target */
        int verified = o->max_new - (int)k0 - 2;
        if (verified > o->block)
            verified = o->block;
        o->expect_accepted += right < verified ? right : verified;
    }
    return M3_OK;
}

static oracle oracle_for(const m3_engine *e, const plain_run *plain, int block, const int *plan,
                         int n_plan, int max_new, int max_reqs) {
    oracle o = {.e = e, .plain = plain, .block = block, .plan = plan, .n_plan = n_plan,
                .ctx_ok = true, .fail_at = -1, .max_new = max_new};
    (void)max_reqs;
    return o;
}

/* The batch's prompts: [NREQ] pointers into one buffer. */
typedef struct prompts {
    int32_t buf[NREQ][N_PROMPT];
    const int32_t *p[NREQ];
    int n[NREQ];
} prompts;

static void make_prompts(prompts *ps, int V) {
    for (int r = 0; r < NREQ; r++) {
        make_prompt(r, V, ps->buf[r]);
        ps->p[r] = ps->buf[r];
        ps->n[r] = prompt_len(r);
    }
}

static bool same_as_plain(const m3_gen_result *res, const plain_run *got, const plain_run *plain,
                          int max_new) {
    bool same = res->n_tokens == max_new && (!got || got->n == max_new);
    for (int i = 0; same && i < max_new; i++)
        same = res->tokens[i] == plain->tokens[i] &&
               (!got || !memcmp(got->logits + (size_t)i * plain->V,
                                plain->logits + (size_t)i * plain->V,
                                (size_t)plain->V * sizeof(float)));
    return same;
}

/* n requests (1 or NREQ) through the oracle with a plan; max_rows sets
 * how many requests a cycle takes (max_rows / (block + 1)); exact_rows, as
 * a backend's (0: any), how many rows a verify step may have, so that a
 * cycle verifies in parts of whole requests. */
static void oracle_case_exact(m3_model *m, const plain_run *plain, int n, int max_rows,
                              const int *plan, int n_plan, int block, int max_new,
                              int exact_rows, const char *what) {
    m3_engine *e = make_engine(m, max_rows, n);
    if (!e)
        return;
    e->be->exact_rows = exact_rows;
    int V = plain[0].V;
    prompts ps;
    make_prompts(&ps, V);
    oracle o = oracle_for(e, plain, block, plan, n_plan, max_new, n);
    m3_proposer pr = {block, NREQ, &o, oracle_extend, oracle_propose};
    plain_run got[NREQ];
    logit_sink sink;
    m3_gen_opts go = recording_opts(got, n, V, max_new, &sink);
    m3_gen_result res[NREQ];
    m3_spec_stats stats = {.keep_steps = true};
    CHECK_OK(m3_speculate(e, &pr, n, ps.p, ps.n, &go, res, &stats));
    for (int r = 0; r < n; r++) {
        bool same = res[r].tokens && same_as_plain(&res[r], &got[r], &plain[r], max_new);
        if (!same)
            fprintf(stderr, "%s: request %d's tokens or logits differ from plain greedy\n", what,
                    r);
        CHECK(same);
        /* per request: the first token, accepted + 1 a draft step, and at
         * most one plain step at the end (one token left: nothing to draft) */
        int64_t acc = 0, cyc = 0;
        for (int i = 0; i < stats.n_steps; i++)
            if (stats.steps[i].request == r) {
                acc += stats.steps[i].accepted;
                cyc++;
            }
        CHECK(acc + cyc + 1 <= max_new && acc + cyc + 2 >= max_new);
    }
    CHECK(o.ctx_ok);
    CHECK(stats.accepted == o.expect_accepted);
    int per_step = max_rows / (block + 1) < n ? max_rows / (block + 1) : n;
    CHECK(o.most == per_step); /* a draft step takes as many requests as fit */
    CHECK(stats.n_steps == stats.cycles && stats.batch_steps >= o.calls);
    /* a verify step a cycle, or one a part: as many whole requests as fit
     * exact_rows (block + 1 rows each while they draft; at least one) */
    int part = exact_rows > 0 ? exact_rows / (block + 1) : per_step;
    part = part < 1 ? 1 : part < per_step ? part : per_step;
    if (part == per_step)
        CHECK(stats.verify_steps == stats.batch_steps);
    else
        CHECK(stats.verify_steps >= stats.batch_steps + 1 &&
              stats.verify_steps <= stats.batch_steps * ((per_step + part - 1) / part));
    printf("%s: %lld cycles in %lld steps (%lld verify steps), %lld accepted of %lld\n", what,
           (long long)stats.cycles, (long long)stats.batch_steps,
           (long long)stats.verify_steps, (long long)stats.accepted, (long long)stats.drafted);
    m3_spec_stats_free(&stats);
    for (int r = 0; r < n; r++) {
        free(res[r].tokens);
        free(got[r].logits);
    }
    /* without a callback (on a backend that chooses tokens, the verify
     * step's come from m3_engine_step_greedy; here the CPU's, from the
     * logits on the host): the same run */
    m3_engine *e2 = make_engine(m, max_rows, n);
    if (e2)
        e2->be->exact_rows = exact_rows;
    oracle o2 = oracle_for(e2, plain, block, plan, n_plan, max_new, n);
    m3_proposer pr2 = {block, NREQ, &o2, oracle_extend, oracle_propose};
    go.on_request_token = NULL;
    m3_spec_stats stats2 = {0};
    if (e2) {
        CHECK_OK(m3_speculate(e2, &pr2, n, ps.p, ps.n, &go, res, &stats2));
        for (int r = 0; r < n; r++) {
            CHECK(res[r].tokens && same_as_plain(&res[r], NULL, &plain[r], max_new));
            free(res[r].tokens);
        }
        CHECK(stats2.accepted == o2.expect_accepted && o2.ctx_ok);
    }
    m3_engine_free(e2);
    m3_engine_free(e);
}

static void oracle_case(m3_model *m, const plain_run *plain, int n, int max_rows,
                        const int *plan, int n_plan, int block, int max_new, const char *what) {
    oracle_case_exact(m, plain, n, max_rows, plan, n_plan, block, max_new, 0, what);
}

/* An end-of-sequence token inside an accepted run ends generation there
 * (in a batch: each request at its own); a callback stops one request of
 * a batch; a proposer's failure ends the run with its message. */
static void stop_cases(m3_model *m, const plain_run *plain) {
    m3_engine *e = make_engine(m, 64, NREQ);
    if (!e)
        return;
    int V = plain[0].V;
    prompts ps;
    make_prompts(&ps, V);
    static const int all_right[] = {7};
    oracle o = oracle_for(e, plain, 7, all_right, 1, MAX_NEW, NREQ);
    m3_proposer pr = {7, NREQ, &o, oracle_extend, oracle_propose};
    /* make request 0's plain token 5 the end-of-sequence token */
    m3_config *cfg = &e->cfg;
    int saved_n = cfg->num_eos;
    int32_t saved = cfg->eos_ids[0];
    cfg->num_eos = 1;
    cfg->eos_ids[0] = plain[0].tokens[5];
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = MAX_NEW;
    m3_gen_result res[NREQ];
    m3_spec_stats stats = {0};
    CHECK_OK(m3_speculate(e, &pr, NREQ, ps.p, ps.n, &go, res, &stats));
    for (int r = 0; r < NREQ; r++) {
        int first = 0;
        while (first < MAX_NEW && plain[r].tokens[first] != cfg->eos_ids[0])
            first++;
        bool eos = first < MAX_NEW;
        CHECK(res[r].stopped_at_eos == eos && res[r].n_tokens == (eos ? first + 1 : MAX_NEW));
        CHECK(res[r].tokens && !memcmp(res[r].tokens, plain[r].tokens,
                                       (size_t)res[r].n_tokens * sizeof(int32_t)));
        free(res[r].tokens);
    }
    cfg->num_eos = saved_n;
    cfg->eos_ids[0] = saved;
    m3_engine_free(e);

    /* request 1 stopped by its callback after 9 tokens; the others run on */
    e = make_engine(m, 64, NREQ);
    if (!e)
        return;
    plain_run got[NREQ];
    for (int r = 0; r < NREQ; r++)
        got[r] = (plain_run){.logits = malloc((size_t)MAX_NEW * V * sizeof(float)), .V = V};
    logit_sink sink = {got, 1, 9};
    go.stop_at_eos = false;
    go.on_request_token = keep_request_logits;
    go.user = &sink;
    oracle o1 = oracle_for(e, plain, 7, all_right, 1, MAX_NEW, NREQ);
    m3_proposer p1 = {7, NREQ, &o1, oracle_extend, oracle_propose};
    CHECK_OK(m3_speculate(e, &p1, NREQ, ps.p, ps.n, &go, res, &stats));
    for (int r = 0; r < NREQ; r++) {
        int want = r == 1 ? 9 : MAX_NEW;
        CHECK(res[r].n_tokens == want && got[r].n == want && res[r].tokens &&
              !memcmp(res[r].tokens, plain[r].tokens, (size_t)want * sizeof(int32_t)));
        free(res[r].tokens);
        free(got[r].logits);
    }
    m3_engine_free(e);
    go.on_request_token = NULL;

    e = make_engine(m, 64, NREQ);
    if (!e)
        return;
    oracle f = oracle_for(e, plain, 7, all_right, 1, MAX_NEW, NREQ);
    f.fail_at = 2;
    m3_proposer pf = {7, NREQ, &f, oracle_extend, oracle_propose};
    CHECK_FAILS(m3_speculate(e, &pf, NREQ, ps.p, ps.n, &go, res, &stats), M3_ERR_INTERNAL,
                "oracle failure at call 2");
    for (int r = 0; r < NREQ; r++)
        CHECK(res[r].tokens == NULL && res[r].n_tokens == 0);
    /* every sequence was given back */
    m3_seq s;
    for (int r = 0; r < NREQ; r++)
        CHECK_OK(m3_seq_create(e, &s));
    m3_engine_free(e);
}

/* Plain batched generation: each prompt's m3_generate tokens and logits,
 * with more live requests than a step's rows (max_rows 2) and without. */
static void plain_batch_case(m3_model *m, const plain_run *plain) {
    int V = plain[0].V;
    prompts ps;
    make_prompts(&ps, V);
    static const int rows[] = {64, 2};
    for (int k = 0; k < 2; k++) {
        m3_engine *e = make_engine(m, rows[k], NREQ);
        if (!e)
            return;
        plain_run got[NREQ];
        logit_sink sink;
        m3_gen_opts go = recording_opts(got, NREQ, V, MAX_NEW, &sink);
        m3_gen_result res[NREQ];
        CHECK_OK(m3_generate_batch(e, NREQ, ps.p, ps.n, &go, res));
        for (int r = 0; r < NREQ; r++) {
            CHECK(res[r].tokens && same_as_plain(&res[r], &got[r], &plain[r], MAX_NEW));
            CHECK(res[r].n_prompt == ps.n[r] && res[r].decode_seconds > 0);
            free(res[r].tokens);
            free(got[r].logits);
        }
        /* refusals: a callback without the request, more prompts than
         * sequences, a bad prompt named by its index, too few free pages */
        go.on_token = keep_logits;
        CHECK_FAILS(m3_generate_batch(e, NREQ, ps.p, ps.n, &go, res), M3_ERR_INVALID_ARG,
                    "on_request_token");
        go.on_token = NULL;
        const int32_t *more[NREQ + 1] = {ps.p[0], ps.p[1], ps.p[2], ps.p[0]};
        int more_n[NREQ + 1] = {ps.n[0], ps.n[1], ps.n[2], ps.n[0]};
        m3_gen_result more_res[NREQ + 1];
        CHECK_FAILS(m3_generate_batch(e, NREQ + 1, more, more_n, &go, more_res),
                    M3_ERR_INVALID_ARG, "max_seqs");
        int lens[NREQ] = {ps.n[0], 0, ps.n[2]};
        CHECK_FAILS(m3_generate_batch(e, NREQ, ps.p, lens, &go, res), M3_ERR_INVALID_ARG,
                    "prompt 1 of the batch");
        go.max_new_tokens = (int)(m3_engine_max_context(e) - N_PROMPT);
        CHECK_FAILS(m3_generate_batch(e, NREQ, ps.p, ps.n, &go, res), M3_ERR_OUT_OF_PAGES,
                    "pages of cache");
        m3_engine_free(e);
    }
}

/* The real drafter: the same tokens as plain greedy, alone and in a
 * batch; a batch's draft steps are each prompt's alone. */
static void drafter_case(m3_model *m, const plain_run *plain, int64_t window) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/draft_w%lld", g_tmp, (long long)window);
    m3_synth_draft_opts d = {2, 7, window, false};
    m3_synth_opts so = {9, false, 0};
    CHECK_OK(m3_synth_drafter(m3_model_config(m), dir, &d, &so));
    m3_drafter *dr = NULL;
    m3_model_opts mo = {false};
    CHECK_OK(m3_drafter_load(dir, m, &mo, &dr));
    if (!dr)
        return;
    CHECK(m3_drafter_block(dr) == 7);
    int V = plain[0].V;
    prompts ps;
    make_prompts(&ps, V);
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = MAX_NEW;
    go.stop_at_eos = false;
    /* each prompt alone */
    m3_spec_stats solo[NREQ];
    for (int r = 0; r < NREQ; r++) {
        m3_engine *e = make_engine(m, 64, 1);
        m3_gen_result res;
        solo[r] = (m3_spec_stats){.keep_steps = true, .keep_draft_logits = true};
        CHECK_OK(m3_generate_speculative(e, dr, ps.p[r], ps.n[r], &go, &res, &solo[r]));
        CHECK(res.n_tokens == MAX_NEW && res.tokens &&
              !memcmp(res.tokens, plain[r].tokens, sizeof plain[r].tokens));
        CHECK(solo[r].n_steps > 0 && solo[r].draft_logits != NULL);
        /* the cycles' time split: both parts counted, inside the decode time */
        CHECK(solo[r].draft_seconds > 0 && solo[r].verify_seconds > 0 &&
              solo[r].draft_seconds + solo[r].verify_seconds <= res.decode_seconds);
        for (int i = 1; i < solo[r].n_steps; i++) /* positions follow the accepted counts */
            CHECK(solo[r].steps[i].pos ==
                  solo[r].steps[i - 1].pos + solo[r].steps[i - 1].accepted + 1);
        free(res.tokens);
        m3_engine_free(e);
    }
    /* the batch at TP 1 (two requests a draft step, then one: max_rows 16)
     * and TP 2 (ranks as threads; the drafter whole on rank 0), and all
     * three a draft step (max_rows 64) on a backend that verifies at most
     * 8 rows a step (a request a verify step: the drafter's context taken
     * a step at a time): each request's tokens, and its draft steps
     * bitwise as alone */
    static const int tps[] = {1, 2, 1, 2}, rows_of[] = {16, 16, 64, 64}, exact[] = {0, 0, 8, 8};
    for (int k = 0; k < 4; k++) {
        if (k == 3 && window) /* TP 2 held to 8 rows: with the unwindowed drafter only */
            continue;
        m3_engine *e = make_engine_tp(m, rows_of[k], tps[k], NREQ);
        CHECK(e != NULL);
        if (!e)
            continue;
        (e->be ? e : e->ranks[0])->be->exact_rows = exact[k];
        m3_gen_result res[NREQ];
        m3_spec_stats stats = {.keep_steps = true, .keep_draft_logits = true};
        CHECK_OK(m3_generate_speculative_batch(e, dr, NREQ, ps.p, ps.n, &go, res, &stats));
        size_t row = (size_t)7 * V;
        for (int r = 0; r < NREQ; r++) {
            CHECK(res[r].n_tokens == MAX_NEW && res[r].tokens &&
                  !memcmp(res[r].tokens, plain[r].tokens, sizeof plain[r].tokens));
            int seen = 0;
            bool same = true;
            for (int i = 0; i < stats.n_steps; i++) {
                const m3_spec_step *st = &stats.steps[i];
                if (st->request != r)
                    continue;
                const m3_spec_step *alone = seen < solo[r].n_steps ? &solo[r].steps[seen] : NULL;
                same = same && alone && alone->pos == st->pos && alone->anchor == st->anchor &&
                       alone->accepted == st->accepted &&
                       !memcmp(alone->drafts, st->drafts, sizeof st->drafts) &&
                       !memcmp(solo[r].draft_logits + seen * row, stats.draft_logits + i * row,
                               row * sizeof(float));
                seen++;
            }
            if (!same || seen != solo[r].n_steps)
                fprintf(stderr, "drafter batch at TP %d: request %d's draft steps differ from "
                        "its own (%d of %d)\n", tps[k], r, seen, solo[r].n_steps);
            CHECK(same && seen == solo[r].n_steps);
            free(res[r].tokens);
        }
        CHECK(stats.batch_steps < stats.cycles); /* requests shared steps */
        CHECK(exact[k] ? stats.verify_steps > stats.batch_steps
                       : stats.verify_steps == stats.batch_steps);
        m3_spec_stats_free(&stats);
        m3_engine_free(e);
    }
    for (int r = 0; r < NREQ; r++)
        m3_spec_stats_free(&solo[r]);
    /* greedy only; the verify step must fit max_rows; a draft step takes
     * 1..max_reqs requests */
    m3_engine *e = make_engine(m, 64, 1);
    m3_gen_result res;
    go.sampler.temperature = 0.5f;
    CHECK_FAILS(m3_generate_speculative(e, dr, ps.p[0], ps.n[0], &go, &res, NULL),
                M3_ERR_UNSUPPORTED, "greedy only");
    CHECK_OK(m3_drafter_attach(dr, e));
    m3_seq seqs[M3_MAX_DRAFT_REQS + 1] = {0};
    int64_t pos[M3_MAX_DRAFT_REQS + 1] = {0};
    int32_t anchors[M3_MAX_DRAFT_REQS + 1] = {0}, drafts[(M3_MAX_DRAFT_REQS + 1) * 7];
    CHECK(dr->run.max_reqs == 1); /* max_seqs 1 */
    CHECK_FAILS(m3_drafter_propose(dr, 2, seqs, pos, anchors, drafts, NULL), M3_ERR_INVALID_ARG,
                "a draft step of 2 requests: 1 to 1");
    m3_drafter_detach(dr);
    m3_engine_free(e);
    e = make_engine(m, 4, 1);
    go.sampler.temperature = 0;
    CHECK_FAILS(m3_generate_speculative(e, dr, ps.p[0], ps.n[0], &go, &res, NULL),
                M3_ERR_INVALID_ARG, "max_rows is 4");
    m3_engine_free(e);
    m3_drafter_free(dr);
}

/* A fresh drafter of `layers` layers (seed) for m under g_tmp/name,
 * attached to a new CPU engine of 64 rows and 2 sequences; false (the
 * check failed, nothing left allocated) when any of that fails. */
static bool attached_drafter(m3_model *m, const char *name, int layers, uint64_t seed,
                             m3_drafter **dr, m3_engine **e) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, name);
    m3_synth_draft_opts dopt = {layers, 7, 0, false};
    m3_synth_opts so = {seed, false, 0};
    m3_model_opts mo = {false};
    *dr = NULL;
    CHECK_OK(m3_synth_drafter(m3_model_config(m), dir, &dopt, &so));
    CHECK_OK(m3_drafter_load(dir, m, &mo, dr));
    *e = make_engine(m, 64, 2);
    if (*dr && *e && m3_drafter_attach(*dr, *e) == M3_OK)
        return true;
    CHECK(false);
    m3_engine_free(*e);
    m3_drafter_free(*dr);
    return false;
}

/* The context takes the rows the target kept and writes nothing at the
 * others' slots (after a cut they may be another sequence's pages): the
 * drafter's cache poisoned, one 10-row step, extend with a keep mask; then
 * without one. */
static void keep_mask_case(m3_model *m) {
    m3_drafter *dr = NULL;
    m3_engine *e = NULL;
    if (!attached_drafter(m, "draft_keep", 1, 4, &dr, &e))
        return;
    const m3_config *a = &dr->cfg.attn;
    int Nkv = a->num_kv_heads, D = a->head_dim;
    size_t n = (size_t)dr->run.n_pages * M3_PAGE_TOKENS * Nkv * D;
    const uint16_t poison = 0x7fc1;
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < n; i++)
            dr->run.k_cache[0][i] = dr->run.v_cache[0][i] = poison;
        m3_seq seq;
        CHECK_OK(m3_seq_create(e, &seq));
        int32_t tokens[10] = {5, 9, 1, 33, 7, 2, 8, 40, 3, 11};
        m3_request rq = {seq, tokens, 10};
        float *logits = malloc((size_t)m3_model_config(m)->vocab_size * sizeof *logits);
        CHECK_OK(m3_engine_step(e, &rq, 1, logits, NULL));
        static const uint8_t keep[10] = {1, 0, 1, 1, 0, 0, 1, 0, 0, 1};
        CHECK_OK(m3_drafter_extend(dr, 10, pass ? NULL : keep));
        for (int t = 0; t < 10; t++) {
            int64_t slot = e->step.host.slots[t];
            size_t at = (size_t)(slot / M3_PAGE_TOKENS) * M3_PAGE_TOKENS * Nkv * D +
                        (size_t)(slot % M3_PAGE_TOKENS) * D; /* head 0 of [page, head, 128, D] */
            bool written = false;
            for (int i = 0; i < D; i++)
                written |= dr->run.k_cache[0][at + i] != poison ||
                           dr->run.v_cache[0][at + i] != poison;
            bool want = pass || keep[t];
            if (written != want)
                fprintf(stderr, "keep mask, pass %d: row %d %s\n", pass, t,
                        written ? "written, though dropped" : "not written, though kept");
            CHECK(written == want);
        }
        free(logits);
        CHECK_OK(m3_seq_free(e, seq));
    }
    m3_drafter_detach(dr);
    m3_engine_free(e);
    m3_drafter_free(dr);
}

/* The benchmark's parts of a draft step (m3_drafter_bench_part, `m3 bench
 * draft`): the whole step, and the layers, head and Markov head one after
 * the other, give m3_drafter_propose's drafts and logits bit for bit; a
 * part of too many requests or an unknown part is refused. */
static void parts_case(m3_model *m) {
    m3_drafter *dr = NULL;
    m3_engine *e = NULL;
    if (!attached_drafter(m, "draft_parts", 2, 6, &dr, &e))
        return;
    int B = dr->cfg.block, V = dr->cfg.vocab_size, G = dr->run.max_reqs;
    m3_seq seqs[2];
    int32_t tokens[12] = {5, 9, 1, 33, 7, 2, 8, 40, 3, 11, 6, 4};
    size_t nl = (size_t)2 * B * V;
    float *logits = malloc(nl * sizeof *logits);
    for (int g = 0; g < 2; g++) {
        CHECK_OK(m3_seq_create(e, &seqs[g]));
        m3_request rq = {seqs[g], tokens + g, 10};
        CHECK_OK(m3_engine_step(e, &rq, 1, logits, NULL));
        CHECK_OK(m3_drafter_extend(dr, 10, NULL));
    }
    int64_t pos[2] = {10, 10};
    int32_t anchors[2] = {17, 23}, want[2 * M3_MAX_DRAFT_BLOCK];
    CHECK_OK(m3_drafter_propose(dr, 2, seqs, pos, anchors, want, logits));
    for (int way = 0; way < 2; way++) {
        memset(dr->run.drafts, 0xff, (size_t)(B + 1) * G * sizeof *dr->run.drafts);
        memset(dr->run.logits, 0xff, nl * sizeof *logits);
        CHECK_OK(m3_drafter_bench_inputs(dr, 2, seqs, pos, anchors));
        if (way == 0)
            CHECK_OK(m3_drafter_bench_part(dr, 2, M3_DRAFT_PART_STEP));
        for (int k = M3_DRAFT_PART_LAYERS; way == 1 && k <= M3_DRAFT_PART_MARKOV; k++)
            CHECK_OK(m3_drafter_bench_part(dr, 2, (m3_draft_part)k));
        bool same = !memcmp(dr->run.logits, logits, nl * sizeof *logits);
        for (int g = 0; g < 2; g++)
            for (int j = 0; j < B; j++)
                same &= dr->run.drafts[(j + 1) * G + g] == want[g * B + j];
        if (!same)
            fprintf(stderr, "draft parts (%s) differ from propose\n", way ? "one by one" : "whole");
        CHECK(same);
    }
    CHECK_FAILS(m3_drafter_bench_part(dr, G + 1, M3_DRAFT_PART_STEP), M3_ERR_INVALID_ARG,
                "requests");
    CHECK_FAILS(m3_drafter_bench_part(dr, 1, (m3_draft_part)9), M3_ERR_INVALID_ARG, "part");
    free(logits);
    for (int g = 0; g < 2; g++)
        CHECK_OK(m3_seq_free(e, seqs[g]));
    m3_drafter_detach(dr);
    m3_engine_free(e);
    m3_drafter_free(dr);
}

/* A drafter made for another target is refused with the field named. */
static void mismatch_case(const m3_model *m, m3_model *other) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/draft_other", g_tmp);
    m3_synth_draft_opts d = {1, 3, 0, false};
    m3_synth_opts so = {1, false, 0};
    CHECK_OK(m3_synth_drafter(m3_model_config(other), dir, &d, &so));
    m3_drafter *dr = NULL;
    m3_model_opts mo = {false};
    m3_status st = m3_drafter_load(dir, m, &mo, &dr);
    CHECK(st == M3_ERR_CONFIG && dr == NULL);
    CHECK(strstr(m3_last_error(), "drafter hidden_size") ||
          strstr(m3_last_error(), "drafter vocab_size") ||
          strstr(m3_last_error(), "drafter tap layer"));
    CHECK_FAILS(m3_drafter_load(g_tmp, m, &mo, &dr), M3_ERR_IO, "config.json");
}

/* The drafter's config.json: both spellings, and the refusals. */
static void config_cases(void) {
    static const char *base =
        "\"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
        "\"num_key_value_heads\": 2, \"head_dim\": 16, \"rotary_dim\": 8, "
        "\"vocab_size\": 100";
    char text[1024];
    m3_draft_config d;
    snprintf(text, sizeof text,
             "{\"text_config\": {%s, \"dspark_target_layer_ids\": [3, 1], "
             "\"dspark_noise_token_id\": 99, \"dspark_block_size\": 7, "
             "\"dspark_markov_rank\": 4, \"dspark_markov_head_type\": \"vanilla\", "
             "\"layer_types\": [\"sliding_attention\", \"sliding_attention\"], "
             "\"sliding_window\": 64}}",
             base);
    CHECK_OK(m3_draft_config_parse(text, strlen(text), &d));
    CHECK(d.n_taps == 2 && d.taps[0] == 3 && d.taps[1] == 1 && d.mask_token == 99 &&
          d.block == 7 && d.markov_rank == 4 && d.window == 64 && d.attn.num_layers == 2 &&
          d.attn.head_dim == 16 && d.attn.rotary_dim == 8 && d.vocab_size == 100);
    snprintf(text, sizeof text,
             "{%s, \"target_layer_ids\": [0], \"mask_token_id\": 5, \"block_size\": 3, "
             "\"markov_rank\": 0, \"num_anchors\": 512}",
             base);
    CHECK_OK(m3_draft_config_parse(text, strlen(text), &d));
    CHECK(d.n_taps == 1 && d.mask_token == 5 && d.block == 3 && d.markov_rank == 0 &&
          d.window == 0);
    snprintf(text, sizeof text,
             "{%s, \"target_layer_ids\": [0], \"mask_token_id\": 5, \"block_size\": 3}", base);
    CHECK_OK(m3_draft_config_parse(text, strlen(text), &d));
    CHECK(d.markov_rank == -1); /* not given: the loader reads markov_w1's shape */
    static const struct {
        const char *extra, *message;
    } bad[] = {
        {"\"target_layer_ids\": [0], \"mask_token_id\": 5, \"block_size\": 7, "
         "\"markov_rank\": 8, \"markov_head_type\": \"gated\"",
         "markov_head_type = gated"},
        {"\"mask_token_id\": 5, \"block_size\": 7", "not a DSpark drafter"},
        {"\"target_layer_ids\": [0], \"mask_token_id\": 5, \"block_size\": 16",
         "block_size = 16 is out of range"},
        {"\"target_layer_ids\": [], \"mask_token_id\": 5, \"block_size\": 7",
         "list of 1 to 16 layer ids"},
        {"\"target_layer_ids\": [0], \"mask_token_id\": 5, \"block_size\": 7, "
         "\"layer_types\": [\"sliding_attention\", \"full_attention\"], \"sliding_window\": 9",
         "mixes sliding and full"},
        {"\"target_layer_ids\": [0], \"mask_token_id\": 5, \"block_size\": 7, "
         "\"layer_types\": [\"sliding_attention\", \"sliding_attention\"], \"sliding_window\": 4",
         "smaller than the block"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(text, sizeof text, "{%s, %s}", base, bad[i].extra);
        m3_status st = m3_draft_config_parse(text, strlen(text), &d);
        CHECK(st != M3_OK && strstr(m3_last_error(), bad[i].message));
        if (st == M3_OK || !strstr(m3_last_error(), bad[i].message))
            fprintf(stderr, "bad drafter config %zu: %s\n", i, m3_last_error());
    }
    /* the synth's render parses back to the same config */
    m3_config t;
    CHECK_OK(m3_preset("tiny", &t));
    m3_synth_draft_opts o = {3, 5, 32, false};
    char *json = NULL;
    m3_draft_config a, b;
    CHECK_OK(m3_draft_config_for(&t, &o, &a));
    CHECK_OK(m3_draft_config_to_json(&a, &json));
    CHECK_OK(m3_draft_config_parse(json, strlen(json), &b));
    CHECK(b.block == 5 && b.window == 32 && b.attn.num_layers == 3 && b.n_taps == a.n_taps &&
          !memcmp(b.taps, a.taps, sizeof a.taps) && b.ffn_dim == a.ffn_dim);
    free(json);
}

int main(void) {
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    m3_config cfg, small;
    char tdir[600], sdir[600];
    snprintf(tdir, sizeof tdir, "%s/tiny", g_tmp);
    snprintf(sdir, sizeof sdir, "%s/small", g_tmp);
    m3_synth_opts so = {7, false, 0};
    m3_model *m = NULL, *other = NULL;
    m3_model_opts mo = {false};
    CHECK_OK(m3_preset("tiny", &cfg));
    CHECK_OK(m3_synth(&cfg, tdir, &so));
    CHECK_OK(m3_model_load(tdir, &mo, &m));
    CHECK_OK(m3_preset("small", &small));
    CHECK_OK(m3_config_cut_layers(&small, 2));
    CHECK_OK(m3_synth(&small, sdir, &so));
    CHECK_OK(m3_model_load(sdir, &mo, &other));
    if (!m || !other)
        return check_summary("test_speculate");

    /* plain greedy of each prompt alone, the reference for every run below */
    plain_run plain[NREQ];
    prompts ps;
    make_prompts(&ps, cfg.vocab_size);
    for (int r = 0; r < NREQ; r++) {
        plain[r] = (plain_run){.V = cfg.vocab_size};
        plain[r].logits = malloc((size_t)MAX_NEW * plain[r].V * sizeof(float));
        m3_engine *e = make_engine(m, 64, 1);
        m3_gen_opts go = m3_gen_defaults();
        go.max_new_tokens = MAX_NEW;
        go.stop_at_eos = false;
        go.on_token = keep_logits;
        go.user = &plain[r];
        m3_gen_result res;
        CHECK_OK(m3_generate(e, ps.p[r], ps.n[r], &go, &res));
        CHECK(res.n_tokens == MAX_NEW && plain[r].n == MAX_NEW);
        memcpy(plain[r].tokens, res.tokens, sizeof plain[r].tokens);
        free(res.tokens);
        m3_engine_free(e);
    }

    /* the cases under `full` run in the release build only (the sanitizer
     * build sets M3_TEST_QUICK): each repeats a path another case takes */
    const char *q = getenv("M3_TEST_QUICK");
    bool full = !q || !*q || !strcmp(q, "0");
    config_cases();
    plain_batch_case(m, plain);
    static const int cycle_plan[] = {0, 1, 2, 3, 4, 5, 6, 7};
    static const int none[] = {0}, all[] = {7}, two[] = {2};
    oracle_case(m, plain, 1, 64, cycle_plan, 8, 7, MAX_NEW, "every count 0..7");
    if (full) {
        oracle_case(m, plain, 1, 64, none, 1, 7, MAX_NEW, "none accepted");
        oracle_case(m, plain, 1, 64, all, 1, 7, MAX_NEW, "all accepted");
    }
    oracle_case(m, plain, 1, 64, all, 1, 7, 13, "all accepted, the end inside a block");
    if (full) {
        oracle_case(m, plain, 1, 64, two, 1, 3, MAX_NEW, "block 3");
        oracle_case(m, plain, 1, 64, all, 1, 15, MAX_NEW, "block 15");
        oracle_case(m, plain, NREQ, 64, cycle_plan, 8, 7, MAX_NEW, "a batch of 3, every count");
    }
    oracle_case(m, plain, NREQ, 16, cycle_plan, 8, 7, MAX_NEW, "a batch of 3, 2 a step");
    if (full)
        oracle_case(m, plain, NREQ, 64, all, 1, 7, 13, "a batch of 3, the end inside a block");
    oracle_case(m, plain, NREQ, 8, two, 1, 3, MAX_NEW, "a batch of 3, block 3, 2 a step");
    /* a backend whose rows round alike only up to 16 (CUDA) or 8 rows a
     * step: the three requests of a cycle verified two, or one, a step */
    oracle_case_exact(m, plain, NREQ, 64, cycle_plan, 8, 7, MAX_NEW, 16,
                      "a batch of 3 a step, verified in steps of 16 rows");
    oracle_case_exact(m, plain, NREQ, 64, two, 1, 3, MAX_NEW, 8,
                      "a batch of 3 a step, block 3, verified in steps of 8 rows");
    if (full)
        oracle_case_exact(m, plain, NREQ, 64, all, 1, 7, 13, 4,
                          "a batch of 3 a step, verified a request a step (4 exact rows)");
    stop_cases(m, plain);
    if (full)
        drafter_case(m, plain, 0);
    drafter_case(m, plain, 8);
    keep_mask_case(m);
    parts_case(m);
    mismatch_case(m, other);

    for (int r = 0; r < NREQ; r++)
        free(plain[r].logits);
    m3_model_free(m);
    m3_model_free(other);
    check_remove_dir(g_tmp);
    return check_summary("test_speculate");
}
