/*
 * Tests for model/config.c and model/preset.c: that every spelling of the
 * released MiniMax-M3 config.json (nested under text_config, flat, and the
 * flattened Hugging Face one with index_* fields and per-layer type lists)
 * parses to m3_preset("m3"); that m3_config_to_json round-trips every preset
 * field by field; m3_config_cut_layers; eos and quantization handling; and
 * one case per validation rule of the parser, each checked for its status
 * and for a message that names the offending field. The configs are JSON
 * text written from SPEC §2.1, so a drift in either the preset or the parser
 * shows up here. Mutated configs are built with cJSON from those texts, so
 * each case changes exactly the fields it names.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend.h"
#include "check.h"

/* ------------------------------------------------------------ JSON texts */

/* comma-separated repetitions, to write 60-entry per-layer lists literally */
#define X2(x) x "," x
#define X3(x) x "," x "," x
#define X5(x) X2(x) "," X3(x)
#define X10(x) X5(x) "," X5(x)
#define X50(x) X10(x) "," X10(x) "," X10(x) "," X10(x) "," X10(x)
#define X56(x) X50(x) "," X5(x) "," x
#define X57(x) X50(x) "," X5(x) "," X2(x)

/* layers 0-2 dense, 3-59 sparse attention + MoE */
#define M3_FLAGS "[" X3("0") "," X57("1") "]"
#define ALL_ZERO "[" X3("0") "," X57("0") "]"
#define ALL_ONE "[" X3("1") "," X57("1") "]"
#define FLAGS_59 "[" X3("0") "," X56("1") "]"

/* The released text config (SPEC §2.1), without its braces. */
#define M3_TEXT_FIELDS                                                                     \
    "\"model_type\": \"minimax_m3\","                                                      \
    "\"hidden_size\": 6144, \"num_hidden_layers\": 60,"                                    \
    "\"num_attention_heads\": 64, \"num_key_value_heads\": 4, \"head_dim\": 128,"          \
    "\"rotary_dim\": 64, \"partial_rotary_factor\": 0.5, \"rope_theta\": 5000000,"         \
    "\"vocab_size\": 200064,"                                                              \
    "\"intermediate_size\": 3072, \"dense_intermediate_size\": 12288,"                     \
    "\"shared_intermediate_size\": 3072, \"n_shared_experts\": 1,"                         \
    "\"num_local_experts\": 128, \"num_experts_per_tok\": 4,"                              \
    "\"moe_layer_freq\": " M3_FLAGS ","                                                    \
    "\"scoring_func\": \"sigmoid\", \"use_routing_bias\": true,"                           \
    "\"routed_scaling_factor\": 2.0,"                                                      \
    "\"hidden_act\": \"swigluoai\", \"swiglu_alpha\": 1.702, \"swiglu_limit\": 7.0,"       \
    "\"rms_norm_eps\": 1e-06, \"use_gemma_norm\": true, \"qk_norm_type\": \"per_head\","   \
    "\"use_qk_norm\": true, \"tie_word_embeddings\": false,"                               \
    "\"max_position_embeddings\": 1048576, \"eos_token_id\": 200020,"                      \
    "\"torch_dtype\": \"bfloat16\","                                                       \
    "\"sparse_attention_config\": {"                                                       \
    "  \"use_sparse_attention\": true,"                                                    \
    "  \"sparse_attention_freq\": " M3_FLAGS ","                                           \
    "  \"sparse_num_index_heads\": 4, \"sparse_index_dim\": 128,"                          \
    "  \"sparse_block_size\": 128, \"sparse_topk_blocks\": 16,"                            \
    "  \"sparse_init_block\": 0, \"sparse_local_block\": 1,"                               \
    "  \"sparse_score_type\": \"max\","                                                    \
    "  \"sparse_disable_index_value\": " M3_FLAGS "}"

/* config.json as released: the VL wrapper with the text config nested. */
static const char *const M3_NESTED =
    "{\"architectures\": [\"MiniMaxM3SparseForConditionalGeneration\"],"
    "\"model_type\": \"minimax_m3_vl\","
    "\"vision_config\": {\"hidden_size\": 1280, \"model_type\": \"minimax_vit\"},"
    "\"text_config\": {" M3_TEXT_FIELDS "}}";

/* The same text config as the whole file. */
static const char *const M3_FLAT = "{" M3_TEXT_FIELDS "}";

#define FA "\"full_attention\""
#define SA "\"minimax_m3_sparse\""
#define DENSE "\"dense\""
#define MOE "\"sparse\""

/* The flattened spelling of newer Hugging Face exports. Fields it leaves out
 * (index_init_blocks, rotary_dim) take their defaults; "silu" is how those
 * exports name the same SwiGLU-OAI activation. */
static const char *const M3_HF =
    "{\"model_type\": \"minimax_m3\","
    "\"architectures\": [\"MiniMaxM3SparseForCausalLM\"],"
    "\"hidden_size\": 6144, \"num_hidden_layers\": 60,"
    "\"num_attention_heads\": 64, \"num_key_value_heads\": 4, \"head_dim\": 128,"
    "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 5000000.0,"
    "                      \"partial_rotary_factor\": 0.5},"
    "\"vocab_size\": 200064,"
    "\"intermediate_size\": 3072, \"dense_intermediate_size\": 12288,"
    "\"shared_intermediate_size\": 3072, \"n_shared_experts\": 1,"
    "\"num_local_experts\": 128, \"num_experts_per_tok\": 4,"
    "\"layer_types\": [" X3(FA) "," X57(SA) "],"
    "\"mlp_layer_types\": [" X3(DENSE) "," X57(MOE) "],"
    "\"index_n_heads\": 4, \"index_head_dim\": 128, \"index_block_size\": 128,"
    "\"index_topk_blocks\": 16, \"index_local_blocks\": 1,"
    "\"scoring_func\": \"sigmoid\", \"use_routing_bias\": true,"
    "\"routed_scaling_factor\": 2.0,"
    "\"hidden_act\": \"silu\", \"swiglu_alpha\": 1.702, \"swiglu_limit\": 7.0,"
    "\"rms_norm_eps\": 1e-06, \"use_gemma_norm\": true, \"qk_norm_type\": \"per_head\","
    "\"tie_word_embeddings\": false, \"max_position_embeddings\": 1048576,"
    "\"eos_token_id\": 200020}";

/* ------------------------------------------------------------ helpers */

static m3_status parse_text(const char *json, m3_config *out) {
    return m3_config_parse(json, strlen(json), out);
}

