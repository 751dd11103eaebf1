/*
 * `m3 bench draft` (bench_draft.h): a target engine on one GPU with a
 * drafter attached, each point's requests given sequences of `context`
 * tokens whose drafter context cache holds random values (the step reads
 * them; what they hold does not change what it reads), then every part of
 * the draft step captured alone and replayed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_draft.h"
#include "bench/bench_util.h"
#include "core/status.h"
#include "cuda/cuda_bench.h"
#include "spec/drafter.h"

static const char *const part_names[M3_BENCH_DRAFT_PARTS] = {"step", "layers", "head", "markov"};

const char *m3_bench_draft_part_name(int part) {
    return part >= 0 && part < M3_BENCH_DRAFT_PARTS ? part_names[part] : "?";
}

/* The floor's bytes of each part for n requests at `context` tokens. */
static void part_bytes(const m3_drafter *d, int n, int64_t context, double *bytes) {
    const m3_config *a = &d->cfg.attn;
    int B = d->cfg.block;
    double layers = 0;
    for (int i = 0; i < a->num_layers; i++) {
        const m3_draft_layer *L = &d->bw.layers[i];
        layers += bench_tensor_bytes(&L->input_norm) + bench_tensor_bytes(&L->post_norm) +
                  bench_linear_bytes(&L->q_proj) + bench_linear_bytes(&L->k_proj) +
                  bench_linear_bytes(&L->v_proj) + bench_linear_bytes(&L->o_proj) +
                  bench_tensor_bytes(&L->q_norm) + bench_tensor_bytes(&L->k_norm) + bench_linear_bytes(&L->gate) +
                  bench_linear_bytes(&L->up) + bench_linear_bytes(&L->down);
    }
    /* each request's context K and V in every layer (a window reads at
     * most its keys), and the block's embedding rows */
    int64_t keys = d->cfg.window && d->cfg.window < context ? d->cfg.window : context;
    layers += (double)a->num_layers * n * keys * a->num_kv_heads * a->head_dim * 2.0 * 2.0;
    layers += (double)n * B * a->hidden_size * 2.0 + bench_tensor_bytes(&d->bw.final_norm);
    bytes[M3_DRAFT_PART_LAYERS] = layers;
    bytes[M3_DRAFT_PART_HEAD] = bench_tensor_bytes(&d->run.lm_head);
    /* a Markov step reads W2 once for every request and each request's
     * logits row once */
    double w2 = d->cfg.markov_rank ? bench_tensor_bytes(&d->bw.markov_w2) : 0;
    bytes[M3_DRAFT_PART_MARKOV] = B * (w2 + (double)n * d->cfg.vocab_size * 4.0);
    bytes[M3_DRAFT_PART_STEP] = layers + bytes[M3_DRAFT_PART_HEAD] + bytes[M3_DRAFT_PART_MARKOV];
}

/* One part of a draft step of n requests: run once eagerly (it sizes the
 * workspaces), capture, replay iters times after three warm-ups. */
static m3_status time_part(m3_drafter *d, int n, m3_draft_part part, int iters, double *median,
                           double *min) {
    m3_backend *be = d->run.eng->be;
    double *us = calloc((size_t)iters, sizeof *us);
    if (!us)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory for timings");
    void *graph = NULL;
    m3_status st = m3_drafter_bench_part(d, n, part);
    if (!st)
        st = be->ops->sync(be);
    if (!st)
        st = be->ops->graph_begin(be);
    if (!st) {
        m3_status cap = m3_drafter_bench_part(d, n, part);
        m3_status end = be->ops->graph_end(be, cap == M3_OK, &graph);
        st = cap ? cap : end;
    }
    for (int i = -3; !st && i < iters; i++) {
        double t = 0;
        st = m3_cuda_timed_launch(be, graph, &t);
        if (i >= 0)
            us[i] = t;
    }
    if (graph)
        be->ops->graph_free(be, graph);
    if (!st) {
        qsort(us, (size_t)iters, sizeof *us, bench_cmp_double);
        *median = us[iters / 2];
        *min = us[0];
    }
    free(us);
    return st;
}

static m3_status run_point(m3_engine *e, m3_drafter *d, int n, int64_t context, int iters,
                           double gbps, m3_bench_draft_point *p) {
    memset(p, 0, sizeof *p);
    p->requests = n;
    p->context = context;
    m3_seq seqs[M3_MAX_DRAFT_REQS];
    int64_t pos[M3_MAX_DRAFT_REQS];
    int32_t anchors[M3_MAX_DRAFT_REQS];
    m3_status st = M3_OK;
    int made = 0;
    for (; made < n && !st; made++) {
        st = m3_seq_create(e, &seqs[made]);
        if (!st)
            st = m3_engine_set_len(e, seqs[made], context);
        else
            made--; /* not created: nothing to free */
        pos[made] = context;
        anchors[made] = (int32_t)((7919 * (made + 1)) % d->cfg.vocab_size);
    }
    if (!st)
        st = m3_drafter_bench_inputs(d, n, seqs, pos, anchors);
    for (int k = 0; !st && k < M3_BENCH_DRAFT_PARTS; k++)
        st = time_part(d, n, (m3_draft_part)k, iters, &p->median_us[k], &p->min_us[k]);
    for (int i = 0; i < made; i++)
        m3_seq_free(e, seqs[i]);
    if (st)
        return m3_fail_context(st, "draft step of %d requests at context %lld", n,
                               (long long)context);
    part_bytes(d, n, context, p->bytes);
    for (int k = 0; k < M3_BENCH_DRAFT_PARTS; k++)
        p->floor_us[k] = p->bytes[k] / (gbps * 1e9) * 1e6;
    return M3_OK;
}

