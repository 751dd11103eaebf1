/*
 * config.json -> m3_config. MiniMax-M3 configs come in two spellings
 * (SPEC §2.1): the released one, nested under text_config with a
 * `sparse_attention_config` object and per-layer 0/1 lists
 * (`moe_layer_freq`, `sparse_attention_freq`), and the flattened one of newer
 * Hugging Face exports (`index_*` fields, `layer_types`, `mlp_layer_types`,
 * `rope_parameters`). Both land in the same struct. Everything the engine
 * cannot run (another block size, softmax routing, plain RMSNorm, RoPE
 * scaling, ...) is refused here with a message naming the field and value,
 * so later code can trust the struct.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/config_json.h"

/* ------------------------------------------------------------ field access */

typedef struct {
    const cJSON *text; /* the text config object */
    const cJSON *root; /* the file's top-level object */
} cfg_src;

/* The first of the (NULL-terminated) names present in obj, or NULL. */
static const cJSON *find_any(const cJSON *obj, const char *const *names, const char **found) {
    for (int i = 0; obj && names[i]; i++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, names[i]);
        if (it && !cJSON_IsNull(it)) {
            if (found)
                *found = names[i];
            return it;
        }
    }
    return NULL;
}

#define NAMES(...) ((const char *const[]){__VA_ARGS__, NULL})

/* An integer field: required (no default) unless has_default. */
static m3_status get_int(const cJSON *obj, const char *const *names, bool has_default,
                         int64_t def, int64_t lo, int64_t hi, int64_t *out) {
    const char *name = names[0];
    const cJSON *it = find_any(obj, names, &name);
    if (!it) {
        if (has_default) {
            *out = def;
            return M3_OK;
        }
        if (names[1])
            return m3_fail(M3_ERR_CONFIG, "config.json: missing required field '%s' (or '%s')",
                           names[0], names[1]);
        return m3_fail(M3_ERR_CONFIG, "config.json: missing required field '%s'", names[0]);
    }
    double v = it->valuedouble;
    if (!cJSON_IsNumber(it) || v != floor(v) || fabs(v) > 9007199254740992.0)
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be an integer", name);
    if ((int64_t)v < lo || (int64_t)v > hi)
        return m3_fail(M3_ERR_CONFIG, "config.json: %s = %lld is out of range [%lld, %lld]",
                       name, (long long)v, (long long)lo, (long long)hi);
    *out = (int64_t)v;
    return M3_OK;
}

static m3_status get_num(const cJSON *obj, const char *const *names, bool has_default,
                         double def, double *out) {
    const char *name = names[0];
    const cJSON *it = find_any(obj, names, &name);
    if (!it) {
        if (has_default) {
            *out = def;
            return M3_OK;
        }
        return m3_fail(M3_ERR_CONFIG, "config.json: missing required field '%s'", names[0]);
    }
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be a finite number", name);
    *out = it->valuedouble;
    return M3_OK;
}

/* A number the engine keeps as fp32 (norm epsilon, routing scale, SwiGLU
 * constants): it must be finite as fp32, and the range checks apply to the
 * fp32 value, since that is what the math uses (1e-46 passes "> 0" as a
 * double and is 0 as a float). */
static m3_status to_f32(const char *name, double v, float *out) {
    float f = (float)v;
    if (!isfinite(f))
        return m3_fail(M3_ERR_CONFIG, "config.json: %s = %g is outside fp32's range", name, v);
    *out = f;
    return M3_OK;
}

static m3_status get_bool(const cJSON *obj, const char *const *names, bool def, bool *out) {
    const char *name = names[0];
    const cJSON *it = find_any(obj, names, &name);
    if (!it) {
        *out = def;
        return M3_OK;
    }
    if (!cJSON_IsBool(it))
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be true or false", name);
    *out = cJSON_IsTrue(it);
    return M3_OK;
}

/* A string field; *out is NULL when absent. */
static m3_status get_str(const cJSON *obj, const char *const *names, const char **out) {
    const char *name = names[0];
    const cJSON *it = find_any(obj, names, &name);
    *out = NULL;
    if (!it)
        return M3_OK;
    if (!cJSON_IsString(it))
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be a string", name);
    *out = it->valuestring;
    return M3_OK;
}

