/*
 * `m3 bench layer` (see bench_layer.h). One engine serves every point: its
 * caches are filled with random values (a prefill of 128K tokens per row
 * would take far longer than the measurement), sequences are given the
 * point's context length, and one decode step of the chosen layer is
 * captured into a CUDA graph and replayed. Between replays the input rows
 * and the sequences rotate through enough sets that their caches and
 * activations exceed the L2 several times over, so the cache is not what
 * is measured. The median replay time is set against the floor. With
 * --span N the graph holds N consecutive layers (each layer's output the
 * next one's input, as in a decode step) and every figure is a mean per
 * layer: the time a layer takes among neighbours whose work may overlap
 * its own (one kernel's tail with the next one's start; work one layer
 * does for the next, as the next-layer prefetch that docs/PERF.md's
 * fifty-seventh session measured with it). A point
 * frees all its sequences, and a drained page pool hands out its pages in
 * its first order again (cache.c), so every point gets the same pages
 * whichever points ran before it.
 *
 * TP over GPUs (--tp N): the engine is a TP front; every rank builds,
 * captures and replays its own graph on its own thread at once (the
 * collectives join them), a point's time per replay is the slowest
 * rank's, and the floor is one rank's bytes over one GPU's bandwidth. The
 * stock path's all-reduces are also timed alone (the same sizes, captured
 * and replayed the same way): the all-reduce cost inside the layer time.
 * Path "stock-cp" is the stock path with indexer context parallelism (TP
 * over GPUs): each rank scores its share of the blocks, so its floor
 * counts that share of the index cache.
 */
#include "bench/bench_layer.h"
#include "bench/bench_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "core/progress.h"
#include "core/status.h"
#include "cuda/cuda_bench.h"
#include "cuda/cuda_mono.h"
#include "decode/engine.h"
#include "model/shard.h"
#include "mono/mono.h"

#define ROTATE_BYTES ((double)(512u << 20)) /* inputs rotated per point: ~8x the L2 */
#define MAX_SETS 64

/* Weights every step of the layer reads, whatever the routing. */
static double fixed_weight_bytes(const m3_layer_weights *w) {
    double b = bench_tensor_bytes(&w->input_norm) + bench_tensor_bytes(&w->post_norm) +
               bench_linear_bytes(&w->q_proj) + bench_linear_bytes(&w->k_proj) + bench_linear_bytes(&w->v_proj) +
               bench_linear_bytes(&w->o_proj) + bench_tensor_bytes(&w->q_norm) + bench_tensor_bytes(&w->k_norm);
    if (w->sparse)
        b += bench_linear_bytes(&w->iq_proj) + bench_linear_bytes(&w->ik_proj) + bench_tensor_bytes(&w->iq_norm) +
             bench_tensor_bytes(&w->ik_norm);
    if (w->moe)
        b += bench_tensor_bytes(&w->router) + bench_tensor_bytes(&w->router_bias) +
             bench_linear_bytes(&w->sh_gate) + bench_linear_bytes(&w->sh_up) + bench_linear_bytes(&w->sh_down);
    else
        b += bench_linear_bytes(&w->mlp_gate) + bench_linear_bytes(&w->mlp_up) + bench_linear_bytes(&w->mlp_down);
    return b;
}

static double expert_bytes(const m3_layer_weights *w) {
    return w->moe ? bench_linear_bytes(&w->exp_gate[0]) + bench_linear_bytes(&w->exp_up[0]) +
                        bench_linear_bytes(&w->exp_down[0])
                  : 0;
}

/* Cache bytes one row at kv_len must read in the layer on one rank;
 * index_share: the share of the (replicated) index cache it scores. */
static double cache_bytes_per_row(const m3_config *c, const m3_layer_weights *w, int64_t kv_len,
                                  double index_share) {
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
    double index = (double)kv_len * c->index_dim * 2 * index_share;
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
    m3_engine *e;  /* TP 1: the engine; TP > 1: the front */
    int world;
    int layer, span;           /* layers layer .. layer + span - 1 */
    const m3_layer_weights *w; /* rank 0's, of `layer` (w + i: layer + i's) */
    m3_seq *seqs; /* [sets * rows] */
    bool mono;    /* the mono path's layer, else the stock path's */
    bool cp;      /* the stock path with indexer context parallelism */
    /* the point being timed, shared by the rank threads */
    int rows, sets, iters;
    double warmup_ms;
    double *us;   /* [world][iters]: each rank's replay times */
    double *ar_us;/* [world][iters]: the stock path's all-reduces alone (TP > 1) */
    float *ar_buf[M3_MAX_TP]; /* each rank's [rows * k, H] fp32 for them */
    double unique[M3_MAX_LAYERS]; /* per span layer: distinct experts, mean over sets */
} bench_ctx;

