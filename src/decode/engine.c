/*
 * The engine: sets up a backend, its weights, the paged cache and the
 * step scratch for a loaded model, and turns a batch of requests (tokens
 * appended to sequences) into one step: it checks every request, reserves
 * cache pages (all or nothing), fills the step metadata (positions, slots,
 * block tables; SPEC §4), runs the forward, and only then commits the new
 * sequence lengths, so a failed step changes nothing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/pool.h"
#include "core/status.h"
#include "cp/indexer_cp.h"
#include "cpu/cpu_mono.h"
#include "cuda/cuda_comm.h"
#include "decode/engine.h"
#include "mono/mono.h"
#include "model/config_json.h"
#include "model/shard.h"

m3_engine_opts m3_engine_defaults(void) {
    m3_engine_opts o = {0};
    o.device = M3_DEVICE_CPU;
    o.gpu = 0;
    o.graphs = true;
    o.threads = 0;
    o.max_tokens = 0; /* min(max_position_embeddings, 32768) */
    o.max_rows = 256;
    o.max_seqs = 8;
    return o;
}

static void free_scratch(m3_engine *e) {
    void **ptrs = (void **)&e->s;
    for (size_t i = 0; i < sizeof e->s / sizeof(void *); i++)
        if (ptrs[i])
            e->be->ops->release(e->be, ptrs[i]);
    memset(&e->s, 0, sizeof e->s);
}

static m3_status alloc_scratch(m3_engine *e) {
    const m3_config *c = &e->cfg;
    size_t R = (size_t)m3_engine_rows(e), H = (size_t)c->hidden_size, D = (size_t)c->head_dim;
    size_t Ni = (size_t)c->index_heads, Di = (size_t)c->index_dim;
    size_t F = (size_t)(c->dense_dim > 0 ? c->dense_dim : 1);
    m3_scratch *s = &e->s;
    struct {
        void **ptr;
        size_t bytes;
    } want[] = {
        {(void **)&s->hidden, R * H * 2},
        {(void **)&s->residual, R * H * 2},
        {(void **)&s->x, R * H * 2},
        {(void **)&s->o, R * H * 2},
        {(void **)&s->partial, R * H * 8},
        {(void **)&s->q, R * (size_t)c->num_q_heads * D * 2},
        {(void **)&s->k, R * (size_t)c->num_kv_heads * D * 2},
        {(void **)&s->v, R * (size_t)c->num_kv_heads * D * 2},
        {(void **)&s->iq, R * Ni * Di * 2 + 2},
        {(void **)&s->ik, R * Di * 2 + 2},
        {(void **)&s->scores, R * Ni * (size_t)e->max_blocks * 4 + 4},
        {(void **)&s->selected, R * Ni * (size_t)(c->topk_blocks + 1) * 4},
        {(void **)&s->attn, R * (size_t)c->num_q_heads * D * 2},
        {(void **)&s->gate, R * F * 2},
        {(void **)&s->up, R * F * 2},
        {(void **)&s->act, R * F * 2},
        {(void **)&s->out_hidden, R * H * 2},
        {(void **)&s->out_residual, R * H * 2},
        {(void **)&s->final, R * H * 2},
        {(void **)&s->out_rows, R * 4},
        {(void **)&s->logits, R * (size_t)c->vocab_size * 4},
    };
    M3_TRY(e->be->ops->alloc(e->be, R * 4, (void **)&e->tokens_dev));
    M3_TRY(e->be->ops->alloc(e->be, R * 8, (void **)&e->counter_dev));
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        M3_TRY(e->be->ops->alloc(e->be, want[i].bytes, want[i].ptr));
    return M3_OK;
}

static void free_graphs(m3_engine *e) {
    for (int i = 0; i < M3_GRAPH_BUCKETS; i++)
        if (e->graph[i]) {
            e->be->ops->graph_free(e->be, e->graph[i]);
            e->graph[i] = NULL;
        }
}

static void free_step(m3_engine *e) {
    m3_step_arrays *h = &e->step.host, *d = &e->step.dev;
    void *hp[] = {h->tokens, h->positions, h->slots, h->row_req,
                  h->seq_lens, h->query_start, h->block_table};
    void *dp[] = {d->tokens, d->positions, d->slots, d->row_req,
                  d->seq_lens, d->query_start, d->block_table};
    for (int i = 0; i < 7; i++) {
        free(hp[i]);
        if (dp[i])
            e->be->ops->release(e->be, dp[i]);
    }
    memset(&e->step, 0, sizeof e->step);
}

/* Host and backend copies of the step arrays, sized for the limits. */
static m3_status alloc_step(m3_engine *e) {
    size_t R = (size_t)m3_engine_rows(e), B = (size_t)e->opts.max_seqs;
    size_t sizes[7] = {R * 4, R * 8, R * 8, R * 4, B * 4, (B + 1) * 4, B * (size_t)e->max_blocks * 4};
    m3_step_arrays *h = &e->step.host, *d = &e->step.dev;
    void **hp[] = {(void **)&h->tokens, (void **)&h->positions, (void **)&h->slots,
                   (void **)&h->row_req, (void **)&h->seq_lens, (void **)&h->query_start,
                   (void **)&h->block_table};
    void **dp[] = {(void **)&d->tokens, (void **)&d->positions, (void **)&d->slots,
                   (void **)&d->row_req, (void **)&d->seq_lens, (void **)&d->query_start,
                   (void **)&d->block_table};
    for (int i = 0; i < 7; i++) {
        *hp[i] = m3_calloc(1, sizes[i], "step metadata");
        if (!*hp[i])
            return M3_ERR_NO_MEMORY;
        M3_TRY(e->be->ops->alloc(e->be, sizes[i], dp[i]));
    }
    return M3_OK;
}

