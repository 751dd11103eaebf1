/*
 * Loading a checkpoint folder: config.json, the safetensors set (validated
 * in full by formats/safetensors.c), then binding every tensor the forward
 * pass needs to a view with its shape and dtype checked. Released names
 * and the newer Hugging Face names are both accepted (SPEC §2.2); fused
 * tensors (gate_up_proj, stacked experts) become zero-copy row views, so
 * the rest of the engine sees one layout. Tensors the engine does not use
 * (mtp.*, the vision tower) are ignored.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/bind.h"
#include "model/model.h"

#define NAME_CAP 256

typedef m3_binder binder;

const m3_st_entry *m3_bind_find(const m3_binder *b, const char *suffix) {
    char name[NAME_CAP];
    snprintf(name, sizeof name, "%s%s", b->prefix, suffix);
    return m3_st_find(b->files, name);
}
#define find m3_bind_find

static void shape_str(const int64_t *shape, int ndim, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
}

/* Check e's dtype and shape; ndim = number of expected dims. */
static m3_status check_entry(const binder *b, const m3_st_entry *e, m3_dtype dtype, int ndim,
                             const int64_t *shape) {
    if (e->dtype != dtype)
        return m3_fail(M3_ERR_FORMAT, "tensor %s has dtype %s; expected %s", e->name,
                       e->dtype_name, m3_dtype_name(dtype));
    bool ok = e->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = e->shape[i] == shape[i];
    if (!ok) {
        char got[96], want[96];
        shape_str(e->shape, e->ndim, got, sizeof got);
        shape_str(shape, ndim, want, sizeof want);
        return m3_fail(M3_ERR_FORMAT, "tensor %s has shape %s; expected %s", e->name, got, want);
    }
    return M3_OK;
}

static m3_status missing(const binder *b, const char *suffix) {
    return m3_fail(M3_ERR_FORMAT, "checkpoint is missing tensor %s%s", b->prefix, suffix);
}

/* A [n] or [n, k] tensor of the given dtype named prefix+suffix. */
m3_status m3_bind_plain(const m3_binder *b, const char *suffix, m3_dtype dtype, int64_t n,
                        int64_t k, m3_tensor *out) {
    const m3_st_entry *e = find(b, suffix);
    if (!e)
        return missing(b, suffix);
    int64_t shape[2] = {n, k};
    M3_TRY(check_entry(b, e, dtype, k ? 2 : 1, shape));
    *out = m3_st_tensor(e);
    return M3_OK;
}

/* A linear weight base+".weight" [n, k]: bf16, or MXFP8 (e4m3 plus u8
 * base+".weight_scale_inv" [n, k/32]). */
static m3_status bind_linear_entry(const binder *b, const m3_st_entry *w, const char *scale_suffix,
                                   int64_t n, int64_t k, m3_linear *out) {
    int64_t shape[2] = {n, k};
    memset(out, 0, sizeof *out);
    if (w->dtype == M3_DT_F8_E4M3) {
        if (k % 32)
            return m3_fail(M3_ERR_FORMAT, "tensor %s: MXFP8 needs K = %lld divisible by 32",
                           w->name, (long long)k);
        M3_TRY(check_entry(b, w, M3_DT_F8_E4M3, 2, shape));
        const m3_st_entry *s = find(b, scale_suffix);
        if (!s)
            return m3_fail(M3_ERR_FORMAT, "tensor %s is F8_E4M3 but %s%s is missing", w->name,
                           b->prefix, scale_suffix);
        int64_t sshape[2] = {n, k / 32};
        M3_TRY(check_entry(b, s, M3_DT_U8, 2, sshape));
        out->w = m3_st_tensor(w);
        out->scale = m3_st_tensor(s);
        return M3_OK;
    }
    if (w->dtype != M3_DT_BF16)
        return m3_fail(M3_ERR_FORMAT, "tensor %s has dtype %s; expected BF16 or F8_E4M3 (MXFP8)",
                       w->name, w->dtype_name);
    M3_TRY(check_entry(b, w, M3_DT_BF16, 2, shape));
    out->w = m3_st_tensor(w);
    return M3_OK;
}

