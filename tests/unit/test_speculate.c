/*
 * Speculative decoding's verify loop (spec/speculate.c) and the DSpark
 * drafter's plumbing, on the tiny preset on the CPU.
 *
 * A random drafter almost never agrees with a random target, so the loop's
 * acceptance rule is driven here by an oracle proposer that knows plain
 * greedy decoding's tokens and makes a planned number of them right in
 * each step (0..B, cycling), then one wrong. Checked, against plain
 * m3_generate on a fresh engine: the same tokens and bitwise the same
 * logits for every token; the accepted counts the plan implies; the
 * context the proposer was given (rows kept, positions contiguous); the
 * end at max_new_tokens inside a block and at an end-of-sequence token
 * inside an accepted run; a proposer failure ending the run with its
 * message. Then the real drafter (m3 synth --draft-for's weights): the same
 * tokens as plain greedy, with and without a key window, at TP 1 and
 * TP 2 (bitwise the same draft logits), and its refusals (temperature, a
 * too-small max_rows, a mismatched target).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/status.h"
#include "spec/speculate.h"

#define N_PROMPT 200
#define MAX_NEW 40

static char g_tmp[] = "/tmp/m3_test_speculate_XXXXXX";

typedef struct plain_run {
    int32_t tokens[MAX_NEW];
    float *logits; /* [MAX_NEW, V] */
    int n, V;
} plain_run;

static int keep_logits(void *user, int32_t token, const float *logits, int vocab) {
    plain_run *p = user;
    (void)token;
    memcpy(p->logits + (size_t)p->n++ * vocab, logits, (size_t)vocab * sizeof *logits);
    return 0;
}

static m3_engine *make_engine_tp(m3_model *m, int max_rows, int tp) {
    m3_engine_opts o = m3_engine_defaults();
    o.threads = 2;
    o.tp = tp;
    o.tp_timeout_ms = 20000;
    o.max_rows = max_rows;
    o.max_seqs = 1;
    o.max_tokens = N_PROMPT + MAX_NEW + 16;
    m3_engine *e = NULL;
    if (m3_engine_create(m, &o, &e))
        fprintf(stderr, "engine: %s\n", m3_last_error());
    return e;
}

static m3_engine *make_engine(m3_model *m, int max_rows) { return make_engine_tp(m, max_rows, 1); }

/* The oracle: drafts for anchor position p are the plain run's tokens for
 * p + 1.. (token k of the run is at position N_PROMPT + k), the first
 * plan[step % n_plan] of them right and the next one wrong. */
typedef struct oracle {
    const plain_run *plain;
    int block;
    int step;
    const int *plan;
    int n_plan;
    int64_t expect_accepted;
    int64_t ctx_rows;  /* rows handed to extend */
    int fail_at;       /* propose fails at this step (-1: never) */
    int max_new;       /* the run's max_new_tokens */
} oracle;

static m3_status oracle_extend(void *self, int rows) {
    oracle *o = self;
    o->ctx_rows += rows;
    return M3_OK;
}

static m3_status oracle_propose(void *self, m3_seq seq, int64_t p, int32_t anchor,
                                int32_t *drafts, float *logits) {
    oracle *o = self;
    (void)seq;
    (void)logits;
    if (o->step == o->fail_at)
        return m3_fail(M3_ERR_INTERNAL, "oracle failure at step %d", o->step);
    int right = o->plan[o->step++ % o->n_plan];
    int64_t k0 = p - N_PROMPT; /* anchor = plain token k0 */
    CHECK(k0 >= 0 && k0 < o->plain->n && o->plain->tokens[k0] == anchor);
    CHECK(o->ctx_rows == p); /* the context holds every position below the anchor */
    for (int j = 0; j < o->block; j++) {
        int64_t k = k0 + 1 + j;
        int32_t t = k < o->plain->n ? o->plain->tokens[k] : 0;
        drafts[j] = j < right ? t : (t + 1) % o->plain->V;
    }
    /* drafts the loop verifies: tokens 0..k0 are out, one is left for the target */
    int verified = o->max_new - (int)k0 - 2;
    if (verified > o->block)
        verified = o->block;
    o->expect_accepted += right < verified ? right : verified;
    return M3_OK;
}