static m3_engine *rank_engine(const bench_ctx *b, int r) {
    return b->world > 1 ? b->e->ranks[r] : b->e;
}

/* fn on every rank at once (TP: each on its own thread, bound to its GPU) */
static m3_status on_ranks(bench_ctx *b, m3_status (*fn)(m3_engine *rank, void *b)) {
    return b->world > 1 ? m3_tp_run_all(b->e, fn, b) : fn(b->e, b);
}

/* Build set s's decode step on rank engine e and give it fresh input rows
 * (the same on every rank: TP ranks hold the same activations). */
static m3_status prepare_set(bench_ctx *b, m3_engine *e, int rows, int s) {
    m3_request reqs[M3_GRAPH_MAX_ROWS];
    static const int32_t token = 1;
    for (int r = 0; r < rows; r++)
        reqs[r] = (m3_request){b->seqs[s * rows + r], &token, 1};
    M3_TRY(m3_engine_build(e, reqs, rows, true));
    size_t n = (size_t)rows * e->cfg.hidden_size;
    M3_TRY(m3_cuda_fill_random_bf16(e->be, e->s.hidden, n, 1000 + 2 * (uint64_t)s, 1.0f));
    return m3_cuda_fill_random_bf16(e->be, e->s.residual, n, 1001 + 2 * (uint64_t)s, 1.0f);
}

/* The span's layers on the benchmarked path. */
static m3_status run_layer(bench_ctx *b, m3_engine *e) {
    for (int l = b->layer; l < b->layer + b->span; l++) {
        if (!b->mono)
            M3_TRY(m3_stock_layer(e, &e->step, l, false));
        else
            M3_TRY(m3_mono_run_layer(e->mono, &e->step, l, e->s.hidden, e->s.residual));
    }
    return M3_OK;
}

/* Capture ops (run once eagerly first: it sizes the workspaces). */
static m3_status capture(m3_engine *e, m3_status (*ops)(bench_ctx *, m3_engine *), bench_ctx *b,
                         void **graph) {
    M3_TRY(ops(b, e));
    M3_TRY(e->be->ops->sync(e->be));
    M3_TRY(e->be->ops->graph_begin(e->be));
    e->step.capturing = true;
    m3_status cap = ops(b, e);
    e->step.capturing = false;
    m3_status end = e->be->ops->graph_end(e->be, cap == M3_OK, graph);
    return cap ? cap : end;
}

/* The all-reduces of the stock path's layer at TP > 1, alone: o_proj's
 * [rows, H], the experts' [rows * k, H] and the shared expert's [rows, H]
 * fp32 partials (the values do not matter). */
static m3_status allreduces(bench_ctx *b, m3_engine *e) {
    int64_t n = (int64_t)b->rows * e->cfg.hidden_size;
    float *buf = b->ar_buf[e->tp_rank];
    M3_TRY(e->comm->ops->all_reduce_sum_f32(e->comm, buf, n));
    M3_TRY(e->comm->ops->all_reduce_sum_f32(e->comm, buf, n * e->cfg.experts_per_tok));
    return e->comm->ops->all_reduce_sum_f32(e->comm, buf, n);
}

/* One replay of graph (fresh inputs first when sets > 0: input set `set`
 * modulo sets). TP: the ranks start it together (inputs ready, then a host
 * barrier), so a rank's time is not another's late start. */
static m3_status replay_once(bench_ctx *b, m3_engine *e, void *graph, int sets, int set,
                             double *us) {
    bool all = true;
    if (sets)
        M3_TRY(prepare_set(b, e, b->rows, set % sets));
    if (b->world > 1) {
        M3_TRY(e->be->ops->sync(e->be));
        M3_TRY(m3_comm_agree(e->comm, true, &all));
    }
    return m3_cuda_timed_launch(e->be, graph, us);
}