#define INT_FIELD(obj, dst, names, hasdef, def, lo, hi)                    \
    do {                                                                   \
        int64_t v_;                                                        \
        M3_TRY(get_int((obj), names, (hasdef), (def), (lo), (hi), &v_));   \
        (dst) = (int)v_;                                                   \
    } while (0)

/* ------------------------------------------------------------ per-layer lists */

/* A per-layer 0/1 list (released spelling): flags[i] = value != 0. */
static m3_status layer_flag_list(const cJSON *it, const char *name, int layers, bool *flags) {
    if (!cJSON_IsArray(it))
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be a list of 0/1, one per layer",
                       name);
    int n = cJSON_GetArraySize(it);
    if (n != layers)
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' has %d entries for %d layers", name, n,
                       layers);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, it) {
        if (!cJSON_IsNumber(e) || (e->valuedouble != 0 && e->valuedouble != 1))
            return m3_fail(M3_ERR_CONFIG, "config.json: %s[%d] must be 0 or 1", name, i);
        flags[i++] = e->valuedouble != 0;
    }
    return M3_OK;
}

/* A per-layer list of type names (flattened spelling): flags[i] = the entry
 * is one of yes[], else it must be one of no[]. */
static m3_status layer_type_list(const cJSON *it, const char *name, int layers,
                                 const char *const *yes, const char *const *no, bool *flags) {
    if (!cJSON_IsArray(it))
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be a list of strings", name);
    int n = cJSON_GetArraySize(it);
    if (n != layers)
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' has %d entries for %d layers", name, n,
                       layers);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, it) {
        bool known = false;
        for (int k = 0; cJSON_IsString(e) && yes[k]; k++)
            if (!strcmp(e->valuestring, yes[k]))
                known = flags[i] = true;
        for (int k = 0; cJSON_IsString(e) && no[k]; k++)
            if (!strcmp(e->valuestring, no[k])) {
                known = true;
                flags[i] = false;
            }
        if (!known)
            return m3_fail(M3_ERR_CONFIG, "config.json: %s[%d] = %s is not a known layer type",
                           name, i, cJSON_IsString(e) ? e->valuestring : "(not a string)");
        i++;
    }
    return M3_OK;
}

/* ------------------------------------------------------------ sections */

