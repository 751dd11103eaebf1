/*
 * The CUDA backend: device selection and checks, memory, the weights' upload
 * into one device allocation (experts of a layer laid out at a uniform
 * stride so kernels can index them by id), a grow-only workspace, graph
 * capture, and the ops table. The ops themselves live in cuda_*.cu.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"

extern "C" {
#include "model/config_json.h" /* m3_config_count_sparse, _moe */
}

extern "C" m3_status m3_cuda_error(cudaError_t err, const char *what, const char *file,
                                   int line) {
    cudaGetLastError(); /* clear a sticky launch error so the next call reports its own */
    return m3_fail(err == cudaErrorMemoryAllocation ? M3_ERR_NO_MEMORY : M3_ERR_DEVICE,
                   "CUDA: %s failed: %s (%s:%d)", what, cudaGetErrorString(err), file, line);
}

extern "C" m3_status m3_cuda_workspace(m3_cuda *cu, int slot, size_t bytes, void **out) {
    if (bytes > cu->ws_bytes[slot]) {
        if (cu->capturing)
            return m3_fail(M3_ERR_INTERNAL,
                           "CUDA workspace %d must grow to %zu bytes during graph capture; run "
                           "the step once eagerly first",
                           slot, bytes);
        if (cu->ws[slot]) {
            /* a graph captured earlier may replay into the old buffer: keep it */
            if (cu->n_retired == cu->cap_retired) {
                int cap = cu->cap_retired ? 2 * cu->cap_retired : 16;
                void **grown = (void **)realloc(cu->retired, (size_t)cap * sizeof *grown);
                if (!grown)
                    return m3_fail(M3_ERR_NO_MEMORY, "out of memory retiring a workspace");
                cu->retired = grown;
                cu->cap_retired = cap;
            }
            cu->retired[cu->n_retired++] = cu->ws[slot];
            cu->ws[slot] = NULL;
            cu->ws_bytes[slot] = 0;
        }
        size_t want = (bytes + bytes / 4 + 255) / 256 * 256;
        M3_CUDA_TRY(cudaMalloc(&cu->ws[slot], want));
        cu->ws_bytes[slot] = want;
    }
    *out = cu->ws[slot];
    return M3_OK;
}

extern "C" m3_status m3_cuda_workspace_zeroed(m3_cuda *cu, int slot, size_t bytes, void **out) {
    void *before = cu->ws[slot];
    M3_TRY(m3_cuda_workspace(cu, slot, bytes, out));
    if (*out != before) /* a new buffer (never during a capture: it would not grow) */
        M3_CUDA_TRY(cudaMemsetAsync(*out, 0, cu->ws_bytes[slot], cu->stream));
    return M3_OK;
}

extern "C" m3_status m3_cuda_workspace_parts(m3_cuda *cu, int slot, const size_t *sizes, int n,
                                             void **parts) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (sizes[i] + 255) / 256 * 256;
    char *base;
    M3_TRY(m3_cuda_workspace(cu, slot, total, (void **)&base));
    for (int i = 0; i < n; i++) {
        parts[i] = base;
        base += (sizes[i] + 255) / 256 * 256;
    }
    return M3_OK;
}

/* ------------------------------------------------------------ memory */

static m3_status cuda_alloc(m3_backend *be, size_t bytes, void **ptr) {
    *ptr = NULL;
    M3_CUDA_TRY(cudaMalloc(ptr, bytes ? bytes : 256));
    return M3_OK;
}

static void cuda_release(m3_backend *be, void *ptr) {
    if (ptr)
        cudaFree(ptr);
}

static m3_status cuda_upload(m3_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes)
        M3_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice,
                                    m3_cuda_of(be)->stream));
    return M3_OK;
}

extern "C" m3_status m3_cuda_stream_wait(m3_cuda *cu) {
    if (cu->wait)
        return cu->wait(cu, cu->wait_arg);
    M3_CUDA_TRY(cudaStreamSynchronize(cu->stream));
    return M3_OK;
}