/* Replay graph: warm-ups first, at least three and for at least
 * b->warmup_ms (a point measured right after a heavier one runs several
 * percent slower for tens of milliseconds: docs/PERF.md, fifty-sixth
 * session; TP: the ranks agree when to stop, so they replay alike), then
 * iters timed replays into us[iters]. */
static m3_status replay(bench_ctx *b, m3_engine *e, void *graph, int sets, double *us) {
    const double t0 = m3_now_seconds();
    int n = 0;
    for (;; n++) {
        bool done = n >= 3 && (m3_now_seconds() - t0) * 1e3 >= b->warmup_ms;
        if (b->world > 1)
            M3_TRY(m3_comm_agree(e->comm, done, &done));
        if (done)
            break;
        double t;
        M3_TRY(replay_once(b, e, graph, sets, n, &t));
    }
    for (int i = 0; i < b->iters; i++)
        M3_TRY(replay_once(b, e, graph, sets, n + i, &us[i]));
    return M3_OK;
}

/* One rank's share of a point: capture, count the routed experts, time
 * the replays (and at TP > 1 the all-reduces alone). */
static m3_status time_rank(m3_engine *e, void *arg) {
    bench_ctx *b = arg;
    int r = b->world > 1 ? e->tp_rank : 0, rows = b->rows, sets = b->sets;
    void *graph = NULL, *ar_graph = NULL;
    M3_TRY(prepare_set(b, e, rows, 0));
    m3_status st = capture(e, run_layer, b, &graph);
    double unique[M3_MAX_LAYERS] = {0};
    bool moe = false; /* (no MoE layer in the span: no experts to count) */
    for (int l = 0; l < b->span; l++)
        moe = moe || b->w[l].moe;
    for (int s = 0; !st && moe && s < sets; s++) {
        st = prepare_set(b, e, rows, s);
        /* the stock MoE op counts the distinct experts; both paths route
         * alike (a span's layers in order: each routes its input) */
        for (int l = 0; !st && l < b->span; l++) {
            int n = 0;
            st = m3_stock_layer(e, &e->step, b->layer + l, false);
            if (!st && b->w[l].moe)
                st = m3_cuda_moe_unique_experts(e->be, &n);
            unique[l] += n;
        }
    }
    if (!st)
        st = replay(b, e, graph, sets, b->us + (size_t)r * b->iters);
    size_t ar_bytes = (size_t)rows * e->cfg.experts_per_tok * e->cfg.hidden_size * 4;
    if (!st && b->world > 1)
        st = e->be->ops->alloc(e->be, ar_bytes, (void **)&b->ar_buf[r]);
    if (!st && b->world > 1)
        st = m3_cuda_fill_random_bf16(e->be, b->ar_buf[r], ar_bytes / 2, 7, 1.0f);
    if (!st && b->world > 1)
        st = capture(e, allreduces, b, &ar_graph);
    if (!st && b->world > 1)
        st = replay(b, e, ar_graph, 0, b->ar_us + (size_t)r * b->iters);
    for (int l = 0; !st && r == 0 && l < b->span; l++)
        b->unique[l] = unique[l] / sets;
    if (graph)
        e->be->ops->graph_free(e->be, graph);
    if (ar_graph)
        e->be->ops->graph_free(e->be, ar_graph);
    if (b->ar_buf[r]) {
        e->be->ops->sync(e->be);
        e->be->ops->release(e->be, b->ar_buf[r]);
        b->ar_buf[r] = NULL;
    }
    return st;
}

/* Per replay the slowest rank; the series' median, minimum and drift
 * (bench_series_of). */
static bench_series summarize(const bench_ctx *b, const double *us) {
    const int n = b->iters;
    double *worst = calloc((size_t)n * 2, sizeof *worst);
    if (!worst)
        return (bench_series){NAN, NAN, NAN, NAN};
    for (int i = 0; i < n; i++)
        for (int r = 0; r < b->world; r++)
            worst[i] = fmax(worst[i], us[(size_t)r * n + i]);
    bench_series s = bench_series_of(worst, n, worst + n);
    free(worst);
    return s;
}