m3_status m3_bind_linear(const m3_binder *b, const char *base, int64_t n, int64_t k,
                         m3_linear *out) {
    char wname[NAME_CAP], sname[NAME_CAP];
    snprintf(wname, sizeof wname, "%s.weight", base);
    snprintf(sname, sizeof sname, "%s.weight_scale_inv", base);
    const m3_st_entry *w = find(b, wname);
    if (!w)
        return missing(b, wname);
    return bind_linear_entry(b, w, sname, n, k, out);
}

/* gate and up: separate (gate_base, up_base) or one fused tensor
 * fused_base [2n, k] with the gate rows first. */
m3_status m3_bind_gate_up(const m3_binder *b, const char *gate_base, const char *up_base,
                          const char *fused_base, int64_t n, int64_t k, m3_linear *gate,
                          m3_linear *up) {
    char wname[NAME_CAP], sname[NAME_CAP];
    snprintf(wname, sizeof wname, "%s.weight", fused_base);
    snprintf(sname, sizeof sname, "%s.weight_scale_inv", fused_base);
    const m3_st_entry *fused = find(b, wname);
    if (!fused) {
        M3_TRY(m3_bind_linear(b, gate_base, n, k, gate));
        return m3_bind_linear(b, up_base, n, k, up);
    }
    m3_linear both;
    M3_TRY(bind_linear_entry(b, fused, sname, 2 * n, k, &both));
    *gate = m3_linear_rows_view(&both, 0, n);
    *up = m3_linear_rows_view(&both, n, n);
    return M3_OK;
}

/* Row block e of a stacked [E, rows, k] tensor (and its [E, rows, k/32]
 * scale) as a 2-D linear. */
static m3_linear stacked_slice(const m3_st_entry *w, const m3_st_entry *s, int64_t e) {
    m3_linear l = {0};
    int64_t wshape[2] = {w->shape[1], w->shape[2]};
    l.w = m3_tensor_make(w->dtype, 2, wshape,
                         (char *)w->data + e * wshape[0] * wshape[1] * (int64_t)m3_dtype_size(w->dtype));
    l.w.name = w->name;
    if (s) {
        int64_t sshape[2] = {s->shape[1], s->shape[2]};
        l.scale = m3_tensor_make(M3_DT_U8, 2, sshape, (char *)s->data + e * sshape[0] * sshape[1]);
        l.scale.name = s->name;
    }
    return l;
}

/* The newer layout: mlp.experts.gate_up_proj [E, 2I, H] and
 * mlp.experts.down_proj [E, H, I] (optionally with .weight and MXFP8
 * *_scale_inv companions). */
static m3_status bind_stacked_experts(const binder *b, const char *base, m3_layer_weights *lw,
                                      const m3_config *c) {
    char n1[NAME_CAP], n2[NAME_CAP];
    const m3_st_entry *gu = NULL, *dn = NULL, *gus = NULL, *dns = NULL;
    for (int with_suffix = 0; with_suffix < 2 && !gu; with_suffix++) {
        snprintf(n1, sizeof n1, "%s.gate_up_proj%s", base, with_suffix ? ".weight" : "");
        snprintf(n2, sizeof n2, "%s.down_proj%s", base, with_suffix ? ".weight" : "");
        gu = find(b, n1);
        dn = find(b, n2);
    }
    if (!gu)
        return m3_fail(M3_ERR_FORMAT,
                       "checkpoint is missing the experts of layer %d (%s%s.0.w1.weight or "
                       "%s%s.gate_up_proj)",
                       lw->index, b->prefix, base, b->prefix, base);
    if (!dn)
        return missing(b, n2);
    int64_t E = c->num_experts, I = c->expert_dim, H = c->hidden_size;
    bool fp8 = gu->dtype == M3_DT_F8_E4M3;
    m3_dtype dt = fp8 ? M3_DT_F8_E4M3 : M3_DT_BF16;
    int64_t gshape[3] = {E, 2 * I, H}, dshape[3] = {E, H, I};
    if (gu->dtype != M3_DT_BF16 && !fp8)
        return m3_fail(M3_ERR_FORMAT, "tensor %s has dtype %s; expected BF16 or F8_E4M3",
                       gu->name, gu->dtype_name);
    M3_TRY(check_entry(b, gu, dt, 3, gshape));
    M3_TRY(check_entry(b, dn, dt, 3, dshape));
    if (fp8) {
        if (H % 32 || I % 32)
            return m3_fail(M3_ERR_FORMAT, "tensor %s: MXFP8 needs K divisible by 32", gu->name);
        snprintf(n1, sizeof n1, "%s.gate_up_proj_scale_inv", base);
        snprintf(n2, sizeof n2, "%s.down_proj_scale_inv", base);
        gus = find(b, n1);
        dns = find(b, n2);
        if (!gus)
            return missing(b, n1);
        if (!dns)
            return missing(b, n2);
        int64_t gss[3] = {E, 2 * I, H / 32}, dss[3] = {E, H, I / 32};
        M3_TRY(check_entry(b, gus, M3_DT_U8, 3, gss));
        M3_TRY(check_entry(b, dns, M3_DT_U8, 3, dss));
    }
    for (int64_t e = 0; e < E; e++) {
        m3_linear both = stacked_slice(gu, gus, e);
        lw->exp_gate[e] = m3_linear_rows_view(&both, 0, I);
        lw->exp_up[e] = m3_linear_rows_view(&both, I, I);
        lw->exp_down[e] = stacked_slice(dn, dns, e);
    }
    return M3_OK;
}