static m3_status parse_attention(const cJSON *t, m3_config *c) {
    int64_t v;
    INT_FIELD(t, c->hidden_size, NAMES("hidden_size"), false, 0, 1, 65536);
    INT_FIELD(t, c->num_layers, NAMES("num_hidden_layers"), false, 0, 1, M3_MAX_LAYERS);
    INT_FIELD(t, c->num_q_heads, NAMES("num_attention_heads"), false, 0, 1, 1024);
    INT_FIELD(t, c->num_kv_heads, NAMES("num_key_value_heads"), false, 0, 1, 1024);
    M3_TRY(get_int(t, NAMES("head_dim"), true, c->hidden_size / c->num_q_heads, 2, 1024, &v));
    c->head_dim = (int)v;
    if (c->head_dim < 2 || c->head_dim > 1024) /* a derived default is checked too */
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: head_dim = hidden_size / num_attention_heads = %d is out of "
                       "range [2, 1024]; give head_dim",
                       c->head_dim);
    if (c->num_q_heads % c->num_kv_heads)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: num_attention_heads = %d is not a multiple of "
                       "num_key_value_heads = %d",
                       c->num_q_heads, c->num_kv_heads);
    if (c->head_dim % 2)
        return m3_fail(M3_ERR_CONFIG, "config.json: head_dim = %d must be even", c->head_dim);

    /* RoPE: rotary_dim, or partial_rotary_factor x head_dim (top level or in
     * rope_parameters); theta likewise. Scaled RoPE variants are refused. */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(t, "rope_parameters");
    if (rp && !cJSON_IsNull(rp) && !cJSON_IsObject(rp))
        return m3_fail(M3_ERR_CONFIG, "config.json: 'rope_parameters' must be an object");
    const char *rope_type = NULL;
    M3_TRY(get_str(rp, NAMES("rope_type", "type"), &rope_type));
    if (rope_type && strcmp(rope_type, "default"))
        return m3_fail(M3_ERR_UNSUPPORTED, "config.json: rope_type = %s is not supported (only "
                       "default RoPE)", rope_type);
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(t, "rope_scaling");
    if (rs && !cJSON_IsNull(rs)) {
        const char *rs_type = NULL;
        M3_TRY(get_str(rs, NAMES("rope_type", "type"), &rs_type));
        if (!rs_type || strcmp(rs_type, "default"))
            return m3_fail(M3_ERR_UNSUPPORTED,
                           "config.json: rope_scaling (%s) is not supported (only default RoPE)",
                           rs_type ? rs_type : "set");
    }
    double factor = 1.0;
    const cJSON *pf_obj = find_any(t, NAMES("partial_rotary_factor"), NULL) ? t : rp;
    M3_TRY(get_num(pf_obj, NAMES("partial_rotary_factor"), true, 1.0, &factor));
    if (!(factor > 0 && factor <= 1))
        return m3_fail(M3_ERR_CONFIG, "config.json: partial_rotary_factor = %g must be in (0, 1]",
                       factor);
    double exact = factor * c->head_dim;
    int from_factor = (int)lround(exact);
    if (fabs(exact - from_factor) > 1e-6 || from_factor < 2)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: rotary_dim = partial_rotary_factor %g x head_dim %d = %g "
                       "is not a whole number of at least 2 dimensions",
                       factor, c->head_dim, exact);
    M3_TRY(get_int(t, NAMES("rotary_dim"), true, from_factor, 2, c->head_dim, &v));
    c->rotary_dim = (int)v;
    if (find_any(t, NAMES("rotary_dim"), NULL) &&
        find_any(pf_obj, NAMES("partial_rotary_factor"), NULL) && from_factor != c->rotary_dim)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: rotary_dim = %d disagrees with partial_rotary_factor = %g "
                       "x head_dim = %d",
                       c->rotary_dim, factor, c->head_dim);
    if (c->rotary_dim % 2)
        return m3_fail(M3_ERR_CONFIG, "config.json: rotary_dim = %d must be even", c->rotary_dim);
    double theta;
    const cJSON *th_obj = find_any(t, NAMES("rope_theta"), NULL) ? t : rp;
    M3_TRY(get_num(th_obj, NAMES("rope_theta"), true, 5000000.0, &theta));
    if (!(theta > 1))
        return m3_fail(M3_ERR_CONFIG, "config.json: rope_theta = %g must be > 1", theta);
    c->rope_theta = theta;

    bool flag;
    M3_TRY(get_bool(t, NAMES("use_qk_norm"), true, &flag));
    if (!flag)
        return m3_fail(M3_ERR_UNSUPPORTED, "config.json: use_qk_norm = false is not supported");
    const char *qk_type;
    M3_TRY(get_str(t, NAMES("qk_norm_type"), &qk_type));
    if (qk_type && strcmp(qk_type, "per_head"))
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: qk_norm_type = %s is not supported (only per_head)", qk_type);
    M3_TRY(get_bool(t, NAMES("attention_output_gate"), false, &flag));
    if (flag)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: attention_output_gate = true is not supported");
    M3_TRY(get_bool(t, NAMES("use_gemma_norm"), true, &flag));
    if (!flag)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: use_gemma_norm = false is not supported (every norm is "
                       "Gemma RMSNorm)");
    double eps;
    M3_TRY(get_num(t, NAMES("rms_norm_eps"), true, 1e-6, &eps));
    M3_TRY(to_f32("rms_norm_eps", eps, &c->rms_norm_eps));
    if (!(c->rms_norm_eps > 0 && c->rms_norm_eps < 1))
        return m3_fail(M3_ERR_CONFIG, "config.json: rms_norm_eps = %g must be in (0, 1) as fp32",
                       eps);
    M3_TRY(get_int(t, NAMES("max_position_embeddings"), true, 1 << 20, 1, (int64_t)1 << 32, &v));
    c->max_position_embeddings = v;
    return M3_OK;
}