/* Field-by-field equality; prints every difference under the label `what`,
 * so a failing case says which field drifted. */
static int config_same(const m3_config *a, const m3_config *b, const char *what) {
    int bad = 0;
#define SAME(f)                                                                          \
    if (a->f != b->f) {                                                                  \
        fprintf(stderr, "  %s: %s = %.17g, expected %.17g\n", what, #f, (double)a->f,   \
                (double)b->f);                                                           \
        bad++;                                                                           \
    }
    SAME(hidden_size) SAME(num_layers) SAME(num_q_heads) SAME(num_kv_heads) SAME(head_dim)
    SAME(rotary_dim) SAME(rope_theta) SAME(vocab_size) SAME(expert_dim) SAME(dense_dim)
    SAME(shared_dim) SAME(num_experts) SAME(experts_per_tok) SAME(use_routing_bias)
    SAME(routed_scaling_factor) SAME(swiglu_alpha) SAME(swiglu_limit) SAME(rms_norm_eps)
    SAME(tie_word_embeddings) SAME(max_position_embeddings) SAME(index_heads) SAME(index_dim)
    SAME(block_size) SAME(topk_blocks) SAME(init_blocks) SAME(local_blocks) SAME(num_eos)
    SAME(mxfp8)
#undef SAME
    /* every slot, not just the first num_layers: stale flags past the last
     * layer would leak into a later cut or count */
    for (int i = 0; i < M3_MAX_LAYERS; i++) {
        if (a->layer_sparse[i] != b->layer_sparse[i] || a->layer_moe[i] != b->layer_moe[i]) {
            fprintf(stderr, "  %s: layer %d sparse/moe = %d/%d, expected %d/%d\n", what, i,
                    a->layer_sparse[i], a->layer_moe[i], b->layer_sparse[i], b->layer_moe[i]);
            bad++;
        }
    }
    for (int i = 0; i < a->num_eos && i < 8 && a->num_eos == b->num_eos; i++)
        if (a->eos_ids[i] != b->eos_ids[i]) {
            fprintf(stderr, "  %s: eos_ids[%d] = %d, expected %d\n", what, i, a->eos_ids[i],
                    b->eos_ids[i]);
            bad++;
        }
    return bad == 0;
}

/* Where a mutation applies: the released nested config's top level, its
 * text_config, its sparse_attention_config, or the top level of the
 * flattened Hugging Face config. */
enum where { ROOT = 1, TEXT, SPARSE, HF };

typedef struct mutation {
    enum where where;
    const char *field;
    const char *value; /* JSON text; NULL deletes the field */
} mutation;

/* Apply up to 4 mutations to the base config (M3_HF when the first one is
 * HF, else M3_NESTED) and parse the result. */
static m3_status parse_mutated(const mutation *muts, int n, m3_config *out) {
    bool hf = n > 0 && muts[0].where == HF;
    cJSON *root = cJSON_Parse(hf ? M3_HF : M3_NESTED);
    if (!root) {
        fprintf(stderr, "test bug: base config is not JSON\n");
        return M3_ERR_INTERNAL;
    }
    for (int i = 0; i < n && muts[i].field; i++) {
        cJSON *obj = root;
        if (muts[i].where == TEXT || muts[i].where == SPARSE)
            obj = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        if (muts[i].where == SPARSE)
            obj = cJSON_GetObjectItemCaseSensitive(obj, "sparse_attention_config");
        cJSON_DeleteItemFromObjectCaseSensitive(obj, muts[i].field);
        if (muts[i].value) {
            cJSON *v = cJSON_Parse(muts[i].value);
            if (!v) {
                fprintf(stderr, "test bug: value of %s is not JSON\n", muts[i].field);
                cJSON_Delete(root);
                return M3_ERR_INTERNAL;
            }
            cJSON_AddItemToObject(obj, muts[i].field, v);
        }
    }
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    m3_status st = m3_config_parse(text, strlen(text), out);
    free(text);
    return st;
}

/* One mutation, the common case. */
static m3_status parse_with(enum where w, const char *field, const char *value, m3_config *out) {
    mutation m = {w, field, value};
    return parse_mutated(&m, 1, out);
}

/* ------------------------------------------------------------ spellings */

