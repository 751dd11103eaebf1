/*
 * `m3 bench layer` (see bench_layer.h). One engine serves every point: its
 * caches are filled with random values (a prefill of 128K tokens per row
 * would take far longer than the measurement), sequences are given the
 * point's context length, and one decode step of the chosen layer is
 * captured into a CUDA graph and replayed. Between replays the input rows
 * and the sequences rotate through enough sets that their caches and
 * activations exceed the L2 several times over, so the cache is not what
 * is measured. The median replay time is set against the floor.
 */
#include "bench/bench_layer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "core/status.h"
#include "cuda/cuda_bench.h"
#include "cuda/cuda_mono.h"
#include "decode/engine.h"
#include "mono/mono.h"

#define ROTATE_BYTES ((double)(512u << 20)) /* inputs rotated per point: ~8x the L2 */
#define MAX_SETS 64

static double tensor_bytes(const m3_tensor *t) {
    return t->data ? (double)m3_tensor_nelem(t) * (double)m3_dtype_size(t->dtype) : 0;
}

static double linear_bytes(const m3_linear *l) {
    return tensor_bytes(&l->w) + tensor_bytes(&l->scale);
}

/* Weights every step of the layer reads, whatever the routing. */
static double fixed_weight_bytes(const m3_layer_weights *w) {
    double b = tensor_bytes(&w->input_norm) + tensor_bytes(&w->post_norm) +
               linear_bytes(&w->q_proj) + linear_bytes(&w->k_proj) + linear_bytes(&w->v_proj) +
               linear_bytes(&w->o_proj) + tensor_bytes(&w->q_norm) + tensor_bytes(&w->k_norm);
    if (w->sparse)
        b += linear_bytes(&w->iq_proj) + linear_bytes(&w->ik_proj) + tensor_bytes(&w->iq_norm) +
             tensor_bytes(&w->ik_norm);
    if (w->moe)
        b += tensor_bytes(&w->router) + tensor_bytes(&w->router_bias) +
             linear_bytes(&w->sh_gate) + linear_bytes(&w->sh_up) + linear_bytes(&w->sh_down);
    else
        b += linear_bytes(&w->mlp_gate) + linear_bytes(&w->mlp_up) + linear_bytes(&w->mlp_down);
    return b;
}

static double expert_bytes(const m3_layer_weights *w) {
    return w->moe ? linear_bytes(&w->exp_gate[0]) + linear_bytes(&w->exp_up[0]) +
                        linear_bytes(&w->exp_down[0])
                  : 0;
}

