/*
 * `m3 synth`: a checkpoint in the released layout (SPEC §2.2 names, bf16
 * weights, fp32 router weight and bias) filled with deterministic random
 * values. Each element is a pure function of (seed, tensor name, index), so
 * the bytes do not depend on sharding, threads or write order. Scales keep
 * activations O(1): linear weights are uniform with standard deviation
 * 1/sqrt(fan_in), the embedding has unit variance, norm weights sit near 0
 * (Gemma norms multiply by 1 + w), the router gives unit-variance logits.
 * Large checkpoints are sharded with an index, written through temp files
 * so an interrupted run never leaves a file that looks complete.
 */
#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/bf16.h"
#include "core/pool.h"
#include "core/progress.h"
#include "core/status.h"
#include "formats/safetensors.h"
#include "model/config_json.h"

typedef enum { INIT_LINEAR, INIT_EMBED, INIT_NORM, INIT_ROUTER, INIT_BIAS, INIT_SCALE } init_kind;

typedef struct synth_tensor {
    char name[160];
    m3_dtype dtype;
    int ndim;
    int64_t shape[2];
    init_kind init;
    float std;       /* standard deviation of the values */
    int shard;
} synth_tensor;

typedef struct synth_list {
    synth_tensor *t;
    int n, cap;
} synth_list;

static m3_status add(synth_list *l, m3_dtype dt, int64_t n, int64_t k, init_kind init, float std,
                     const char *fmt, ...) M3_PRINTF(7, 8);

static m3_status add(synth_list *l, m3_dtype dt, int64_t n, int64_t k, init_kind init, float std,
                     const char *fmt, ...) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 256;
        synth_tensor *t = realloc(l->t, (size_t)cap * sizeof *t);
        if (!t)
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory listing synth tensors");
        l->t = t;
        l->cap = cap;
    }
    synth_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->dtype = dt;
    t->ndim = k ? 2 : 1;
    t->shape[0] = n;
    t->shape[1] = k;
    t->init = init;
    t->std = std;
    return M3_OK;
}

#define P "language_model.model."

/* A linear weight [n, k]; MXFP8 checkpoints add the u8 exponents. */
static m3_status add_linear(synth_list *l, bool mxfp8, int64_t n, int64_t k, const char *base) {
    float std = 1.0f / sqrtf((float)k);
    if (!mxfp8)
        return add(l, M3_DT_BF16, n, k, INIT_LINEAR, std, "%s.weight", base);
    M3_TRY(add(l, M3_DT_F8_E4M3, n, k, INIT_LINEAR, std, "%s.weight", base));
    return add(l, M3_DT_U8, n, k / 32, INIT_SCALE, std, "%s.weight_scale_inv", base);
}

static m3_status list_layer(synth_list *l, const m3_config *c, int i) {
    char b[160];
    int64_t H = c->hidden_size, D = c->head_dim, Di = c->index_dim;
    bool q8 = c->mxfp8;
    const float norm_std = 0.05f;
    M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, norm_std, P "layers.%d.input_layernorm.weight", i));
    M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, norm_std,
               P "layers.%d.post_attention_layernorm.weight", i));