static m3_status alloc_cache(m3_engine *e, int32_t n_pages) {
    const m3_config *c = &e->cfg;
    size_t kv_bytes = (size_t)n_pages * (size_t)c->num_kv_heads * M3_PAGE_TOKENS *
                      (size_t)c->head_dim * 2;
    size_t index_bytes = (size_t)n_pages * M3_PAGE_TOKENS * (size_t)c->index_dim * 2;
    for (int i = 0; i < c->num_layers; i++) {
        m3_cache_layer *l = &e->cache.layers[i];
        M3_TRY(e->be->ops->alloc(e->be, kv_bytes, &l->k));
        M3_TRY(e->be->ops->alloc(e->be, kv_bytes, &l->v));
        if (c->layer_sparse[i])
            M3_TRY(e->be->ops->alloc(e->be, index_bytes, &l->index));
    }
    return M3_OK;
}

static m3_status check_opts(const m3_config *c, m3_engine_opts *o) {
    if (o->device != M3_DEVICE_CPU && o->device != M3_DEVICE_CUDA)
        return m3_fail(M3_ERR_INVALID_ARG, "device %d is not cpu (0) or cuda (1)",
                       (int)o->device);
    if (o->max_rows < 1 || o->max_rows > 1 << 16)
        return m3_fail(M3_ERR_INVALID_ARG, "max_rows = %d: must be in [1, 65536]", o->max_rows);
    if (o->max_seqs < 1 || o->max_seqs > 1 << 16)
        return m3_fail(M3_ERR_INVALID_ARG, "max_seqs = %d: must be in [1, 65536]", o->max_seqs);
    if (o->max_tokens < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "max_tokens = %lld: must be >= 0",
                       (long long)o->max_tokens);
    if (o->max_tokens == 0)
        o->max_tokens = c->max_position_embeddings < 32768 ? c->max_position_embeddings : 32768;
    if (o->max_tokens > (int64_t)M3_PAGE_TOKENS * (1 << 30))
        return m3_fail(M3_ERR_INVALID_ARG, "max_tokens = %lld is too large",
                       (long long)o->max_tokens);
    return M3_OK;
}

m3_status m3_engine_bind_thread(m3_engine *e) {
    return e->be && e->be->ops->bind_thread ? e->be->ops->bind_thread(e->be) : M3_OK;
}

static void free_rank(m3_engine *e) {
    if (!e)
        return;
    (void)m3_engine_bind_thread(e); /* a GPU rank frees on its own GPU */
    m3_mono_free(e->mono);
    if (e->be) {
        free_graphs(e);
        if (e->tokens_dev)
            e->be->ops->release(e->be, e->tokens_dev);
        if (e->counter_dev)
            e->be->ops->release(e->be, e->counter_dev);
        if (e->cp_err)
            e->be->ops->release(e->be, e->cp_err);
        free_scratch(e);
        free_step(e);
        m3_engine_set_taps(e, NULL, 0);
        for (int i = 0; e->cache.layers && i < e->cfg.num_layers; i++) {
            m3_cache_layer *l = &e->cache.layers[i];
            void *ptrs[3] = {l->k, l->v, l->index};
            for (int k = 0; k < 3; k++)
                if (ptrs[k])
                    e->be->ops->release(e->be, ptrs[k]);
        }
        e->be->ops->unload_weights(e->be, &e->cfg, &e->w);
        if (e->own_comm) { /* it hooks the backend's stream waits: before the backend */
            m3_comm_free(e->comm);
            e->comm = NULL;
        }
        e->be->ops->destroy(e->be);
    }
    m3_cache_destroy(&e->cache);
    if (e->shard.layers)
        m3_tp_shard_free(&e->model->cfg, &e->shard);
    if (e->tp_size <= 1)
        m3_comm_free(e->comm); /* at TP > 1 the front owns the host comms */
    free(e);
}

void m3_engine_free(m3_engine *e) {
    if (!e)
        return;
    for (int r = 0; r < M3_MAX_TP; r++) {
        free_rank(e->ranks[r]);
        m3_comm_free(e->rank_comms[r]);
    }
    m3_gpu_group_free(e->gpu_group);
    m3_cpu_mono_group_free(e->mono_group);
    if (e->ranks[0])
        free(e); /* a front holds nothing else */
    else
        free_rank(e);
}

/* One rank's engine: its backend, weights (the model's, or at TP > 1 this
 * rank's shard), cache, scratch and step buffers. */