static m3_status bind_moe(const binder *b, m3_layer_weights *lw, const m3_config *c) {
    char s[NAME_CAP], s2[NAME_CAP], s3[NAME_CAP];
    int i = lw->index;
    int64_t E = c->num_experts, I = c->expert_dim, H = c->hidden_size, Is = c->shared_dim;
    lw->exp_gate = calloc((size_t)E * 3, sizeof(m3_linear));
    if (!lw->exp_gate)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory binding experts of layer %d", i);
    lw->exp_up = lw->exp_gate + E;
    lw->exp_down = lw->exp_gate + 2 * E;

    /* released layout: block_sparse_moe.*; newer: mlp.* */
    snprintf(s, sizeof s, "layers.%d.block_sparse_moe.gate.weight", i);
    bool released = find(b, s) != NULL;
    const char *moe = released ? "block_sparse_moe" : "mlp";
    snprintf(s, sizeof s, "layers.%d.%s.gate.weight", i, moe);
    M3_TRY(m3_bind_plain(b, s, M3_DT_F32, E, H, &lw->router));
    if (c->use_routing_bias) {
        snprintf(s, sizeof s, "layers.%d.%s.e_score_correction_bias", i, moe);
        if (!released && !find(b, s))
            snprintf(s, sizeof s, "layers.%d.mlp.gate.e_score_correction_bias", i);
        M3_TRY(m3_bind_plain(b, s, M3_DT_F32, E, 0, &lw->router_bias));
    }
    snprintf(s, sizeof s, "layers.%d.%s.experts.0.w1.weight", i, moe);
    if (find(b, s)) {
        for (int64_t e = 0; e < E; e++) {
            snprintf(s, sizeof s, "layers.%d.%s.experts.%lld.w1", i, moe, (long long)e);
            M3_TRY(m3_bind_linear(b, s, I, H, &lw->exp_gate[e]));
            snprintf(s, sizeof s, "layers.%d.%s.experts.%lld.w3", i, moe, (long long)e);
            M3_TRY(m3_bind_linear(b, s, I, H, &lw->exp_up[e]));
            snprintf(s, sizeof s, "layers.%d.%s.experts.%lld.w2", i, moe, (long long)e);
            M3_TRY(m3_bind_linear(b, s, H, I, &lw->exp_down[e]));
        }
    } else {
        snprintf(s, sizeof s, "layers.%d.%s.experts", i, moe);
        M3_TRY(bind_stacked_experts(b, s, lw, c));
    }
    if (Is) {
        snprintf(s, sizeof s, "layers.%d.%s.shared_experts.gate_proj", i, moe);
        snprintf(s2, sizeof s2, "layers.%d.%s.shared_experts.up_proj", i, moe);
        snprintf(s3, sizeof s3, "layers.%d.%s.shared_experts.gate_up_proj", i, moe);
        M3_TRY(m3_bind_gate_up(b, s, s2, s3, Is, H, &lw->sh_gate, &lw->sh_up));
        snprintf(s, sizeof s, "layers.%d.%s.shared_experts.down_proj", i, moe);
        M3_TRY(m3_bind_linear(b, s, H, Is, &lw->sh_down));
    }
    return M3_OK;
}