static void test_released_spellings(void) {
    m3_config want, got;
    CHECK_OK(m3_preset("m3", &want));

    /* the preset itself holds the SPEC §2.1 numbers (the JSON texts above
     * are written from the same table, so this pins both ends) */
    CHECK(want.hidden_size == 6144 && want.num_layers == 60 && want.num_q_heads == 64);
    CHECK(want.num_kv_heads == 4 && want.head_dim == 128 && want.rotary_dim == 64);
    CHECK(want.vocab_size == 200064 && want.expert_dim == 3072 && want.dense_dim == 12288);
    CHECK(want.shared_dim == 3072 && want.num_experts == 128 && want.experts_per_tok == 4);
    CHECK(want.index_heads == 4 && want.index_dim == 128 && want.block_size == 128);
    CHECK(want.topk_blocks == 16 && want.init_blocks == 0 && want.local_blocks == 1);
    CHECK(!want.layer_sparse[2] && want.layer_sparse[3] && want.layer_sparse[59]);
    CHECK(!want.layer_moe[2] && want.layer_moe[3] && want.layer_moe[59]);

    CHECK_OK(parse_text(M3_NESTED, &got));
    CHECK(config_same(&got, &want, "nested"));
    CHECK_OK(parse_text(M3_FLAT, &got));
    CHECK(config_same(&got, &want, "flat"));
    CHECK_OK(parse_text(M3_HF, &got));
    CHECK(config_same(&got, &want, "flattened HF"));

    /* the other accepted names of the flattened spelling */
    const mutation aliases[] = {
        {HF, "layer_types", "[" X3("\"dense_attention\"") "," X57("\"sparse_attention\"") "]"},
        {HF, "mlp_layer_types", "[" X3(DENSE) "," X57("\"moe\"") "]"},
        {HF, "index_init_blocks", "0"},
        {HF, "hidden_act", "\"swigluoai\""},
    };
    CHECK_OK(parse_mutated(aliases, 4, &got));
    CHECK(config_same(&got, &want, "flattened HF, alias layer type names"));
    const mutation sizes[] = {
        {HF, "intermediate_size", NULL},
        {HF, "moe_intermediate_size", "3072"},
        {HF, "dense_intermediate_size", NULL},
        {HF, "mlp_intermediate_size", "12288"},
    };
    CHECK_OK(parse_mutated(sizes, 4, &got));
    CHECK(config_same(&got, &want, "flattened HF, moe_/mlp_intermediate_size"));
    const mutation experts[] = {
        {HF, "num_local_experts", NULL},
        {HF, "n_routed_experts", "128"},
        {HF, "n_shared_experts", NULL},
        {HF, "num_shared_experts", "1"},
    };
    CHECK_OK(parse_mutated(experts, 4, &got));
    CHECK(config_same(&got, &want, "flattened HF, n_routed/num_shared_experts"));

    /* RoPE from the factor alone; theta and factor at the top level of a
     * flattened config also count */
    const mutation factor_only[] = {{TEXT, "rotary_dim", NULL}};
    CHECK_OK(parse_mutated(factor_only, 1, &got));
    CHECK(config_same(&got, &want, "partial_rotary_factor without rotary_dim"));
    const mutation rope_top[] = {
        {HF, "rope_parameters", NULL},
        {HF, "rope_theta", "5000000"},
        {HF, "partial_rotary_factor", "0.5"},
    };
    CHECK_OK(parse_mutated(rope_top, 3, &got));
    CHECK(config_same(&got, &want, "flattened HF, RoPE at top level"));

    /* a null text_config or rope_scaling is as good as none */
    const mutation nulls[] = {{TEXT, "rope_scaling", "null"}, {TEXT, "quantization_config", "null"}};
    CHECK_OK(parse_mutated(nulls, 2, &got));
    CHECK(config_same(&got, &want, "null rope_scaling / quantization_config"));
    CHECK_OK(parse_with(TEXT, "rope_scaling", "{\"rope_type\": \"default\"}", &got));
    CHECK(config_same(&got, &want, "default rope_scaling"));
    const mutation flat_null_tc[] = {{HF, "text_config", "null"}};
    CHECK_OK(parse_mutated(flat_null_tc, 1, &got));
    CHECK(config_same(&got, &want, "flattened HF with text_config null"));

    /* use_sparse_attention false turns every layer dense, and the index
     * fields are then neither needed nor kept */
    CHECK_OK(parse_with(SPARSE, "use_sparse_attention", "false", &got));
    int n_sparse = 0;
    for (int i = 0; i < M3_MAX_LAYERS; i++)
        n_sparse += got.layer_sparse[i];
    CHECK(n_sparse == 0 && got.index_heads == 0 && got.topk_blocks == 0);
    CHECK(got.layer_moe[3] && !got.layer_moe[2]);
}

/* Only the required fields: everything else takes the documented default. */
static void test_defaults(void) {
    const char *min =
        "{\"hidden_size\": 256, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
        " \"num_key_value_heads\": 2, \"vocab_size\": 512, \"intermediate_size\": 64,"
        " \"num_local_experts\": 4, \"num_experts_per_tok\": 2}";
    m3_config c;
    CHECK_OK(parse_text(min, &c));
    CHECK(c.head_dim == 64);           /* hidden_size / num_attention_heads */
    CHECK(c.rotary_dim == 64);         /* partial_rotary_factor 1 */
    CHECK(c.rope_theta == 5000000.0);
    CHECK(c.rms_norm_eps == 1e-6f);
    CHECK(c.max_position_embeddings == 1 << 20);
    CHECK(c.block_size == 128);
    CHECK(c.layer_moe[0] && c.layer_moe[1] && !c.layer_moe[2]); /* HF default: all MoE */
    CHECK(!c.layer_sparse[0] && !c.layer_sparse[1]);
    CHECK(c.index_heads == 0 && c.index_dim == 0 && c.topk_blocks == 0);
    CHECK(c.shared_dim == 0 && c.dense_dim == 0);
    CHECK(c.use_routing_bias && c.routed_scaling_factor == 1.0f);
    CHECK(c.swiglu_alpha == 1.702f && c.swiglu_limit == 7.0f);
    CHECK(!c.tie_word_embeddings && !c.mxfp8 && c.num_eos == 0);
}

/* ------------------------------------------------------------ round trip */

static void round_trip(const m3_config *p, const char *what) {
    char *json = NULL;
    CHECK_OK(m3_config_to_json(p, &json));
    if (!json)
        return;
    m3_config back;
    m3_status st = parse_text(json, &back);
    CHECK_OK(st);
    if (st == M3_OK)
        CHECK(config_same(&back, p, what));
    /* the released layout: the VL wrapper around a nested text config */
    cJSON *root = cJSON_Parse(json);
    CHECK(root != NULL);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    CHECK(cJSON_IsString(mt) && !strcmp(mt->valuestring, "minimax_m3_vl"));
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    CHECK(cJSON_IsObject(tc));
    CHECK(cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(tc, "sparse_attention_config")));
    cJSON_Delete(root);
    free(json);
}

static void test_round_trip(void) {
    const char *const presets[] = {"tiny", "m3", "m3-tp4-rank"};
    for (int i = 0; i < 3; i++) {
        m3_config p;
        CHECK_OK(m3_preset(presets[i], &p));
        round_trip(&p, presets[i]);

        char what[64];
        p.mxfp8 = true;
        snprintf(what, sizeof what, "%s mxfp8", presets[i]);
        round_trip(&p, what);
        p.mxfp8 = false;

        /* list eos ids and a tied embedding survive too */
        p.num_eos = 3;
        p.eos_ids[1] = 7;
        p.eos_ids[2] = 9;
        p.tie_word_embeddings = true;
        snprintf(what, sizeof what, "%s eos list, tied", presets[i]);
        round_trip(&p, what);
    }
    CHECK_FAILS(m3_preset("m4", &(m3_config){0}), M3_ERR_INVALID_ARG, "unknown preset 'm4'");

    /* cut configs are what `m3 synth --layers` writes and the loader reads */
    for (int n = 1; n <= 5; n++) {
        m3_config p;
        CHECK_OK(m3_preset("m3", &p));
        CHECK_OK(m3_config_cut_layers(&p, n));
        char what[64];
        snprintf(what, sizeof what, "m3 cut to %d layers", n);
        round_trip(&p, what);
    }
    m3_config t;
    CHECK_OK(m3_preset("tiny", &t));
    CHECK_OK(m3_config_cut_layers(&t, 2));
    round_trip(&t, "tiny cut to 2 layers");
}