static m3_status time_point(bench_ctx *b, int rows, int sets, int iters, m3_bench_point *p) {
    m3_engine *e = b->e;
    b->rows = rows, b->sets = sets, b->iters = iters;
    b->us = calloc((size_t)b->world * iters, sizeof *b->us);
    b->ar_us = calloc((size_t)b->world * iters, sizeof *b->ar_us);
    m3_status st = b->us && b->ar_us ? on_ranks(b, time_rank)
                                     : m3_fail(M3_ERR_NO_MEMORY, "out of memory for timings");
    if (!st) {
        bench_series t = summarize(b, b->us);
        p->median_us = t.median, p->min_us = t.min;
        p->first_third_us = t.first_third, p->last_third_us = t.last_third;
        if (b->world > 1) /* (one layer's all-reduces) */
            p->allreduce_us = summarize(b, b->ar_us).median;
        double u = 0;
        for (int l = 0; l < b->span; l++)
            u += b->unique[l];
        p->unique_experts = u / b->span;
        p->median_us /= b->span, p->min_us /= b->span;
        p->first_third_us /= b->span, p->last_third_us /= b->span;
    }
    free(b->us), free(b->ar_us);
    b->us = b->ar_us = NULL;
    const char *trace = getenv("M3_MONO_TRACE");
    if (!st && b->mono && trace && b->world == 1) { /* one eager step, item by item */
        char path[4096];
        snprintf(path, sizeof path, "%s.rows%d.ctx%lld.txt", trace, rows,
                 (long long)e->cache.seqs[b->seqs[0]].len + 1);
        m3_cuda_mono *x = m3_mono_executor(e->mono);
        st = prepare_set(b, e, rows, 0);
        if (!st)
            st = m3_cuda_mono_trace_start(x);
        if (!st)
            st = run_layer(b, e);
        if (!st)
            st = m3_cuda_mono_trace_write(x, path);
    }
    return st;
}