static m3_status bind_attention(const binder *b, m3_layer_weights *lw, const m3_config *c) {
    char s[NAME_CAP];
    int i = lw->index;
    int64_t H = c->hidden_size, D = c->head_dim, Di = c->index_dim;
#define LIN(field, what, n, k)                                     \
    do {                                                           \
        snprintf(s, sizeof s, "layers.%d.self_attn." what, i);     \
        M3_TRY(m3_bind_linear(b, s, (n), (k), &lw->field));           \
    } while (0)
#define NORM(field, what, n)                                       \
    do {                                                           \
        snprintf(s, sizeof s, "layers.%d." what ".weight", i);     \
        M3_TRY(m3_bind_plain(b, s, M3_DT_BF16, (n), 0, &lw->field));  \
    } while (0)
    NORM(input_norm, "input_layernorm", H);
    NORM(post_norm, "post_attention_layernorm", H);
    LIN(q_proj, "q_proj", c->num_q_heads * D, H);
    LIN(k_proj, "k_proj", c->num_kv_heads * D, H);
    LIN(v_proj, "v_proj", c->num_kv_heads * D, H);
    LIN(o_proj, "o_proj", H, c->num_q_heads * D);
    NORM(q_norm, "self_attn.q_norm", D);
    NORM(k_norm, "self_attn.k_norm", D);
    if (lw->sparse) {
        snprintf(s, sizeof s, "layers.%d.self_attn.index_q_proj.weight", i);
        if (find(b, s)) {
            LIN(iq_proj, "index_q_proj", c->index_heads * Di, H);
            LIN(ik_proj, "index_k_proj", Di, H);
            NORM(iq_norm, "self_attn.index_q_norm", Di);
            NORM(ik_norm, "self_attn.index_k_norm", Di);
        } else {
            LIN(iq_proj, "indexer.q_proj", c->index_heads * Di, H);
            LIN(ik_proj, "indexer.k_proj", Di, H);
            NORM(iq_norm, "self_attn.indexer.q_norm", Di);
            NORM(ik_norm, "self_attn.indexer.k_norm", Di);
        }
    }
#undef LIN
#undef NORM
    return M3_OK;
}

/* The row-parallel weights (whose K a TP shard splits): their GPU sums
 * are cut into m3_k_chunks chunks at every world (core/tensor.h). */
static void mark_row_parallel(m3_linear *l) {
    if (l->w.data)
        l->k_chunks = m3_k_chunks(l->w.ne[1]);
}

/* The column-parallel weights (whose rows a TP shard splits): prefill's
 * GEMM runs on M3_N_BLOCKS row blocks of the full N at every world. */
static void mark_column_parallel(m3_linear *l) {
    if (l->w.data && l->w.ne[0] % M3_N_BLOCKS == 0)
        l->n_chunks = M3_N_BLOCKS;
}

static m3_status bind_layer(const binder *b, m3_layer_weights *lw, const m3_config *c) {
    char s[NAME_CAP], s2[NAME_CAP], s3[NAME_CAP];
    int i = lw->index;
    M3_TRY(bind_attention(b, lw, c));
    mark_row_parallel(&lw->o_proj);
    m3_linear *cols[] = {&lw->q_proj, &lw->k_proj, &lw->v_proj, &lw->iq_proj};
    for (size_t j = 0; j < sizeof cols / sizeof *cols; j++)
        mark_column_parallel(cols[j]);
    if (lw->moe) {
        M3_TRY(bind_moe(b, lw, c));
        mark_row_parallel(&lw->sh_down);
        mark_column_parallel(&lw->sh_gate);
        mark_column_parallel(&lw->sh_up);
        for (int e = 0; lw->exp_down && e < c->num_experts; e++)
            mark_row_parallel(&lw->exp_down[e]);
        return M3_OK;
    }
    snprintf(s, sizeof s, "layers.%d.mlp.gate_proj", i);
    snprintf(s2, sizeof s2, "layers.%d.mlp.up_proj", i);
    snprintf(s3, sizeof s3, "layers.%d.mlp.gate_up_proj", i);
    M3_TRY(m3_bind_gate_up(b, s, s2, s3, c->dense_dim, c->hidden_size, &lw->mlp_gate, &lw->mlp_up));
    snprintf(s, sizeof s, "layers.%d.mlp.down_proj", i);
    M3_TRY(m3_bind_linear(b, s, c->hidden_size, c->dense_dim, &lw->mlp_down));
    mark_row_parallel(&lw->mlp_down);
    mark_column_parallel(&lw->mlp_gate);
    mark_column_parallel(&lw->mlp_up);
    return M3_OK;
}

