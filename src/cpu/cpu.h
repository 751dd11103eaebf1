/*
 * The CPU backend's internals: the backend state (a worker pool and
 * per-thread scratch) and the row kernels the ops are built from. The
 * kernels are exposed so that fused CPU executors (the mono path) compute
 * with the very same code, and therefore the very same bits, as the stock
 * ops. Every kernel accumulates in a fixed order, so results never depend
 * on the thread count.
 */
#ifndef M3_CPU_CPU_H
#define M3_CPU_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "core/pool.h"

typedef struct m3_cpu {
    m3_pool *pool;
    int n_threads;
    /* per-thread float scratch, grown on demand before a parallel op */
    float **thread_buf;
    size_t thread_buf_floats;
    /* op-level scratch, one buffer per user so nested ops never share */
    void *scratch[4];
    size_t scratch_bytes[4];
} m3_cpu;

enum m3_cpu_scratch_slot {
    M3_SCRATCH_WIDEN = 0, /* linear: activations widened to fp32 */
    M3_SCRATCH_MOE,       /* MoE: gathered rows and expert outputs */
    M3_SCRATCH_ROUTER,    /* MoE: router logits and choices */
    M3_SCRATCH_MISC,
};

/* Make every thread's scratch hold at least floats floats. */
m3_status m3_cpu_thread_scratch(m3_cpu *cpu, size_t floats);
/* Make scratch buffer `slot` hold at least bytes bytes; returns it. */
m3_status m3_cpu_scratch(m3_cpu *cpu, int slot, size_t bytes, void **out);

/* ---- row kernels ---- */

/* sum_i a[i] b[i] accumulated in double, unrounded (a TP partial: ranks'
 * partials are summed in double, then rounded as one dot product is). */
double m3_dot_f64(const float *a, const float *b, int64_t n);
/* sum_i a[i] b[i], accumulated in double and rounded to fp32 once. */
float m3_dot_f32(const float *a, const float *b, int64_t n);
/* bf16 -> fp32 for n values. */
void m3_bf16_row_to_f32(const uint16_t *src, float *dst, int64_t n);
/* Row n of a linear weight as fp32 (bf16 widened, or MXFP8 dequantised). */
void m3_linear_row_f32(const m3_linear *w, int64_t n, float *dst);
/* y[i] = (x[i] * r) * (1 + w[i]) with r = 1 / sqrt(ms + eps), ms the mean
 * of squares accumulated in double and rounded once; fp32, not rounded to
 * bf16. */
void m3_gemma_norm_f32(const float *x, const uint16_t *w, int64_t dim, float eps, float *y);
/* cos/sin of position * theta^(-2i/rotary_dim), i < rotary_dim/2: the
 * angle in double, cos and sin rounded to fp32. */
void m3_rope_table(int64_t position, const m3_rope *rope, float *cos_out, float *sin_out);
/* NeoX rotation of x[0 .. rotary_dim) in place with a table from above. */
void m3_rope_apply(float *x, int rotary_dim, const float *cos_t, const float *sin_t);
/* exp of an fp32 value, correctly rounded: computed in double, rounded
 * once (libm's expf is off by one ulp on a fraction of inputs, enough to
 * flip bf16 roundings against another implementation). */
float m3_exp_f32(float x);
/* 1 / (1 + exp(-x)) with m3_exp_f32, in fp32. */
float m3_sigmoid_f32(float x);
/* g = min(gate, limit), u = clamp(up, -limit, limit),
 * g * sigmoid(alpha g) * (u + 1), fp32. */
float m3_swiglu_oai(float gate, float up, const m3_swiglu *act);
/* Choose the step's top-k experts of one row from router logits [E]:
 * ids by sigmoid(l) + bias (ties to the lower id), weights s / sum s. */
void m3_route_row(const float *logits, const float *bias, int num_experts, int top_k,
                  int32_t *ids, float *weights);
/* SPEC §3 selection for one (row, head): scores [nblocks]; out [topk]
 * ascending, padded with -1. cand is scratch of nblocks entries. */
void m3_select_row(const float *scores, int nblocks, const m3_select_params *p, int32_t *out,
                   int32_t *cand);

/* ---- per-row / per-head kernels of the ops (the stock ops loop these) ---- */

/* Element offset of (slot page/off's token, head) in a [pages, heads, 128,
 * dim] cache (the index cache: heads 1). */
static inline size_t m3_cache_offset(int64_t page, int64_t off, int heads, int head, int dim) {
    return (size_t)(((page * heads + head) * M3_PAGE_TOKENS + off) * dim);
}
/* Keys of block b visible at kv_len: min(kv_len - 128 b, 128) (<= 0: none). */
static inline int64_t m3_block_keys(int64_t kv_len, int b) {
    int64_t first = (int64_t)b * M3_PAGE_TOKENS;
    return kv_len - first < M3_PAGE_TOKENS ? kv_len - first : M3_PAGE_TOKENS;
}
/* add_rmsnorm of one row: with add, residual = bf16(add + residual) (in
 * place); out = bf16(gemma_norm(residual) with w) when out is given, and
 * out_f32 the same rounded values as fp32 when given. scratch: 2 dim. */
