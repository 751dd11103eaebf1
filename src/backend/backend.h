/*
 * The backend interface: the ops of the stock (op-by-op) forward pass, one
 * function pointer each, so the CPU backend (the reference) and the CUDA
 * backend fill in the same table and decode/forward.c runs unchanged on
 * either. Every op computes exactly SPEC §2.3 / §3 with its rounding
 * points; the comment on each says which values it rounds to bf16.
 *
 * Pointers passed to ops are backend memory (host memory for the CPU
 * backend, device memory for CUDA). Activations are bf16 stored as
 * uint16_t, row-major; "rows" is the step's row count T. Weight views
 * (m3_tensor, m3_linear) come from the backend's m3_weights copy.
 *
 * Rows with a negative slot are padding: ops that write the cache skip
 * them, and their outputs elsewhere are ignored by the caller.
 */
#ifndef M3_BACKEND_BACKEND_H
#define M3_BACKEND_BACKEND_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/tensor.h"
#include "decode/step.h"
#include "dist/comm.h"
#include "m3.h"
#include "model/model.h"

/* Most requests one draft_markov call serves (the drafter's
 * M3_MAX_DRAFT_REQS). */
#define M3_MAX_MARKOV_REQS 8

typedef struct m3_backend m3_backend;

typedef struct m3_rope {
    int rotary_dim; /* RoPE on dims [0, rotary_dim); pairs (i, i + rotary_dim/2) */
    double theta;
} m3_rope;

/* The index scores' whole multiplier, SPEC §3: index_dim^-0.5 * log2(e),
 * rounded once to fp32 (the block scores are base-2 logits). */
static inline float m3_index_scale(int dim) {
    return (float)(1.0 / sqrt((double)dim) * 1.4426950408889634);
}

typedef struct m3_select_params {
    int topk;
    int init_blocks;
    int local_blocks;
} m3_select_params;

typedef struct m3_swiglu {
    float alpha, limit;
} m3_swiglu;

/* What an MoE layer needs besides its weights. */
typedef struct m3_moe_params {
    int num_experts, top_k;
    float routed_scaling;
    m3_swiglu act;
    m3_comm *tp; /* the TP group when the experts are sharded; NULL at TP 1 */
} m3_moe_params;

/* One DSpark draft layer's weights (spec/drafter.h loads them; the fused
 * drafter kernels read them). */
/* Shapes: H hidden (the target's), D head_dim, Nq/Nkv query/KV heads, F the
 * MLP width, k taps, V vocabulary, r Markov rank, B block rows. */
typedef struct m3_draft_layer {
    m3_tensor input_norm, post_norm; /* [H] bf16 */
    m3_linear q_proj;                /* [Nq*D, H] */
    m3_linear k_proj, v_proj;        /* [Nkv*D, H] */
    m3_linear o_proj;                /* [H, Nq*D] */
    m3_tensor q_norm, k_norm;        /* [D] bf16 */
    m3_linear gate, up;              /* [F, H] */
    m3_linear down;                  /* [H, F] */
} m3_draft_layer;

/* What the fused drafter layers need (draft_layers_build): the drafter's
 * shapes and weights, its cache, and the draft step's fixed buffers
 * (backend memory; T = n * block rows, request-major, as draft_forward.c
 * lays them out). */
typedef struct m3_draft_layers_args {
    int n_layers, hidden_size, q_heads, kv_heads, head_dim, ffn, block;
    int max_reqs, max_blocks;           /* requests a step; the block tables' width */
    float eps, scale;                   /* RMSNorm eps; attention 1/sqrt(D) */
    m3_rope rope;
    m3_swiglu swiglu;
    int64_t window;                     /* keys a row sees (0: all) */
    const m3_draft_layer *layers;       /* [n_layers] */
    const m3_tensor *final_norm;        /* [H] */
    uint16_t *const *k_cache, *const *v_cache; /* [n_layers]: [pages, Nkv, 128, D] */
    const int64_t *positions;           /* [T] */
    const int32_t *pages;               /* [max_reqs, max_blocks] */
    uint16_t *residual, *hidden;        /* [T, H]: the stream (residual in: the embedding) */
    uint16_t *x, *o, *final;            /* [T, H] */
    uint16_t *q, *attn;                 /* [T, Nq D] */
    uint16_t *k, *v;                    /* [T, Nkv D] */
    uint16_t *act;                      /* [T, F] */
} m3_draft_layers_args;