static m3_status cuda_download(m3_backend *be, void *dst, const void *src, size_t bytes) {
    m3_cuda *cu = m3_cuda_of(be);
    if (bytes)
        M3_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cu->stream));
    return m3_cuda_stream_wait(cu);
}

static m3_status cuda_sync(m3_backend *be) { return m3_cuda_stream_wait(m3_cuda_of(be)); }

static m3_status cuda_bind_thread(m3_backend *be) {
    M3_CUDA_TRY(cudaSetDevice(m3_cuda_of(be)->device));
    return M3_OK;
}

/* ------------------------------------------------------------ weights */

/* A pass over every weight: first to size the block, then to copy. */
typedef struct upload_pass {
    m3_cuda *cu;
    char *base;      /* NULL on the sizing pass */
    size_t offset;
    m3_progress prog;
} upload_pass;

static size_t tensor_bytes(const m3_tensor *t) {
    return (size_t)m3_tensor_nelem(t) * m3_dtype_size(t->dtype);
}

static m3_status upload_tensor(upload_pass *u, const m3_tensor *host, m3_tensor *dev) {
    if (!host->data) {
        memset(dev, 0, sizeof *dev);
        return M3_OK;
    }
    /* a TP shard's column slice is a row-strided matrix: made dense here */
    size_t es = m3_dtype_size(host->dtype);
    bool strided = !m3_tensor_is_contiguous(host);
    if (strided && (host->ndim != 2 || host->nb[1] != (int64_t)es))
        return m3_fail(M3_ERR_INTERNAL, "tensor %s is neither dense nor a row-strided matrix",
                       host->name ? host->name : "?");
    size_t bytes = tensor_bytes(host);
    *dev = *host;
    if (strided)
        dev->nb[0] = host->ne[1] * (int64_t)es;
    if (u->base) {
        dev->data = u->base + u->offset;
        if (strided)
            M3_CUDA_TRY(cudaMemcpy2D(dev->data, (size_t)dev->nb[0], host->data,
                                     (size_t)host->nb[0], (size_t)dev->nb[0],
                                     (size_t)host->ne[0], cudaMemcpyHostToDevice));
        else
            M3_CUDA_TRY(cudaMemcpy(dev->data, host->data, bytes, cudaMemcpyHostToDevice));
        m3_progress_add(&u->prog, (int64_t)bytes);
    }
    /* 256-byte granules: vector loads, and a uniform stride for experts */
    u->offset += (bytes + 255) / 256 * 256;
    return M3_OK;
}

static m3_status upload_linear(upload_pass *u, const m3_linear *host, m3_linear *dev) {
    M3_TRY(upload_tensor(u, &host->w, &dev->w));
    return upload_tensor(u, &host->scale, &dev->scale);
}

/* Experts of one kind (gate, up or down) back to back: one linear each
 * for the weights, then one each for the scales, so expert e of the kind
 * sits at base + e * stride. */
static m3_status upload_experts(upload_pass *u, int E, const m3_linear *host, m3_linear *dev) {
    for (int e = 0; e < E; e++) {
        M3_TRY(upload_tensor(u, &host[e].w, &dev[e].w));
        dev[e].k_chunks = host[e].k_chunks;
        dev[e].n_chunks = host[e].n_chunks;
    }
    for (int e = 0; e < E; e++)
        M3_TRY(upload_tensor(u, &host[e].scale, &dev[e].scale));
    return M3_OK;
}