static void oracle_case(m3_model *m, const plain_run *plain, const int *plan, int n_plan,
                        int block, int max_new, const char *what) {
    m3_engine *e = make_engine(m, 64);
    if (!e)
        return;
    oracle o = {plain, block, 0, plan, n_plan, 0, 0, -1, max_new};
    m3_proposer pr = {block, &o, oracle_extend, oracle_propose};
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % plain->V);
    plain_run got = {.logits = malloc((size_t)MAX_NEW * plain->V * sizeof(float)), .V = plain->V};
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = max_new;
    go.stop_at_eos = false;
    go.on_token = keep_logits;
    go.user = &got;
    m3_gen_result res;
    m3_spec_stats stats = {.keep_steps = true};
    CHECK_OK(m3_speculate(e, &pr, prompt, N_PROMPT, &go, &res, &stats));
    CHECK(res.n_tokens == max_new);
    bool same = res.n_tokens == max_new && got.n == max_new;
    for (int i = 0; same && i < max_new; i++)
        same = res.tokens[i] == plain->tokens[i] &&
               !memcmp(got.logits + (size_t)i * plain->V, plain->logits + (size_t)i * plain->V,
                       (size_t)plain->V * sizeof(float));
    if (!same)
        fprintf(stderr, "%s: tokens or logits differ from plain greedy\n", what);
    CHECK(same);
    CHECK(stats.accepted == o.expect_accepted);
    CHECK(stats.n_steps == stats.cycles && stats.cycles == o.step);
    /* the first token, accepted + 1 a draft step, and at most one plain
     * step at the end (one token left: nothing to draft) */
    CHECK(stats.accepted + stats.cycles + 1 <= max_new &&
          stats.accepted + stats.cycles + 2 >= max_new);
    printf("%s: %lld steps, %lld accepted of %lld\n", what, (long long)stats.cycles,
           (long long)stats.accepted, (long long)stats.drafted);
    /* without on_token (on a backend that chooses tokens, the verify
     * step's come from m3_engine_step_greedy; here the CPU's, from the
     * logits on the host): the same run */
    m3_engine *e2 = make_engine(m, 64);
    oracle o2 = {plain, block, 0, plan, n_plan, 0, 0, -1, max_new};
    m3_proposer pr2 = {block, &o2, oracle_extend, oracle_propose};
    go.on_token = NULL;
    m3_gen_result res2 = {0};
    m3_spec_stats stats2 = {.keep_steps = true};
    if (e2) {
        CHECK_OK(m3_speculate(e2, &pr2, prompt, N_PROMPT, &go, &res2, &stats2));
        CHECK(res2.n_tokens == max_new && res2.tokens &&
              !memcmp(res2.tokens, plain->tokens, (size_t)max_new * sizeof *res2.tokens));
        CHECK(stats2.accepted == o2.expect_accepted && stats2.cycles == stats.cycles);
    }
    m3_spec_stats_free(&stats2);
    free(res2.tokens);
    m3_engine_free(e2);
    m3_spec_stats_free(&stats);
    free(res.tokens);
    free(got.logits);
    m3_engine_free(e);
}

/* An end-of-sequence token inside an accepted run ends generation there;
 * a proposer's failure ends the run with its message. */
static void stop_cases(m3_model *m, const plain_run *plain) {
    m3_engine *e = make_engine(m, 64);
    if (!e)
        return;
    static const int all_right[] = {7};
    oracle o = {plain, 7, 0, all_right, 1, 0, 0, -1, MAX_NEW};
    m3_proposer pr = {7, &o, oracle_extend, oracle_propose};
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % plain->V);
    /* make plain token 5 the end-of-sequence token */
    m3_config *cfg = &e->cfg;
    int saved_n = cfg->num_eos;
    int32_t saved = cfg->eos_ids[0];
    cfg->num_eos = 1;
    cfg->eos_ids[0] = plain->tokens[5];
    int first = 0;
    while (plain->tokens[first] != plain->tokens[5])
        first++;
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = MAX_NEW;
    m3_gen_result res;
    m3_spec_stats stats = {0};
    CHECK_OK(m3_speculate(e, &pr, prompt, N_PROMPT, &go, &res, &stats));
    CHECK(res.stopped_at_eos && res.n_tokens == first + 1);
    free(res.tokens);
    cfg->num_eos = saved_n;
    cfg->eos_ids[0] = saved;
    m3_engine_free(e);

    e = make_engine(m, 64);
    if (!e)
        return;
    oracle f = {plain, 7, 0, all_right, 1, 0, 0, 2, MAX_NEW};
    m3_proposer pf = {7, &f, oracle_extend, oracle_propose};
    go.stop_at_eos = false;
    CHECK_FAILS(m3_speculate(e, &pf, prompt, N_PROMPT, &go, &res, &stats), M3_ERR_INTERNAL,
                "oracle failure at step 2");
    CHECK(res.tokens == NULL && res.n_tokens == 0);
    m3_engine_free(e);
}