static m3_status parse_sparse(const cJSON *t, m3_config *c) {
    /* the released object, or the flattened index_* fields in the text config */
    const cJSON *sc = cJSON_GetObjectItemCaseSensitive(t, "sparse_attention_config");
    if (sc && !cJSON_IsNull(sc) && !cJSON_IsObject(sc))
        return m3_fail(M3_ERR_CONFIG, "config.json: 'sparse_attention_config' must be an object");
    const cJSON *s = sc && cJSON_IsObject(sc) ? sc : t;
    int L = c->num_layers;

    const cJSON *freq = find_any(s, NAMES("sparse_attention_freq"), NULL);
    const cJSON *types = find_any(t, NAMES("layer_types"), NULL);
    if (freq)
        M3_TRY(layer_flag_list(freq, "sparse_attention_freq", L, c->layer_sparse));
    else if (types)
        M3_TRY(layer_type_list(types, "layer_types", L,
                               NAMES("minimax_m3_sparse", "sparse_attention"),
                               NAMES("full_attention", "dense_attention"), c->layer_sparse));
    bool use_sparse = true;
    M3_TRY(get_bool(s, NAMES("use_sparse_attention"), true, &use_sparse));
    bool configured = (sc && cJSON_IsObject(sc)) || find_any(t, NAMES("index_topk_blocks"), NULL);
    if (use_sparse && configured && !freq && !types)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: sparse attention is configured but no layer says whether it "
                       "is sparse (sparse_attention_freq or layer_types is missing)");
    int n_sparse = 0;
    for (int i = 0; i < L; i++) {
        c->layer_sparse[i] = c->layer_sparse[i] && use_sparse;
        n_sparse += c->layer_sparse[i];
    }

    INT_FIELD(s, c->block_size, NAMES("sparse_block_size", "index_block_size"), true, 128, 1,
              1 << 20);
    if (c->block_size != 128)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: sparse_block_size = %d is not supported (the page and "
                       "block size is 128)",
                       c->block_size);
    if (!n_sparse) {
        c->index_heads = c->index_dim = c->topk_blocks = 0;
        return M3_OK;
    }
    INT_FIELD(s, c->index_heads, NAMES("sparse_num_index_heads", "index_n_heads"), false, 0, 1,
              1024);
    INT_FIELD(s, c->index_dim, NAMES("sparse_index_dim", "index_head_dim"), false, 0, 2, 1024);
    INT_FIELD(s, c->topk_blocks, NAMES("sparse_topk_blocks", "index_topk_blocks"), false, 0, 1,
              1 << 20);
    INT_FIELD(s, c->init_blocks, NAMES("sparse_init_block", "index_init_blocks"), true, 0, 0,
              1 << 20);
    INT_FIELD(s, c->local_blocks, NAMES("sparse_local_block", "index_local_blocks"), true, 1, 0,
              1 << 20);
    if (c->index_heads != c->num_kv_heads)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: sparse_num_index_heads = %d must equal num_key_value_heads "
                       "= %d (each index head selects for its KV group)",
                       c->index_heads, c->num_kv_heads);
    if (c->index_dim % 2 || c->index_dim < c->rotary_dim)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: sparse_index_dim = %d must be even and at least rotary_dim "
                       "= %d",
                       c->index_dim, c->rotary_dim);
    if (c->init_blocks + c->local_blocks > c->topk_blocks)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: sparse_init_block + sparse_local_block = %d exceeds "
                       "sparse_topk_blocks = %d (forced blocks count inside the top-k)",
                       c->init_blocks + c->local_blocks, c->topk_blocks);
    const char *score_type;
    M3_TRY(get_str(s, NAMES("sparse_score_type"), &score_type));
    if (score_type && strcmp(score_type, "max"))
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: sparse_score_type = %s is not supported (only max)",
                       score_type);
    /* index value/output weights: the engine has none, so every sparse layer
     * must disable them */
    const cJSON *dv = find_any(s, NAMES("sparse_disable_index_value"), NULL);
    if (dv && cJSON_IsBool(dv)) {
        if (!cJSON_IsTrue(dv))
            return m3_fail(M3_ERR_UNSUPPORTED,
                           "config.json: sparse_disable_index_value = false is not supported");
    } else if (dv) {
        bool disabled[M3_MAX_LAYERS] = {0};
        M3_TRY(layer_flag_list(dv, "sparse_disable_index_value", L, disabled));
        for (int i = 0; i < L; i++)
            if (c->layer_sparse[i] && !disabled[i])
                return m3_fail(M3_ERR_UNSUPPORTED,
                               "config.json: sparse_disable_index_value[%d] = 0: index value "
                               "weights are not supported",
                               i);
    }
    return M3_OK;
}