static void test_cut_layers(void) {
    m3_config full, c;
    CHECK_OK(m3_preset("m3", &full));

    c = full;
    CHECK_OK(m3_config_cut_layers(&c, 5));
    CHECK(c.num_layers == 5);
    CHECK(!c.layer_sparse[2] && c.layer_sparse[3] && c.layer_sparse[4] && !c.layer_sparse[5]);
    CHECK(!c.layer_moe[2] && c.layer_moe[3] && c.layer_moe[4] && !c.layer_moe[5]);
    CHECK(!c.layer_sparse[59] && !c.layer_moe[59]);
    CHECK(c.index_heads == 4 && c.index_dim == 128 && c.topk_blocks == 16 &&
          c.local_blocks == 1);
    CHECK(c.hidden_size == full.hidden_size && c.vocab_size == full.vocab_size);

    /* the dense prefix alone has no sparse layer, so no index geometry, the
     * same as parsing a config without sparse layers gives */
    c = full;
    CHECK_OK(m3_config_cut_layers(&c, 3));
    CHECK(c.num_layers == 3 && !c.layer_sparse[0] && !c.layer_sparse[2] && !c.layer_sparse[3]);
    CHECK(c.index_heads == 0 && c.index_dim == 0 && c.topk_blocks == 0);
    CHECK(c.init_blocks == 0 && c.local_blocks == 0);

    c = full;
    CHECK_OK(m3_config_cut_layers(&c, 60)); /* a no-op */
    CHECK(config_same(&c, &full, "cut to all 60 layers"));

    c = full;
    CHECK_FAILS(m3_config_cut_layers(&c, 0), M3_ERR_INVALID_ARG, "layers = 0");
    CHECK_FAILS(m3_config_cut_layers(&c, 61), M3_ERR_INVALID_ARG, "layers = 61");
    CHECK_FAILS(m3_config_cut_layers(&c, -2), M3_ERR_INVALID_ARG, "layers = -2");
    CHECK(config_same(&c, &full, "after refused cuts"));
}

/* ------------------------------------------------------------ eos, quant */

static void test_eos(void) {
    m3_config c;
    CHECK_OK(parse_with(TEXT, "eos_token_id", "200020", &c));
    CHECK(c.num_eos == 1 && c.eos_ids[0] == 200020);
    CHECK_OK(parse_with(TEXT, "eos_token_id", "[200020, 200021, 5]", &c));
    CHECK(c.num_eos == 3 && c.eos_ids[0] == 200020 && c.eos_ids[1] == 200021 && c.eos_ids[2] == 5);
    CHECK_OK(parse_with(TEXT, "eos_token_id", NULL, &c));
    CHECK(c.num_eos == 0);

    /* only at the top level of the file (a VL wrapper's own field) */
    const mutation top[] = {{TEXT, "eos_token_id", NULL}, {ROOT, "eos_token_id", "[1, 2]"}};
    CHECK_OK(parse_mutated(top, 2, &c));
    CHECK(c.num_eos == 2 && c.eos_ids[0] == 1 && c.eos_ids[1] == 2);
    /* the text config's own value wins over the wrapper's */
    CHECK_OK(parse_with(ROOT, "eos_token_id", "3", &c));
    CHECK(c.num_eos == 1 && c.eos_ids[0] == 200020);

    CHECK_FAILS(parse_with(TEXT, "eos_token_id", "200064", &c), M3_ERR_CONFIG,
                "eos_token_id = 200064 is outside the vocab");
    CHECK_FAILS(parse_with(TEXT, "eos_token_id", "-1", &c), M3_ERR_CONFIG, "eos_token_id");
    CHECK_FAILS(parse_with(TEXT, "eos_token_id", "[1, 200064]", &c), M3_ERR_CONFIG,
                "eos_token_id entries");
    CHECK_FAILS(parse_with(TEXT, "eos_token_id", "[1, \"2\"]", &c), M3_ERR_CONFIG,
                "eos_token_id entries");
    CHECK_FAILS(parse_with(TEXT, "eos_token_id", "\"</s>\"", &c), M3_ERR_CONFIG,
                "eos_token_id must be an integer or a list");
    const mutation top_bad[] = {{TEXT, "eos_token_id", NULL}, {ROOT, "eos_token_id", "999999"}};
    CHECK_FAILS(parse_mutated(top_bad, 2, &c), M3_ERR_CONFIG, "eos_token_id = 999999");
}

static void test_quantization(void) {
    m3_config c;
    const char *mx = "{\"quant_method\": \"mxfp8\", \"activation_scheme\": \"dynamic\","
                     " \"weight_block_size\": [1, 32]}";
    CHECK_OK(parse_with(ROOT, "quantization_config", mx, &c));
    CHECK(c.mxfp8);
    CHECK_OK(parse_with(TEXT, "quantization_config", mx, &c));
    CHECK(c.mxfp8);
    CHECK_OK(parse_with(ROOT, "quantization_config", "{\"quant_method\": \"mxfp8\"}", &c));
    CHECK(c.mxfp8);
    CHECK_OK(parse_text(M3_NESTED, &c));
    CHECK(!c.mxfp8);

    CHECK_FAILS(parse_with(ROOT, "quantization_config",
                           "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}", &c),
                M3_ERR_UNSUPPORTED, "quant_method = fp8");
    CHECK_FAILS(parse_with(ROOT, "quantization_config", "{\"quant_method\": \"awq\"}", &c),
                M3_ERR_UNSUPPORTED, "quant_method = awq");
    CHECK_FAILS(parse_with(TEXT, "quantization_config", "{\"quant_method\": \"gptq\"}", &c),
                M3_ERR_UNSUPPORTED, "quant_method = gptq");
    CHECK_FAILS(parse_with(ROOT, "quantization_config", "{\"bits\": 4}", &c),
                M3_ERR_UNSUPPORTED, "quant_method = (missing)");
    CHECK_FAILS(parse_with(ROOT, "quantization_config",
                           "{\"quant_method\": \"mxfp8\", \"weight_block_size\": [1, 64]}", &c),
                M3_ERR_UNSUPPORTED, "weight_block_size");
    CHECK_FAILS(parse_with(ROOT, "quantization_config",
                           "{\"quant_method\": \"mxfp8\", \"weight_block_size\": [32]}", &c),
                M3_ERR_UNSUPPORTED, "weight_block_size");
}

/* ------------------------------------------------------------ validation */

typedef struct bad_case {
    mutation m[4];
    m3_status status;
    const char *msg; /* must appear in m3_last_error() */
} bad_case;

/* One row per rule of config.c, in the parser's order. Each changes the
 * released config (or the flattened one) only as much as the rule needs. */
