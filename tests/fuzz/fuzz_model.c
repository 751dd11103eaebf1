/*
 * A checkpoint's safetensors header against the model binder: the folder
 * holds a fixed small config.json and one model.safetensors whose data
 * section is a synthesized model's (bf16 or MXFP8: the input's first
 * byte; its second says how many 4-byte poisonings of the data follow:
 * NaN, infinities, the largest values) and whose header is the rest of
 * the input (so names, dtypes, shapes and offsets are what varies). The binder promises
 * (model/model.c) that a checkpoint it accepts has every tensor the
 * config needs, with its shape and dtype, inside the file. Properties: a
 * refusal has a message; an accepted model builds a CPU engine that runs
 * a prefill and two decode steps without a fault (the values are whatever
 * the bytes hold, NaN included, so they are not checked).
 *
 * M3_FUZZ_WRITE_SEED=PREFIX writes the valid inputs (the variant byte, no
 * poison, the synthesized header) to PREFIX_bf16.json and PREFIX_mxfp8.json and
 * exits: the seeds of corpus/fuzz_model.
 */
#include "fuzz.h"

/* Small, every layer kind: a dense full-attention layer, then sparse
 * attention with MoE (shared expert, routing bias, MXFP8 off). */
static const char kConfig[] =
    "{\"model_type\": \"minimax_m3\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
    "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 32,"
    "\"rotary_dim\": 16, \"rope_theta\": 10000, \"vocab_size\": 64,"
    "\"intermediate_size\": 32, \"dense_intermediate_size\": 64,"
    "\"shared_intermediate_size\": 32, \"n_shared_experts\": 1,"
    "\"num_local_experts\": 4, \"num_experts_per_tok\": 2, \"moe_layer_freq\": [0, 1],"
    "\"scoring_func\": \"sigmoid\", \"use_routing_bias\": true,"
    "\"routed_scaling_factor\": 2.0, \"hidden_act\": \"swigluoai\","
    "\"swiglu_alpha\": 1.702, \"swiglu_limit\": 7.0, \"rms_norm_eps\": 1e-06,"
    "\"use_gemma_norm\": true, \"qk_norm_type\": \"per_head\","
    "\"tie_word_embeddings\": false, \"max_position_embeddings\": 4096,"
    "\"eos_token_id\": 63, \"sparse_attention_config\": {\"sparse_attention_freq\": [0, 1],"
    "\"sparse_num_index_heads\": 1, \"sparse_index_dim\": 32, \"sparse_block_size\": 128,"
    "\"sparse_topk_blocks\": 2, \"sparse_init_block\": 0, \"sparse_local_block\": 1,"
    "\"sparse_score_type\": \"max\", \"sparse_disable_index_value\": [0, 1]}}";

/* Two checkpoints of that config: bf16, and MXFP8 (e4m3 weights with
 * their uint8 block scales, quantization_config in config.json). */
enum { kVariants = 2 };
static uint8_t *g_data[kVariants]; /* each synthesized file's data section */
static size_t g_data_bytes[kVariants];
static char g_ckpt[kVariants][700]; /* the folders inputs are written to */