static m3_status upload_layer(upload_pass *u, const m3_config *cfg, const m3_layer_weights *h,
                              m3_layer_weights *d) {
    m3_linear *experts = d->exp_gate; /* keep the device arrays across passes */
    *d = *h;
    d->exp_gate = experts;
    M3_TRY(upload_tensor(u, &h->input_norm, &d->input_norm));
    M3_TRY(upload_tensor(u, &h->post_norm, &d->post_norm));
    M3_TRY(upload_linear(u, &h->q_proj, &d->q_proj));
    M3_TRY(upload_linear(u, &h->k_proj, &d->k_proj));
    M3_TRY(upload_linear(u, &h->v_proj, &d->v_proj));
    M3_TRY(upload_linear(u, &h->o_proj, &d->o_proj));
    M3_TRY(upload_tensor(u, &h->q_norm, &d->q_norm));
    M3_TRY(upload_tensor(u, &h->k_norm, &d->k_norm));
    M3_TRY(upload_linear(u, &h->iq_proj, &d->iq_proj));
    M3_TRY(upload_linear(u, &h->ik_proj, &d->ik_proj));
    M3_TRY(upload_tensor(u, &h->iq_norm, &d->iq_norm));
    M3_TRY(upload_tensor(u, &h->ik_norm, &d->ik_norm));
    M3_TRY(upload_linear(u, &h->mlp_gate, &d->mlp_gate));
    M3_TRY(upload_linear(u, &h->mlp_up, &d->mlp_up));
    M3_TRY(upload_linear(u, &h->mlp_down, &d->mlp_down));
    M3_TRY(upload_tensor(u, &h->router, &d->router));
    M3_TRY(upload_tensor(u, &h->router_bias, &d->router_bias));
    M3_TRY(upload_linear(u, &h->sh_gate, &d->sh_gate));
    M3_TRY(upload_linear(u, &h->sh_up, &d->sh_up));
    M3_TRY(upload_linear(u, &h->sh_down, &d->sh_down));
    if (!h->moe)
        return M3_OK;
    int E = cfg->num_experts;
    if (!d->exp_gate) {
        d->exp_gate = (m3_linear *)calloc((size_t)E * 3, sizeof(m3_linear));
        if (!d->exp_gate)
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory for expert views");
    }
    d->exp_up = d->exp_gate + E;
    d->exp_down = d->exp_gate + 2 * E;
    M3_TRY(upload_experts(u, E, h->exp_gate, d->exp_gate));
    M3_TRY(upload_experts(u, E, h->exp_up, d->exp_up));
    return upload_experts(u, E, h->exp_down, d->exp_down);
}

static m3_status upload_all(upload_pass *u, const m3_config *cfg, const m3_weights *host,
                            m3_weights *out) {
    M3_TRY(upload_tensor(u, &host->embed, &out->embed));
    M3_TRY(upload_tensor(u, &host->norm, &out->norm));
    if (cfg->tie_word_embeddings)
        out->lm_head = out->embed;
    else
        M3_TRY(upload_tensor(u, &host->lm_head, &out->lm_head));
    for (int i = 0; i < cfg->num_layers; i++)
        M3_TRY(upload_layer(u, cfg, &host->layers[i], &out->layers[i]));
    return M3_OK;
}

static void cuda_unload_weights(m3_backend *be, const m3_config *cfg, m3_weights *w) {
    m3_cuda *cu = m3_cuda_of(be);
    for (int i = 0; w->layers && i < cfg->num_layers; i++)
        free(w->layers[i].exp_gate);
    free(w->layers);
    if (cu->weights_block)
        cudaFree(cu->weights_block);
    cu->weights_block = NULL;
    memset(w, 0, sizeof *w);
}

static m3_status cuda_load_weights(m3_backend *be, const m3_config *cfg, const m3_weights *host,
                                   m3_weights *out) {
    m3_cuda *cu = m3_cuda_of(be);
    memset(out, 0, sizeof *out);
    out->layers = (m3_layer_weights *)calloc((size_t)cfg->num_layers, sizeof(m3_layer_weights));
    if (!out->layers)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory for layer views");
    upload_pass u = {cu, NULL, 0, {0}};
    m3_status st = upload_all(&u, cfg, host, out);
    if (!st) {
        size_t total = u.offset;
        cudaError_t err = cudaMalloc(&cu->weights_block, total);
        if (err != cudaSuccess)
            st = m3_fail(M3_ERR_NO_MEMORY, "CUDA: cannot allocate %.2f GiB for the weights: %s",
                         (double)total / (1 << 30), cudaGetErrorString(err));
        u.base = (char *)cu->weights_block;
        u.offset = 0;
        m3_progress_begin(&u.prog, "uploading weights", (int64_t)total, true);
    }
    if (!st)
        st = upload_all(&u, cfg, host, out);
    m3_progress_end(&u.prog);
    if (st)
        cuda_unload_weights(be, cfg, out);
    return st;
}