/* SwiGLU-OAI everywhere. Flattened Hugging Face exports write "silu" for
 * the same activation (their modeling code applies the OAI clamps). */
static m3_status parse_swiglu(const cJSON *t, m3_config *c, bool flattened) {
    const char *act;
    M3_TRY(get_str(t, NAMES("hidden_act"), &act));
    if (act && strcmp(act, "swigluoai") && !(flattened && !strcmp(act, "silu")))
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: hidden_act = %s is not supported (only swigluoai)", act);
    double alpha, limit, beta;
    M3_TRY(get_num(t, NAMES("swiglu_alpha"), true, 1.702, &alpha));
    M3_TRY(get_num(t, NAMES("swiglu_limit"), true, 7.0, &limit));
    M3_TRY(get_num(t, NAMES("swiglu_beta"), true, 1.0, &beta));
    if (beta != 1.0)
        return m3_fail(M3_ERR_UNSUPPORTED, "config.json: swiglu_beta = %g is not supported (1)",
                       beta);
    M3_TRY(to_f32("swiglu_alpha", alpha, &c->swiglu_alpha));
    M3_TRY(to_f32("swiglu_limit", limit, &c->swiglu_limit));
    if (!(c->swiglu_limit > 0))
        return m3_fail(M3_ERR_CONFIG, "config.json: swiglu_limit = %g must be > 0 as fp32",
                       limit);
    return M3_OK;
}

static m3_status parse_ffn(const cJSON *t, m3_config *c, bool flattened) {
    int L = c->num_layers;
    const cJSON *freq = find_any(t, NAMES("moe_layer_freq"), NULL);
    const cJSON *types = find_any(t, NAMES("mlp_layer_types"), NULL);
    if (freq)
        M3_TRY(layer_flag_list(freq, "moe_layer_freq", L, c->layer_moe));
    else if (types)
        M3_TRY(layer_type_list(types, "mlp_layer_types", L, NAMES("sparse", "moe"),
                               NAMES("dense"), c->layer_moe));
    else
        for (int i = 0; i < L; i++)
            c->layer_moe[i] = true; /* Hugging Face's default: every layer MoE */
    int n_moe = 0;
    for (int i = 0; i < L; i++)
        n_moe += c->layer_moe[i];

    if (n_moe < L)
        INT_FIELD(t, c->dense_dim, NAMES("dense_intermediate_size", "mlp_intermediate_size"),
                  false, 0, 1, 1 << 20);
    if (n_moe) {
        INT_FIELD(t, c->expert_dim, NAMES("intermediate_size", "moe_intermediate_size"), false, 0,
                  1, 1 << 20);
        INT_FIELD(t, c->num_experts, NAMES("num_local_experts", "n_routed_experts"), false, 0, 1,
                  4096);
        INT_FIELD(t, c->experts_per_tok, NAMES("num_experts_per_tok"), false, 0, 1, 64);
        if (c->experts_per_tok > c->num_experts)
            return m3_fail(M3_ERR_CONFIG,
                           "config.json: num_experts_per_tok = %d exceeds num_local_experts = %d",
                           c->experts_per_tok, c->num_experts);
        int shared_width = 0, n_shared = 0;
        INT_FIELD(t, shared_width, NAMES("shared_intermediate_size"), true, 0, 0, 1 << 20);
        INT_FIELD(t, n_shared, NAMES("n_shared_experts", "num_shared_experts"), true,
                  shared_width > 0, 0, 64);
        if (n_shared > 1)
            return m3_fail(M3_ERR_UNSUPPORTED,
                           "config.json: n_shared_experts = %d is not supported (0 or 1)",
                           n_shared);
        if (n_shared && !shared_width)
            return m3_fail(M3_ERR_CONFIG,
                           "config.json: n_shared_experts = 1 needs shared_intermediate_size");
        c->shared_dim = n_shared ? shared_width : 0;
        const char *scoring;
        M3_TRY(get_str(t, NAMES("scoring_func"), &scoring));
        if (scoring && strcmp(scoring, "sigmoid"))
            return m3_fail(M3_ERR_UNSUPPORTED,
                           "config.json: scoring_func = %s is not supported (only sigmoid)",
                           scoring);
        M3_TRY(get_bool(t, NAMES("use_routing_bias"), true, &c->use_routing_bias));
        double rsf;
        M3_TRY(get_num(t, NAMES("routed_scaling_factor"), true, 1.0, &rsf));
        M3_TRY(to_f32("routed_scaling_factor", rsf, &c->routed_scaling_factor));
        if (!(c->routed_scaling_factor > 0))
            return m3_fail(M3_ERR_CONFIG,
                           "config.json: routed_scaling_factor = %g must be > 0 as fp32", rsf);
    }

    return parse_swiglu(t, c, flattened);
}