static const char *const prefixes[] = {"language_model.model.", "model.language_model.", "model.",
                                       ""};
static const char *const head_names[] = {"language_model.lm_head.weight",
                                         "model.language_model.lm_head.weight", "lm_head.weight"};

static m3_status bind_model(m3_model *m) {
    const m3_config *c = &m->cfg;
    binder b = {m->files, NULL};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes && !b.prefix; i++) {
        binder probe = {m->files, prefixes[i]};
        if (find(&probe, "embed_tokens.weight"))
            b.prefix = prefixes[i];
    }
    if (!b.prefix)
        return m3_fail(M3_ERR_FORMAT,
                       "checkpoint has no embedding (language_model.model.embed_tokens.weight, "
                       "model.language_model.embed_tokens.weight or model.embed_tokens.weight)");
    M3_TRY(m3_bind_plain(&b, "embed_tokens.weight", M3_DT_BF16, c->vocab_size, c->hidden_size,
                      &m->w.embed));
    M3_TRY(m3_bind_plain(&b, "norm.weight", M3_DT_BF16, c->hidden_size, 0, &m->w.norm));
    if (c->tie_word_embeddings) {
        m->w.lm_head = m->w.embed;
    } else {
        binder bare = {m->files, ""};
        const char *head = NULL;
        for (size_t i = 0; i < sizeof head_names / sizeof *head_names && !head; i++)
            if (find(&bare, head_names[i]))
                head = head_names[i];
        if (!head)
            return m3_fail(M3_ERR_FORMAT,
                           "checkpoint has no lm_head (language_model.lm_head.weight or "
                           "lm_head.weight) and tie_word_embeddings is false");
        M3_TRY(m3_bind_plain(&bare, head, M3_DT_BF16, c->vocab_size, c->hidden_size, &m->w.lm_head));
    }
    m->w.layers = calloc((size_t)c->num_layers, sizeof *m->w.layers);
    if (!m->w.layers)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory binding layers");
    for (int i = 0; i < c->num_layers; i++) {
        m->w.layers[i].index = i;
        m->w.layers[i].sparse = c->layer_sparse[i];
        m->w.layers[i].moe = c->layer_moe[i];
        M3_TRY(bind_layer(&b, &m->w.layers[i], c));
    }
    return M3_OK;
}

m3_status m3_model_load(const char *dir, const m3_model_opts *opts, m3_model **out) {
    *out = NULL;
    if (!dir || !dir[0])
        return m3_fail(M3_ERR_INVALID_ARG, "the model directory is %s", dir ? "empty" : "NULL");
    m3_model *m = calloc(1, sizeof *m);
    char path[4096];
    if (!m)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory loading %s", dir);
    m->dir = m3_strdup(dir, "the model directory's path");
    snprintf(path, sizeof path, "%s/config.json", dir);
    m3_status st = m->dir ? m3_config_load(path, &m->cfg) : M3_ERR_NO_MEMORY;
    if (!st)
        st = m3_st_open_dir(dir, opts && opts->progress, &m->files);
    if (!st)
        st = bind_model(m);
    if (st) {
        m3_fail_context(st, "loading %s", dir);
        m3_model_free(m);
        return st;
    }
    *out = m;
    return M3_OK;
}

const m3_config *m3_model_config(const m3_model *m) { return &m->cfg; }

void m3_model_free(m3_model *m) {
    if (!m)
        return;
    for (int i = 0; m->w.layers && i < m->cfg.num_layers; i++)
        free(m->w.layers[i].exp_gate);
    free(m->w.layers);
    m3_st_close(m->files);
    free(m->dir);
    free(m);
}
