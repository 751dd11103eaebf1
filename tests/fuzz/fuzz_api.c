/*
 * The public engine API under a program of calls the input's bytes choose,
 * on a small synthesized model: sequences created and freed (also ids
 * never made or already freed), steps with 0-4 requests of 0-11 tokens
 * (ids out of the vocabulary, a sequence twice, past the context or the
 * cache), decode steps that sample with any sampler (negative, NaN or
 * infinite temperature, top-k and top-p out of range), m3_generate and
 * m3_generate_batch, plain and speculative with a DSpark drafter (any
 * prompt lengths, token count, sampler and early stop; batches beyond the
 * free sequences or pages), and m3_sample on
 * logits with NaN and infinities. The engine is one of: stock, auto, mono
 * at TP 1 or auto at TP 2 (CPU). Properties (include/m3.h): a failing call
 * says why; on failure no sequence changes (every live sequence keeps its
 * length); a successful step lengthens each request's sequence by its
 * tokens and gives logits without NaN; a sampled token is inside the
 * vocabulary; every sequence frees at the end, and nothing faults.
 */
#include <math.h>

#include "fuzz.h"

/* 4 query heads over 2 KV heads (so TP 2 splits it), a dense layer then
 * two sparse MoE layers (what mono fuses), 128-dim index heads. */
static const char kConfig[] =
    "{\"model_type\": \"minimax_m3\", \"hidden_size\": 64, \"num_hidden_layers\": 3,"
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 32,"
    "\"rotary_dim\": 16, \"rope_theta\": 10000, \"vocab_size\": 96,"
    "\"intermediate_size\": 32, \"dense_intermediate_size\": 64,"
    "\"shared_intermediate_size\": 32, \"n_shared_experts\": 1,"
    "\"num_local_experts\": 4, \"num_experts_per_tok\": 2, \"moe_layer_freq\": [0, 1, 1],"
    "\"scoring_func\": \"sigmoid\", \"use_routing_bias\": true,"
    "\"routed_scaling_factor\": 2.0, \"hidden_act\": \"swigluoai\","
    "\"swiglu_alpha\": 1.702, \"swiglu_limit\": 7.0, \"rms_norm_eps\": 1e-06,"
    "\"use_gemma_norm\": true, \"qk_norm_type\": \"per_head\","
    "\"tie_word_embeddings\": false, \"max_position_embeddings\": 200,"
    "\"eos_token_id\": 95, \"sparse_attention_config\": {\"sparse_attention_freq\": [0, 1, 1],"
    "\"sparse_num_index_heads\": 2, \"sparse_index_dim\": 128, \"sparse_block_size\": 128,"
    "\"sparse_topk_blocks\": 1, \"sparse_init_block\": 0, \"sparse_local_block\": 1,"
    "\"sparse_score_type\": \"max\", \"sparse_disable_index_value\": [0, 1, 1]}}";
enum { kVocab = 96, kMaxSeqs = 3, kSlots = 6 };

static m3_model *g_model;
static m3_drafter *g_drafter; /* 1 layer, block 3, a 16-key window */

static void setup(void) {
    if (g_model)
        return;
    char dir[700], draft[720];
    snprintf(dir, sizeof dir, "%s/model", fuzz_dir());
    snprintf(draft, sizeof draft, "%s/draft", dir);
    m3_config cfg;
    m3_synth_opts so = {5, false, 0};
    m3_synth_draft_opts dopt = {1, 3, 16, false};
    if (m3_config_parse(kConfig, sizeof kConfig - 1, &cfg) != M3_OK ||
        m3_synth(&cfg, dir, &so) != M3_OK || m3_model_load(dir, NULL, &g_model) != M3_OK ||
        m3_synth_drafter(&cfg, draft, &dopt, &so) != M3_OK ||
        m3_drafter_load(draft, g_model, NULL, &g_drafter) != M3_OK) {
        fprintf(stderr, "fuzz_api setup: %s\n", m3_last_error());
        exit(2);
    }
}