static m3_status run_point(bench_ctx *b, int rows, int64_t context, int iters, double gbps,
                           m3_bench_point *p) {
    m3_engine *e = b->e;
    const m3_config *c = &rank_engine(b, 0)->cfg; /* one rank's shapes */
    int sets = sets_for(c, b->w, rows, context);
    memset(p, 0, sizeof *p);
    p->layer = b->layer;
    p->span = b->span;
    p->rows = rows;
    p->context = context;
    p->path = b->mono ? "mono" : b->cp ? "stock-cp" : "stock";
    p->sets = sets;
    p->tp = b->world;
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
    p->weight_bytes = p->cache_bytes = 0; /* means per layer */
    for (int l = 0; l < b->span; l++) {
        const m3_layer_weights *w = &b->w[l];
        p->weight_bytes += (fixed_weight_bytes(w) + b->unique[l] * expert_bytes(w)) / b->span;
        p->cache_bytes +=
            rows * cache_bytes_per_row(c, w, context, b->cp ? 1.0 / b->world : 1.0) / b->span;
    }
    p->bytes = p->weight_bytes + p->cache_bytes;
    p->floor_us = p->bytes / (gbps * 1e9) * 1e6;
    /* what streaming the same bytes costs one kernel, ramp and tail in */
    st = m3_cuda_read_time(rank_engine(b, 0)->be, (size_t)p->bytes, 20, &p->read_us);
    if (st)
        return m3_fail_context(st, "rows %d, context %lld", rows, (long long)context);
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

/* span: o->span as the bench runs it (0 and 1: one layer) */
static m3_status check_opts(const m3_bench_layer_opts *o, const m3_config *c, int layer,
                            int span) {
    if (strcmp(o->path, "stock") && strcmp(o->path, "mono") && strcmp(o->path, "stock-cp"))
        return m3_fail(M3_ERR_UNSUPPORTED, "bench path '%s': expected stock, mono or stock-cp",
                       o->path);
    if (layer < 0 || layer >= c->num_layers)
        return m3_fail(M3_ERR_INVALID_ARG, "layer %d: the model has %d layers", layer,
                       c->num_layers);
    if (o->span < 0 || span > c->num_layers - layer)
        return m3_fail(M3_ERR_INVALID_ARG, "span %d from layer %d: the model has %d layers",
                       o->span, layer, c->num_layers);
    for (int l = layer; !strcmp(o->path, "stock-cp") && l < layer + span; l++)
        if (!c->layer_sparse[l])
            return m3_fail(M3_ERR_INVALID_ARG,
                           "bench path stock-cp: layer %d is not a sparse layer", l);
    if (o->iters < 1 || o->n_rows < 1 || o->n_contexts < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "bench needs iterations, rows and contexts");
    if (!(o->warmup_ms >= 0 && o->warmup_ms <= 600000))
        return m3_fail(M3_ERR_INVALID_ARG, "warm-up %g ms: must be in [0, 600000]", o->warmup_ms);
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

static m3_status fill_caches(m3_engine *e, void *unused) {
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

static m3_status bind_mono(m3_engine *e, void *unused) {
    return m3_mono_bind_cache(e->mono, &e->cache, e->cache.n_pages, false);
}

m3_status m3_bench_layer(const m3_bench_layer_opts *o, m3_bench_layer_result *out) {
    memset(out, 0, sizeof *out);
    m3_model *model = NULL;
    m3_model_opts mo = {true};
    M3_TRY(m3_model_load(o->model_dir, &mo, &model));
    const m3_config *c = m3_model_config(model);
    bench_ctx b = {.world = o->tp > 1 ? o->tp : 1, .layer = pick_layer(c, o->layer),
                   .span = o->span > 1 ? o->span : 1, .warmup_ms = o->warmup_ms};
    m3_status st = check_opts(o, c, b.layer, b.span);
    b.w = st ? NULL : &model->w.layers[b.layer];
    m3_engine_opts eo = m3_engine_defaults();
    eo.device = M3_DEVICE_CUDA;
    eo.gpu = o->gpu;
    eo.tp = b.world;
    eo.graphs = true; /* capacity-wide block tables: one capture per row count */
    eo.max_rows = M3_GRAPH_MAX_ROWS;
    b.mono = !strcmp(o->path, "mono");
    b.cp = !strcmp(o->path, "stock-cp");
    eo.decode = b.mono ? M3_DECODE_MONO : M3_DECODE_STOCK;
    eo.indexer_cp = b.cp; /* the engine refuses it below TP 2 or past the index heads */
    /* sized by one rank's shapes, as the points will be (TP: fewer KV heads,
     * so more input sets rotate through) */
    m3_config rank_cfg = b.world > 1 ? m3_tp_config(c, b.world) : *c;
    if (!st)
        capacity(o, &rank_cfg, b.w, &eo.max_seqs, &eo.max_tokens);
    if (!st)
        st = m3_engine_create(model, &eo, &b.e);
    m3_engine *r0 = st ? NULL : rank_engine(&b, 0);
    if (!st) {
        b.w = &r0->w.layers[b.layer]; /* rank 0's device copy (TP: its shard's shapes) */
        b.seqs = calloc((size_t)eo.max_seqs, sizeof *b.seqs);
        st = b.seqs ? on_ranks(&b, fill_caches) : m3_fail(M3_ERR_NO_MEMORY, "out of memory");
    }
    if (!st && b.mono)
        st = on_ranks(&b, bind_mono);
    if (!st) /* one GPU's: every rank reads its own memory */
        st = m3_engine_bind_thread(r0);
    if (!st)
        st = m3_cuda_read_bandwidth(r0->be, (size_t)4 << 30, 20, &out->read_gb_per_s);
    if (!st)
        fprintf(stderr,
                "bench: layer %d (%s, %s)%s, TP %d, read bandwidth %.0f GB/s per GPU\n",
                b.layer, c->layer_sparse[b.layer] ? "sparse" : "dense",
                c->layer_moe[b.layer] ? "MoE" : "dense MLP",
                b.span > 1 ? " and the layers after it (means per layer)" : "", b.world,
                out->read_gb_per_s);
    for (int i = 0; !st && i < o->n_contexts; i++)
        for (int j = 0; !st && j < o->n_rows; j++) {
            m3_bench_point *p = &out->points[out->n_points];
            st = run_point(&b, o->rows[j], o->contexts[i], o->iters, out->read_gb_per_s, p);
            if (!st) {
                out->n_points++;
                fprintf(stderr,
                        "bench: rows %2d context %7lld: %8.1f us, floor %8.1f us (%.2fx), "
                        "one read-only kernel %.1f us",
                        p->rows, (long long)p->context, p->median_us, p->floor_us,
                        p->median_us / p->floor_us, p->read_us);
                if (b.world > 1)
                    fprintf(stderr, ", stock all-reduces alone %.1f us", p->allreduce_us);
                fputc('\n', stderr);
            }
        }
    free(b.seqs);
    m3_engine_free(b.e);
    m3_model_free(model);
    return st;
}