static m3_status parse_tokens(const cfg_src *src, m3_config *c) {
    const cJSON *eos = find_any(src->text, NAMES("eos_token_id"), NULL);
    if (!eos)
        eos = find_any(src->root, NAMES("eos_token_id"), NULL);
    c->num_eos = 0;
    if (eos && cJSON_IsNumber(eos)) {
        if (eos->valuedouble != floor(eos->valuedouble) || eos->valuedouble < 0 ||
            eos->valuedouble >= c->vocab_size)
            return m3_fail(M3_ERR_CONFIG, "config.json: eos_token_id = %g is outside the vocab %d",
                           eos->valuedouble, c->vocab_size);
        c->eos_ids[c->num_eos++] = (int32_t)eos->valuedouble;
    } else if (eos && cJSON_IsArray(eos)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, eos) {
            if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) ||
                e->valuedouble < 0 || e->valuedouble >= c->vocab_size)
                return m3_fail(M3_ERR_CONFIG,
                               "config.json: eos_token_id entries must be token ids below the "
                               "vocab size %d",
                               c->vocab_size);
            if (c->num_eos == 8)
                return m3_fail(M3_ERR_UNSUPPORTED,
                               "config.json: eos_token_id lists at most 8 ids are supported");
            c->eos_ids[c->num_eos++] = (int32_t)e->valuedouble;
        }
    } else if (eos) {
        return m3_fail(M3_ERR_CONFIG, "config.json: eos_token_id must be an integer or a list");
    }
    return M3_OK;
}

static m3_status parse_quant(const cfg_src *src, m3_config *c) {
    const cJSON *q = find_any(src->text, NAMES("quantization_config"), NULL);
    if (!q)
        q = find_any(src->root, NAMES("quantization_config"), NULL);
    c->mxfp8 = false;
    if (!q)
        return M3_OK;
    const char *method;
    M3_TRY(get_str(q, NAMES("quant_method"), &method));
    if (!method || strcmp(method, "mxfp8"))
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: quantization_config.quant_method = %s is not supported "
                       "(only mxfp8)",
                       method ? method : "(missing)");
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(q, "weight_block_size");
    if (bs && !(cJSON_IsArray(bs) && cJSON_GetArraySize(bs) == 2 &&
                cJSON_GetArrayItem(bs, 0)->valuedouble == 1 &&
                cJSON_GetArrayItem(bs, 1)->valuedouble == 32))
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: mxfp8 weight_block_size must be [1, 32]");
    c->mxfp8 = true;
    return M3_OK;
}

static bool known_model_type(const char *t) {
    static const char *const known[] = {"minimax_m3", "minimax_m3_vl", "minimax_m3_text",
                                        "minimax_m3_vl_text"};
    for (size_t i = 0; i < sizeof known / sizeof *known; i++)
        if (!strcmp(t, known[i]))
            return true;
    return false;
}