/* Random values in every draft layer's context cache. */
static m3_status fill_context(m3_drafter *d) {
    const m3_config *a = &d->cfg.attn;
    m3_backend *be = d->run.eng->be;
    size_t kv = (size_t)d->run.n_pages * a->num_kv_heads * M3_PAGE_TOKENS * a->head_dim;
    for (int i = 0; i < a->num_layers; i++) {
        M3_TRY(m3_cuda_fill_random_bf16(be, d->run.k_cache[i], kv, 20 * (uint64_t)i + 1, 1.0f));
        M3_TRY(m3_cuda_fill_random_bf16(be, d->run.v_cache[i], kv, 20 * (uint64_t)i + 2, 1.0f));
    }
    return be->ops->sync(be);
}

static m3_status check_opts(const m3_bench_draft_opts *o) {
    if (!o->model_dir || !o->draft_dir)
        return m3_fail(M3_ERR_INVALID_ARG, "bench draft: the target (--model) and the drafter "
                       "(--draft) are both required");
    if (o->n_requests < 1 || o->n_contexts < 1 || o->iters < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "bench draft: %d request counts, %d contexts, %d "
                       "iterations: at least one of each", o->n_requests, o->n_contexts,
                       o->iters);
    for (int i = 0; i < o->n_requests; i++)
        if (o->requests[i] < 1 || o->requests[i] > M3_MAX_DRAFT_REQS)
            return m3_fail(M3_ERR_INVALID_ARG, "bench draft: %d requests (1 to %d)",
                           o->requests[i], M3_MAX_DRAFT_REQS);
    for (int i = 0; i < o->n_contexts; i++)
        if (o->contexts[i] < 1)
            return m3_fail(M3_ERR_INVALID_ARG, "bench draft: a context of %lld tokens",
                           (long long)o->contexts[i]);
    return M3_OK;
}

m3_status m3_bench_draft(const m3_bench_draft_opts *o, m3_bench_draft_result *out) {
    memset(out, 0, sizeof *out);
    M3_TRY(check_opts(o));
    int max_req = 0;
    int64_t max_ctx = 0;
    for (int i = 0; i < o->n_requests; i++)
        max_req = o->requests[i] > max_req ? o->requests[i] : max_req;
    for (int i = 0; i < o->n_contexts; i++)
        max_ctx = o->contexts[i] > max_ctx ? o->contexts[i] : max_ctx;
    m3_model *model = NULL;
    m3_drafter *d = NULL;
    m3_engine *e = NULL;
    m3_model_opts mo = {true};
    M3_TRY(m3_model_load(o->model_dir, &mo, &model));
    m3_status st = m3_drafter_load(o->draft_dir, model, &mo, &d);
    int B = st ? 0 : d->cfg.block;
    if (!st && max_ctx + B + 1 > m3_model_config(model)->max_position_embeddings)
        st = m3_fail(M3_ERR_INVALID_ARG, "bench draft: a context of %lld tokens is past the "
                     "model's %lld positions", (long long)max_ctx,
                     (long long)m3_model_config(model)->max_position_embeddings);
    if (!st) {
        m3_engine_opts eo = m3_engine_defaults();
        eo.device = M3_DEVICE_CUDA;
        eo.gpu = o->gpu;
        eo.graphs = true;
        eo.max_seqs = max_req;
        eo.max_rows = max_req * (B + 1);
        eo.max_tokens = (int64_t)max_req * (max_ctx + 2 * M3_PAGE_TOKENS);
        st = m3_engine_create(model, &eo, &e);
    }
    if (!st)
        st = m3_drafter_attach(d, e);
    if (!st)
        st = fill_context(d);
    if (!st)
        st = m3_cuda_read_bandwidth(e->be, (size_t)4 << 30, 20, &out->read_gb_per_s);
    if (!st) {
        out->block = B;
        out->layers = d->cfg.attn.num_layers;
        fprintf(stderr, "bench draft: %d layers, block %d, Markov rank %d, read bandwidth %.0f "
                "GB/s\n", out->layers, B, d->cfg.markov_rank, out->read_gb_per_s);
    }
    for (int i = 0; !st && i < o->n_contexts; i++)
        for (int j = 0; !st && j < o->n_requests; j++) {
            m3_bench_draft_point *p = &out->points[out->n_points];
            st = run_point(e, d, o->requests[j], o->contexts[i], o->iters, out->read_gb_per_s,
                           p);
            if (st)
                break;
            out->n_points++;
            fprintf(stderr, "bench draft: %d requests, context %lld:", p->requests,
                    (long long)p->context);
            for (int k = 0; k < M3_BENCH_DRAFT_PARTS; k++)
                fprintf(stderr, " %s %.1f us (%.2fx floor)", part_names[k], p->median_us[k],
                        p->median_us[k] / p->floor_us[k]);
            fputc('\n', stderr);
        }
    if (d && d->run.eng)
        m3_drafter_detach(d);
    m3_engine_free(e);
    m3_drafter_free(d);
    m3_model_free(model);
    return st;
}
