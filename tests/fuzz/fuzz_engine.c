/*
 * The engine over the configs SPEC §2.1 allows (and some it does not): the
 * input's bytes choose a small config (layers, heads, GQA groups, head and
 * rotary dims, widths, experts and top-k, each layer's attention and FFN
 * kind, forced blocks, the shared expert, routing bias, tied embeddings,
 * MXFP8), mostly inside the space, sometimes at or past its edges. The
 * config is parsed, synthesized, loaded, and a prompt long enough for the
 * indexer's selection to matter is run, then 1-5 sequences decode together
 * (the mono path's row limit sometimes below that, so mono and stock steps
 * interleave), by stock at TP 1 (the reference) and three engines of
 * these, chosen by the input: stock at TP 1 again in chunks of 5 prompt
 * rows on one thread, mono and auto at TP 1, stock, mono and auto at TP 2
 * (ranks as threads), stock and mono at TP 2 with indexer context
 * parallelism.
 * Properties: every refusal (config, synth, load, engine) has a message;
 * auto accepts every model stock accepts at its TP size;
 * nothing faults; every engine that accepts the model gives the
 * reference's logits bit for bit on every row (the CPU paths share their
 * sums' order and rounding points: docs/ARCHITECTURE.md), and those
 * logits are never NaN.
 */
#include <math.h>

#include "fuzz.h"

/* One of n choices: the first ones are the space's common values, the
 * last ones its edges, so most inputs run and some probe the checks. */
#define PICK(s, ...)                                                                 \
    ((const int[]){__VA_ARGS__}[fuzz_take(s) % (sizeof((const int[]){__VA_ARGS__}) /      \
                                           sizeof(int))])

typedef struct {
    char json[4096];
    bool mxfp8;
    uint64_t seed;
    int n_prompt, chunk, n_decode;
    int n_seqs;        /* sequences decoding together: the prompt's and n_seqs - 1 short ones */
    int mono_max_rows; /* 0: the default; 1-3: wider decode steps run stock between mono ones */
} fuzz_case;

static void flags(char *out, size_t cap, const int *f, int n) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%d", i ? ", " : "", f[i]);
    if (k < cap)
        snprintf(out + k, cap - k, "]");
}