typedef struct m3_backend_ops {
    const char *name;
    /* The backend's memory is the host's (the CPU): weights stay views of
     * the mapped files, and host code may read activations directly. */
    bool host_memory;
    void (*destroy)(m3_backend *be);

    /* ---- memory ---- */
    m3_status (*alloc)(m3_backend *be, size_t bytes, void **ptr);
    void (*release)(m3_backend *be, void *ptr);
    m3_status (*upload)(m3_backend *be, void *dst, const void *src, size_t bytes);
    m3_status (*download)(m3_backend *be, void *dst, const void *src, size_t bytes);
    m3_status (*sync)(m3_backend *be);
    /* Make the calling thread use this backend's device (a TP rank's thread
     * before its work; NULL: nothing to do, as on the CPU). */
    m3_status (*bind_thread)(m3_backend *be);
    /* The backend's copy of the weights (CPU: the host views themselves). */
    m3_status (*load_weights)(m3_backend *be, const m3_config *cfg, const m3_weights *host,
                              m3_weights *out);
    void (*unload_weights)(m3_backend *be, const m3_config *cfg, m3_weights *w);

    /* ---- ops ---- */

    /* out[t] = table[tokens[t] - vocab_start] (bf16 rows, exact); zeros
     * for a token outside [vocab_start, vocab_start + table rows): the
     * vocab-parallel embedding of a TP rank (vocab_start 0 at TP 1). */
    m3_status (*embed)(m3_backend *be, int rows, const int32_t *tokens, const m3_tensor *table,
                       int64_t vocab_start, uint16_t *out);

    /* out = bf16(in), n values of in_dtype F32 (or F64, CPU: rounded to fp32
     * first, as every CPU dot product is): a TP partial sum, all-reduced. */
    m3_status (*round_bf16)(m3_backend *be, int64_t n, m3_dtype in_dtype, const void *in,
                            uint16_t *out);

    /* Copy rows idx[i] of src [*, dim] to dst [n, dim]. */
    m3_status (*gather_rows)(m3_backend *be, int n, const int32_t *idx, int dim,
                             const uint16_t *src, uint16_t *dst);

    /* out[t, i] = bf16(a[t, i] + b[t, i]) for a, b dense [rows, dim]; out's
     * rows lie out_stride elements apart, so a row can be one slice of a
     * wider one (a layer tap's place in the drafter's context row). */
    m3_status (*add_rows)(m3_backend *be, int rows, int dim, const uint16_t *a,
                          const uint16_t *b, int64_t out_stride, uint16_t *out);

    /* With add: residual = bf16(add + residual); without: residual as is.
     * out = bf16(gemma_rmsnorm(residual) with w).     [rows, dim] */
    m3_status (*add_rmsnorm)(m3_backend *be, int rows, int dim, const uint16_t *add,
                             uint16_t *residual, const m3_tensor *w, float eps, uint16_t *out);

    /* out[t, n] = sum_k x[t, k] w[n, k] in fp32; out is bf16 (rounded) or
     * f32 (out_dtype); the CPU also gives F64, the unrounded sum (a TP
     * partial: summed over ranks first, then rounded as one dot product
     * would be). x [rows, K] dense; out [rows, N] dense. */
    m3_status (*linear)(m3_backend *be, int rows, const uint16_t *x, const m3_linear *w,
                        m3_dtype out_dtype, void *out);

    /* n linears of the same x (2 <= n <= 6): out[i] exactly as linear(w[i])
     * gives it, in one pass where the backend can (a layer's projections;
     * gate and up). NULL: m3_linear_group runs linear n times. */
    m3_status (*linear_group)(m3_backend *be, int rows, const uint16_t *x, int n,
                              const m3_linear *const *w, m3_dtype out_dtype, void *const *out);

    /* Per head of x [rows, heads, dim] (row stride row_stride elements):
     * gemma norm with the shared w [dim], then NeoX RoPE at positions[t] on
     * the first rotary_dim dims; rounded to bf16 once. */
    m3_status (*head_norm_rope)(m3_backend *be, int rows, int heads, int dim, uint16_t *x,
                                int64_t row_stride, const m3_tensor *w, float eps,
                                const int64_t *positions, const m3_rope *rope);

    /* cache [pages, heads, 128, dim] at slots[t] <- src [rows, heads, dim]
     * (row stride src_stride elements). Negative slots are skipped. */
    m3_status (*cache_write)(m3_backend *be, int rows, const int64_t *slots, int heads, int dim,
                             const uint16_t *src, int64_t src_stride, uint16_t *cache);

    /* scores [rows, heads, step->max_blocks] fp32: per index head h and
     * visible block b of the row's sequence, max over positions q < kv_len
     * in b of dot(iq[t,h], icache[q]) * scale; -inf past the visible
     * blocks. iq [rows, heads, dim]; icache [pages, 128, dim]. */
    m3_status (*index_scores)(m3_backend *be, const m3_step *step, int heads, int dim,
                              const uint16_t *iq, const uint16_t *icache, float scale,
                              float *scores);

    /* selected [rows, heads, topk] int32: SPEC §3 selection per (row,
     * head), ascending block ids, padded with -1. */
    m3_status (*select_blocks)(m3_backend *be, const m3_step *step, int heads,
                               const float *scores, const m3_select_params *p,
                               int32_t *selected);

    /* out [rows, q_heads, dim] = softmax(q k^T * scale) v per query head
     * over its KV group's keys: all positions < kv_len (selected == NULL) or
     * those of the selected blocks [rows, kv_heads, topk]. Each head's
     * output rounded to bf16. */
    m3_status (*attention)(m3_backend *be, const m3_step *step, int q_heads, int kv_heads,
                           int dim, const uint16_t *q, const uint16_t *kcache,
                           const uint16_t *vcache, const int32_t *selected, int topk,
                           float scale, uint16_t *out);

    /* The DSpark drafter's attention (docs/DSPARK.md; NULL: the backend
     * has none), for `requests` requests at once, each as follows on its
     * slices (request i: q, out + i * rows * q_heads * dim; bk, bv + i *
     * rows * kv_heads * dim; pages + i * max_blocks; pos + i * rows): its
     * query rows q [rows, q_heads, dim] at positions p + t, where
     * p = pos[0] (backend memory, >= 0: the block's first position, read by
     * the op, so a graph of the draft step serves every position), each
     * over the context keys of kcache / vcache (the drafter's paged cache,
     * [pages, kv_heads, 128, dim], block table `pages`) at positions
     * [max(0, p + t - window + 1) with a window, else 0, p), then over every
     * row's block key bk / value bv [rows, kv_heads, dim], in that order;
     * softmax as attention's; out [rows, q_heads, dim] bf16 per head.
     * max_blocks: the block table's capacity (the most pages any position
     * replayed from a graph may reach), which sizes a GPU's launches. */
    m3_status (*draft_attention)(m3_backend *be, int requests, int rows, int q_heads,
                                 int kv_heads, int dim,
                                 const uint16_t *q, const uint16_t *bk, const uint16_t *bv,
                                 const uint16_t *kcache, const uint16_t *vcache,
                                 const int32_t *pages, int max_blocks, const int64_t *pos,
                                 int64_t window, float scale, uint16_t *out);

    /* The DSpark drafter's Markov step (docs/DSPARK.md; NULL: the backend
     * has none): row[v] += bias[v] (fp32, written back; bias NULL: the row
     * as it is), then *token = the row's argmax (lowest id on ties, NaN
     * never chosen; 0 when every value is NaN), token in backend memory:
     * the next row's bias is gathered by it without a trip to the host. */
    m3_status (*draft_argmax)(m3_backend *be, int vocab, float *row, const float *bias,
                              int32_t *token);

    /* The DSpark drafter's Markov step for n requests in one call (NULL, or
     * M3_ERR_UNSUPPORTED for these weights: the drafter runs gather_rows,
     * linear and draft_argmax instead, whose results this gives bit for
     * bit): for request g, rows[g] (fp32 [V], row_stride apart) +=
     * W2 . W1[prev[g]] (W1, W2 [V, R] bf16, summed as linear sums), then
     * next[g] = draft_argmax's token of it; prev, rows, next in backend
     * memory. n = 0 asks only whether the op takes these weights (outside
     * a capture: it also readies the op's state). n <= M3_MAX_MARKOV_REQS. */
    m3_status (*draft_markov)(m3_backend *be, int n, const m3_tensor *w1, const m3_tensor *w2,
                              const int32_t *prev, float *rows, int64_t row_stride,
                              int32_t *next);

    /* The DSpark drafter's layers and final norm in fused kernels (SPEC
     * §7; NULL: the backend has none, and the drafter runs its layers op
     * by op). build checks the shapes (M3_ERR_UNSUPPORTED with the reason
     * where the kernels do not take them) and makes a runner for these
     * weights, cache and buffers, outside any graph capture; run computes
     * a draft step of n requests (1..max_reqs): from residual (the rows'
     * embedding) to final, with hidden, x, q, k, v, attn, o and act as
     * scratch, the same values as the stock ops (bit for bit where the
     * backend's linear takes the step's rows on the same kernel); free
     * releases the runner (NULL: nothing). A runner holds the cache's
     * addresses: another cache needs another runner. */
    m3_status (*draft_layers_build)(m3_backend *be, const m3_draft_layers_args *a,
                                    void **runner);
    m3_status (*draft_layers_run)(m3_backend *be, void *runner, int n);
    void (*draft_layers_free)(m3_backend *be, void *runner);

    /* out = bf16(swiglu_oai(gate, up)) elementwise over n values. */
    m3_status (*swiglu)(m3_backend *be, int64_t n, const uint16_t *gate, const uint16_t *up,
                        const m3_swiglu *act, uint16_t *out);

    /* MoE FFN of one layer: fp32 router (sigmoid, top-k by s + bias, ties to
     * the lower id, weights s/sum s), the routed experts (gate/up/act/down
     * each rounded), the shared expert, y = bf16(scaling * sum w_i e_i +
     * shared) summed in fp32. x, out [rows, H].
     * With p->tp (world > 1) lw holds this rank's slice of every expert's
     * width: the down outputs are partial sums, all-reduced through p->tp
     * before they are rounded, so out is the whole layer's y on every rank
     * (CPU: exactly the TP 1 result). */
    m3_status (*moe)(m3_backend *be, int rows, const uint16_t *x, const m3_layer_weights *lw,
                     const m3_moe_params *p, uint16_t *out);

    /* ---- graphs (NULL: the backend has none) ----
     * Ops launched between begin and end are recorded, not run; end with
     * keep returns an executable graph that replays them. */
    m3_status (*graph_begin)(m3_backend *be);
    m3_status (*graph_end)(m3_backend *be, bool keep, void **graph);
    m3_status (*graph_launch)(m3_backend *be, void *graph);
    void (*graph_free)(m3_backend *be, void *graph);

    /* ---- sampling on the device (NULL: the host samples) ----
     * tokens[r] = argmax of logits row r (temperature 0; lowest id on ties,
     * NaN never chosen, -1 if all are NaN) or a draw from
     * softmax(logits / temperature) keyed by (seed, counter[r]). */
    m3_status (*sample)(m3_backend *be, int rows, const float *logits, int vocab,
                        float temperature, uint64_t seed, const int64_t *counter,
                        int32_t *tokens);
} m3_backend_ops;