static const bad_case bad_cases[] = {
    /* required fields */
    {{{TEXT, "hidden_size", NULL}}, M3_ERR_CONFIG, "missing required field 'hidden_size'"},
    {{{TEXT, "num_hidden_layers", NULL}}, M3_ERR_CONFIG,
     "missing required field 'num_hidden_layers'"},
    {{{TEXT, "num_attention_heads", NULL}}, M3_ERR_CONFIG,
     "missing required field 'num_attention_heads'"},
    {{{TEXT, "num_key_value_heads", NULL}}, M3_ERR_CONFIG,
     "missing required field 'num_key_value_heads'"},
    {{{TEXT, "vocab_size", NULL}}, M3_ERR_CONFIG, "missing required field 'vocab_size'"},
    {{{TEXT, "intermediate_size", NULL}}, M3_ERR_CONFIG,
     "missing required field 'intermediate_size'"},
    {{{TEXT, "dense_intermediate_size", NULL}}, M3_ERR_CONFIG,
     "missing required field 'dense_intermediate_size'"},
    {{{TEXT, "num_local_experts", NULL}}, M3_ERR_CONFIG,
     "missing required field 'num_local_experts'"},
    {{{TEXT, "num_experts_per_tok", NULL}}, M3_ERR_CONFIG,
     "missing required field 'num_experts_per_tok'"},
    {{{SPARSE, "sparse_num_index_heads", NULL}}, M3_ERR_CONFIG,
     "missing required field 'sparse_num_index_heads'"},
    {{{SPARSE, "sparse_index_dim", NULL}}, M3_ERR_CONFIG,
     "missing required field 'sparse_index_dim'"},
    {{{SPARSE, "sparse_topk_blocks", NULL}}, M3_ERR_CONFIG,
     "missing required field 'sparse_topk_blocks'"},
    {{{HF, "index_n_heads", NULL}}, M3_ERR_CONFIG, "sparse_num_index_heads"},
    {{{HF, "index_topk_blocks", NULL}}, M3_ERR_CONFIG, "sparse_topk_blocks"},

    /* wrong types */
    {{{TEXT, "hidden_size", "\"6144\""}}, M3_ERR_CONFIG, "'hidden_size' must be an integer"},
    {{{TEXT, "num_hidden_layers", "60.5"}}, M3_ERR_CONFIG,
     "'num_hidden_layers' must be an integer"},
    {{{TEXT, "vocab_size", "true"}}, M3_ERR_CONFIG, "'vocab_size' must be an integer"},
    {{{SPARSE, "sparse_topk_blocks", "[16]"}}, M3_ERR_CONFIG,
     "'sparse_topk_blocks' must be an integer"},
    {{{HF, "index_head_dim", "128.25"}}, M3_ERR_CONFIG, "'index_head_dim' must be an integer"},
    {{{TEXT, "use_gemma_norm", "1"}}, M3_ERR_CONFIG, "'use_gemma_norm' must be true or false"},
    {{{TEXT, "use_routing_bias", "\"true\""}}, M3_ERR_CONFIG,
     "'use_routing_bias' must be true or false"},
    {{{TEXT, "tie_word_embeddings", "0"}}, M3_ERR_CONFIG,
     "'tie_word_embeddings' must be true or false"},
    {{{TEXT, "tie_word_embeddings", NULL}, {ROOT, "tie_word_embeddings", "\"no\""}},
     M3_ERR_CONFIG, "'tie_word_embeddings' must be true or false"},
    {{{SPARSE, "use_sparse_attention", "1"}}, M3_ERR_CONFIG,
     "'use_sparse_attention' must be true or false"},
    {{{TEXT, "rope_theta", "\"5e6\""}}, M3_ERR_CONFIG, "'rope_theta' must be a finite number"},
    {{{TEXT, "swiglu_alpha", "\"1.702\""}}, M3_ERR_CONFIG,
     "'swiglu_alpha' must be a finite number"},
    {{{TEXT, "hidden_act", "7"}}, M3_ERR_CONFIG, "'hidden_act' must be a string"},
    {{{TEXT, "model_type", "3"}}, M3_ERR_CONFIG, "'model_type' must be a string"},
    {{{ROOT, "text_config", "[1]"}}, M3_ERR_CONFIG, "'text_config' must be an object"},
    {{{TEXT, "sparse_attention_config", "true"}}, M3_ERR_CONFIG,
     "'sparse_attention_config' must be an object"},
    {{{HF, "rope_parameters", "5000000"}}, M3_ERR_CONFIG, "'rope_parameters' must be an object"},

    /* out of range */
    {{{TEXT, "hidden_size", "0"}}, M3_ERR_CONFIG, "hidden_size = 0 is out of range"},
    {{{TEXT, "hidden_size", "-6144"}}, M3_ERR_CONFIG, "hidden_size = -6144 is out of range"},
    {{{TEXT, "num_hidden_layers", "0"}}, M3_ERR_CONFIG, "num_hidden_layers = 0 is out of range"},
    {{{TEXT, "num_hidden_layers", "257"}}, M3_ERR_CONFIG,
     "num_hidden_layers = 257 is out of range"},
    {{{TEXT, "num_attention_heads", "-64"}}, M3_ERR_CONFIG,
     "num_attention_heads = -64 is out of range"},
    {{{TEXT, "num_key_value_heads", "0"}}, M3_ERR_CONFIG,
     "num_key_value_heads = 0 is out of range"},
    {{{TEXT, "head_dim", "0"}}, M3_ERR_CONFIG, "head_dim = 0 is out of range"},
    {{{TEXT, "vocab_size", "0"}}, M3_ERR_CONFIG, "vocab_size = 0 is out of range"},
    {{{TEXT, "intermediate_size", "-1"}}, M3_ERR_CONFIG, "intermediate_size = -1 is out of range"},
    {{{TEXT, "dense_intermediate_size", "0"}}, M3_ERR_CONFIG,
     "dense_intermediate_size = 0 is out of range"},
    {{{TEXT, "num_local_experts", "0"}}, M3_ERR_CONFIG, "num_local_experts = 0 is out of range"},
    {{{TEXT, "num_experts_per_tok", "0"}}, M3_ERR_CONFIG,
     "num_experts_per_tok = 0 is out of range"},
    {{{TEXT, "shared_intermediate_size", "-3072"}}, M3_ERR_CONFIG,
     "shared_intermediate_size = -3072 is out of range"},
    {{{TEXT, "max_position_embeddings", "0"}}, M3_ERR_CONFIG,
     "max_position_embeddings = 0 is out of range"},
    {{{SPARSE, "sparse_topk_blocks", "0"}}, M3_ERR_CONFIG, "sparse_topk_blocks = 0 is out of range"},
    {{{SPARSE, "sparse_num_index_heads", "0"}}, M3_ERR_CONFIG,
     "sparse_num_index_heads = 0 is out of range"},
    {{{SPARSE, "sparse_local_block", "-1"}}, M3_ERR_CONFIG, "sparse_local_block = -1 is out of range"},
    {{{TEXT, "num_attention_heads", "6"}}, M3_ERR_CONFIG,
     "num_attention_heads = 6 is not a multiple of num_key_value_heads = 4"},
    {{{TEXT, "head_dim", "127"}}, M3_ERR_CONFIG, "head_dim = 127 must be even"},
    {{{TEXT, "rotary_dim", "256"}}, M3_ERR_CONFIG, "rotary_dim = 256 is out of range"},
    {{{TEXT, "rotary_dim", "0"}, {TEXT, "partial_rotary_factor", NULL}}, M3_ERR_CONFIG,
     "rotary_dim = 0 is out of range"},
    {{{TEXT, "rotary_dim", "32"}}, M3_ERR_CONFIG,
     "rotary_dim = 32 disagrees with partial_rotary_factor"},
    {{{HF, "rotary_dim", "128"}}, M3_ERR_CONFIG,
     "rotary_dim = 128 disagrees with partial_rotary_factor"},
    {{{TEXT, "rotary_dim", "63"}, {TEXT, "partial_rotary_factor", NULL}}, M3_ERR_CONFIG,
     "rotary_dim = 63 must be even"},
    {{{TEXT, "partial_rotary_factor", "0"}}, M3_ERR_CONFIG, "partial_rotary_factor = 0"},
    {{{TEXT, "partial_rotary_factor", "1.5"}}, M3_ERR_CONFIG, "partial_rotary_factor = 1.5"},
    {{{TEXT, "rope_theta", "1"}}, M3_ERR_CONFIG, "rope_theta = 1 must be > 1"},
    {{{TEXT, "rms_norm_eps", "0"}}, M3_ERR_CONFIG, "rms_norm_eps = 0"},
    {{{TEXT, "swiglu_limit", "0"}}, M3_ERR_CONFIG, "swiglu_limit = 0 must be > 0"},
    /* fp32 fields judged as fp32 (found by fuzz_config: 1e-46 is 0 as a float) */
    {{{TEXT, "rms_norm_eps", "1e-46"}}, M3_ERR_CONFIG, "rms_norm_eps = 1e-46 must be in (0, 1)"},
    {{{TEXT, "rms_norm_eps", "0.99999999999"}}, M3_ERR_CONFIG, "must be in (0, 1) as fp32"},
    {{{TEXT, "swiglu_limit", "1e-50"}}, M3_ERR_CONFIG, "swiglu_limit = 1e-50 must be > 0"},
    {{{TEXT, "swiglu_limit", "1e300"}}, M3_ERR_CONFIG, "swiglu_limit = 1e+300 is outside fp32"},
    {{{TEXT, "swiglu_alpha", "-1e39"}}, M3_ERR_CONFIG, "swiglu_alpha = -1e+39 is outside fp32"},
    {{{TEXT, "routed_scaling_factor", "1e-60"}}, M3_ERR_CONFIG,
     "routed_scaling_factor = 1e-60 must be > 0"},
    {{{TEXT, "routed_scaling_factor", "4e38"}}, M3_ERR_CONFIG,
     "routed_scaling_factor = 4e+38 is outside fp32"},

    /* per-layer lists */
    {{{TEXT, "moe_layer_freq", FLAGS_59}}, M3_ERR_CONFIG,
     "'moe_layer_freq' has 59 entries for 60 layers"},
    {{{SPARSE, "sparse_attention_freq", FLAGS_59}}, M3_ERR_CONFIG,
     "'sparse_attention_freq' has 59 entries for 60 layers"},
    {{{SPARSE, "sparse_disable_index_value", "[" X3("0") "," X57("1") ",1]"}}, M3_ERR_CONFIG,
     "'sparse_disable_index_value' has 61 entries for 60 layers"},
    {{{TEXT, "moe_layer_freq", "[" X3("0") "," X56("1") ",2]"}}, M3_ERR_CONFIG,
     "moe_layer_freq[59] must be 0 or 1"},
    {{{SPARSE, "sparse_attention_freq", "[" X3("0") ",0.5," X56("1") "]"}}, M3_ERR_CONFIG,
     "sparse_attention_freq[3] must be 0 or 1"},
    {{{TEXT, "moe_layer_freq", "[" X3("0") "," X56("1") ",true]"}}, M3_ERR_CONFIG,
     "moe_layer_freq[59] must be 0 or 1"},
    {{{TEXT, "moe_layer_freq", "1"}}, M3_ERR_CONFIG, "'moe_layer_freq' must be a list"},
    {{{HF, "layer_types", "[" X3(FA) "," X56(SA) ",\"linear_attention\"]"}}, M3_ERR_CONFIG,
     "layer_types[59] = linear_attention is not a known layer type"},
    {{{HF, "layer_types", "[" X3(FA) "," X56(SA) ",1]"}}, M3_ERR_CONFIG,
     "layer_types[59] = (not a string)"},
    {{{HF, "mlp_layer_types", "[\"shared\"," X2(DENSE) "," X57(MOE) "]"}}, M3_ERR_CONFIG,
     "mlp_layer_types[0] = shared is not a known layer type"},
    {{{HF, "layer_types", "[" X3(FA) "," X56(SA) "]"}}, M3_ERR_CONFIG,
     "'layer_types' has 59 entries for 60 layers"},
    {{{HF, "mlp_layer_types", "\"sparse\""}}, M3_ERR_CONFIG,
     "'mlp_layer_types' must be a list of strings"},

    /* sparse attention the engine cannot run */
    {{{SPARSE, "sparse_block_size", "64"}}, M3_ERR_UNSUPPORTED, "sparse_block_size = 64"},
    {{{HF, "index_block_size", "256"}}, M3_ERR_UNSUPPORTED, "256 is not supported"},
    {{{SPARSE, "sparse_num_index_heads", "8"}}, M3_ERR_UNSUPPORTED,
     "sparse_num_index_heads = 8 must equal num_key_value_heads = 4"},
    {{{HF, "index_n_heads", "1"}}, M3_ERR_UNSUPPORTED, "must equal num_key_value_heads"},
    {{{SPARSE, "sparse_index_dim", "32"}}, M3_ERR_CONFIG, "sparse_index_dim = 32"},
    {{{SPARSE, "sparse_index_dim", "127"}}, M3_ERR_CONFIG, "sparse_index_dim = 127"},
    {{{SPARSE, "sparse_init_block", "16"}}, M3_ERR_CONFIG,
     "sparse_init_block + sparse_local_block = 17 exceeds sparse_topk_blocks = 16"},
    {{{HF, "index_topk_blocks", "1"}, {HF, "index_init_blocks", "1"}}, M3_ERR_CONFIG,
     "exceeds sparse_topk_blocks = 1"},
    {{{SPARSE, "sparse_score_type", "\"sum\""}}, M3_ERR_UNSUPPORTED,
     "sparse_score_type = sum is not supported"},
    {{{SPARSE, "sparse_disable_index_value", "[" X3("0") "," X56("1") ",0]"}},
     M3_ERR_UNSUPPORTED, "sparse_disable_index_value[59] = 0"},
    {{{SPARSE, "sparse_disable_index_value", ALL_ZERO}}, M3_ERR_UNSUPPORTED,
     "sparse_disable_index_value[3] = 0"},
    {{{SPARSE, "sparse_disable_index_value", "false"}}, M3_ERR_UNSUPPORTED,
     "sparse_disable_index_value = false"},

    /* FFN the engine cannot run */
    {{{TEXT, "scoring_func", "\"softmax\""}}, M3_ERR_UNSUPPORTED,
     "scoring_func = softmax is not supported"},
    {{{TEXT, "hidden_act", "\"gelu\""}}, M3_ERR_UNSUPPORTED, "hidden_act = gelu is not supported"},
    /* "silu" names SwiGLU-OAI only in the flattened spelling */
    {{{TEXT, "hidden_act", "\"silu\""}}, M3_ERR_UNSUPPORTED, "hidden_act = silu"},
    {{{HF, "hidden_act", "\"gelu_pytorch_tanh\""}}, M3_ERR_UNSUPPORTED,
     "hidden_act = gelu_pytorch_tanh"},
    {{{TEXT, "swiglu_beta", "2"}}, M3_ERR_UNSUPPORTED, "swiglu_beta = 2 is not supported"},
    {{{TEXT, "n_shared_experts", "2"}}, M3_ERR_UNSUPPORTED, "n_shared_experts = 2"},
    {{{TEXT, "shared_intermediate_size", NULL}}, M3_ERR_CONFIG,
     "n_shared_experts = 1 needs shared_intermediate_size"},
    {{{TEXT, "num_local_experts", "2"}}, M3_ERR_CONFIG,
     "num_experts_per_tok = 4 exceeds num_local_experts = 2"},

    /* attention and norms the engine cannot run */
    {{{TEXT, "use_gemma_norm", "false"}}, M3_ERR_UNSUPPORTED, "use_gemma_norm = false"},
    {{{TEXT, "qk_norm_type", "\"per_layer\""}}, M3_ERR_UNSUPPORTED,
     "qk_norm_type = per_layer is not supported"},
    {{{TEXT, "use_qk_norm", "false"}}, M3_ERR_UNSUPPORTED, "use_qk_norm = false"},
    {{{TEXT, "attention_output_gate", "true"}}, M3_ERR_UNSUPPORTED,
     "attention_output_gate = true"},
    {{{TEXT, "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}"}}, M3_ERR_UNSUPPORTED,
     "rope_scaling (yarn) is not supported"},
    {{{TEXT, "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}"}}, M3_ERR_UNSUPPORTED,
     "rope_scaling (linear)"},
    {{{TEXT, "rope_scaling", "{\"factor\": 2.0}"}}, M3_ERR_UNSUPPORTED, "rope_scaling (set)"},
    {{{HF, "rope_parameters", "{\"rope_type\": \"yarn\", \"rope_theta\": 5000000}"}},
     M3_ERR_UNSUPPORTED, "rope_type = yarn is not supported"},

    /* another model */
    {{{TEXT, "model_type", "\"llama\""}}, M3_ERR_UNSUPPORTED, "model_type = llama is not MiniMax-M3"},
    {{{HF, "model_type", "\"minimax_m2\""}}, M3_ERR_UNSUPPORTED,
     "model_type = minimax_m2 is not MiniMax-M3"},
    {{{ROOT, "text_config", NULL}, {ROOT, "model_type", "\"qwen2_vl\""}}, M3_ERR_UNSUPPORTED,
     "model_type = qwen2_vl"},
};