#define LIN(n, k, ...)                                  \
    do {                                                \
        snprintf(b, sizeof b, P __VA_ARGS__);           \
        M3_TRY(add_linear(l, q8, (n), (k), b));         \
    } while (0)
    LIN(c->num_q_heads * D, H, "layers.%d.self_attn.q_proj", i);
    LIN(c->num_kv_heads * D, H, "layers.%d.self_attn.k_proj", i);
    LIN(c->num_kv_heads * D, H, "layers.%d.self_attn.v_proj", i);
    LIN(H, c->num_q_heads * D, "layers.%d.self_attn.o_proj", i);
    M3_TRY(add(l, M3_DT_BF16, D, 0, INIT_NORM, norm_std, P "layers.%d.self_attn.q_norm.weight", i));
    M3_TRY(add(l, M3_DT_BF16, D, 0, INIT_NORM, norm_std, P "layers.%d.self_attn.k_norm.weight", i));
    if (c->layer_sparse[i]) {
        LIN(c->index_heads * Di, H, "layers.%d.self_attn.index_q_proj", i);
        LIN(Di, H, "layers.%d.self_attn.index_k_proj", i);
        M3_TRY(add(l, M3_DT_BF16, Di, 0, INIT_NORM, norm_std,
                   P "layers.%d.self_attn.index_q_norm.weight", i));
        M3_TRY(add(l, M3_DT_BF16, Di, 0, INIT_NORM, norm_std,
                   P "layers.%d.self_attn.index_k_norm.weight", i));
    }
    if (!c->layer_moe[i]) {
        LIN(c->dense_dim, H, "layers.%d.mlp.gate_proj", i);
        LIN(c->dense_dim, H, "layers.%d.mlp.up_proj", i);
        LIN(H, c->dense_dim, "layers.%d.mlp.down_proj", i);
        return M3_OK;
    }
    M3_TRY(add(l, M3_DT_F32, c->num_experts, H, INIT_ROUTER, 1.0f / sqrtf((float)H),
               P "layers.%d.block_sparse_moe.gate.weight", i));
    if (c->use_routing_bias)
        M3_TRY(add(l, M3_DT_F32, c->num_experts, 0, INIT_BIAS, 0.1f,
                   P "layers.%d.block_sparse_moe.e_score_correction_bias", i));
    for (int e = 0; e < c->num_experts; e++) {
        LIN(c->expert_dim, H, "layers.%d.block_sparse_moe.experts.%d.w1", i, e);
        LIN(H, c->expert_dim, "layers.%d.block_sparse_moe.experts.%d.w2", i, e);
        LIN(c->expert_dim, H, "layers.%d.block_sparse_moe.experts.%d.w3", i, e);
    }
    if (c->shared_dim) {
        LIN(c->shared_dim, H, "layers.%d.block_sparse_moe.shared_experts.gate_proj", i);
        LIN(c->shared_dim, H, "layers.%d.block_sparse_moe.shared_experts.up_proj", i);
        LIN(H, c->shared_dim, "layers.%d.block_sparse_moe.shared_experts.down_proj", i);
    }
#undef LIN
    return M3_OK;
}

static m3_status list_tensors(synth_list *l, const m3_config *c) {
    int64_t V = c->vocab_size, H = c->hidden_size;
    M3_TRY(add(l, M3_DT_BF16, V, H, INIT_EMBED, 1.0f, P "embed_tokens.weight"));
    for (int i = 0; i < c->num_layers; i++)
        M3_TRY(list_layer(l, c, i));
    M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, 0.05f, P "norm.weight"));
    if (!c->tie_word_embeddings)
        M3_TRY(add(l, M3_DT_BF16, V, H, INIT_LINEAR, 1.0f / sqrtf((float)H),
                   "language_model.lm_head.weight"));
    return M3_OK;
}