/* ------------------------------------------------------------ graphs */

static m3_status cuda_graph_begin(m3_backend *be) {
    m3_cuda *cu = m3_cuda_of(be);
    M3_CUDA_TRY(cudaStreamBeginCapture(cu->stream, cudaStreamCaptureModeThreadLocal));
    cu->capturing = true;
    return M3_OK;
}

static m3_status cuda_graph_end(m3_backend *be, bool keep, void **graph_exec) {
    m3_cuda *cu = m3_cuda_of(be);
    cudaGraph_t graph = NULL;
    cu->capturing = false;
    *graph_exec = NULL;
    cudaError_t err = cudaStreamEndCapture(cu->stream, &graph);
    if (err != cudaSuccess || !keep) {
        if (graph)
            cudaGraphDestroy(graph);
        if (err != cudaSuccess)
            return m3_cuda_error(err, "cudaStreamEndCapture", __FILE__, __LINE__);
        return M3_OK;
    }
    cudaGraphExec_t exec = NULL;
    err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (err != cudaSuccess)
        return m3_cuda_error(err, "cudaGraphInstantiate", __FILE__, __LINE__);
    *graph_exec = exec;
    return M3_OK;
}

static m3_status cuda_graph_launch(m3_backend *be, void *graph_exec) {
    M3_CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)graph_exec, m3_cuda_of(be)->stream));
    return M3_OK;
}

static void cuda_graph_free(m3_backend *be, void *graph_exec) {
    if (graph_exec)
        cudaGraphExecDestroy((cudaGraphExec_t)graph_exec);
}

/* ------------------------------------------------------------ the table */

static void cuda_destroy(m3_backend *be) {
    if (!be)
        return;
    m3_cuda *cu = m3_cuda_of(be);
    if (cu) {
        cudaSetDevice(cu->device); /* TP: the caller's thread may be on another GPU */
        if (cu->stream)
            cudaStreamSynchronize(cu->stream);
        for (int i = 0; i < M3_CUDA_WORKSPACES; i++)
            if (cu->ws[i])
                cudaFree(cu->ws[i]);
        for (int i = 0; i < cu->n_retired; i++)
            cudaFree(cu->retired[i]);
        free(cu->retired);
        if (cu->cublas_workspace)
            cudaFree(cu->cublas_workspace);
        if (cu->cublas)
            cublasDestroy(cu->cublas);
        if (cu->stream)
            cudaStreamDestroy(cu->stream);
        free(cu);
    }
    free(be);
}

static const m3_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .release = cuda_release,
    .upload = cuda_upload,
    .download = cuda_download,
    .sync = cuda_sync,
    .bind_thread = cuda_bind_thread,
    .load_weights = cuda_load_weights,
    .unload_weights = cuda_unload_weights,
    .embed = m3_cuda_embed,
    .round_bf16 = m3_cuda_round_bf16,
    .gather_rows = m3_cuda_gather_rows,
    .add_rows = m3_cuda_add_rows,
    .add_rmsnorm = m3_cuda_add_rmsnorm,
    .linear = m3_cuda_linear,
    .linear_group = m3_cuda_linear_group,
    .head_norm_rope = m3_cuda_head_norm_rope,
    .cache_write = m3_cuda_cache_write,
    .index_scores = m3_cuda_index_scores,
    .select_blocks = m3_cuda_select_blocks,
    .attention = m3_cuda_attention,
    .draft_attention = m3_cuda_draft_attention,
    .draft_argmax = m3_cuda_draft_argmax,
    .draft_markov = m3_cuda_draft_markov,
    .draft_layers_build = m3_cuda_draft_layers_build,
    .draft_layers_run = m3_cuda_draft_layers_run,
    .draft_layers_free = m3_cuda_draft_layers_free,
    .swiglu = m3_cuda_swiglu,
    .moe = m3_cuda_moe,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_free = cuda_graph_free,
    .sample = m3_cuda_sample,
};