static void test_validation(void) {
    m3_config c;
    CHECK_FAILS(parse_text("{\"hidden_size\": 6144,", &c), M3_ERR_FORMAT, "not valid JSON");
    CHECK_FAILS(parse_text("", &c), M3_ERR_FORMAT, "not valid JSON");
    CHECK_FAILS(parse_text("[{\"hidden_size\": 6144}]", &c), M3_ERR_CONFIG,
                "the top level must be an object");
    CHECK_FAILS(parse_text("\"config\"", &c), M3_ERR_CONFIG, "the top level must be an object");
    /* len bounds the text: a cut-short copy of a valid config is not JSON */
    CHECK_FAILS(m3_config_parse(M3_NESTED, strlen(M3_NESTED) - 1, &c), M3_ERR_FORMAT,
                "not valid JSON");

    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *b = &bad_cases[i];
        int before = check_failures_;
        CHECK_FAILS(parse_mutated(b->m, 4, &c), b->status, b->msg);
        if (check_failures_ != before)
            fprintf(stderr, "  ^ bad case %zu: %s = %s\n", i, b->m[0].field,
                    b->m[0].value ? b->m[0].value : "(deleted)");
    }

    /* a refused config leaves *out zeroed, never half filled */
    m3_config z;
    memset(&z, 0xab, sizeof z);
    CHECK(parse_with(TEXT, "hidden_size", "0", &z) == M3_ERR_CONFIG);
    CHECK(z.hidden_size == 0 && z.num_layers == 0 && z.vocab_size == 0);

    /* fields are required only where a layer uses them */
    const mutation no_moe[] = {
        {TEXT, "moe_layer_freq", ALL_ZERO},
        {TEXT, "intermediate_size", NULL},
        {TEXT, "num_local_experts", NULL},
        {TEXT, "num_experts_per_tok", NULL},
    };
    CHECK_OK(parse_mutated(no_moe, 4, &c));
    CHECK(c.expert_dim == 0 && c.num_experts == 0 && !c.layer_moe[10]);
    const mutation no_dense[] = {
        {TEXT, "moe_layer_freq", ALL_ONE},
        {TEXT, "dense_intermediate_size", NULL},
    };
    CHECK_OK(parse_mutated(no_dense, 2, &c));
    CHECK(c.dense_dim == 0 && c.layer_moe[0]);
    const mutation no_sparse[] = {
        {SPARSE, "sparse_attention_freq", ALL_ZERO},
        {SPARSE, "sparse_num_index_heads", NULL},
        {SPARSE, "sparse_index_dim", NULL},
        {SPARSE, "sparse_topk_blocks", NULL},
    };
    CHECK_OK(parse_mutated(no_sparse, 4, &c));
    CHECK(c.index_heads == 0 && !c.layer_sparse[10]);
    /* index value weights only matter on sparse layers: layers 0-2 of the
     * released config already carry 0; a plain `true` disables them all */
    CHECK_OK(parse_with(SPARSE, "sparse_disable_index_value", "true", &c));
    CHECK_OK(parse_with(SPARSE, "sparse_disable_index_value", NULL, &c));
    /* no shared expert */
    const mutation no_shared[] = {{TEXT, "n_shared_experts", "0"}};
    CHECK_OK(parse_mutated(no_shared, 1, &c));
    CHECK(c.shared_dim == 0);
    CHECK_OK(parse_with(TEXT, "swiglu_beta", "1.0", &c));
}