static void draw(fuzz_bytes *s, fuzz_case *fc) {
    int layers = PICK(s, 1, 2, 3, 4, 2, 3, 0, 5);
    int kv = PICK(s, 2, 1, 2, 4, 3, 0);
    int group = PICK(s, 1, 2, 2, 4, 3, 1);
    int head_dim = PICK(s, 32, 64, 32, 64, 16, 128, 24, 0);
    int rotary = PICK(s, 16, 32, 8, 0, 64, 12, 7);
    int hidden = PICK(s, 64, 96, 128, 64, 32, 160, 48, 8, 0);
    int vocab = PICK(s, 64, 200, 130, 300, 16, 1, 0);
    int expert = PICK(s, 32, 64, 48, 16, 8, 0);
    int dense = PICK(s, 64, 96, 128, 32, 0);
    int shared = PICK(s, 0, 32, 64, 0, 16);
    int experts = PICK(s, 4, 8, 2, 5, 1, 9, 0);
    int topk = PICK(s, 1, 2, 3, 4, 2, 9, 0);
    int index_dim = PICK(s, 32, 64, 128, 128, 16, 8, 0);
    int index_heads = kv + PICK(s, 0, 0, 0, 0, 0, 0, 1, -1);
    int block = PICK(s, 128, 128, 128, 128, 128, 128, 64, 0);
    int topk_blocks = PICK(s, 1, 2, 3, 4, 2, 0, 64);
    int init = PICK(s, 0, 1, 0, 2, 3);
    int local = PICK(s, 1, 0, 1, 2, 3);
    int bias = PICK(s, 1, 0);
    int tie = PICK(s, 0, 1);
    int nested = PICK(s, 0, 1);
    int theta = PICK(s, 10000, 5000000, 100, 1, 0);
    int maxpos = PICK(s, 4096, 1024, 300, 1048576, 0);
    int moe[8] = {0}, sparse[8] = {0};
    int n_flags = layers > 0 && layers <= 8 ? layers : 1;
    unsigned mask_moe = fuzz_take(s), mask_sparse = fuzz_take(s);
    /* most often a run of sparse MoE layers to the end, as in M3 (what
     * the mono path fuses); else any mix */
    unsigned run_from = fuzz_take(s);
    for (int i = 0; i < n_flags; i++) {
        moe[i] = (mask_moe >> i) & 1;
        sparse[i] = (mask_sparse >> i) & 1;
        if (run_from < 192 && i >= (int)(run_from % (unsigned)n_flags))
            moe[i] = sparse[i] = 1;
    }
    fc->mxfp8 = (fuzz_take(s) % 6) == 0;
    fc->seed = fuzz_take(s);
    fc->n_prompt = PICK(s, 140, 3, 40, 257, 20, 130);
    fc->chunk = PICK(s, 64, 37, 256, 7);
    fc->n_decode = PICK(s, 2, 3, 1);
    fc->n_seqs = PICK(s, 2, 1, 3, 5, 2, 4);
    fc->mono_max_rows = PICK(s, 0, 0, 1, 2, 3);

    char fm[64], fs[64];
    flags(fm, sizeof fm, moe, n_flags);
    flags(fs, sizeof fs, sparse, n_flags);
    char text[3500];
    snprintf(text, sizeof text,
             "\"model_type\": \"minimax_m3\", \"hidden_size\": %d, \"num_hidden_layers\": %d,"
             "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d,"
             "\"rotary_dim\": %d, \"rope_theta\": %d, \"vocab_size\": %d,"
             "\"intermediate_size\": %d, \"dense_intermediate_size\": %d,"
             "\"shared_intermediate_size\": %d, \"n_shared_experts\": %d,"
             "\"num_local_experts\": %d, \"num_experts_per_tok\": %d, \"moe_layer_freq\": %s,"
             "\"scoring_func\": \"sigmoid\", \"use_routing_bias\": %s,"
             "\"routed_scaling_factor\": 2.0, \"hidden_act\": \"swigluoai\","
             "\"swiglu_alpha\": 1.702, \"swiglu_limit\": 7.0, \"rms_norm_eps\": 1e-06,"
             "\"use_gemma_norm\": true, \"qk_norm_type\": \"per_head\","
             "\"tie_word_embeddings\": %s, \"max_position_embeddings\": %d,"
             "\"eos_token_id\": %d, \"sparse_attention_config\": {"
             "\"sparse_attention_freq\": %s, \"sparse_disable_index_value\": %s,"
             "\"sparse_num_index_heads\": %d, \"sparse_index_dim\": %d,"
             "\"sparse_block_size\": %d, \"sparse_topk_blocks\": %d,"
             "\"sparse_init_block\": %d, \"sparse_local_block\": %d,"
             "\"sparse_score_type\": \"max\"}",
             hidden, layers, kv * group, kv, head_dim, rotary, theta, vocab, expert, dense,
             shared, shared ? 1 : 0, experts, topk, fm, bias ? "true" : "false",
             tie ? "true" : "false", maxpos, vocab > 0 ? vocab - 1 : 0, fs, fs, index_heads,
             index_dim, block, topk_blocks, init, local);
    if (nested)
        snprintf(fc->json, sizeof fc->json,
                 "{\"model_type\": \"minimax_m3_vl\", \"text_config\": {%s}}", text);
    else
        snprintf(fc->json, sizeof fc->json, "{%s}", text);
}

/* Logits of every row the engine computes: the prompt's prefill (chunked),
 * the other sequences' 3-token prompts in one step, then n_decode steps of
 * every sequence decoding together; out receives rows x vocab floats.
 * Returns false when the engine refuses the model (with a message). */
typedef struct {
    m3_decode_path decode;
    int tp;
    bool indexer_cp;
    const char *name;
    int accepts_as; /* must accept where kinds[accepts_as] did (auto: where stock did); -1 */
    int chunk;      /* the prefill chunk, when not the case's (0) */
    int threads;    /* CPU threads (0: 2) */
} engine_kind;