static void setup_variant(int v) {
    char synth_dir[700], path[800];
    snprintf(synth_dir, sizeof synth_dir, "%s/synth%d", fuzz_dir(), v);
    m3_config cfg;
    m3_synth_opts so = {7, false, 0};
    if (m3_config_parse(kConfig, sizeof kConfig - 1, &cfg) != M3_OK)
        exit(2);
    cfg.mxfp8 = v == 1;
    if (m3_synth(&cfg, synth_dir, &so) != M3_OK) {
        fprintf(stderr, "fuzz_model setup: %s\n", m3_last_error());
        exit(2);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", synth_dir);
    size_t n;
    uint8_t *file = fuzz_read(path, &n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | file[i];
    const char *seed = getenv("M3_FUZZ_WRITE_SEED");
    if (seed) { /* the variant byte, no poison, then the header */
        snprintf(path, sizeof path, "%s_%s.json", seed, v ? "mxfp8" : "bf16");
        const uint8_t tag[2] = {(uint8_t)v, 0};
        fuzz_write(path, (fuzz_part[]){{tag, 2}, {file + 8, (size_t)hlen}}, 2);
    }
    g_data_bytes[v] = n - 8 - (size_t)hlen;
    g_data[v] = malloc(g_data_bytes[v] + 1);
    if (!g_data[v])
        exit(2);
    memcpy(g_data[v], file + 8 + hlen, g_data_bytes[v]);
    free(file);
    snprintf(g_ckpt[v], sizeof g_ckpt[v], "%s/ckpt%d", fuzz_dir(), v);
    if (mkdir(g_ckpt[v], 0700) != 0) {
        perror(g_ckpt[v]);
        exit(2);
    }
    /* the synthesized config.json: MXFP8's names its quantization */
    char src[800];
    snprintf(src, sizeof src, "%s/config.json", synth_dir);
    uint8_t *cfg_text = fuzz_read(src, &n);
    snprintf(path, sizeof path, "%s/config.json", g_ckpt[v]);
    fuzz_write(path, &(fuzz_part){cfg_text, n}, 1);
    free(cfg_text);
}

static void setup(void) {
    if (g_data[0])
        return;
    for (int v = 0; v < kVariants; v++)
        setup_variant(v);
    if (getenv("M3_FUZZ_WRITE_SEED"))
        exit(0);
}

/* A prefill of 5 tokens and two decode steps; faults are the finding. */
static void run(m3_model *model) {
    m3_engine_opts eo = m3_engine_defaults();
    eo.threads = 1;
    eo.max_tokens = 256;
    eo.max_rows = 8;
    m3_engine *eng = NULL;
    m3_status st = m3_engine_create(model, &eo, &eng);
    fuzz_check_refusal(st, "m3_engine_create");
    if (st != M3_OK)
        return;
    m3_seq seq;
    if (m3_seq_create(eng, &seq) != M3_OK)
        fuzz_fail("m3_seq_create: %s", m3_last_error());
    int vocab = m3_model_config(model)->vocab_size;
    float *logits = malloc((size_t)vocab * sizeof *logits);
    const int32_t prompt[5] = {1, 5, 9, 2, 60};
    m3_request rq = {seq, prompt, 5};
    for (int step = 0; step < 3 && logits; step++) {
        st = m3_engine_step(eng, &rq, 1, logits, NULL);
        if (st != M3_OK)
            fuzz_fail("step %d of an accepted model failed: %s", step, m3_last_error());
        rq.tokens = prompt + step;
        rq.n_tokens = 1;
    }
    free(logits);
    m3_engine_free(eng);
}

/* Poison: up to 7 places in the data section set to NaN, an infinity,
 * the largest finite bf16 / e4m3 or zero (2 bytes: a bf16 weight, half an
 * fp32 one, two e4m3 weights or scales), so no value breaks the engine. */
static const uint8_t kPoison[][2] = {{0xc0, 0x7f}, {0x80, 0x7f}, {0x80, 0xff},
                                     {0x7f, 0x7f}, {0x7e, 0xfe}, {0x00, 0x00}};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 2)
        return 0;
    const int v = data[0] % kVariants;
    const int n_poison = data[1] % 8;
    data += 2, size -= 2;
    if (size < (size_t)n_poison * 4)
        return 0;
    uint8_t *file_data = malloc(g_data_bytes[v]);
    if (!file_data)
        exit(2);
    memcpy(file_data, g_data[v], g_data_bytes[v]);
    for (int i = 0; i < n_poison; i++, data += 4, size -= 4) {
        size_t at = ((size_t)data[0] << 16 | (size_t)data[1] << 8 | data[2]) * 2 %
                    (g_data_bytes[v] - 1);
        memcpy(file_data + at, kPoison[data[3] % 6], 2);
    }
    char path[800];
    snprintf(path, sizeof path, "%s/model.safetensors", g_ckpt[v]);
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)((uint64_t)size >> (8 * i));
    fuzz_write(path, (fuzz_part[]){{len, 8}, {data, size}, {file_data, g_data_bytes[v]}}, 3);
    free(file_data);
    m3_model *model = NULL;
    m3_status st = m3_model_load(g_ckpt[v], NULL, &model);
    fuzz_check_refusal(st, "m3_model_load");
    if (st != M3_OK)
        return 0;
    run(model);
    m3_model_free(model);
    return 0;
}