static m3_status create_rank(m3_model *model, const m3_engine_opts *opts, int rank, int tp,
                             m3_comm *comm, struct m3_gpu_group *gpus, m3_engine **out) {
    *out = NULL;
    m3_engine *e = m3_calloc(1, sizeof *e, "engine");
    if (!e)
        return M3_ERR_NO_MEMORY;
    e->model = model;
    e->opts = *opts;
    e->tp_rank = rank;
    e->tp_size = tp;
    e->comm = comm;
    e->cfg = m3_tp_config(&model->cfg, tp);
    e->vocab_full = model->cfg.vocab_size;
    e->vocab_start = (int64_t)rank * e->cfg.vocab_size;
    e->partial_dtype = opts->device == M3_DEVICE_CPU ? M3_DT_F64 : M3_DT_F32;
    m3_status st = check_opts(&e->cfg, &e->opts);
    int64_t max_context = e->opts.max_tokens < e->cfg.max_position_embeddings
                              ? e->opts.max_tokens
                              : e->cfg.max_position_embeddings;
    int32_t n_pages = (int32_t)((e->opts.max_tokens + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
    e->max_blocks = (int)((max_context + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
    /* a model the GPU kernels cannot run is refused before any upload */
    if (!st && e->opts.device == M3_DEVICE_CUDA)
        st = m3_cuda_check_config(&e->cfg);
    if (!st)
        st = e->opts.device == M3_DEVICE_CUDA ? m3_cuda_backend_create(e->opts.gpu, &e->be)
                                              : m3_cpu_backend_create(e->opts.threads, &e->be);
    if (!st) {
        e->be->full_q_heads = model->cfg.num_q_heads;
        e->be->full_kv_heads = model->cfg.num_kv_heads;
        e->graphs = e->opts.graphs && e->be->ops->graph_begin != NULL;
        /* a backend with graphs always sees capacity-wide block tables, so
         * one captured step serves every context length and eager steps
         * launch exactly the kernels a replay would (bit-identical) */
        e->stable_width = e->be->ops->graph_begin != NULL;
        /* indexer CP sizes its work by the capture-stable context bound:
         * block tables as wide as the context allows */
        if (e->opts.indexer_cp)
            e->stable_width = true;
    }
    if (!st && !comm)
        st = m3_comm_create_single(&e->comm);
    if (!st && gpus) { /* collectives through NCCL, decisions through comm */
        m3_comm *gpu_comm = NULL;
        st = m3_cuda_comm_create(gpus, rank, e->be, comm, &gpu_comm);
        if (!st) {
            e->comm = gpu_comm;
            e->own_comm = true;
        }
    }
    const m3_weights *host = &model->w;
    if (!st && tp > 1) {
        st = m3_tp_shard(&model->cfg, &model->w, rank, tp, &e->shard);
        host = &e->shard;
    }
    if (!st)
        st = e->be->ops->load_weights(e->be, &e->cfg, host, &e->w);
    if (!st)
        st = m3_cache_init(&e->cache, e->cfg.num_layers, n_pages, max_context, e->opts.max_seqs);
    if (!st)
        st = alloc_cache(e, n_pages);
    if (!st)
        st = alloc_scratch(e);
    if (!st)
        st = alloc_step(e);
    if (!st && e->opts.indexer_cp && e->opts.device == M3_DEVICE_CUDA) {
        static const int zero[4] = {0, 0, 0, 0};
        st = e->be->ops->alloc(e->be, sizeof zero, (void **)&e->cp_err);
        if (!st)
            st = e->be->ops->upload(e->be, e->cp_err, zero, sizeof zero);
    }
    if (st) {
        free_rank(e);
        return st;
    }
    *out = e;
    return M3_OK;
}

/* The mono path of rank engine e (decode auto or mono): built after its
 * weights; collective over the TP group. Under auto a refusal is kept in
 * front->mono_refused and the engine runs stock; under mono it fails. */
static m3_status start_mono(m3_engine *front, m3_engine *e, void *group) {
    if (e->opts.decode == M3_DECODE_STOCK)
        return M3_OK;
    m3_mono_config mc;
    m3_status st = m3_mono_default_config(e, e->opts.mono_max_rows, &mc);
    if (!st)
        st = m3_mono_create(e, &mc, group, &e->mono);
    else /* the same on every rank: nothing to agree */
        m3_fail_context(st, "mono decode refused");
    if (st && e->opts.decode == M3_DECODE_AUTO) {
        if (e->tp_rank == 0)
            snprintf(front->mono_refused, sizeof front->mono_refused, "%s", m3_last_error());
        snprintf(e->mono_refused, sizeof e->mono_refused, "%s", m3_last_error());
        return M3_OK;
    }
    return st;
}

static m3_status start_mono_rank(m3_engine *rank, void *front) {
    m3_engine *f = front;
    return start_mono(f, rank, f->mono_group);
}

/* GPUs at TP > 1: peer access between them, then every rank's fused
 * kernels learn their peers. Under auto a failure turns mono off on every
 * rank (the reason kept, as for a refusal); under mono it fails. */
static m3_status connect_gpus(m3_engine *f) {
    m3_mono *monos[M3_MAX_TP];
    for (int r = 0; r < f->tp_size; r++)
        monos[r] = f->ranks[r]->mono;
    m3_status st = m3_gpu_group_enable_peers(f->gpu_group);
    if (!st)
        st = m3_mono_connect_gpus(monos, f->tp_size);
    if (!st || f->opts.decode != M3_DECODE_AUTO)
        return st;
    snprintf(f->mono_refused, sizeof f->mono_refused, "mono decode refused: %s",
             m3_last_error());
    for (int r = 0; r < f->tp_size; r++) {
        m3_engine *e = f->ranks[r];
        snprintf(e->mono_refused, sizeof e->mono_refused, "%s", f->mono_refused);
        (void)m3_engine_bind_thread(e);
        m3_mono_free(e->mono);
        e->mono = NULL;
    }
    return M3_OK;
}

const char *m3_engine_mono_refusal(const m3_engine *e) { return e->mono_refused; }

void m3_engine_resolve_decode(m3_engine_opts *o) {
    if (o->decode != M3_DECODE_DEFAULT) /* see m3_decode_path */
        return;
    /* CUDA: the fused kernels beat the stock path at 1-4 rows on one GPU,
     * on a TP-4 rank's shapes (6-27%) and on unsharded ones (2-4%;
     * docs/PERF.md, twenty-seventh session), so there the default fuses
     * steps of up to 4 rows (8-16 rows were ahead too, by less, and were
     * not measured at every width: left stock) */
    bool cuda = o->device == M3_DEVICE_CUDA;
    int tp = o->tp ? o->tp : 1;
    o->decode = cuda && tp > 1 ? M3_DECODE_STOCK : M3_DECODE_AUTO;
    if (cuda && tp == 1 && o->mono_max_rows == 0)
        o->mono_max_rows = 4;
}

m3_status m3_engine_create(m3_model *model, const m3_engine_opts *opts, m3_engine **out) {
    *out = NULL;
    if (!model)
        return m3_fail(M3_ERR_INVALID_ARG, "model is NULL");
    m3_engine_opts o = opts ? *opts : m3_engine_defaults();
    int tp = o.tp ? o.tp : 1;
    m3_engine_resolve_decode(&o);
    if (o.decode < M3_DECODE_DEFAULT || o.decode > M3_DECODE_MONO)
        return m3_fail(M3_ERR_INVALID_ARG, "decode path %d is not default, auto, stock or mono",
                       (int)o.decode);
    m3_status st = m3_tp_check(&model->cfg, tp);
    if (!st && o.indexer_cp && o.device == M3_DEVICE_CUDA && tp < 2)
        st = m3_fail(M3_ERR_UNSUPPORTED, "--indexer-cp with --device cuda and --tp 1: indexer "
                     "context parallelism splits block scoring over GPU ranks; give --tp 2 or "
                     "more");
    /* the context-parallel scorer is SPEC §6's: 128-dim index heads */
    if (!st && o.indexer_cp && m3_config_count_sparse(&model->cfg) &&
        model->cfg.index_dim != M3_CP_DIM)
        st = m3_fail(M3_ERR_UNSUPPORTED, "--indexer-cp needs sparse_index_dim = %d (the "
                     "context-parallel block scorer's width), and the model has %d",
                     M3_CP_DIM, model->cfg.index_dim);
    if (!st && o.indexer_cp && tp > model->cfg.num_kv_heads)
        st = m3_fail(M3_ERR_UNSUPPORTED, "--indexer-cp with tp = %d: each rank must own its own "
                     "index head, and the model has %d", tp, model->cfg.num_kv_heads);
    if (st)
        return m3_fail_context(st, "creating the engine");
    if (tp == 1) {
        st = create_rank(model, &o, 0, 1, NULL, NULL, out);
        if (!st)
            st = start_mono(*out, *out, NULL);
        if (st) {
            m3_engine_free(*out);
            *out = NULL;
            return m3_fail_context(st, "creating the engine");
        }
        return M3_OK;
    }
    /* TP: one rank engine per rank, sharing the cores */
    m3_engine *f = m3_calloc(1, sizeof *f, "engine");
    if (!f)
        return M3_ERR_NO_MEMORY;
    f->model = model;
    f->cfg = model->cfg;
    f->opts = o;
    f->tp_size = tp;
    f->vocab_full = model->cfg.vocab_size;
    st = m3_comm_create_threads(tp, o.tp_timeout_ms, f->rank_comms);
    m3_engine_opts ro = o;
    if (o.device == M3_DEVICE_CPU) {
        int cores = o.threads > 0 ? o.threads : m3_pool_default_threads();
        ro.threads = cores / tp > 0 ? cores / tp : 1;
    } else if (!st) { /* one GPU per rank: --gpu, --gpu + 1, ... */
        int devices[M3_MAX_TP];
        for (int r = 0; r < tp; r++)
            devices[r] = o.gpu + r;
        st = m3_gpu_group_create(devices, tp, o.tp_timeout_ms, &f->gpu_group);
        if (st)
            m3_fail_context(st, "--tp %d over GPUs", tp);
    }
    for (int r = 0; r < tp && !st; r++) {
        ro.gpu = o.gpu + r;
        st = create_rank(model, &ro, r, tp, f->rank_comms[r], f->gpu_group, &f->ranks[r]);
        if (st)
            m3_fail_context(st, "TP rank %d", r);
    }
    if (!st && o.decode != M3_DECODE_STOCK && o.device == M3_DEVICE_CPU)
        st = m3_cpu_mono_group_create(tp, o.mono_max_rows > 0 ? o.mono_max_rows : 16,
                                      &f->ranks[0]->cfg, o.tp_timeout_ms, &f->mono_group);
    if (!st)
        st = m3_tp_run_all(f, start_mono_rank, f);
    if (!st && f->gpu_group && f->ranks[0]->mono)
        st = connect_gpus(f);
    if (st) {
        m3_engine_free(f);
        return m3_fail_context(st, "creating the engine");
    }
    *out = f;
    return M3_OK;
}

/* The engine whose state answers queries: rank 0 at TP > 1 (every rank
 * holds the same sequences and lengths). */
static const m3_engine *lead(const m3_engine *e) { return e->ranks[0] ? e->ranks[0] : e; }

int64_t m3_engine_max_context(const m3_engine *e) { return lead(e)->cache.max_context; }

int32_t m3_engine_free_pages(const m3_engine *e) { return lead(e)->cache.n_free; }

m3_engine_stats m3_engine_get_stats(const m3_engine *e) {
    const m3_engine *l = lead(e);
    m3_engine_stats s = {l->mono_steps, l->stock_steps, l->graph_replays, -1, -1};
    if (l->mono) {
        s.mono_first_layer = m3_mono_first_layer(l->mono);
        s.mono_last_layer = m3_mono_last_layer(l->mono);
    }
    return s;
}

m3_status m3_seq_create(m3_engine *e, m3_seq *out) {
    if (!e->ranks[0])
        return m3_cache_seq_create(&e->cache, out);
    /* every rank's allocator is in the same state, so they agree on the id */
    for (int r = 0; r < e->tp_size; r++) {
        m3_seq id;
        M3_TRY(m3_cache_seq_create(&e->ranks[r]->cache, &id));
        if (r == 0)
            *out = id;
        else if (id != *out)
            return m3_fail(M3_ERR_INTERNAL, "TP rank %d created sequence %d, rank 0 %d", r, id,
                           *out);
    }
    return M3_OK;
}

m3_status m3_seq_free(m3_engine *e, m3_seq seq) {
    if (!e->ranks[0])
        return m3_cache_seq_free(&e->cache, seq);
    for (int r = 0; r < e->tp_size; r++)
        M3_TRY(m3_cache_seq_free(&e->ranks[r]->cache, seq));
    return M3_OK;
}

int64_t m3_seq_len(const m3_engine *e, m3_seq seq) {
    const m3_engine *l = lead(e);
    if (m3_cache_seq_check(&l->cache, seq))
        return -1;
    return l->cache.seqs[seq].len;
}

/* Every request valid, rows within the limits, no sequence twice. */
static m3_status check_requests(const m3_engine *e, const m3_request *reqs, int n_reqs,
                                int *rows) {
    if (n_reqs < 1 || n_reqs > e->opts.max_seqs)
        return m3_fail(M3_ERR_INVALID_ARG, "a step needs 1 to %d requests, got %d",
                       e->opts.max_seqs, n_reqs);
    int64_t total = 0;
    for (int r = 0; r < n_reqs; r++) {
        const m3_request *q = &reqs[r];
        M3_TRY(m3_cache_seq_check(&e->cache, q->seq));
        for (int k = 0; k < r; k++)
            if (reqs[k].seq == q->seq)
                return m3_fail(M3_ERR_INVALID_ARG, "sequence %d appears twice in one step",
                               q->seq);
        if (q->n_tokens < 1 || !q->tokens)
            return m3_fail(M3_ERR_INVALID_ARG, "request %d has no tokens", r);
        for (int i = 0; i < q->n_tokens; i++)
            if (q->tokens[i] < 0 || q->tokens[i] >= e->vocab_full)
                return m3_fail(M3_ERR_INVALID_ARG,
                               "token id %d (request %d, position %d) is outside the vocabulary "
                               "[0, %d)",
                               q->tokens[i], r, i, e->vocab_full);
        int64_t new_len = e->cache.seqs[q->seq].len + q->n_tokens;
        if (new_len > e->cache.max_context)
            return m3_fail(M3_ERR_INVALID_ARG,
                           "sequence %d would reach %lld tokens; the context limit is %lld",
                           q->seq, (long long)new_len, (long long)e->cache.max_context);
        total += q->n_tokens;
    }
    if (total > e->opts.max_rows)
        return m3_fail(M3_ERR_INVALID_ARG, "a step of %lld rows exceeds max_rows = %d",
                       (long long)total, e->opts.max_rows);
    *rows = (int)total;
    return M3_OK;
}

/* Fill the host step arrays (pages already reserved) for rows real rows
 * padded to padded_rows, and upload them. */
static m3_status build_step(m3_engine *e, const m3_request *reqs, int n_reqs, int rows,
                            int padded_rows) {
    m3_step *st = &e->step;
    m3_step_arrays *h = &st->host;
    st->rows = padded_rows;
    st->n_reqs = n_reqs;
    st->n_prefill = st->n_decode = 0;
    st->max_query_len = 0;
    st->n_pages = e->cache.n_pages;
    st->graph_mode = M3_GRAPH_NONE;
    st->capturing = false;
    int t = 0, width = 1;
    for (int r = 0; r < n_reqs; r++) {
        const m3_seq_state *sq = &e->cache.seqs[reqs[r].seq];
        int64_t n = reqs[r].n_tokens, len0 = sq->len;
        int blocks = (int)((len0 + n + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
        width = blocks > width ? blocks : width;
        if (n > 1 || len0 == 0)
            st->n_prefill++;
        else
            st->n_decode++;
        st->max_query_len = n > st->max_query_len ? (int)n : st->max_query_len;
        h->query_start[r] = t;
        h->seq_lens[r] = (int32_t)(len0 + n);
        for (int i = 0; i < n; i++, t++) {
            h->tokens[t] = reqs[r].tokens[i];
            h->positions[t] = len0 + i;
            h->slots[t] = m3_cache_slot(&e->cache, reqs[r].seq, len0 + i);
            h->row_req[t] = r;
        }
    }
    h->query_start[n_reqs] = t;
    for (; t < padded_rows; t++) { /* inert rows: no slot, position 0 */
        h->tokens[t] = 0;
        h->positions[t] = 0;
        h->slots[t] = -1;
        h->row_req[t] = 0;
    }
    /* the table is as wide as the step's longest sequence needs, or, for a
     * backend replaying graphs, as wide as the context allows */
    if (e->stable_width)
        width = e->max_blocks;
    st->max_blocks = width;
    for (int r = 0; r < n_reqs; r++) {
        const m3_seq_state *sq = &e->cache.seqs[reqs[r].seq];
        for (int b = 0; b < width; b++)
            h->block_table[r * width + b] = b < sq->n_blocks ? sq->pages[b] : -1;
    }
    const m3_backend_ops *op = e->be->ops;
    m3_step_arrays *d = &st->dev;
    int R = padded_rows;
    M3_TRY(op->upload(e->be, d->tokens, h->tokens, (size_t)R * 4));
    M3_TRY(op->upload(e->be, d->positions, h->positions, (size_t)R * 8));
    M3_TRY(op->upload(e->be, d->slots, h->slots, (size_t)R * 8));
    M3_TRY(op->upload(e->be, d->row_req, h->row_req, (size_t)R * 4));
    M3_TRY(op->upload(e->be, d->seq_lens, h->seq_lens, (size_t)n_reqs * 4));
    M3_TRY(op->upload(e->be, d->query_start, h->query_start, (size_t)(n_reqs + 1) * 4));
    return op->upload(e->be, d->block_table, h->block_table, (size_t)n_reqs * width * 4);
}

/* The graph bucket of a step of `rows` rows whose logits are those of
 * out_rows (n_out of them), or -1: a decode step (one token per request,
 * each after a prefill: `decode`), padded up to its bucket's width; or,
 * at TP 1, requests extending their sequences by 2..64 rows in all that
 * want every row's logits in order, as a graph computes them (the verify
 * step of speculative decoding, one request or a batch's). Every launch of
 * such a step is sized by its row count and capacities alone and reads
 * the rows' requests from device memory (cuda/cuda_internal.h), so one
 * capture serves every replay of the same row count, however the rows
 * split into requests. */
static int graph_bucket(const m3_engine *e, const m3_request *reqs, int n_reqs, bool decode,
                        int rows, const int32_t *out_rows, int n_out) {
    if (!e->graphs || rows > M3_GRAPH_MAX_VERIFY_ROWS)
        return -1;
    if (decode && rows > M3_GRAPH_MAX_ROWS)
        return -1;
    if (decode) {
        int b = 0;
        while ((1 << b) < rows)
            b++;
        return b;
    }
    if (rows < 2 || e->tp_size > 1 || n_out != rows)
        return -1;
    for (int q = 0; q < n_reqs; q++)
        if (e->cache.seqs[reqs[q].seq].len == 0) /* a prompt's first chunk */
            return -1;
    for (int i = 0; i < n_out; i++)
        if (out_rows[i] != i)
            return -1;
    return M3_GRAPH_DECODE_BUCKETS + rows - 2;
}

/* The forward of the built step, from its graph when it has one: the first
 * step of a bucket runs eagerly (sizing every workspace) and is then
 * captured; later steps replay the capture. */
static m3_status run_forward(m3_engine *e, int bucket, int n_out) {
    m3_step *st = &e->step;
    if (bucket < 0)
        return m3_forward_device(e, st, n_out);
    st->graph_mode = M3_GRAPH_FULL;
    if (!e->graph[bucket]) {
        M3_TRY(m3_forward_device(e, st, n_out));
        int64_t mono = e->mono_steps, stock = e->stock_steps;
        M3_TRY(e->be->ops->graph_begin(e->be));
        st->capturing = true;
        m3_status cap = m3_forward_device(e, st, n_out);
        st->capturing = false;
        m3_status end = e->be->ops->graph_end(e->be, cap == M3_OK, &e->graph[bucket]);
        /* the capture ran nothing; its replays run what it recorded */
        e->graph_mono[bucket] = e->mono_steps > mono;
        e->mono_steps = mono;
        e->stock_steps = stock;
        M3_TRY(cap);
        return end;
    }
    M3_TRY(e->be->ops->graph_launch(e->be, e->graph[bucket]));
    e->graph_replays++;
    if (e->graph_mono[bucket])
        e->mono_steps++;
    else
        e->stock_steps++;
    return M3_OK;
}

/* Reserve pages, build the step, run it with the logits of out_rows
 * (host indices, n_out) in s.logits; on failure give the pages back. */
static m3_status step_forward(m3_engine *e, const m3_request *reqs, int n_reqs,
                              const int32_t *out_rows, int n_out, int *bucket_out) {
    int rows = 0;
    M3_TRY(check_requests(e, reqs, n_reqs, &rows));
    int r = 0;
    m3_status st = M3_OK;
    for (; r < n_reqs && !st; r++)
        st = m3_cache_reserve(&e->cache, reqs[r].seq,
                              e->cache.seqs[reqs[r].seq].len + reqs[r].n_tokens);
    int bucket = -1;
    if (!st) {
        /* decode steps of a graph bucket are padded to its width */
        bool decode = true;
        for (int q = 0; q < n_reqs; q++)
            decode = decode && reqs[q].n_tokens == 1 && e->cache.seqs[reqs[q].seq].len > 0;
        bucket = graph_bucket(e, reqs, n_reqs, decode, rows, out_rows, n_out);
        int padded = bucket >= 0 && bucket < M3_GRAPH_DECODE_BUCKETS ? 1 << bucket : rows;
        if (bucket < 0 && decode && e->mono && !e->n_taps && m3_mono_width(e->mono, rows) > 0)
            padded = m3_mono_width(e->mono, rows); /* the mono path's compiled widths */
        st = build_step(e, reqs, n_reqs, rows, padded);
        if (!st && bucket >= 0)
            n_out = padded; /* a graph computes every padded row's logits */
    }
    if (!st)
        st = e->be->ops->upload(e->be, e->s.out_rows, out_rows, (size_t)n_out * sizeof *out_rows);
    if (!st)
        st = run_forward(e, bucket, n_out);
    if (e->tp_size > 1) {
        /* commit on every rank or on none: a rank that failed ends its
         * peers' waits, and everyone learns the outcome */
        char why[512] = "";
        if (st) {
            snprintf(why, sizeof why, "%s", m3_last_error());
            e->comm->ops->abort(e->comm, why);
        }
        bool all_ok = false;
        m3_status agreed = m3_comm_agree(e->comm, st == M3_OK, &all_ok);
        if (!st && (agreed || !all_ok))
            st = m3_fail(M3_ERR_FAULT, "the step failed on another TP rank");
        else if (st) /* the agreement's own message must not hide the cause */
            m3_fail(st, "%s", why);
    }
    if (st) {
        /* give back the pages this step took; lengths never moved */
        for (int q = 0; q < r; q++)
            m3_cache_trim(&e->cache, reqs[q].seq, e->cache.seqs[reqs[q].seq].len);
        return st;
    }
    for (int q = 0; q < n_reqs; q++)
        e->cache.seqs[reqs[q].seq].len += reqs[q].n_tokens;
    *bucket_out = bucket;
    return M3_OK;
}

m3_status m3_engine_set_len(m3_engine *e, m3_seq seq, int64_t len) {
    for (int r = 0; e->ranks[0] && r < e->tp_size; r++) /* TP: every rank's replica */
        M3_TRY(m3_engine_set_len(e->ranks[r], seq, len));
    if (e->ranks[0])
        return M3_OK;
    M3_TRY(m3_cache_reserve(&e->cache, seq, len));
    m3_cache_trim(&e->cache, seq, len);
    e->cache.seqs[seq].len = len;
    return M3_OK;
}

m3_status m3_engine_build(m3_engine *e, const m3_request *reqs, int n_reqs, bool pad) {
    if (e->ranks[0])
        return m3_fail(M3_ERR_UNSUPPORTED, "benchmark hooks take a TP 1 engine");
    int rows = 0;
    M3_TRY(check_requests(e, reqs, n_reqs, &rows));
    for (int r = 0; r < n_reqs; r++)
        M3_TRY(m3_cache_reserve(&e->cache, reqs[r].seq,
                                e->cache.seqs[reqs[r].seq].len + reqs[r].n_tokens));
    int padded = rows;
    if (pad && rows <= M3_GRAPH_MAX_ROWS)
        while (padded & (padded - 1))
            padded++;
    return build_step(e, reqs, n_reqs, rows, padded);
}

/* A TP 1 engine's step with the logits of every row (all_rows) or of each
 * request's last row in e->s.logits; *rows: the step's rows. */
static m3_status forward_rows(m3_engine *e, const m3_request *reqs, int n_reqs, bool all_rows,
                              int *rows) {
    M3_TRY(m3_engine_bind_thread(e));
    M3_TRY(check_requests(e, reqs, n_reqs, rows));
    int R = m3_engine_rows(e);
    int32_t *out_rows = m3_malloc((size_t)R * sizeof *out_rows, "logit rows");
    if (!out_rows)
        return M3_ERR_NO_MEMORY;
    /* every row, or each request's last row; padded rows map to themselves */
    for (int i = 0; i < R; i++)
        out_rows[i] = i;
    int n_out = *rows;
    if (!all_rows) {
        int t = 0;
        for (int q = 0; q < n_reqs; q++) {
            t += reqs[q].n_tokens;
            out_rows[q] = t - 1;
        }
        n_out = n_reqs;
    }
    int bucket;
    m3_status st = step_forward(e, reqs, n_reqs, out_rows, n_out, &bucket);
    free(out_rows);
    return st;
}

m3_status m3_engine_step(m3_engine *e, const m3_request *reqs, int n_reqs, float *logits,
                         float *all_logits) {
    if (!e || !reqs || (!logits && !all_logits))
        return m3_fail(M3_ERR_INVALID_ARG, "m3_engine_step: engine, requests and an output "
                       "buffer are required");
    if (e->ranks[0])
        return m3_tp_front_step(e, reqs, n_reqs, logits, all_logits);
    int rows = 0;
    M3_TRY(forward_rows(e, reqs, n_reqs, all_logits != NULL, &rows));
    size_t V = (size_t)e->cfg.vocab_size;
    m3_status st = M3_OK;
    if (all_logits)
        st = e->be->ops->download(e->be, all_logits, e->s.logits, (size_t)rows * V * 4);
    if (!st && logits && all_logits) {
        int t = 0;
        for (int q = 0; q < n_reqs; q++) {
            t += reqs[q].n_tokens;
            memcpy(logits + q * V, all_logits + (size_t)(t - 1) * V, V * sizeof *logits);
        }
    } else if (!st && logits) {
        /* a graph step's out rows are its rows, which for decode are the
         * requests' last rows, in order */
        st = e->be->ops->download(e->be, logits, e->s.logits, (size_t)n_reqs * V * 4);
    }
    return st;
}

static bool device_can_sample(const m3_engine *e, const m3_sampler *s) {
    /* a TP front has no backend; its logits are assembled on the host */
    return e->be && e->be->ops->sample && (s->temperature == 0 || (s->top_k == 0 && s->top_p >= 1));
}

bool m3_engine_greedy_on_device(const m3_engine *e) {
    static const m3_sampler greedy = {0, 0, 1, 0};
    return device_can_sample(e, &greedy);
}

m3_status m3_engine_step_greedy(m3_engine *e, const m3_request *reqs, int n_reqs,
                                int32_t *tokens) {
    if (!e || !reqs || !tokens)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_engine_step_greedy: engine, requests and "
                       "tokens are required");
    if (!m3_engine_greedy_on_device(e))
        return m3_fail(M3_ERR_UNSUPPORTED, "m3_engine_step_greedy: this engine's backend "
                       "does not choose tokens (use m3_engine_step and m3_sample)");
    int rows = 0;
    M3_TRY(forward_rows(e, reqs, n_reqs, true, &rows));
    M3_TRY(e->be->ops->sample(e->be, rows, e->s.logits, e->cfg.vocab_size, 0.0f, 0, NULL,
                              e->tokens_dev));
    return e->be->ops->download(e->be, tokens, e->tokens_dev, (size_t)rows * 4);
}

m3_status m3_engine_decode(m3_engine *e, const m3_request *reqs, int n_reqs,
                           const m3_sampler *sampler, m3_rng *rng, int64_t step,
                           int32_t *tokens, float *logits) {
    if (!e || !reqs || !sampler || !tokens)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_engine_decode: engine, requests, sampler and "
                       "tokens are required");
    /* the sampler before the step, so a bad one changes no sequence */
    M3_TRY(m3_sampler_check(sampler));
    for (int q = 0; q < n_reqs; q++)
        if (reqs[q].n_tokens != 1)
            return m3_fail(M3_ERR_INVALID_ARG,
                           "m3_engine_decode: request %d has %d tokens; a decode step has one",
                           q, reqs[q].n_tokens);
    size_t V = (size_t)e->cfg.vocab_size;
    M3_TRY(m3_engine_bind_thread(e));
    if (!device_can_sample(e, sampler)) {
        if (sampler->temperature > 0 && !rng)
            return m3_fail(M3_ERR_INVALID_ARG, "m3_engine_decode: temperature %g needs a "
                           "generator", sampler->temperature);
        float *buf = logits ? logits : m3_malloc((size_t)n_reqs * V * 4, "logits");
        if (!buf)
            return M3_ERR_NO_MEMORY;
        m3_status st = m3_engine_step(e, reqs, n_reqs, buf, NULL);
        for (int q = 0; q < n_reqs && !st; q++)
            st = m3_sample(sampler, rng, buf + q * V, (int)V, &tokens[q]);
        if (buf != logits)
            free(buf);
        return st;
    }
    int32_t out_rows[M3_GRAPH_MAX_ROWS];
    if (n_reqs > M3_GRAPH_MAX_ROWS)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_engine_decode: at most %d requests per step",
                       M3_GRAPH_MAX_ROWS);
    int64_t counters[M3_GRAPH_MAX_ROWS];
    for (int q = 0; q < M3_GRAPH_MAX_ROWS; q++) {
        out_rows[q] = q;
        counters[q] = step * M3_GRAPH_MAX_ROWS + q;
    }
    M3_TRY(e->be->ops->upload(e->be, e->counter_dev, counters, sizeof counters));
    int bucket;
    M3_TRY(step_forward(e, reqs, n_reqs, out_rows, n_reqs, &bucket));
    M3_TRY(e->be->ops->sample(e->be, n_reqs, e->s.logits, (int)V, sampler->temperature,
                              sampler->seed, e->counter_dev, e->tokens_dev));
    M3_TRY(e->be->ops->download(e->be, tokens, e->tokens_dev, (size_t)n_reqs * 4));
    for (int q = 0; q < n_reqs; q++)
        if (tokens[q] < 0)
            return m3_fail(M3_ERR_FAULT, "every logit of request %d is NaN", q);
    if (logits)
        M3_TRY(e->be->ops->download(e->be, logits, e->s.logits, (size_t)n_reqs * V * 4));
    return M3_OK;
}

m3_status m3_engine_set_taps(m3_engine *e, const int *layers, int n) {
    if (n > 0 && e->ranks[0])
        return m3_fail(M3_ERR_UNSUPPORTED, "layer taps need a TP 1 engine (this one has %d "
                       "ranks)", e->tp_size);
    if (n > M3_MAX_TAPS)
        return m3_fail(M3_ERR_INVALID_ARG, "%d layer taps: at most %d", n, M3_MAX_TAPS);
    for (int i = 0; i < n; i++)
        if (layers[i] < 0 || layers[i] >= e->cfg.num_layers)
            return m3_fail(M3_ERR_INVALID_ARG, "layer tap %d: the model has %d layers", layers[i],
                           e->cfg.num_layers);
    if (e->be) /* a GPU rank's buffers and graphs are on its own GPU */
        M3_TRY(m3_engine_bind_thread(e));
    /* a graph captured with or without taps, or writing the old buffer,
     * would replay the wrong step */
    if (e->be)
        free_graphs(e);
    if (e->taps)
        e->be->ops->release(e->be, e->taps);
    e->taps = NULL;
    e->n_taps = 0;
    if (n <= 0)
        return M3_OK;
    size_t R = (size_t)m3_engine_rows(e), H = (size_t)e->cfg.hidden_size;
    M3_TRY(e->be->ops->alloc(e->be, R * (size_t)n * H * sizeof *e->taps, (void **)&e->taps));
    for (int i = 0; i < M3_MAX_LAYERS; i++)
        e->tap_of[i] = -1;
    for (int i = 0; i < n; i++)
        e->tap_of[layers[i]] = i;
    e->n_taps = n;
    return M3_OK;
}