/* The real drafter: the same tokens as plain greedy. */
static void drafter_case(m3_model *m, const char *target_dir, const plain_run *plain,
                         int64_t window) {
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
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % plain->V);
    m3_engine *e = make_engine(m, 64);
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = MAX_NEW;
    go.stop_at_eos = false;
    m3_gen_result res;
    m3_spec_stats stats = {.keep_steps = true, .keep_draft_logits = true};
    CHECK_OK(m3_generate_speculative(e, dr, prompt, N_PROMPT, &go, &res, &stats));
    CHECK(res.n_tokens == MAX_NEW && !memcmp(res.tokens, plain->tokens, sizeof plain->tokens));
    CHECK(stats.n_steps > 0 && stats.draft_logits != NULL);
    /* the cycles' time split: both parts counted, inside the decode time */
    CHECK(stats.draft_seconds > 0 && stats.verify_seconds > 0 &&
          stats.draft_seconds + stats.verify_seconds <= res.decode_seconds);
    for (int i = 0; i < stats.n_steps; i++) /* positions follow the accepted counts */
        CHECK(i == 0 || stats.steps[i].pos == stats.steps[i - 1].pos + stats.steps[i - 1].accepted + 1);
    /* at TP 2 (ranks as threads; the drafter whole on rank 0): the same
     * tokens and bitwise the same draft logits */
    m3_engine *e2 = make_engine_tp(m, 64, 2);
    m3_gen_result res2 = {0};
    m3_spec_stats stats2 = {.keep_steps = true, .keep_draft_logits = true};
    CHECK_OK(m3_generate_speculative(e2, dr, prompt, N_PROMPT, &go, &res2, &stats2));
    CHECK(res2.n_tokens == MAX_NEW && res2.tokens &&
          !memcmp(res2.tokens, plain->tokens, sizeof plain->tokens));
    CHECK(stats2.n_steps == stats.n_steps && stats2.draft_logits &&
          !memcmp(stats2.draft_logits, stats.draft_logits,
                  (size_t)stats.n_steps * 7 * plain->V * sizeof(float)));
    m3_spec_stats_free(&stats2);
    free(res2.tokens);
    m3_engine_free(e2);
    m3_spec_stats_free(&stats);
    free(res.tokens);
    /* greedy only; the verify step must fit max_rows */
    go.sampler.temperature = 0.5f;
    CHECK_FAILS(m3_generate_speculative(e, dr, prompt, N_PROMPT, &go, &res, NULL),
                M3_ERR_UNSUPPORTED, "greedy only");
    m3_engine_free(e);
    e = make_engine(m, 4);
    go.sampler.temperature = 0;
    CHECK_FAILS(m3_generate_speculative(e, dr, prompt, N_PROMPT, &go, &res, NULL),
                M3_ERR_INVALID_ARG, "max_rows is 4");
    m3_engine_free(e);
    m3_drafter_free(dr);
    (void)target_dir;
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

    /* plain greedy, the reference for every run below */
    plain_run plain = {.V = cfg.vocab_size};
    plain.logits = malloc((size_t)MAX_NEW * plain.V * sizeof(float));
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % plain.V);
    m3_engine *e = make_engine(m, 64);
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = MAX_NEW;
    go.stop_at_eos = false;
    go.on_token = keep_logits;
    go.user = &plain;
    m3_gen_result res;
    CHECK_OK(m3_generate(e, prompt, N_PROMPT, &go, &res));
    CHECK(res.n_tokens == MAX_NEW);
    memcpy(plain.tokens, res.tokens, sizeof plain.tokens);
    free(res.tokens);
    m3_engine_free(e);

    config_cases();
    static const int cycle_plan[] = {0, 1, 2, 3, 4, 5, 6, 7};
    static const int none[] = {0}, all[] = {7}, two[] = {2};
    oracle_case(m, &plain, cycle_plan, 8, 7, MAX_NEW, "every count 0..7");
    oracle_case(m, &plain, none, 1, 7, MAX_NEW, "none accepted");
    oracle_case(m, &plain, all, 1, 7, MAX_NEW, "all accepted");
    oracle_case(m, &plain, all, 1, 7, 13, "all accepted, the end inside a block");
    oracle_case(m, &plain, two, 1, 3, MAX_NEW, "block 3");
    oracle_case(m, &plain, all, 1, 15, MAX_NEW, "block 15");
    stop_cases(m, &plain);
    drafter_case(m, tdir, &plain, 0);
    drafter_case(m, tdir, &plain, 8);
    mismatch_case(m, other);

    free(plain.logits);
    m3_model_free(m);
    m3_model_free(other);
    check_remove_dir(g_tmp);
    return check_summary("test_speculate");
}