/* Derived values (head_dim from hidden_size / heads, rotary_dim from
 * partial_rotary_factor) must obey the ranges the explicit fields do:
 * otherwise a config spelled one way is refused and the same config spelled
 * the other way reaches the kernels. */
static void test_derived_values_validated(void) {
    m3_config c;
    /* 32 / 64 heads = head_dim 0, refused when written out (head_dim 0 is
     * out of range) */
    const mutation head0[] = {
        {TEXT, "head_dim", NULL},
        {TEXT, "rotary_dim", NULL},
        {TEXT, "partial_rotary_factor", NULL},
        {TEXT, "hidden_size", "32"},
    };
    CHECK_FAILS(parse_mutated(head0, 4, &c), M3_ERR_CONFIG, "head_dim");
    /* 0.001 x 128 rounds to rotary_dim 0, refused when written out */
    const mutation rot0[] = {
        {TEXT, "rotary_dim", NULL},
        {TEXT, "partial_rotary_factor", "0.001"},
    };
    CHECK_FAILS(parse_mutated(rot0, 2, &c), M3_ERR_CONFIG, "rotary_dim");
    /* eos ids are token ids: integers, like every other id field */
    CHECK_FAILS(parse_with(TEXT, "eos_token_id", "200019.5", &c), M3_ERR_CONFIG, "eos_token_id");
}

