/*
 * Named model shapes and the config.json writer. `tiny` keeps the M3
 * geometry that the kernels care about (head_dim 128, rotary 64, index dim
 * 128, 128-token blocks) at small widths so the CPU reference runs it fast;
 * `m3` is the released configuration; `m3-tp4-rank` is a TP1 model with
 * the shapes one rank of a 4-way tensor-parallel M3 deployment holds, for
 * single-GPU benchmarks. m3_config_to_json writes the released (nested)
 * layout, so synthesized checkpoints look like the real one.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/config_json.h"

int m3_config_count_sparse(const m3_config *c) {
    int n = 0;
    for (int i = 0; i < c->num_layers; i++)
        n += c->layer_sparse[i];
    return n;
}

int m3_config_count_moe(const m3_config *c) {
    int n = 0;
    for (int i = 0; i < c->num_layers; i++)
        n += c->layer_moe[i];
    return n;
}

/* The released MiniMax-M3 text config. */
static void preset_m3(m3_config *c) {
    memset(c, 0, sizeof *c);
    c->hidden_size = 6144;
    c->num_layers = 60;
    c->num_q_heads = 64;
    c->num_kv_heads = 4;
    c->head_dim = 128;
    c->rotary_dim = 64;
    c->rope_theta = 5000000.0;
    c->vocab_size = 200064;
    c->expert_dim = 3072;
    c->dense_dim = 12288;
    c->shared_dim = 3072;
    c->num_experts = 128;
    c->experts_per_tok = 4;
    c->use_routing_bias = true;
    c->routed_scaling_factor = 2.0f;
    c->swiglu_alpha = 1.702f;
    c->swiglu_limit = 7.0f;
    c->rms_norm_eps = 1e-6f;
    c->tie_word_embeddings = false;
    c->max_position_embeddings = 1 << 20;
    c->index_heads = 4;
    c->index_dim = 128;
    c->block_size = 128;
    c->topk_blocks = 16;
    c->init_blocks = 0;
    c->local_blocks = 1;
    for (int i = 0; i < c->num_layers; i++)
        c->layer_sparse[i] = c->layer_moe[i] = i >= 3;
    c->num_eos = 1;
    c->eos_ids[0] = 200020;
}

m3_status m3_preset(const char *name, m3_config *out) {
    m3_config c;
    preset_m3(&c);
    if (!strcmp(name, "m3")) {
        *out = c;
        return M3_OK;
    }
    if (!strcmp(name, "m3-tp4-rank")) {
        /* one rank of TP4: 64/4 query heads, 4/4 KV and index heads, experts
         * and MLPs split four ways on their intermediate dimension */
        c.num_q_heads = 16;
        c.num_kv_heads = 1;
        c.index_heads = 1;
        c.expert_dim = 768;
        c.shared_dim = 768;
        c.dense_dim = 3072;
        *out = c;
        return M3_OK;
    }
    if (!strcmp(name, "small")) {
        /* between tiny and the real widths, for GPU-vs-CPU model tests that
         * the CPU reference still runs in seconds: M3 geometry, 16 query
         * heads per KV head as released, hidden 1024, four layers */
        c.hidden_size = 1024;
        c.num_layers = 4;
        c.num_q_heads = 32;
        c.num_kv_heads = 2;
        c.index_heads = 2;
        c.vocab_size = 8192;
        c.expert_dim = 256;
        c.dense_dim = 2048;
        c.shared_dim = 256;
        c.num_experts = 16;
        c.experts_per_tok = 4;
        c.topk_blocks = 4;
        c.init_blocks = 1;
        c.local_blocks = 1;
        c.max_position_embeddings = 1 << 17;
        memset(c.layer_sparse, 0, sizeof c.layer_sparse);
        memset(c.layer_moe, 0, sizeof c.layer_moe);
        for (int i = 1; i < c.num_layers; i++)
            c.layer_sparse[i] = c.layer_moe[i] = true;
        c.eos_ids[0] = 8191;
        *out = c;
        return M3_OK;
    }
    if (!strcmp(name, "tiny")) {
        /* small widths, M3 geometry; one dense layer then two sparse+MoE
         * layers; top-3 of 128-token blocks with one init and one local
         * block, so the index scores choose among blocks past 384 tokens */
        c.hidden_size = 256;
        c.num_layers = 3;
        c.num_q_heads = 4;
        c.num_kv_heads = 2;
        c.vocab_size = 512;
        c.expert_dim = 128;
        c.dense_dim = 512;
        c.shared_dim = 128;
        c.num_experts = 8;
        c.experts_per_tok = 2;
        c.index_heads = 2;
        c.topk_blocks = 3;
        c.init_blocks = 1;
        c.local_blocks = 1;
        c.max_position_embeddings = 1 << 16;
        memset(c.layer_sparse, 0, sizeof c.layer_sparse);
        memset(c.layer_moe, 0, sizeof c.layer_moe);
        for (int i = 1; i < c.num_layers; i++)
            c.layer_sparse[i] = c.layer_moe[i] = true;
        c.eos_ids[0] = 511;
        *out = c;
        return M3_OK;
    }
    return m3_fail(M3_ERR_INVALID_ARG, "unknown preset '%s' (known: tiny, small, m3, m3-tp4-rank)",
                   name);
}