/* Cache bytes one row at kv_len must read in the layer. */
static double cache_bytes_per_row(const m3_config *c, const m3_layer_weights *w, int64_t kv_len) {
    double kv_token = 2.0 * c->num_kv_heads * c->head_dim * 2; /* K and V, bf16 */
    if (!w->sparse)
        return (double)kv_len * kv_token;
    int64_t nblocks = (kv_len + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS;
    int64_t attended = kv_len;
    if (nblocks > c->topk_blocks) {
        int64_t last = kv_len - (nblocks - 1) * M3_PAGE_TOKENS;
        attended = c->local_blocks > 0 ? (int64_t)(c->topk_blocks - 1) * M3_PAGE_TOKENS + last
                                       : (int64_t)c->topk_blocks * M3_PAGE_TOKENS;
    }
    double index = (double)kv_len * c->index_dim * 2;
    return (double)attended * kv_token + index;
}

static int sets_for(const m3_config *c, const m3_layer_weights *w, int rows, int64_t context) {
    double per_set = rows * ((double)context * (2.0 * c->num_kv_heads * c->head_dim * 2 +
                                                (w->sparse ? c->index_dim * 2.0 : 0)) +
                             4.0 * c->hidden_size);
    int sets = (int)ceil(ROTATE_BYTES / per_set);
    return sets < 1 ? 1 : sets > MAX_SETS ? MAX_SETS : sets;
}

typedef struct bench_ctx {
    m3_engine *e;
    int layer;
    const m3_layer_weights *w;
    m3_seq *seqs; /* [sets * rows] */
    bool mono;    /* the mono path's layer, else the stock path's */
} bench_ctx;

/* Build set s's decode step and give it fresh input rows. */
static m3_status prepare_set(bench_ctx *b, int rows, int s) {
    m3_request reqs[M3_GRAPH_MAX_ROWS];
    static const int32_t token = 1;
    for (int r = 0; r < rows; r++)
        reqs[r] = (m3_request){b->seqs[s * rows + r], &token, 1};
    M3_TRY(m3_engine_build(b->e, reqs, rows, true));
    size_t n = (size_t)rows * b->e->cfg.hidden_size;
    M3_TRY(m3_cuda_fill_random_bf16(b->e->be, b->e->s.hidden, n, 1000 + 2 * (uint64_t)s, 1.0f));
    return m3_cuda_fill_random_bf16(b->e->be, b->e->s.residual, n, 1001 + 2 * (uint64_t)s, 1.0f);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The layer on the benchmarked path. */
static m3_status run_layer(bench_ctx *b) {
    m3_engine *e = b->e;
    if (!b->mono)
        return m3_stock_layer(e, &e->step, b->layer, false);
    return m3_mono_run_layer(e->mono, &e->step, b->layer, e->s.hidden, e->s.residual);
}

static m3_status capture_layer(bench_ctx *b, void **graph) {
    m3_engine *e = b->e;
    M3_TRY(run_layer(b)); /* sizes the workspaces */
    M3_TRY(e->be->ops->sync(e->be));
    M3_TRY(e->be->ops->graph_begin(e->be));
    e->step.capturing = true;
    m3_status cap = run_layer(b);
    e->step.capturing = false;
    m3_status end = e->be->ops->graph_end(e->be, cap == M3_OK, graph);
    return cap ? cap : end;
}

static m3_status time_point(bench_ctx *b, int rows, int sets, int iters, m3_bench_point *p) {
    m3_engine *e = b->e;
    void *graph = NULL;
    M3_TRY(prepare_set(b, rows, 0));
    m3_status st = capture_layer(b, &graph);
    double unique = 0;
    for (int s = 0; !st && b->w->moe && s < sets; s++) {
        int n = 0;
        st = prepare_set(b, rows, s);
        /* the stock MoE op counts the distinct experts; both paths route alike */
        if (!st)
            st = m3_stock_layer(e, &e->step, b->layer, false);
        if (!st)
            st = m3_cuda_moe_unique_experts(e->be, &n);
        unique += n;
    }
    double *us = calloc((size_t)iters, sizeof *us);
    if (!st && !us)
        st = m3_fail(M3_ERR_NO_MEMORY, "out of memory for timings");
    for (int i = -3; !st && i < iters; i++) { /* three warm-up replays */
        double t;
        st = prepare_set(b, rows, (i + 3) % sets);
        if (!st)
            st = m3_cuda_timed_launch(e->be, graph, &t);
        if (!st && i >= 0)
            us[i] = t;
    }
    if (!st) {
        qsort(us, (size_t)iters, sizeof *us, cmp_double);
        p->median_us = us[iters / 2];
        p->min_us = us[0];
        p->unique_experts = b->w->moe ? unique / sets : 0;
    }
    free(us);
    if (graph)
        e->be->ops->graph_free(e->be, graph);
    const char *trace = getenv("M3_MONO_TRACE");
    if (!st && b->mono && trace) { /* one eager step, item by item */
        char path[4096];
        snprintf(path, sizeof path, "%s.rows%d.ctx%lld.txt", trace, rows,
                 (long long)e->cache.seqs[b->seqs[0]].len + 1);
        m3_cuda_mono *x = m3_mono_executor(e->mono);
        st = prepare_set(b, rows, 0);
        if (!st)
            st = m3_cuda_mono_trace_start(x);
        if (!st)
            st = run_layer(b);
        if (!st)
            st = m3_cuda_mono_trace_write(x, path);
    }
    return st;
}

static m3_status run_point(bench_ctx *b, int rows, int64_t context, int iters, double gbps,
                           m3_bench_point *p) {
    m3_engine *e = b->e;
    const m3_config *c = &e->cfg;
    int sets = sets_for(c, b->w, rows, context);
    memset(p, 0, sizeof *p);
    p->layer = b->layer;
    p->rows = rows;
    p->context = context;
    p->path = b->mono ? "mono" : "stock";
    p->sets = sets;
    m3_status st = M3_OK;
    int made = 0;
    for (; made < sets * rows && !st; made++) {
        st = m3_seq_create(e, &b->seqs[made]);
        if (!st)
            st = m3_engine_set_len(e, b->seqs[made], context - 1);
        else
            made--; /* not created: nothing to free */
    }
    if (!st)
        st = time_point(b, rows, sets, iters, p);
    for (int i = 0; i < made; i++)
        m3_seq_free(e, b->seqs[i]);
    if (st)
        return m3_fail_context(st, "rows %d, context %lld", rows, (long long)context);
    p->weight_bytes = fixed_weight_bytes(b->w) + p->unique_experts * expert_bytes(b->w);
    p->cache_bytes = rows * cache_bytes_per_row(c, b->w, context);
    p->bytes = p->weight_bytes + p->cache_bytes;
    p->floor_us = p->bytes / (gbps * 1e9) * 1e6;
    return M3_OK;
}

static int pick_layer(const m3_config *c, int want) {
    if (want >= 0)
        return want;
    for (int i = 0; i < c->num_layers; i++)
        if (c->layer_sparse[i] && c->layer_moe[i])
            return i;
    return c->num_layers - 1;
}

/* The engine's capacity: the largest point's sequences and tokens. */
static void capacity(const m3_bench_layer_opts *o, const m3_config *c,
                     const m3_layer_weights *w, int *max_seqs, int64_t *max_tokens) {
    *max_seqs = 1;
    *max_tokens = M3_PAGE_TOKENS;
    for (int i = 0; i < o->n_contexts; i++)
        for (int j = 0; j < o->n_rows; j++) {
            int sets = sets_for(c, w, o->rows[j], o->contexts[i]);
            int64_t per_seq = (o->contexts[i] + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS *
                              M3_PAGE_TOKENS;
            if (sets * o->rows[j] > *max_seqs)
                *max_seqs = sets * o->rows[j];
            if (sets * o->rows[j] * per_seq > *max_tokens)
                *max_tokens = sets * o->rows[j] * per_seq;
        }
}

static m3_status check_opts(const m3_bench_layer_opts *o, const m3_config *c, int layer) {
    if (strcmp(o->path, "stock") && strcmp(o->path, "mono"))
        return m3_fail(M3_ERR_UNSUPPORTED, "bench path '%s': expected stock or mono", o->path);
    if (layer < 0 || layer >= c->num_layers)
        return m3_fail(M3_ERR_INVALID_ARG, "layer %d: the model has %d layers", layer,
                       c->num_layers);
    if (o->iters < 1 || o->n_rows < 1 || o->n_contexts < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "bench needs iterations, rows and contexts");
    for (int j = 0; j < o->n_rows; j++)
        if (o->rows[j] < 1 || o->rows[j] > M3_GRAPH_MAX_ROWS)
            return m3_fail(M3_ERR_INVALID_ARG, "rows %d: must be in [1, %d]", o->rows[j],
                           M3_GRAPH_MAX_ROWS);
    for (int i = 0; i < o->n_contexts; i++)
        if (o->contexts[i] < 2 || o->contexts[i] > c->max_position_embeddings)
            return m3_fail(M3_ERR_INVALID_ARG, "context %lld: must be in [2, %lld]",
                           (long long)o->contexts[i], (long long)c->max_position_embeddings);
    return M3_OK;
}

static m3_status fill_caches(m3_engine *e) {
    size_t kv = (size_t)e->cache.n_pages * e->cfg.num_kv_heads * M3_PAGE_TOKENS * e->cfg.head_dim;
    size_t index = (size_t)e->cache.n_pages * M3_PAGE_TOKENS * e->cfg.index_dim;
    for (int i = 0; i < e->cfg.num_layers; i++) {
        m3_cache_layer *l = &e->cache.layers[i];
        M3_TRY(m3_cuda_fill_random_bf16(e->be, l->k, kv, 10 * (uint64_t)i + 1, 1.0f));
        M3_TRY(m3_cuda_fill_random_bf16(e->be, l->v, kv, 10 * (uint64_t)i + 2, 1.0f));
        if (l->index)
            M3_TRY(m3_cuda_fill_random_bf16(e->be, l->index, index, 10 * (uint64_t)i + 3, 1.0f));
    }
    return e->be->ops->sync(e->be);
}

m3_status m3_bench_layer(const m3_bench_layer_opts *o, m3_bench_layer_result *out) {
    memset(out, 0, sizeof *out);
    m3_model *model = NULL;
    m3_model_opts mo = {true};
    M3_TRY(m3_model_load(o->model_dir, &mo, &model));
    const m3_config *c = m3_model_config(model);
    bench_ctx b = {NULL, pick_layer(c, o->layer), NULL, NULL, false};
    m3_status st = check_opts(o, c, b.layer);
    b.w = st ? NULL : &model->w.layers[b.layer];
    m3_engine_opts eo = m3_engine_defaults();
    eo.device = M3_DEVICE_CUDA;
    eo.gpu = o->gpu;
    eo.graphs = true; /* capacity-wide block tables: one capture per row count */
    eo.max_rows = M3_GRAPH_MAX_ROWS;
    b.mono = !strcmp(o->path, "mono");
    eo.decode = b.mono ? M3_DECODE_MONO : M3_DECODE_STOCK;
    if (!st)
        capacity(o, c, b.w, &eo.max_seqs, &eo.max_tokens);
    if (!st)
        st = m3_engine_create(model, &eo, &b.e);
    if (!st) {
        b.w = &b.e->w.layers[b.layer]; /* the device copy: same shapes */
        b.seqs = calloc((size_t)eo.max_seqs, sizeof *b.seqs);
        st = b.seqs ? fill_caches(b.e) : m3_fail(M3_ERR_NO_MEMORY, "out of memory");
    }
    if (!st && b.mono)
        st = m3_mono_bind_cache(b.e->mono, &b.e->cache, b.e->cache.n_pages, false);
    if (!st)
        st = m3_cuda_read_bandwidth(b.e->be, (size_t)4 << 30, 20, &out->read_gb_per_s);
    if (!st)
        fprintf(stderr, "bench: layer %d (%s, %s), read bandwidth %.0f GB/s\n", b.layer,
                c->layer_sparse[b.layer] ? "sparse" : "dense",
                c->layer_moe[b.layer] ? "MoE" : "dense MLP", out->read_gb_per_s);
    for (int i = 0; !st && i < o->n_contexts; i++)
        for (int j = 0; !st && j < o->n_rows; j++) {
            m3_bench_point *p = &out->points[out->n_points];
            st = run_point(&b, o->rows[j], o->contexts[i], o->iters, out->read_gb_per_s, p);
            if (!st) {
                out->n_points++;
                fprintf(stderr, "bench: rows %2d context %7lld: %8.1f us, floor %8.1f us (%.2fx)\n",
                        p->rows, (long long)p->context, p->median_us, p->floor_us,
                        p->median_us / p->floor_us);
            }
        }
    free(b.seqs);
    m3_engine_free(b.e);
    m3_model_free(model);
    return st;
}