m3_status m3_config_parse(const char *json, size_t len, m3_config *out) {
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return m3_fail(M3_ERR_FORMAT, "config.json: not valid JSON (near byte %zu)",
                       (size_t)(cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - json : 0));
    m3_status st = M3_OK;
    m3_config c = {0};
    cfg_src src = {root, root};
    if (!cJSON_IsObject(root)) {
        st = m3_fail(M3_ERR_CONFIG, "config.json: the top level must be an object");
        goto done;
    }
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (tc && !cJSON_IsNull(tc)) {
        if (!cJSON_IsObject(tc)) {
            st = m3_fail(M3_ERR_CONFIG, "config.json: 'text_config' must be an object");
            goto done;
        }
        src.text = tc;
    }
    for (int level = 0; level < 2; level++) {
        const char *model_type = NULL;
        if ((st = get_str(level ? root : src.text, NAMES("model_type"), &model_type)))
            goto done;
        if (model_type && !known_model_type(model_type)) {
            st = m3_fail(M3_ERR_UNSUPPORTED, "config.json: model_type = %s is not MiniMax-M3",
                         model_type);
            goto done;
        }
    }
    bool flattened = !cJSON_GetObjectItemCaseSensitive(src.text, "sparse_attention_config") &&
                     (cJSON_GetObjectItemCaseSensitive(src.text, "mlp_layer_types") ||
                      cJSON_GetObjectItemCaseSensitive(src.text, "index_topk_blocks"));
    int64_t v;
    if ((st = parse_attention(src.text, &c)) || (st = parse_sparse(src.text, &c)) ||
        (st = parse_ffn(src.text, &c, flattened)))
        goto done;
    if ((st = get_int(src.text, NAMES("vocab_size"), false, 0, 1, 1 << 24, &v)))
        goto done;
    c.vocab_size = (int)v;
    if ((st = get_bool(src.text, NAMES("tie_word_embeddings"), false, &c.tie_word_embeddings)))
        goto done;
    if (!cJSON_GetObjectItemCaseSensitive(src.text, "tie_word_embeddings") &&
        (st = get_bool(root, NAMES("tie_word_embeddings"), false, &c.tie_word_embeddings)))
        goto done;
    if ((st = parse_tokens(&src, &c)) || (st = parse_quant(&src, &c)))
        goto done;
    *out = c;
done:
    cJSON_Delete(root);
    return st;
}

m3_status m3_config_load(const char *path, m3_config *out) {
    char *text = NULL;
    size_t len = 0;
    M3_TRY(m3_read_text_file(path, 16u << 20, &text, &len));
    m3_status st = m3_config_parse(text, len, out);
    free(text);
    if (st)
        return m3_fail_context(st, "%s", path);
    return M3_OK;
}

m3_status m3_read_text_file(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    /* non-blocking open, so a FIFO is refused instead of waiting forever */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return m3_fail(M3_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return m3_fail(M3_ERR_IO, "%s is not a regular file", path);
    }
    if ((uint64_t)sb.st_size > max_bytes) {
        close(fd);
        return m3_fail(M3_ERR_FORMAT, "%s is larger than %zu bytes", path, max_bytes);
    }
    size_t size = (size_t)sb.st_size, n = 0;
    char *buf = malloc(size + 1);
    if (!buf) {
        close(fd);
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory reading %s", path);
    }
    while (n < size) {
        ssize_t got = read(fd, buf + n, size - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            int err = got < 0 ? errno : EIO;
            free(buf);
            close(fd);
            return m3_fail(M3_ERR_IO, "error reading %s: %s", path, strerror(err));
        }
        n += (size_t)got;
    }
    close(fd);
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return M3_OK;
}

/* ------------------------------------------------------------ DSpark drafter */

/* A list of k layer ids (tap layers), each in [0, M3_MAX_LAYERS). */
static m3_status tap_list(const cJSON *it, const char *name, m3_draft_config *d) {
    if (!cJSON_IsArray(it) || cJSON_GetArraySize(it) < 1 ||
        cJSON_GetArraySize(it) > M3_MAX_TAPS)
        return m3_fail(M3_ERR_CONFIG, "config.json: '%s' must be a list of 1 to %d layer ids",
                       name, M3_MAX_TAPS);
    d->n_taps = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, it) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) ||
            e->valuedouble < 0 || e->valuedouble >= M3_MAX_LAYERS)
            return m3_fail(M3_ERR_CONFIG, "config.json: %s[%d] must be a layer id", name,
                           d->n_taps);
        d->taps[d->n_taps++] = (int)e->valuedouble;
    }
    return M3_OK;
}