extern "C" m3_status m3_cuda_check_config(const m3_config *c) {
    char why[1024] = "";
    const size_t cap = sizeof why;
    const bool sparse = m3_config_count_sparse(c) > 0, moe = m3_config_count_moe(c) > 0;
    if (c->head_dim < 32 || c->head_dim > M3_CUDA_ATTN_DIM_MAX || c->head_dim % 32)
        m3_reasons_add(why, cap, "head_dim %d (attention takes multiples of 32 up to %d)",
                       c->head_dim, M3_CUDA_ATTN_DIM_MAX);
    if (c->rotary_dim / 2 > M3_CUDA_HNR_MAX_HALF)
        m3_reasons_add(why, cap, "rotary_dim %d (at most %d)", c->rotary_dim,
                       2 * M3_CUDA_HNR_MAX_HALF);
    if (c->hidden_size > M3_CUDA_NORM_DIM_MAX)
        m3_reasons_add(why, cap, "hidden_size %d (the norms take at most %d)", c->hidden_size,
                       M3_CUDA_NORM_DIM_MAX);
    if (sparse && (c->index_dim < 8 || c->index_dim % 8 || c->index_dim > M3_CUDA_INDEX_DIM_MAX))
        m3_reasons_add(why, cap, "sparse_index_dim %d (the index scores take multiples of 8 up "
                       "to %d)", c->index_dim, M3_CUDA_INDEX_DIM_MAX);
    else if (sparse && !m3_cuda_index_fits(c->index_heads, c->index_dim))
        m3_reasons_add(why, cap, "%d index heads of %d dims (more than the index scores' shared "
                       "memory holds)", c->index_heads, c->index_dim);
    if (moe && c->experts_per_tok > M3_CUDA_MOE_MAX_K)
        m3_reasons_add(why, cap, "%d experts per token (at most %d)", c->experts_per_tok,
                       M3_CUDA_MOE_MAX_K);
    if (moe && c->num_experts > M3_CUDA_MOE_MAX_EXPERTS)
        m3_reasons_add(why, cap, "%d experts (at most %d)", c->num_experts,
                       M3_CUDA_MOE_MAX_EXPERTS);
    if (moe && (c->hidden_size % M3_CUDA_MOE_ALIGN || c->expert_dim % M3_CUDA_MOE_ALIGN))
        m3_reasons_add(why, cap, "hidden_size %d and expert width %d (per TP rank): the MoE "
                       "kernels take multiples of %d", c->hidden_size, c->expert_dim,
                       M3_CUDA_MOE_ALIGN);
    if (c->vocab_size > M3_CUDA_SAMPLE_MAX_VOCAB)
        m3_reasons_add(why, cap, "vocab_size %d (at most %d per TP rank)", c->vocab_size,
                       M3_CUDA_SAMPLE_MAX_VOCAB);
    if (why[0])
        return m3_fail(M3_ERR_UNSUPPORTED, "the CUDA backend does not take this model: %s", why);
    return M3_OK;
}

static m3_status check_device(int device, cudaDeviceProp *prop) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)
        return m3_fail(M3_ERR_DEVICE, "no usable CUDA device: %s",
                       err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    if (device < 0 || device >= count)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA device %d does not exist (%d found)", device,
                       count);
    M3_CUDA_TRY(cudaGetDeviceProperties(prop, device));
    if (prop->major != 9 || prop->minor != 0)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "CUDA device %d (%s) is sm_%d%d; this build targets sm_90a (Hopper)",
                       device, prop->name, prop->major, prop->minor);
    return M3_OK;
}

/* A count from the environment variable `name`: an integer of at least
 * `least`, else `fallback` (unset, empty, not a number, too small). */
static int64_t env_count(const char *name, int64_t least, int64_t fallback) {
    const char *v = getenv(name);
    char *end = NULL;
    long long x = v && *v ? strtoll(v, &end, 10) : 0;
    return end && *end == '\0' && x >= least ? (int64_t)x : fallback;
}

/* The rows up to which a bf16 linear stays on the MMA kernel, the
 * backend's exact_rows: M3_LINEAR_MMA_ROWS, 16, 32 or 64, else the
 * default (16: cuBLAS from 17 rows). 32 and 64 make a speculative cycle
 * of 3-8 requests one verify step again (spec/speculate.c), at the cost
 * of a 17-32-row MMA launch against cuBLAS: 1.4x at the lm_head on an
 * H100 (docs/PERF.md, forty-eighth session). */