static bool run_engine(m3_model *model, const fuzz_case *fc, const engine_kind *k, float *out,
                       size_t *rows_out) {
    const m3_config *c = m3_model_config(model);
    m3_engine_opts eo = m3_engine_defaults();
    const int chunk = k->chunk ? k->chunk : fc->chunk;
    eo.threads = k->threads ? k->threads : 2;
    eo.max_tokens = 1024;
    eo.max_rows = chunk;
    eo.max_seqs = fc->n_seqs;
    eo.mono_max_rows = fc->mono_max_rows;
    eo.tp = k->tp;
    eo.decode = k->decode;
    eo.indexer_cp = k->indexer_cp;
    eo.tp_timeout_ms = 20000;
    m3_engine *eng = NULL;
    m3_status st = m3_engine_create(model, &eo, &eng);
    fuzz_check_refusal(st, k->name);
    if (st != M3_OK)
        return false;
    int V = c->vocab_size;
    int32_t tokens[512];
    for (int i = 0; i < fc->n_prompt; i++)
        tokens[i] = (int32_t)((i * 7 + 3) % V);
    m3_seq seqs[5];
    for (int i = 0; i < fc->n_seqs; i++)
        if (m3_seq_create(eng, &seqs[i]) != M3_OK)
            fuzz_fail("%s: m3_seq_create: %s", k->name, m3_last_error());
    size_t rows = 0;
    for (int at = 0; at < fc->n_prompt; at += chunk) {
        int n = fc->n_prompt - at < chunk ? fc->n_prompt - at : chunk;
        m3_request rq = {seqs[0], tokens + at, n};
        st = m3_engine_step(eng, &rq, 1, NULL, out + rows * (size_t)V);
        if (st != M3_OK)
            fuzz_fail("%s: prefill at %d: %s", k->name, at, m3_last_error());
        rows += (size_t)n;
    }
    const int32_t short_prompts[4][3] = {
        {1 % V, 2 % V, 3 % V}, {4 % V, 5 % V, 6 % V}, {7 % V, 8 % V, 9 % V}, {3 % V, 1 % V, 4 % V}};
    m3_request rq[5];
    for (int i = 1; i < fc->n_seqs;) { /* the short prompts, chunk rows a step (chunk >= 7) */
        int n = 0;
        while (i < fc->n_seqs && 3 * (n + 1) <= chunk) {
            rq[n++] = (m3_request){seqs[i], short_prompts[i - 1], 3};
            i++;
        }
        st = m3_engine_step(eng, rq, n, NULL, out + rows * (size_t)V);
        if (st != M3_OK)
            fuzz_fail("%s: short prompts: %s", k->name, m3_last_error());
        rows += 3 * (size_t)n;
    }
    int32_t next[5];
    for (int d = 0; d < fc->n_decode; d++) {
        for (int i = 0; i < fc->n_seqs; i++) {
            next[i] = (int32_t)((d * 5 + i * 11 + 1) % V);
            rq[i] = (m3_request){seqs[i], &next[i], 1};
        }
        st = m3_engine_step(eng, rq, fc->n_seqs, NULL, out + rows * (size_t)V);
        if (st != M3_OK)
            fuzz_fail("%s: decode step %d: %s", k->name, d, m3_last_error());
        rows += (size_t)fc->n_seqs;
    }
    m3_engine_free(eng);
    *rows_out = rows;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_bytes s = {data, size};
    fuzz_case fc;
    draw(&s, &fc);
    m3_config cfg;
    m3_status st = m3_config_parse(fc.json, strlen(fc.json), &cfg);
    fuzz_check_refusal(st, "m3_config_parse");
    if (st != M3_OK)
        return 0;
    if (getenv("M3_FUZZ_VERBOSE"))
        fprintf(stderr, "  config %s%s, prompt %d, chunk %d\n", fc.json,
                fc.mxfp8 ? " (mxfp8)" : "", fc.n_prompt, fc.chunk);
    cfg.mxfp8 = fc.mxfp8;
    /* within the context limit (a longer sequence is refused, rightly) */
    if (fc.n_prompt + fc.n_decode > cfg.max_position_embeddings)
        fc.n_prompt = (int)cfg.max_position_embeddings - fc.n_decode;
    if (fc.n_prompt < 1)
        return 0;
    char dir[700];
    snprintf(dir, sizeof dir, "%s/model", fuzz_dir());
    m3_synth_opts so = {fc.seed, false, 0};
    st = m3_synth(&cfg, dir, &so);
    fuzz_check_refusal(st, "m3_synth");
    if (st != M3_OK)
        return 0;
    m3_model *model = NULL;
    st = m3_model_load(dir, NULL, &model);
    if (st != M3_OK)
        fuzz_fail("a synthesized checkpoint does not load: %s", m3_last_error());
    size_t rows_max = (size_t)fc.n_prompt + 3 * 4 + 5 * (size_t)fc.n_decode;
    size_t per = rows_max * (size_t)cfg.vocab_size;
    float *ref = malloc(per * sizeof *ref), *got = malloc(per * sizeof *got);
    if (!ref || !got)
        exit(2);
    const engine_kind kinds[] = {
        {M3_DECODE_STOCK, 1, false, "stock tp1", -1, 0, 0},
        {M3_DECODE_STOCK, 1, false, "stock tp1, prefill chunk 5, 1 thread", 0, 5, 1},
        {M3_DECODE_MONO, 1, false, "mono tp1", -1, 0, 0},
        {M3_DECODE_AUTO, 1, false, "auto tp1", 0, 0, 0},
        {M3_DECODE_STOCK, 2, false, "stock tp2", -1, 0, 0},
        {M3_DECODE_MONO, 2, false, "mono tp2", -1, 0, 0},
        {M3_DECODE_AUTO, 2, false, "auto tp2", 4, 0, 0},
        {M3_DECODE_STOCK, 2, true, "stock tp2 indexer-cp", -1, 0, 0},
        {M3_DECODE_MONO, 2, true, "mono tp2 indexer-cp", -1, 0, 0},
    };
    bool accepted[sizeof kinds / sizeof kinds[0]] = {false};
    size_t ref_rows = 0;
    if (!(accepted[0] = run_engine(model, &fc, &kinds[0], ref, &ref_rows)))
        goto done; /* the stock engine refused the model: clean, nothing to compare */
    for (size_t i = 0; i < ref_rows * (size_t)cfg.vocab_size; i++)
        if (isnan(ref[i]))
            fuzz_fail("stock tp1: NaN logit at row %zu", i / (size_t)cfg.vocab_size);
    /* three of the others per input, chosen by its next byte (an auto
     * kind with the stock kind it is held to), so an input runs in a
     * fraction of a second under the sanitizers */
    enum { n_kinds = sizeof kinds / sizeof kinds[0] };
    bool run[n_kinds] = {true};
    unsigned pick = fuzz_take(&s);
    for (unsigned j = 0; j < 3; j++) {
        unsigned k = 1 + (pick + j * 3) % (n_kinds - 1);
        run[k] = true;
        if (kinds[k].accepts_as >= 0)
            run[kinds[k].accepts_as] = true; /* always an earlier kind */
    }
    for (size_t k = 1; k < n_kinds; k++) {
        size_t rows = 0;
        if (!run[k])
            continue;
        for (size_t i = 0; i < per; i++)
            got[i] = NAN; /* poisoned: a row the engine leaves unwritten fails */
        accepted[k] = run_engine(model, &fc, &kinds[k], got, &rows);
        if (!accepted[k] && kinds[k].accepts_as >= 0 && accepted[kinds[k].accepts_as])
            fuzz_fail("%s refused a model %s runs: %s", kinds[k].name,
                      kinds[kinds[k].accepts_as].name, m3_last_error());
        if (!accepted[k])
            continue;
        if (rows != ref_rows)
            fuzz_fail("%s: %zu rows, stock %zu", kinds[k].name, rows, ref_rows);
        if (memcmp(got, ref, rows * (size_t)cfg.vocab_size * sizeof *ref) != 0) {
            size_t i = 0;
            while (memcmp(&got[i], &ref[i], sizeof *ref) == 0)
                i++;
            fuzz_fail("%s: logits differ from stock tp1 at row %zu, id %zu (%.9g vs %.9g)\n%s",
                      kinds[k].name, i / (size_t)cfg.vocab_size, i % (size_t)cfg.vocab_size,
                      got[i], ref[i], fc.json);
        }
    }
done:
    free(ref);
    free(got);
    m3_model_free(model);
    return 0;
}