/* The key window: layer_types all sliding_attention -> sliding_window; all
 * full_attention (or no layer_types) -> none; mixed: refused. */
static m3_status draft_window(const cJSON *t, m3_draft_config *d) {
    const cJSON *types = find_any(t, NAMES("layer_types"), NULL);
    d->window = 0;
    if (!types)
        return M3_OK;
    bool sliding[M3_MAX_LAYERS];
    M3_TRY(layer_type_list(types, "layer_types", d->attn.num_layers, NAMES("sliding_attention"),
                           NAMES("full_attention"), sliding));
    int n = 0;
    for (int i = 0; i < d->attn.num_layers; i++)
        n += sliding[i];
    if (n && n < d->attn.num_layers)
        return m3_fail(M3_ERR_UNSUPPORTED, "config.json: layer_types mixes sliding and full "
                       "attention; a drafter's layers must all be one or the other");
    if (!n)
        return M3_OK;
    int64_t w;
    M3_TRY(get_int(t, NAMES("sliding_window"), false, 0, 1, (int64_t)1 << 32, &w));
    d->window = w;
    return M3_OK;
}

static m3_status parse_draft(const cJSON *t, const cJSON *root, m3_draft_config *d) {
    int64_t v;
    M3_TRY(parse_attention(t, &d->attn));
    M3_TRY(parse_swiglu(t, &d->attn, false));
    M3_TRY(get_int(t, NAMES("vocab_size"), false, 0, 1, 1 << 24, &v));
    d->vocab_size = (int)v;
    const char *name = "dspark_target_layer_ids";
    const cJSON *taps =
        find_any(t, NAMES("dspark_target_layer_ids", "target_layer_ids"), &name);
    if (!taps)
        return m3_fail(M3_ERR_CONFIG, "config.json: missing 'dspark_target_layer_ids' (or "
                       "'target_layer_ids'): not a DSpark drafter");
    M3_TRY(tap_list(taps, name, d));
    M3_TRY(get_int(t, NAMES("dspark_noise_token_id", "mask_token_id"), false, 0, 0, 1 << 24, &v));
    d->mask_token = (int32_t)v;
    M3_TRY(get_int(t, NAMES("dspark_block_size", "block_size"), false, 0, 1, M3_MAX_DRAFT_BLOCK,
                   &v));
    d->block = (int)v;
    /* absent: -1, the loader takes it from markov_w1's shape (0 without one) */
    M3_TRY(get_int(t, NAMES("dspark_markov_rank", "markov_rank"), true, -1, 0, 1 << 16, &v));
    d->markov_rank = (int)v;
    const char *head = NULL;
    M3_TRY(get_str(t, NAMES("dspark_markov_head_type", "markov_head_type"), &head));
    if (head && strcmp(head, "vanilla"))
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "config.json: markov_head_type = %s is not supported (only vanilla)", head);
    M3_TRY(get_int(t, NAMES("dspark_ffn_hidden_size"), true, 0, 0, 1 << 20, &v));
    d->ffn_dim = (int)v;
    M3_TRY(draft_window(t, d));
    if (d->window && d->window < d->block)
        return m3_fail(M3_ERR_CONFIG,
                       "config.json: sliding_window = %lld is smaller than the block of %d rows",
                       (long long)d->window, d->block);
    cfg_src src = {t, root};
    return parse_quant(&src, &d->attn);
}

m3_status m3_draft_config_parse(const char *json, size_t len, m3_draft_config *out) {
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return m3_fail(M3_ERR_FORMAT, "config.json: not valid JSON (near byte %zu)",
                       (size_t)(cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - json : 0));
    m3_status st;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (!cJSON_IsObject(root))
        st = m3_fail(M3_ERR_CONFIG, "config.json: the top level must be an object");
    else if (t && !cJSON_IsNull(t) && !cJSON_IsObject(t))
        st = m3_fail(M3_ERR_CONFIG, "config.json: 'text_config' must be an object");
    else
        st = parse_draft(t && cJSON_IsObject(t) ? t : root, root, out);
    cJSON_Delete(root);
    return st;
}