static int linear_mma_rows(void) {
    int64_t x = env_count("M3_LINEAR_MMA_ROWS", 16, M3_CUDA_EXACT_ROWS);
    return x == 16 || x == 32 || x == 64 ? (int)x : M3_CUDA_EXACT_ROWS;
}

extern "C" m3_status m3_cuda_backend_create(int device, m3_backend **out) {
    *out = NULL;
    cudaDeviceProp prop;
    M3_TRY(check_device(device, &prop));
    m3_backend *be = (m3_backend *)calloc(1, sizeof *be);
    m3_cuda *cu = (m3_cuda *)calloc(1, sizeof *cu);
    if (!be || !cu) {
        free(be);
        free(cu);
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating the CUDA backend");
    }
    be->ops = &cuda_ops;
    be->impl = cu;
    be->exact_rows = linear_mma_rows();
    /* M3_LINEAR_CUBLAS=0: prefill's linears too on our kernel, in passes
     * (slower; for compute-sanitizer's initcheck, which reports every read
     * of a cuBLAS output as uninitialised: gpu-check's initcheck stage) */
    cu->no_cublas = env_count("M3_LINEAR_CUBLAS", 0, 1) == 0;
    cu->device = device;
    cu->sm_count = prop.multiProcessorCount;
    cu->l2_bytes = (size_t)prop.l2CacheSize;
    /* the drafter attention's context keys from which the split kernels
     * run, and the group keys (KV heads x requests x query passes x the
     * table's keys) from which those run their two-CTAs-a-multiprocessor
     * build (0: never, 1: always) */
    cu->draft_split_from = env_count("M3_DRAFT_SPLIT_FROM", 1, M3_CUDA_DRAFT_SPLIT_FROM);
    cu->draft_split_two_from =
        env_count("M3_DRAFT_SPLIT_TWO_FROM", 0, M3_CUDA_DRAFT_SPLIT_TWO_FROM);
    m3_status st = M3_OK;
    cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess)
        err = cudaStreamCreateWithFlags(&cu->stream, cudaStreamNonBlocking);
    if (err != cudaSuccess)
        st = m3_cuda_error(err, "creating a stream", __FILE__, __LINE__);
    if (!st && cublasCreate(&cu->cublas) != CUBLAS_STATUS_SUCCESS)
        st = m3_fail(M3_ERR_DEVICE, "cuBLAS could not be initialised");
    /* a fixed cuBLAS workspace so cuBLAS never allocates (graph capture) */
    size_t cublas_ws = (size_t)32 << 20;
    if (!st && (err = cudaMalloc(&cu->cublas_workspace, cublas_ws)) != cudaSuccess)
        st = m3_cuda_error(err, "cudaMalloc(cuBLAS workspace)", __FILE__, __LINE__);
    /* zeroed once: compute-sanitizer initcheck reported 1.45 million reads
     * of this workspace as uninitialised, all inside cuBLAS's split-K
     * reduce (either bytes cuBLAS never writes, or writes the tool does not
     * see); with defined contents none are reported (docs/PERF.md, tenth
     * session) and the check stays usable on our own kernels */
    if (!st && (err = cudaMemsetAsync(cu->cublas_workspace, 0, cublas_ws, cu->stream)) !=
                   cudaSuccess)
        st = m3_cuda_error(err, "zeroing the cuBLAS workspace", __FILE__, __LINE__);
    if (!st && (cublasSetStream(cu->cublas, cu->stream) != CUBLAS_STATUS_SUCCESS ||
                cublasSetWorkspace(cu->cublas, cu->cublas_workspace, cublas_ws) !=
                    CUBLAS_STATUS_SUCCESS))
        st = m3_fail(M3_ERR_DEVICE, "cuBLAS stream/workspace setup failed");
    if (st) {
        cuda_destroy(be);
        return st;
    }
    *out = be;
    return M3_OK;
}