/* ------------------------------------------------------------ values */

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Uniform in [-1, 1) from element j of the tensor's stream. */
static float uniform(uint64_t key, int64_t j) {
    uint64_t r = splitmix64(key ^ splitmix64((uint64_t)j));
    return (float)((double)(r >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* The float value of element j before encoding. */
static float value_at(const synth_tensor *t, uint64_t key, int64_t j) {
    /* uniform on [-a, a] has std a/sqrt(3) */
    float u = uniform(key, j) * 1.7320508f * t->std;
    return u;
}

typedef struct fill_job {
    const synth_tensor *t;
    uint64_t key;
    int64_t first; /* first element (or first 32-block row-major for MXFP8) */
    void *buf;
} fill_job;

/* The exponent of a 32-column block: 2^(s-127) >= amax/448 (e4m3's max). */
static uint8_t block_exponent(const synth_tensor *t, uint64_t key, int64_t first_elem) {
    float amax = 0;
    for (int i = 0; i < 32; i++)
        amax = fmaxf(amax, fabsf(value_at(t, key, first_elem + i)));
    if (amax == 0)
        return 127;
    int e = (int)ceilf(log2f(amax / 448.0f));
    return (uint8_t)(e + 127 < 0 ? 0 : e + 127 > 254 ? 254 : e + 127);
}

static void fill_range(void *ctx, int64_t begin, int64_t end, int thread) {
    const fill_job *job = ctx;
    const synth_tensor *t = job->t;
    int64_t scale_block = -1; /* e4m3: the block whose exponent s holds */
    uint8_t s = 127;
    for (int64_t i = begin; i < end; i++) {
        int64_t j = job->first + i;
        switch (t->dtype) {
        case M3_DT_BF16:
            ((uint16_t *)job->buf)[i] = m3_f32_to_bf16(value_at(t, job->key, j));
            break;
        case M3_DT_F32:
            ((float *)job->buf)[i] = value_at(t, job->key, j);
            break;
        case M3_DT_U8: /* the scale of block j: elements 32j .. 32j+31 of the weight */
            ((uint8_t *)job->buf)[i] = block_exponent(t, job->key, j * 32);
            break;
        case M3_DT_F8_E4M3: {
            if (j / 32 != scale_block) { /* once per 32 elements, not per element */
                scale_block = j / 32;
                s = block_exponent(t, job->key, j - j % 32);
            }
            float scaled = value_at(t, job->key, j) / m3_e8m0_to_f32(s);
            ((uint8_t *)job->buf)[i] = m3_f32_to_e4m3(scaled);
            break;
        }
        default:
            break;
        }
    }
}

/* A tensor's values come from the stream of its weight's name, so an MXFP8
 * weight and its scale agree. */
static uint64_t tensor_key(uint64_t seed, const synth_tensor *t) {
    char base[160];
    snprintf(base, sizeof base, "%s", t->name);
    char *suffix = strstr(base, ".weight_scale_inv");
    if (suffix)
        strcpy(suffix, ".weight");
    return splitmix64(seed ^ name_hash(base));
}

static m3_status write_tensor(m3_st_writer *w, const synth_tensor *t, uint64_t seed,
                              m3_pool *pool, void *buf, size_t buf_elems, m3_progress *prog) {
    int64_t n = t->shape[0] * (t->ndim == 2 ? t->shape[1] : 1);
    size_t esize = m3_dtype_size(t->dtype);
    fill_job job = {t, tensor_key(seed, t), 0, buf};
    /* an MXFP8 scale tensor shares its weight's std */
    for (int64_t first = 0; first < n; first += (int64_t)buf_elems) {
        int64_t count = n - first < (int64_t)buf_elems ? n - first : (int64_t)buf_elems;
        job.first = first;
        m3_pool_for(pool, count, 4096, fill_range, &job);
        M3_TRY(m3_st_writer_write(w, buf, (size_t)count * esize));
        m3_progress_add(prog, (int64_t)count * (int64_t)esize);
    }
    return M3_OK;
}

static m3_status write_file_atomic(const char *path, const char *text) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return m3_fail(M3_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    size_t len = strlen(text);
    bool ok = fwrite(text, 1, len, f) == len;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return m3_fail(M3_ERR_IO, "cannot write %s", path);
    }
    return M3_OK;
}

static m3_status make_dir(const char *dir) {
    char buf[4096];
    if (!dir[0])
        return m3_fail(M3_ERR_INVALID_ARG, "the output directory is an empty string");
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return m3_fail(M3_ERR_IO, "cannot create directory %s: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return m3_fail(M3_ERR_IO, "cannot create directory %s: %s", buf, strerror(errno));
    return M3_OK;
}

/* Assign shards: consecutive tensors until a shard passes max_bytes. */
static int assign_shards(synth_list *l, int64_t max_bytes, int64_t *total) {
    int shard = 0;
    int64_t in_shard = 0;
    *total = 0;
    for (int i = 0; i < l->n; i++) {
        synth_tensor *t = &l->t[i];
        int64_t bytes = t->shape[0] * (t->ndim == 2 ? t->shape[1] : 1) *
                        (int64_t)m3_dtype_size(t->dtype);
        if (in_shard > 0 && in_shard + bytes > max_bytes) {
            shard++;
            in_shard = 0;
        }
        t->shard = shard;
        in_shard += bytes;
        *total += bytes;
    }
    return shard + 1;
}

static void shard_name(char *buf, size_t cap, int shard, int n_shards) {
    if (n_shards == 1)
        snprintf(buf, cap, "model.safetensors");
    else
        snprintf(buf, cap, "model-%05d-of-%05d.safetensors", shard + 1, n_shards);
}

static m3_status write_shard(const char *dir, const synth_list *l, int shard, int n_shards,
                             uint64_t seed, m3_pool *pool, void *buf, size_t buf_bytes,
                             m3_progress *prog) {
    char name[64], path[4200];
    shard_name(name, sizeof name, shard, n_shards);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    m3_st_writer *w;
    M3_TRY(m3_st_writer_create(path, &w));
    /* the shard's tensors in declaration order; the writer says in which
     * order their bytes are streamed */
    int *idx = malloc((size_t)l->n * sizeof *idx), n = 0;
    m3_status st = idx ? M3_OK : m3_fail(M3_ERR_NO_MEMORY, "out of memory writing %s", path);
    for (int i = 0; i < l->n && !st; i++)
        if (l->t[i].shard == shard) {
            idx[n++] = i;
            st = m3_st_writer_add(w, l->t[i].name, l->t[i].dtype, l->t[i].ndim, l->t[i].shape);
        }
    if (!st)
        st = m3_st_writer_begin(w);
    for (size_t k = 0; !st && k < m3_st_writer_count(w); k++) {
        const synth_tensor *t = &l->t[idx[m3_st_writer_order(w, k)]];
        st = write_tensor(w, t, seed, pool, buf, buf_bytes / m3_dtype_size(t->dtype), prog);
    }
    free(idx);
    if (st) {
        m3_st_writer_abort(w);
        return st;
    }
    return m3_st_writer_finish(w);
}

static m3_status write_index(const char *dir, const synth_list *l, int n_shards, int64_t total) {
    size_t cap = 256 + (size_t)l->n * 256, n = 0;
    char *text = malloc(cap);
    if (!text)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory writing the index");
    n += (size_t)snprintf(text + n, cap - n,
                          "{\n  \"metadata\": {\"total_size\": %lld},\n  \"weight_map\": {\n",
                          (long long)total);
    for (int i = 0; i < l->n; i++) {
        char name[64];
        shard_name(name, sizeof name, l->t[i].shard, n_shards);
        n += (size_t)snprintf(text + n, cap - n, "    \"%s\": \"%s\"%s\n", l->t[i].name, name,
                              i + 1 < l->n ? "," : "");
    }
    snprintf(text + n, cap - n, "  }\n}\n");
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    m3_status st = write_file_atomic(path, text);
    free(text);
    return st;
}

/* Write the listed tensors and config.json (json) into dir. */
static m3_status write_checkpoint(const char *dir, synth_list *lp, const char *json,
                                  const m3_synth_opts *opts) {
    m3_synth_opts o = opts ? *opts : (m3_synth_opts){0};
    if (!o.max_shard_bytes)
        o.max_shard_bytes = (int64_t)4 << 30;
    M3_TRY(make_dir(dir));
    synth_list l = *lp;
    m3_pool *pool = NULL;
    size_t buf_bytes = (size_t)16 << 20;
    void *buf = NULL;
    m3_progress prog;
    int64_t total = 0;
    int n_shards = assign_shards(&l, o.max_shard_bytes, &total);
    char path[4200];
    /* a stale index or single file from an earlier synth would shadow the
     * new files */
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    remove(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    remove(path);
    m3_status st = m3_pool_create(0, &pool);
    if (!st && !(buf = malloc(buf_bytes)))
        st = m3_fail(M3_ERR_NO_MEMORY, "out of memory for the synth buffer");
    m3_progress_begin(&prog, "synth", total, o.progress);
    for (int s = 0; s < n_shards && !st; s++)
        st = write_shard(dir, &l, s, n_shards, o.seed, pool, buf, buf_bytes, &prog);
    m3_progress_end(&prog);
    if (!st && n_shards > 1)
        st = write_index(dir, &l, n_shards, total);
    if (!st) {
        snprintf(path, sizeof path, "%s/config.json", dir);
        st = write_file_atomic(path, json);
    }
    free(buf);
    m3_pool_free(pool);
    return st;
}

m3_status m3_synth(const m3_config *cfg, const char *dir, const m3_synth_opts *opts) {
    if (cfg->mxfp8 && (cfg->hidden_size % 32 || cfg->expert_dim % 32 || cfg->dense_dim % 32 ||
                       cfg->shared_dim % 32 || (cfg->num_q_heads * cfg->head_dim) % 32))
        return m3_fail(M3_ERR_INVALID_ARG, "MXFP8 synth needs every K dimension divisible by 32");
    synth_list l = {0};
    char *json = NULL;
    m3_status st = list_tensors(&l, cfg);
    if (!st)
        st = m3_config_to_json(cfg, &json);
    if (!st)
        st = write_checkpoint(dir, &l, json, opts);
    free(json);
    free(l.t);
    if (st)
        return m3_fail_context(st, "synth into %s", dir);
    return M3_OK;
}

#define DP "language_model.model.dspark."

/* The drafter's tensors in the release's names (docs/DSPARK.md). */
static m3_status list_drafter(synth_list *l, const m3_draft_config *d) {
    const m3_config *c = &d->attn;
    int64_t H = c->hidden_size, D = c->head_dim, F = d->ffn_dim, V = d->vocab_size;
    bool q8 = c->mxfp8;
    const float norm_std = 0.05f;
    char b[160];
    M3_TRY(add_linear(l, q8, H, d->n_taps * H, DP "fc"));
    M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, norm_std, DP "hidden_norm.weight"));
    M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, norm_std, DP "final_norm.weight"));
    if (d->markov_rank) {
        M3_TRY(add(l, M3_DT_BF16, V, d->markov_rank, INIT_EMBED, 1.0f,
                   DP "markov_head.markov_w1.weight"));
        M3_TRY(add(l, M3_DT_BF16, V, d->markov_rank, INIT_LINEAR,
                   1.0f / sqrtf((float)d->markov_rank), DP "markov_head.markov_w2.weight"));
    }
    for (int i = 0; i < c->num_layers; i++) {
        M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, norm_std,
                   DP "layers.%d.decoder_layer.input_layernorm.weight", i));
        M3_TRY(add(l, M3_DT_BF16, H, 0, INIT_NORM, norm_std,
                   DP "layers.%d.decoder_layer.post_attention_layernorm.weight", i));
