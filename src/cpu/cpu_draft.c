/*
 * The DSpark drafter's attention on the CPU (backend op draft_attention,
 * docs/DSPARK.md): each block row's query heads over the context keys of
 * the drafter's paged cache (positions below the anchor's, optionally
 * windowed) and then every row of the block, with no causal order inside
 * the block. The arithmetic is the target's (cpu_attention.c): fp32 scores,
 * their exp summed in double, p = e / sum, out = sum p v in double, rounded
 * once to bf16. One (row, head) per pool item. Also the Markov head's
 * step (draft_argmax): the bias added, then the row's argmax.
 */
#include <math.h>
#include <string.h>

#include "core/bf16.h"
#include "core/status.h"
#include "cpu/cpu.h"

typedef struct draft_job {
    m3_cpu *cpu;
    int rows, q_heads, kv_heads, dim;
    const uint16_t *q, *bk, *bv, *kcache, *vcache;
    const int32_t *pages;
    int64_t p, window;
    float scale;
    uint16_t *out;
    int64_t max_keys;
} draft_job;

/* Key (or value) i of a row: context position lo + i while i < n_ctx, else
 * block row i - n_ctx; KV head g. */
static const uint16_t *key_at(const draft_job *j, int g, int64_t lo, int64_t n_ctx, int64_t i,
                              bool value) {
    if (i < n_ctx) {
        int64_t pos = lo + i;
        return (value ? j->vcache : j->kcache) +
               m3_cache_offset(j->pages[pos / M3_PAGE_TOKENS], pos % M3_PAGE_TOKENS, j->kv_heads,
                               g, j->dim);
    }
    return (value ? j->bv : j->bk) + ((size_t)(i - n_ctx) * j->kv_heads + g) * j->dim;
}

static void draft_chunk(void *ctx, int64_t begin, int64_t end, int thread) {
    const draft_job *j = ctx;
    int D = j->dim, group = j->q_heads / j->kv_heads;
    /* q, one key / value row, the sums (doubles, 8-byte aligned), the scores */
    float *q = j->cpu->thread_buf[thread], *kv = q + D;
    double *acc = (double *)(q + ((2 * D + 1) & ~1));
    float *s = (float *)(acc + D);
    for (int64_t item = begin; item < end; item++) {
        int t = (int)(item / j->q_heads), h = (int)(item % j->q_heads), g = h / group;
        int64_t lo = 0;
        if (j->window > 0 && j->p + t - j->window + 1 > 0)
            lo = j->p + t - j->window + 1;
        if (lo > j->p)
            lo = j->p;
        int64_t n_ctx = j->p - lo, n = n_ctx + j->rows;
        m3_bf16_row_to_f32(j->q + (size_t)item * D, q, D);
        float m = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            m3_bf16_row_to_f32(key_at(j, g, lo, n_ctx, i, false), kv, D);
            s[i] = m3_dot_f32(q, kv, D) * j->scale;
            m = fmaxf(m, s[i]);
        }
        double sum_d = 0;
        for (int64_t i = 0; i < n; i++) {
            s[i] = m3_exp_f32(s[i] - m);
            sum_d += s[i];
        }
        float sum = (float)sum_d;
        memset(acc, 0, (size_t)D * sizeof *acc);
        for (int64_t i = 0; i < n; i++) {
            float pr = s[i] / sum;
            m3_bf16_row_to_f32(key_at(j, g, lo, n_ctx, i, true), kv, D);
            for (int d = 0; d < D; d++)
                acc[d] += (double)pr * (double)kv[d];
        }
        uint16_t *out = j->out + (size_t)item * D;
        for (int d = 0; d < D; d++)
            out[d] = m3_f32_to_bf16((float)acc[d]);
    }
}

m3_status m3_cpu_draft_attention(m3_backend *be, int requests, int rows, int q_heads,
                                 int kv_heads, int dim, const uint16_t *q, const uint16_t *bk,
                                 const uint16_t *bv, const uint16_t *kcache,
                                 const uint16_t *vcache, const int32_t *pages, int max_blocks,
                                 const int64_t *pos, int64_t window, float scale, uint16_t *out) {
    if (requests < 1 || rows < 1 || !pos || max_blocks < 0 || window < 0 || q_heads < 1 ||
        kv_heads < 1 || q_heads % kv_heads)
        return m3_fail(M3_ERR_INVALID_ARG, "draft attention: %d requests of %d rows, a block "
                       "table of %d pages, window %lld, %d / %d heads, positions %s", requests,
                       rows, max_blocks, (long long)window, q_heads, kv_heads,
                       pos ? "given" : "missing");
    m3_cpu *cpu = m3_cpu_of(be);
    size_t q_rows = (size_t)rows * q_heads * dim, kv_rows = (size_t)rows * kv_heads * dim;
    for (int i = 0; i < requests; i++) {
        int64_t p = pos[(size_t)i * rows];
        if (p < 0)
            return m3_fail(M3_ERR_INVALID_ARG, "draft attention: request %d at position %lld",
                           i, (long long)p);
        draft_job j = {cpu, rows, q_heads, kv_heads, dim, q + i * q_rows, bk + i * kv_rows,
                       bv + i * kv_rows, kcache, vcache, pages + (size_t)i * max_blocks,
                       p, window, scale, out + i * q_rows, p + rows};
        M3_TRY(m3_cpu_thread_scratch(cpu, (size_t)dim * 4 + 2 + (size_t)j.max_keys));
        m3_pool_for(cpu->pool, (int64_t)rows * q_heads, 1, draft_chunk, &j);
    }
    return M3_OK;
}

m3_status m3_cpu_draft_argmax(m3_backend *be, int vocab, float *row, const float *bias,
                              int32_t *token) {
    (void)be;
    if (vocab < 1 || !row || !token)
        return m3_fail(M3_ERR_INVALID_ARG, "draft argmax: vocab %d, row and token are required",
                       vocab);
    int32_t best = -1;
    for (int v = 0; v < vocab; v++) {
        if (bias)
            row[v] += bias[v];
        if (!isnan(row[v]) && (best < 0 || row[v] > row[best]))
            best = v;
    }
    *token = best < 0 ? 0 : best; /* every value NaN: token 0 (a draft is a token id) */
    return M3_OK;
}