/* ------------------------------------------------------------ files */

static void test_load(void) {
    m3_config c, want;
    CHECK_OK(m3_preset("m3", &want));
    CHECK_FAILS(m3_config_load("no_such_dir_m3/config.json", &c), M3_ERR_IO,
                "no_such_dir_m3/config.json");

    char path[64];
    snprintf(path, sizeof path, "config_test_%ld.json", (long)getpid());
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f)
        return;
    fputs(M3_NESTED, f);
    fclose(f);
    CHECK_OK(m3_config_load(path, &c));
    CHECK(config_same(&c, &want, "loaded from file"));

    /* a refused file names itself and the field */
    f = fopen(path, "wb");
    if (f) {
        fputs("{\"num_hidden_layers\": 2}", f);
        fclose(f);
        CHECK_FAILS(m3_config_load(path, &c), M3_ERR_CONFIG, path);
        CHECK(strstr(m3_last_error(), "hidden_size") != NULL);
    }
    /* a folder is not a config file (the caller passed the checkpoint
     * folder instead of its config.json) */
    char dir[64];
    snprintf(dir, sizeof dir, "config_test_dir_%ld", (long)getpid());
    if (mkdir(dir, 0700) == 0) {
        CHECK_FAILS(m3_config_load(dir, &c), M3_ERR_IO, dir);
        rmdir(dir);
    }
    /* an empty file is not JSON */
    f = fopen(path, "wb");
    if (f) {
        fclose(f);
        CHECK_FAILS(m3_config_load(path, &c), M3_ERR_FORMAT, "not valid JSON");
    }
    remove(path);
}

/* The CUDA backend's shape check (m3_cuda_check_config): it needs no GPU,
 * so a CUDA build checks it here; a build without CUDA has the stub. */
static void test_cuda_shapes(void) {
    m3_config c;
    CHECK_OK(m3_preset("tiny", &c));
    CHECK_OK(m3_cuda_check_config(&c));
    CHECK_OK(m3_preset("m3-tp4-rank", &c));
    CHECK_OK(m3_cuda_check_config(&c));
#ifdef M3_HAVE_CUDA
    m3_config bad;
    CHECK_OK(m3_preset("tiny", &bad));
    bad.head_dim = 48;
    CHECK_FAILS(m3_cuda_check_config(&bad), M3_ERR_UNSUPPORTED,
                "head_dim 48 (attention takes multiples of 32 up to 256)");
    CHECK_OK(m3_preset("tiny", &bad));
    bad.index_dim = 12;
    CHECK_FAILS(m3_cuda_check_config(&bad), M3_ERR_UNSUPPORTED, "sparse_index_dim 12");
    CHECK_OK(m3_preset("tiny", &bad));
    bad.expert_dim = 100;
    bad.experts_per_tok = 65;
    bad.num_experts = 70;
    CHECK_FAILS(m3_cuda_check_config(&bad), M3_ERR_UNSUPPORTED, "65 experts per token");
    CHECK(strstr(m3_last_error(), "expert width 100") != NULL); /* every reason, joined */
    /* a model without MoE layers: the MoE limits do not apply */
    CHECK_OK(m3_preset("tiny", &bad));
    CHECK_OK(m3_config_cut_layers(&bad, 1)); /* tiny's layer 0: dense */
    bad.hidden_size = 200;
    CHECK_OK(m3_cuda_check_config(&bad));
    /* nor the index limits without sparse layers */
    bad.index_dim = 12;
    CHECK_OK(m3_cuda_check_config(&bad));
#endif
}

int main(void) {
    test_cuda_shapes();
    test_released_spellings();
    test_defaults();
    test_round_trip();
    test_cut_layers();
    test_eos();
    test_quantization();
    test_validation();
    test_derived_values_validated();
    test_load();
    return check_summary("test_config");
}