static const int32_t kTokenIds[] = {0, 1, 7, 42, kVocab - 1, kVocab, -1, 1 << 30};
static const float kTemps[] = {0, 0.8f, 1, -1, NAN, INFINITY, 1e-30f};
static const float kTopP[] = {1, 0.9f, 0.5f, 0, 1.5f, NAN, -0.0f};
static const int kTopK[] = {0, 1, 5, -3, 1000};
static const float kLogits[] = {0, 1, -1, 30, -30, NAN, INFINITY, -INFINITY};
#define COUNT(a) (int)(sizeof(a) / sizeof((a)[0]))

typedef struct {
    m3_engine *eng;
    m3_seq ids[kSlots];
    bool live[kSlots];
    int64_t len[kSlots];
} state;

/* Every live sequence has the length the calls so far gave it. */
static void check_lengths(const state *st, const char *after) {
    for (int i = 0; i < kSlots; i++)
        if (st->live[i] && m3_seq_len(st->eng, st->ids[i]) != st->len[i])
            fuzz_fail("after %s: sequence %d has %lld tokens, expected %lld", after, st->ids[i],
                      (long long)m3_seq_len(st->eng, st->ids[i]), (long long)st->len[i]);
}

/* The slot whose live sequence is id (ids are reused once freed), or -1. */
static int live_slot(const state *st, m3_seq id) {
    for (int i = 0; i < kSlots; i++)
        if (st->live[i] && st->ids[i] == id)
            return i;
    return -1;
}

/* A sequence id for a request: mostly a slot's (live, or freed), sometimes
 * one never made. Sets *slot to the live slot holding it (-1: none). */
static m3_seq pick_seq(fuzz_bytes *s, const state *st, int *slot) {
    unsigned b = fuzz_take(s);
    m3_seq id = b % 8 == 7 ? (m3_seq)(b % 3 == 0 ? -1 : 17 + (int)(b % 5))
                           : st->ids[b % kSlots];
    *slot = live_slot(st, id);
    return id;
}

static void op_step(fuzz_bytes *s, state *st, bool decode) {
    int n_reqs = (int)(fuzz_take(s) % 5);
    m3_request reqs[4];
    int slots[4];
    int32_t toks[4][12];
    for (int r = 0; r < n_reqs; r++) {
        reqs[r].seq = pick_seq(s, st, &slots[r]);
        reqs[r].n_tokens = decode ? 1 : (int)(fuzz_take(s) % 12);
        for (int t = 0; t < 12; t++) {
            unsigned b = fuzz_take(s);
            toks[r][t] = b < 224 ? (int32_t)(b % kVocab) : kTokenIds[b % COUNT(kTokenIds)];
        }
        reqs[r].tokens = toks[r];
    }
    float *logits = malloc((size_t)(n_reqs ? n_reqs : 1) * kVocab * sizeof *logits);
    if (!logits)
        exit(2);
    m3_status rc;
    int32_t sampled[4] = {-7, -7, -7, -7};
    if (decode) {
        m3_sampler smp = {kTemps[fuzz_take(s) % COUNT(kTemps)], kTopK[fuzz_take(s) % COUNT(kTopK)],
                          kTopP[fuzz_take(s) % COUNT(kTopP)], fuzz_take(s)};
        m3_rng rng;
        m3_rng_seed(&rng, 3);
        rc = m3_engine_decode(st->eng, reqs, n_reqs, &smp, &rng, 0, sampled, logits);
        fuzz_check_refusal(rc, "m3_engine_decode");
    } else {
        rc = m3_engine_step(st->eng, reqs, n_reqs, logits, NULL);
        fuzz_check_refusal(rc, "m3_engine_step");
    }
    if (rc == M3_OK) {
        for (int r = 0; r < n_reqs; r++) {
            if (slots[r] < 0)
                fuzz_fail("a step with sequence %d (not live) succeeded", reqs[r].seq);
            st->len[slots[r]] += reqs[r].n_tokens;
            if (decode && (sampled[r] < 0 || sampled[r] >= kVocab))
                fuzz_fail("decode sampled token %d", sampled[r]);
        }
        for (int i = 0; i < n_reqs * kVocab; i++)
            if (isnan(logits[i]))
                fuzz_fail("a successful step gave a NaN logit (request %d)", i / kVocab);
    }
    free(logits);
    check_lengths(st, decode ? "m3_engine_decode" : "m3_engine_step");
}

