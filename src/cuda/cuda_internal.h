/*
 * The CUDA backend's insides, shared by its .cu files: the backend state
 * (device, stream, cuBLAS handle, a grow-only workspace), error checking
 * that turns CUDA failures into m3_status with a message, and the op entry
 * points each .cu file provides. Every op has the contract of the same op
 * in backend/backend.h and is checked against the CPU backend by
 * tests/gpu/test_cuda_ops.c.
 *
 * Rules every op follows, so whole decode steps can be captured into CUDA
 * graphs: launch on cu->stream only; never synchronize, allocate device
 * memory or copy to the host inside an op (scratch comes from
 * m3_cuda_workspace, which refuses to grow while capturing); read step
 * metadata from step->dev (device memory) only, never step->host; size
 * grids by capacities that do not change between steps (step->max_blocks,
 * rows) and let blocks past a row's real work return at once.
 */
#ifndef M3_CUDA_CUDA_INTERNAL_H
#define M3_CUDA_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* the library's C headers, with C linkage for the .cu files that use them */
#ifdef __cplusplus
extern "C" {
#endif

#include "backend/backend.h"
#include "core/progress.h"
#include "core/status.h"
#include "cuda/cuda_limits.h"

enum m3_cuda_workspace_slot {
    M3_CUDA_WS_ATTENTION = 0, /* split-K partials of attention */
    M3_CUDA_WS_MOE,           /* router logits, routing, expert activations */
    M3_CUDA_WS_LINEAR,        /* the decode linear's chunk partials; split-K partials */
    M3_CUDA_WS_LINEAR_COUNT,  /* the decode linear's arrivals per tile: zero between launches */
    M3_CUDA_WS_SAMPLE,        /* sampling partials */
    M3_CUDA_WS_MISC,
    M3_CUDA_WS_COMM,          /* TP: the ranks' gathered values, summed over ranks */
    M3_CUDA_WS_CP,            /* indexer CP in a layer: gathered queries, scores, keys */
    M3_CUDA_WS_MARKOV,        /* the DSpark Markov step's keys and counter */
    M3_CUDA_WS_DRAFT,         /* the drafter attention's split partials (long contexts) */
    M3_CUDA_WORKSPACES        /* (how many: a slot added above is counted) */
};

typedef struct m3_cuda {
    int device;
    int sm_count;
    size_t l2_bytes;
    bool no_cublas;           /* M3_LINEAR_CUBLAS=0: the linear op never takes cuBLAS (for
                               * initcheck, which does not see cuBLAS's stores) */
    int64_t draft_split_from; /* drafter context keys from which its attention splits them
                               * over CTAs (M3_DRAFT_SPLIT_FROM) */
    int64_t draft_split_two_from; /* KV heads x requests x query passes x the table's
                                   * keys from which those CTAs run two a multiprocessor
                                   * (M3_DRAFT_SPLIT_TWO_FROM; 0: never, 1: always) */
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *cublas_workspace;
    bool capturing;           /* a graph capture is in progress on stream */
    void *ws[M3_CUDA_WORKSPACES];
    size_t ws_bytes[M3_CUDA_WORKSPACES];
    void *weights_block;      /* every weight, one allocation */
    const int32_t *moe_n_uniq;/* device: distinct experts of the last MoE op (bench) */
    /* outgrown workspaces: graphs captured earlier may still point at them,
     * so they live until the backend is destroyed */
    void **retired;
    int n_retired, cap_retired;
    /* TP over GPUs (cuda_comm.cu): waits for the stream go through the
     * group, which bounds them and ends them when a peer fails */
    m3_status (*wait)(struct m3_cuda *cu, void *arg);
    void *wait_arg;
} m3_cuda;

static inline m3_cuda *m3_cuda_of(m3_backend *be) { return (m3_cuda *)be->impl; }

/* A CUDA error as an m3_status naming the call and the CUDA message. */
m3_status m3_cuda_error(cudaError_t err, const char *what, const char *file, int line);
#define M3_CUDA_TRY(call)                                                         \
    do {                                                                          \
        cudaError_t m3_cuda_e_ = (call);                                          \
        if (m3_cuda_e_ != cudaSuccess)                                            \
            return m3_cuda_error(m3_cuda_e_, #call, __FILE__, __LINE__);          \
    } while (0)
/* After a launch: the launch's own error (bad configuration, ...), naming
 * the kernel. */
#define M3_CUDA_LAUNCHED(what)                                                    \
    do {                                                                          \
        cudaError_t m3_cuda_e_ = cudaGetLastError();                              \
        if (m3_cuda_e_ != cudaSuccess)                                            \
            return m3_cuda_error(m3_cuda_e_, (what), __FILE__, __LINE__);         \
    } while (0)

/* Wait until everything launched on cu->stream has run (bounded at TP). */
m3_status m3_cuda_stream_wait(m3_cuda *cu);

/* Scratch buffer `slot` of at least bytes (256-byte aligned). Grows outside
 * capture; while capturing a growth is an error (a warm-up step must have
 * sized it). */
m3_status m3_cuda_workspace(m3_cuda *cu, int slot, size_t bytes, void **out);
/* The same, the bytes zero when first handed out (kernels that count in
 * it leave it zero again). */
m3_status m3_cuda_workspace_zeroed(m3_cuda *cu, int slot, size_t bytes, void **out);
/* Workspace `slot` cut into n parts: parts[i] of sizes[i] bytes, each part
 * 256-byte aligned (an op's several scratch arrays in one buffer). */
m3_status m3_cuda_workspace_parts(m3_cuda *cu, int slot, const size_t *sizes, int n,
                                  void **parts);

/* The chunks of K a weight's GPU sums are cut into (cuda_ksum.cuh): a
 * row-parallel weight's share of the full K's, else the rule's for K. */
static inline int m3_cuda_k_chunks(const m3_linear *w) {
    return w->k_chunks > 0 ? w->k_chunks : m3_k_chunks(w->w.ne[1]);
}

/* ---- ops (see backend.h for each contract) ---- */
/* cuda_elementwise.cu */
m3_status m3_cuda_embed(m3_backend *be, int rows, const int32_t *tokens, const m3_tensor *table,
                        int64_t vocab_start, uint16_t *out);
m3_status m3_cuda_round_bf16(m3_backend *be, int64_t n, m3_dtype in_dtype, const void *in,
                             uint16_t *out);
m3_status m3_cuda_gather_rows(m3_backend *be, int n, const int32_t *idx, int dim,
                              const uint16_t *src, uint16_t *dst);
m3_status m3_cuda_add_rows(m3_backend *be, int rows, int dim, const uint16_t *a,
                           const uint16_t *b, int64_t out_stride, uint16_t *out);
m3_status m3_cuda_add_rmsnorm(m3_backend *be, int rows, int dim, const uint16_t *add,
                              uint16_t *residual, const m3_tensor *w, float eps, uint16_t *out);
m3_status m3_cuda_head_norm_rope(m3_backend *be, int rows, int heads, int dim, uint16_t *x,
                                 int64_t row_stride, const m3_tensor *w, float eps,
                                 const int64_t *positions, const m3_rope *rope);
m3_status m3_cuda_cache_write(m3_backend *be, int rows, const int64_t *slots, int heads, int dim,
                              const uint16_t *src, int64_t src_stride, uint16_t *cache);
m3_status m3_cuda_swiglu(m3_backend *be, int64_t n, const uint16_t *gate, const uint16_t *up,
                         const m3_swiglu *act, uint16_t *out);
/* cuda_index.cu */
/* whether index_scores' staged tiles for heads x dim fit a CTA's shared memory */
bool m3_cuda_index_fits(int heads, int dim);
m3_status m3_cuda_index_scores(m3_backend *be, const m3_step *step, int heads, int dim,
                               const uint16_t *iq, const uint16_t *icache, float scale,
                               float *scores);
m3_status m3_cuda_select_blocks(m3_backend *be, const m3_step *step, int heads,
                                const float *scores, const m3_select_params *p,
                                int32_t *selected);
/* cuda_attention.cu */
m3_status m3_cuda_attention(m3_backend *be, const m3_step *step, int q_heads, int kv_heads,
                            int dim, const uint16_t *q, const uint16_t *kcache,
                            const uint16_t *vcache, const int32_t *selected, int topk,
                            float scale, uint16_t *out);
/* cuda_draft_layers.cu */
m3_status m3_cuda_draft_layers_build(m3_backend *be, const m3_draft_layers_args *a,
                                     void **runner);
m3_status m3_cuda_draft_layers_run(m3_backend *be, void *runner, int n);
void m3_cuda_draft_layers_free(m3_backend *be, void *runner);

/* cuda_draft.cu */
m3_status m3_cuda_draft_attention(m3_backend *be, int requests, int rows, int q_heads,
                                  int kv_heads, int dim,
                                  const uint16_t *q, const uint16_t *bk, const uint16_t *bv,
                                  const uint16_t *kcache, const uint16_t *vcache,
                                  const int32_t *pages, int max_blocks, const int64_t *pos,
                                  int64_t window, float scale, uint16_t *out);
m3_status m3_cuda_draft_markov(m3_backend *be, int n, const m3_tensor *w1, const m3_tensor *w2,
                               const int32_t *prev, float *rows, int64_t row_stride,
                               int32_t *next);
m3_status m3_cuda_draft_argmax(m3_backend *be, int vocab, float *row, const float *bias,
                               int32_t *token);
/* cuda_linear.cu */
m3_status m3_cuda_linear(m3_backend *be, int rows, const uint16_t *x, const m3_linear *w,
                         m3_dtype out_dtype, void *out);
m3_status m3_cuda_linear_group(m3_backend *be, int rows, const uint16_t *x, int n,
                               const m3_linear *const *w, m3_dtype out_dtype, void *const *out);
/* The same product through cuBLAS (bf16 weights only): what the decode
 * GEMV is measured against (m3 bench linear). */
m3_status m3_cuda_linear_cublas(m3_cuda *cu, int rows, const uint16_t *x, const m3_linear *w,
                                m3_dtype out_dtype, void *out);
/* fp32 weights [N, K] (the router): out [rows, N] fp32 */
m3_status m3_cuda_linear_f32w(m3_cuda *cu, int rows, const uint16_t *x, const float *w,
                              int64_t n, int64_t k, float *out);
/* cuda_moe.cu */
m3_status m3_cuda_moe(m3_backend *be, int rows, const uint16_t *x, const m3_layer_weights *lw,
                      const m3_moe_params *p, uint16_t *out);
/* cuda_sample.cu: tokens[r] = argmax of logits row r (lowest id on ties,
 * NaN never chosen; -1 when every logit is NaN), or with temperature > 0 a
 * draw from softmax(logits / T) keyed by (seed, counter[r]) */
m3_status m3_cuda_sample(m3_backend *be, int rows, const float *logits, int vocab,
                         float temperature, uint64_t seed, const int64_t *counter,
                         int32_t *tokens);

#ifdef __cplusplus
}
#endif

#endif