#define LIN(n, k, what)                                                             \
    do {                                                                            \
        snprintf(b, sizeof b, DP "layers.%d.decoder_layer." what, i);               \
        M3_TRY(add_linear(l, q8, (n), (k), b));                                     \
    } while (0)
        LIN(c->num_q_heads * D, H, "self_attn.q_proj");
        LIN(c->num_kv_heads * D, H, "self_attn.k_proj");
        LIN(c->num_kv_heads * D, H, "self_attn.v_proj");
        LIN(H, c->num_q_heads * D, "self_attn.o_proj");
        LIN(F, H, "mlp.gate_proj");
        LIN(F, H, "mlp.up_proj");
        LIN(H, F, "mlp.down_proj");
#undef LIN
        M3_TRY(add(l, M3_DT_BF16, D, 0, INIT_NORM, norm_std,
                   DP "layers.%d.decoder_layer.self_attn.q_norm.weight", i));
        M3_TRY(add(l, M3_DT_BF16, D, 0, INIT_NORM, norm_std,
                   DP "layers.%d.decoder_layer.self_attn.k_norm.weight", i));
    }
    return M3_OK;
}

m3_status m3_synth_drafter(const m3_config *target, const char *dir,
                           const m3_synth_draft_opts *draft, const m3_synth_opts *opts) {
    m3_draft_config d;
    M3_TRY(m3_draft_config_for(target, draft, &d));
    const m3_config *c = &d.attn;
    if (c->mxfp8 && (c->hidden_size % 32 || d.ffn_dim % 32 || (c->num_q_heads * c->head_dim) % 32))
        return m3_fail(M3_ERR_INVALID_ARG, "MXFP8 synth needs every K dimension divisible by 32");
    synth_list l = {0};
    char *json = NULL;
    m3_status st = list_drafter(&l, &d);
    if (!st)
        st = m3_draft_config_to_json(&d, &json);
    if (!st)
        st = write_checkpoint(dir, &l, json, opts);
    free(json);
    free(l.t);
    if (st)
        return m3_fail_context(st, "synth of a drafter into %s", dir);
    return M3_OK;
}