m3_status m3_config_cut_layers(m3_config *c, int n) {
    if (n < 1 || n > c->num_layers)
        return m3_fail(M3_ERR_INVALID_ARG, "layers = %d: must be in [1, %d]", n, c->num_layers);
    c->num_layers = n;
    for (int i = n; i < M3_MAX_LAYERS; i++)
        c->layer_sparse[i] = c->layer_moe[i] = false;
    /* fields of layer kinds that no longer exist read back as zero from
     * config.json, so clear them here too */
    if (!m3_config_count_sparse(c))
        c->index_heads = c->index_dim = c->topk_blocks = c->init_blocks = c->local_blocks = 0;
    if (!m3_config_count_moe(c)) {
        c->expert_dim = c->shared_dim = c->num_experts = c->experts_per_tok = 0;
        c->use_routing_bias = false;
        c->routed_scaling_factor = 0;
    }
    if (m3_config_count_moe(c) == c->num_layers)
        c->dense_dim = 0;
    return M3_OK;
}

static cJSON *layer_list(const bool *flags, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(flags[i] ? 1 : 0));
    return a;
}

/* The fields of a dense M3 layer's attention, norms and SwiGLU, shared by
 * the target's config.json and a DSpark drafter's. */
static void dense_fields_json(cJSON *t, const m3_config *c) {
    cJSON_AddNumberToObject(t, "hidden_size", c->hidden_size);
    cJSON_AddNumberToObject(t, "num_hidden_layers", c->num_layers);
    cJSON_AddNumberToObject(t, "num_attention_heads", c->num_q_heads);
    cJSON_AddNumberToObject(t, "num_key_value_heads", c->num_kv_heads);
    cJSON_AddNumberToObject(t, "head_dim", c->head_dim);
    cJSON_AddNumberToObject(t, "rotary_dim", c->rotary_dim);
    cJSON_AddNumberToObject(t, "partial_rotary_factor", (double)c->rotary_dim / c->head_dim);
    cJSON_AddNumberToObject(t, "rope_theta", c->rope_theta);
    cJSON_AddStringToObject(t, "hidden_act", "swigluoai");
    cJSON_AddNumberToObject(t, "swiglu_alpha", c->swiglu_alpha);
    cJSON_AddNumberToObject(t, "swiglu_limit", c->swiglu_limit);
    cJSON_AddNumberToObject(t, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddBoolToObject(t, "use_gemma_norm", true);
    cJSON_AddNumberToObject(t, "max_position_embeddings", (double)c->max_position_embeddings);
}

static cJSON *text_config_json(const m3_config *c) {
    cJSON *t = cJSON_CreateObject();
    cJSON_AddStringToObject(t, "model_type", "minimax_m3");
    dense_fields_json(t, c);
    cJSON_AddNumberToObject(t, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(t, "intermediate_size", c->expert_dim);
    cJSON_AddNumberToObject(t, "dense_intermediate_size", c->dense_dim);
    cJSON_AddNumberToObject(t, "shared_intermediate_size", c->shared_dim);
    cJSON_AddNumberToObject(t, "n_shared_experts", c->shared_dim ? 1 : 0);
    cJSON_AddNumberToObject(t, "num_local_experts", c->num_experts);
    cJSON_AddNumberToObject(t, "num_experts_per_tok", c->experts_per_tok);
    cJSON_AddItemToObject(t, "moe_layer_freq", layer_list(c->layer_moe, c->num_layers));
    cJSON_AddStringToObject(t, "scoring_func", "sigmoid");
    cJSON_AddBoolToObject(t, "use_routing_bias", c->use_routing_bias);
    cJSON_AddNumberToObject(t, "routed_scaling_factor", c->routed_scaling_factor);
    cJSON_AddStringToObject(t, "qk_norm_type", "per_head");
    cJSON_AddBoolToObject(t, "tie_word_embeddings", c->tie_word_embeddings);
    if (c->num_eos == 1)
        cJSON_AddNumberToObject(t, "eos_token_id", c->eos_ids[0]);
    else if (c->num_eos > 1)
        cJSON_AddItemToObject(t, "eos_token_id", cJSON_CreateIntArray(c->eos_ids, c->num_eos));

    cJSON *s = cJSON_CreateObject();
    bool any_sparse = m3_config_count_sparse(c) > 0;
    cJSON_AddBoolToObject(s, "use_sparse_attention", any_sparse);
    cJSON_AddItemToObject(s, "sparse_attention_freq", layer_list(c->layer_sparse, c->num_layers));
    cJSON_AddItemToObject(s, "sparse_disable_index_value",
                          layer_list(c->layer_sparse, c->num_layers));
    cJSON_AddNumberToObject(s, "sparse_block_size", c->block_size ? c->block_size : 128);
    if (any_sparse) {
        cJSON_AddNumberToObject(s, "sparse_num_index_heads", c->index_heads);
        cJSON_AddNumberToObject(s, "sparse_index_dim", c->index_dim);
        cJSON_AddNumberToObject(s, "sparse_topk_blocks", c->topk_blocks);
        cJSON_AddNumberToObject(s, "sparse_init_block", c->init_blocks);
        cJSON_AddNumberToObject(s, "sparse_local_block", c->local_blocks);
        cJSON_AddStringToObject(s, "sparse_score_type", "max");
    }
    cJSON_AddItemToObject(t, "sparse_attention_config", s);
    return t;
}

m3_status m3_config_to_json(const m3_config *c, char **out) {
    *out = NULL;
    cJSON *root = cJSON_CreateObject();
    cJSON *arch = cJSON_CreateArray();
    cJSON_AddItemToArray(arch, cJSON_CreateString("MiniMaxM3SparseForConditionalGeneration"));
    cJSON_AddItemToObject(root, "architectures", arch);
    cJSON_AddStringToObject(root, "model_type", "minimax_m3_vl");
    cJSON_AddItemToObject(root, "text_config", text_config_json(c));
    if (c->mxfp8) {
        cJSON *q = cJSON_CreateObject();
        cJSON_AddStringToObject(q, "quant_method", "mxfp8");
        cJSON_AddStringToObject(q, "activation_scheme", "dynamic");
        int bs[2] = {1, 32};
        cJSON_AddItemToObject(q, "weight_block_size", cJSON_CreateIntArray(bs, 2));
        cJSON_AddItemToObject(root, "quantization_config", q);
    }
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory rendering config.json");
    *out = text;
    return M3_OK;
}

/* ------------------------------------------------------------ DSpark drafter */

m3_status m3_draft_config_for(const m3_config *t, const m3_synth_draft_opts *o,
                              m3_draft_config *out) {
    memset(out, 0, sizeof *out);
    int layers = o && o->layers ? o->layers : 5;
    if (layers < 1 || layers > M3_MAX_LAYERS)
        return m3_fail(M3_ERR_INVALID_ARG, "a drafter of %d layers", layers);
    m3_config *a = &out->attn;
    a->hidden_size = t->hidden_size;
    a->num_layers = layers;
    a->num_q_heads = t->num_q_heads;
    a->num_kv_heads = t->num_kv_heads;
    a->head_dim = t->head_dim;
    a->rotary_dim = t->rotary_dim;
    a->rope_theta = t->rope_theta;
    a->rms_norm_eps = t->rms_norm_eps;
    a->swiglu_alpha = t->swiglu_alpha;
    a->swiglu_limit = t->swiglu_limit;
    a->max_position_embeddings = t->max_position_embeddings;
    a->mxfp8 = o && o->mxfp8;
    out->vocab_size = t->vocab_size;
    /* k taps spread over the target's layers, the last one included (the
     * release taps 5 of 60: 3, 17, 31, 45, 59) */
    out->n_taps = t->num_layers < 5 ? t->num_layers : 5;
    for (int i = 0; i < out->n_taps; i++)
        out->taps[i] = (int)((int64_t)(i + 1) * t->num_layers / out->n_taps) - 1;
    out->mask_token = t->vocab_size - 1;
    out->block = o && o->block ? o->block : 7;
    out->markov_rank = t->hidden_size >= 1024 ? 256 : 8;
    out->ffn_dim = t->dense_dim ? t->dense_dim : 2 * t->hidden_size;
    out->window = o ? o->window : 0;
    if (out->block < 1 || out->block > M3_MAX_DRAFT_BLOCK)
        return m3_fail(M3_ERR_INVALID_ARG, "a draft block of %d rows (1 to %d)", out->block,
                       M3_MAX_DRAFT_BLOCK);
    if (out->window && out->window < out->block)
        return m3_fail(M3_ERR_INVALID_ARG, "a window of %lld keys is smaller than the block of %d",
                       (long long)out->window, out->block);
    return M3_OK;
}

m3_status m3_draft_config_to_json(const m3_draft_config *d, char **out) {
    *out = NULL;
    const m3_config *c = &d->attn;
    cJSON *root = cJSON_CreateObject();
    cJSON *t = cJSON_AddObjectToObject(root, "text_config");
    dense_fields_json(t, c);
    cJSON_AddNumberToObject(t, "vocab_size", d->vocab_size);
    cJSON_AddNumberToObject(t, "dspark_ffn_hidden_size", d->ffn_dim);
    cJSON_AddItemToObject(t, "dspark_target_layer_ids", cJSON_CreateIntArray(d->taps, d->n_taps));
    cJSON_AddNumberToObject(t, "dspark_noise_token_id", d->mask_token);
    cJSON_AddNumberToObject(t, "dspark_block_size", d->block);
    if (d->markov_rank >= 0) /* (-1: not given) */
        cJSON_AddNumberToObject(t, "dspark_markov_rank", d->markov_rank);
    cJSON_AddStringToObject(t, "dspark_markov_head_type", "vanilla");
    cJSON *types = cJSON_AddArrayToObject(t, "layer_types");
    for (int i = 0; i < c->num_layers; i++)
        cJSON_AddItemToArray(types, cJSON_CreateString(d->window ? "sliding_attention"
                                                                 : "full_attention"));
    if (d->window)
        cJSON_AddNumberToObject(t, "sliding_window", (double)d->window);
    if (c->mxfp8) {
        cJSON *q = cJSON_AddObjectToObject(root, "quantization_config");
        cJSON_AddStringToObject(q, "quant_method", "mxfp8");
        int bs[2] = {1, 32};
        cJSON_AddItemToObject(q, "weight_block_size", cJSON_CreateIntArray(bs, 2));
    }
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory rendering the drafter's config.json");
    *out = text;
    return M3_OK;
}