void m3_add_norm_row(const uint16_t *add, uint16_t *residual, const uint16_t *w, int dim,
                     float eps, float *scratch, uint16_t *out, float *out_f32);
/* head_norm_rope of one head in place: gemma norm with w, NeoX RoPE with a
 * table from m3_rope_table on [0, rotary_dim), rounded to bf16 once.
 * scratch: 2 dim. */
void m3_head_norm_rope_row(uint16_t *head, const uint16_t *w, int dim, float eps, int rotary_dim,
                           const float *cos_t, const float *sin_t, float *scratch);
/* The index score of one block for one (row, index head): max over its
 * first count keys (index cache page `page`) of dot(q, key), NaN winning,
 * times scale; -inf with no key. q fp32 [dim]; kbuf: dim floats. */
float m3_index_block_score(const float *q, const uint16_t *icache, int64_t page, int64_t count,
                           int dim, float scale, float *kbuf);
/* Softmax attention of one query head (KV group g of kv_heads) over the
 * keys of blocks[0..nblocks) of a row's block table (positions < kv_len):
 * scores q.k * scale, softmax (max, correctly rounded exp, sum in double),
 * out = bf16(sum p v accumulated in double) [dim]. buf: 8-byte aligned,
 * M3_ATTEND_BUF_FLOATS floats for up to max_keys keys. */
void m3_attend_head(const float *q, int g, int kv_heads, int dim, const uint16_t *kcache,
                    const uint16_t *vcache, const int32_t *table, const int32_t *blocks,
                    int nblocks, int64_t kv_len, float scale, float *buf, uint16_t *out);
#define M3_ATTEND_BUF_FLOATS(dim, max_keys) ((size_t)(dim) * 3 + (size_t)(max_keys))
/* The MoE output of one element: bf16(scaling * sum_s weights[s] down[s]
 * (+ shared)), summed in fp32 in routing-rank order; down[s] are the
 * rounded expert outputs (fp32 values of bf16). */
uint16_t m3_moe_combine_elem(int k, const float *weights, const float *down, float scaling,
                             bool has_shared, float shared);

/* ---- ops (the backend table's entries, callable directly) ---- */
m3_status m3_cpu_linear(m3_backend *be, int rows, const uint16_t *x, const m3_linear *w,
                        m3_dtype out_dtype, void *out);
m3_status m3_cpu_linear_f32w(m3_cpu *cpu, int rows, const uint16_t *x, const m3_tensor *w,
                             float *out);
m3_status m3_cpu_swiglu(m3_backend *be, int64_t n, const uint16_t *gate, const uint16_t *up,
                        const m3_swiglu *act, uint16_t *out);
m3_status m3_cpu_index_scores(m3_backend *be, const m3_step *step, int heads, int dim,
                              const uint16_t *iq, const uint16_t *icache, float scale,
                              float *scores);
m3_status m3_cpu_select_blocks(m3_backend *be, const m3_step *step, int heads,
                               const float *scores, const m3_select_params *p, int32_t *selected);
m3_status m3_cpu_attention(m3_backend *be, const m3_step *step, int q_heads, int kv_heads,
                           int dim, const uint16_t *q, const uint16_t *kcache,
                           const uint16_t *vcache, const int32_t *selected, int topk, float scale,
                           uint16_t *out);
m3_status m3_cpu_cache_write(m3_backend *be, int rows, const int64_t *slots, int heads, int dim,
                             const uint16_t *src, int64_t src_stride, uint16_t *cache);
m3_status m3_cpu_moe(m3_backend *be, int rows, const uint16_t *x, const m3_layer_weights *lw,
                     const m3_moe_params *p, uint16_t *out);

/* backend op draft_attention (cpu_draft.c) */
m3_status m3_cpu_draft_attention(m3_backend *be, int requests, int rows, int q_heads,
                                 int kv_heads, int dim,
                                 const uint16_t *q, const uint16_t *bk, const uint16_t *bv,
                                 const uint16_t *kcache, const uint16_t *vcache,
                                 const int32_t *pages, int max_blocks, const int64_t *pos,
                                 int64_t window, float scale, uint16_t *out);
/* backend op draft_argmax (cpu_draft.c) */
m3_status m3_cpu_draft_argmax(m3_backend *be, int vocab, float *row, const float *bias,
                              int32_t *token);

static inline m3_cpu *m3_cpu_of(m3_backend *be) { return (m3_cpu *)be->impl; }

#endif