static void op_sample(fuzz_bytes *s) {
    float logits[8];
    int vocab = 1 + (int)(fuzz_take(s) % 8);
    for (int i = 0; i < vocab; i++)
        logits[i] = kLogits[fuzz_take(s) % COUNT(kLogits)];
    m3_sampler smp = {kTemps[fuzz_take(s) % COUNT(kTemps)], kTopK[fuzz_take(s) % COUNT(kTopK)],
                      kTopP[fuzz_take(s) % COUNT(kTopP)], fuzz_take(s)};
    m3_rng rng;
    m3_rng_seed(&rng, fuzz_take(s));
    int32_t tok = -7;
    m3_status rc = m3_sample(&smp, &rng, logits, vocab, &tok);
    fuzz_check_refusal(rc, "m3_sample");
    if (rc == M3_OK && (tok < 0 || tok >= vocab || isnan(logits[tok])))
        fuzz_fail("m3_sample chose %d of %d logits", tok, vocab);
}

/* m3_generate on a prompt of 0-24 tokens (sometimes past the context),
 * 0-5 new tokens (or -1), any sampler, stopping at EOS or not, and a
 * callback that may stop early; or m3_generate_batch on 0-4 such prompts
 * (more than the free sequences or pages at times) with a callback that
 * may stop one request. It works in sequences of its own and frees them:
 * the live sequences keep their lengths either way. */
static int stop_after(void *user, int32_t token, const float *logits, int vocab) {
    int *left = user;
    (void)token, (void)logits, (void)vocab;
    return --*left <= 0;
}

static int stop_request_after(void *user, int request, int32_t token, const float *logits,
                              int vocab) {
    int *left = user;
    (void)token, (void)logits, (void)vocab;
    return request == 0 && --*left <= 0;
}

static void check_result(const m3_gen_result *res, int max_new, const char *what) {
    if (res->n_tokens < 0 || res->n_tokens > max_new)
        fuzz_fail("%s made %d tokens of %d", what, res->n_tokens, max_new);
    for (int i = 0; i < res->n_tokens; i++)
        if (res->tokens[i] < 0 || res->tokens[i] >= kVocab)
            fuzz_fail("%s made token %d", what, res->tokens[i]);
}

static void op_generate(fuzz_bytes *s, state *st) {
    enum { kBatch = 4 };
    static int32_t prompt[kBatch][300];
    const int32_t *prompts[kBatch];
    int n_prompt[kBatch];
    int n = (int)(fuzz_take(s) % (kBatch + 1)); /* 0: m3_generate */
    for (int r = 0; r < (n ? n : 1); r++) {
        unsigned b = fuzz_take(s);
        n_prompt[r] = b >= 250 ? 300 : (int)(b % 25);
        for (int i = 0; i < n_prompt[r]; i++)
            prompt[r][i] = (int32_t)(fuzz_take(s) % kVocab);
        prompts[r] = prompt[r];
    }
    m3_gen_opts o = m3_gen_defaults();
    o.max_new_tokens = (int)(fuzz_take(s) % 7) - 1;
    o.sampler = (m3_sampler){kTemps[fuzz_take(s) % COUNT(kTemps)],
                             kTopK[fuzz_take(s) % COUNT(kTopK)],
                             kTopP[fuzz_take(s) % COUNT(kTopP)], fuzz_take(s)};
    o.stop_at_eos = fuzz_take(s) % 2;
    int left = (int)(fuzz_take(s) % 4);
    if (left) {
        o.on_token = n ? NULL : stop_after;
        o.on_request_token = n ? stop_request_after : NULL;
        o.user = &left;
    }
    m3_gen_result res[kBatch];
    /* speculative at times (greedy only: other samplers are refused) */
    bool spec = fuzz_take(s) % 3 == 0;
    const char *what = spec ? (n ? "m3_generate_speculative_batch" : "m3_generate_speculative")
                            : (n ? "m3_generate_batch" : "m3_generate");
    m3_spec_stats stats = {.keep_steps = fuzz_take(s) % 2 == 0};
    m3_status rc =
        spec ? (n ? m3_generate_speculative_batch(st->eng, g_drafter, n, prompts, n_prompt, &o,
                                                  res, &stats)
                  : m3_generate_speculative(st->eng, g_drafter, prompts[0], n_prompt[0], &o,
                                            &res[0], &stats))
             : (n ? m3_generate_batch(st->eng, n, prompts, n_prompt, &o, res)
                  : m3_generate(st->eng, prompts[0], n_prompt[0], &o, &res[0]));
    if (rc != M3_OK && (stats.steps || stats.n_steps))
        fuzz_fail("a failed %s left %d draft steps", what, stats.n_steps);
    for (int i = 0; i < stats.n_steps; i++)
        if (stats.steps[i].request < 0 || stats.steps[i].request >= (n ? n : 1) ||
            stats.steps[i].accepted > stats.steps[i].verified)
            fuzz_fail("%s: draft step %d of request %d accepted %d of %d", what, i,
                      stats.steps[i].request, stats.steps[i].accepted, stats.steps[i].verified);
    m3_spec_stats_free(&stats);
    fuzz_check_refusal(rc, what);
    for (int r = 0; r < (n ? n : 1); r++) {
        if (rc == M3_OK)
            check_result(&res[r], o.max_new_tokens, what);
        else if (res[r].tokens || res[r].n_tokens)
            fuzz_fail("a failed %s left %d tokens", what, res[r].n_tokens);
        free(res[r].tokens);
    }
    check_lengths(st, what);
}