struct m3_backend {
    const m3_backend_ops *ops;
    void *impl;
    /* The whole model's attention heads (a TP rank's ops see its share):
     * the CUDA attention picks its KV splits from these, so a rank splits
     * each head's keys as TP 1 does (the same bits). 0: the op's own. */
    int full_q_heads, full_kv_heads;
    /* The most rows a step can have with every row's results the bits a
     * one-row step gives (0: any number; the CPU's). CUDA: 16, past which
     * the linear leaves its MMA kernel for cuBLAS, whose sums' order
     * depends on the shape. */
    int exact_rows;
};

/* The ops' linear_group, or linear n times where a backend has none. */
static inline m3_status m3_linear_group(m3_backend *be, int rows, const uint16_t *x, int n,
                                        const m3_linear *const *w, m3_dtype out_dtype,
                                        void *const *out) {
    if (be->ops->linear_group)
        return be->ops->linear_group(be, rows, x, n, w, out_dtype, out);
    for (int i = 0; i < n; i++) {
        m3_status st = be->ops->linear(be, rows, x, w[i], out_dtype, out[i]);
        if (st)
            return st;
    }
    return M3_OK;
}

/* The CPU backend with n_threads workers (0: all cores). */
m3_status m3_cpu_backend_create(int n_threads, m3_backend **out);
/* The CUDA backend on GPU `device`; M3_ERR_UNSUPPORTED in a build without
 * CUDA, M3_ERR_DEVICE without a usable GPU. */
m3_status m3_cuda_backend_create(int device, m3_backend **out);
/* Whether the CUDA backend's kernels take a model's shapes (cfg: one TP
 * rank's): M3_ERR_UNSUPPORTED naming every shape they do not (the limits:
 * cuda/cuda_limits.h). Needs no GPU; M3_OK in a build without CUDA, where
 * the backend itself is refused. */
m3_status m3_cuda_check_config(const m3_config *cfg);

#endif