static m3_engine *make_engine(unsigned kind) {
    m3_engine_opts eo = m3_engine_defaults();
    eo.threads = 2;
    eo.max_rows = 8;
    eo.max_seqs = kMaxSeqs;
    eo.max_tokens = 2 * 128 + 64; /* the cache fills before three sequences reach the limit */
    const m3_decode_path paths[] = {M3_DECODE_STOCK, M3_DECODE_AUTO, M3_DECODE_MONO,
                                    M3_DECODE_AUTO};
    eo.decode = paths[kind % 4];
    eo.tp = kind % 4 == 3 ? 2 : 1;
    m3_engine *eng = NULL;
    m3_status rc = m3_engine_create(g_model, &eo, &eng);
    if (rc != M3_OK)
        fuzz_fail("engine kind %u refused: %s", kind % 4, m3_last_error());
    return eng;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    fuzz_bytes s = {data, size};
    state st = {0};
    st.eng = make_engine(fuzz_take(&s));
    for (int i = 0; i < kSlots; i++)
        st.ids[i] = -1;
    for (int op = 0; op < 64 && s.n; op++) {
        unsigned b = fuzz_take(&s);
        switch (b % 6) {
        case 0: { /* a new sequence in a free slot */
            int i = (int)(fuzz_take(&s) % kSlots);
            if (st.live[i])
                break;
            m3_seq id;
            m3_status rc = m3_seq_create(st.eng, &id);
            fuzz_check_refusal(rc, "m3_seq_create");
            if (rc == M3_OK) {
                st.ids[i] = id;
                st.live[i] = true;
                st.len[i] = 0;
            }
            check_lengths(&st, "m3_seq_create");
            break;
        }
        case 1: { /* free a slot's sequence, live or not */
            int i = (int)(fuzz_take(&s) % kSlots), holder = live_slot(&st, st.ids[i]);
            m3_status rc = m3_seq_free(st.eng, st.ids[i]);
            fuzz_check_refusal(rc, "m3_seq_free");
            if (rc == M3_OK && holder < 0)
                fuzz_fail("freeing sequence %d (not live) succeeded", st.ids[i]);
            if (rc != M3_OK && holder >= 0)
                fuzz_fail("freeing live sequence %d failed: %s", st.ids[i], m3_last_error());
            if (holder >= 0)
                st.live[holder] = false;
            check_lengths(&st, "m3_seq_free");
            break;
        }
        case 2:
            op_step(&s, &st, false);
            break;
        case 3:
            op_step(&s, &st, true);
            break;
        case 4:
            op_generate(&s, &st);
            break;
        default:
            op_sample(&s);
        }
    }
    for (int i = 0; i < kSlots; i++)
        if (st.live[i] && m3_seq_free(st.eng, st.ids[i]) != M3_OK)
            fuzz_fail("freeing live sequence %d at the end: %s", st.ids[i], m3_last_error());
    m3_engine_free(st.eng);
    return 0;
}
