/*
 * Attention on the CPU: cache writes, the indexer's block scores, block
 * selection and paged (dense or block-sparse) attention, SPEC §2.3 steps
 * 4-5 and §3. Rows read the cache through their request's block table;
 * a row at position p sees keys at positions < p + 1.
 */
#include <math.h>
#include <string.h>

#include "cache/cache.h"
#include "core/bf16.h"
#include "core/status.h"
#include "cpu/cpu.h"

static inline size_t cache_offset(int64_t page, int64_t off, int heads, int head, int dim) {
    return m3_cache_offset(page, off, heads, head, dim);
}

m3_status m3_cpu_cache_write(m3_backend *be, int rows, const int64_t *slots, int heads, int dim,
                             const uint16_t *src, int64_t src_stride, uint16_t *cache) {
    for (int t = 0; t < rows; t++) {
        if (slots[t] < 0)
            continue; /* padded row */
        int64_t page = slots[t] / M3_PAGE_TOKENS, off = slots[t] % M3_PAGE_TOKENS;
        for (int h = 0; h < heads; h++)
            memcpy(cache + cache_offset(page, off, heads, h, dim), src + t * src_stride + h * dim,
                   (size_t)dim * sizeof(uint16_t));
    }
    return M3_OK;
}

static inline int64_t row_kv_len(const m3_step *s, int t) { return s->host.positions[t] + 1; }

static inline const int32_t *row_table(const m3_step *s, int t) {
    return s->host.block_table + (int64_t)s->host.row_req[t] * s->max_blocks;
}

/* ------------------------------------------------------------ index scores */

typedef struct score_job {
    m3_cpu *cpu;
    const m3_step *step;
    int heads, dim;
    const uint16_t *iq, *icache;
    float scale;
    float *scores;
} score_job;

static void score_chunk(void *ctx, int64_t begin, int64_t end, int thread) {
    const score_job *j = ctx;
    float *q = j->cpu->thread_buf[thread], *k = q + j->dim;
    for (int64_t item = begin; item < end; item++) {
        int t = (int)(item / j->heads), h = (int)(item % j->heads);
        float *out = j->scores + item * j->step->max_blocks;
        int64_t kv_len = row_kv_len(j->step, t);
        int nblocks = (int)((kv_len + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
        const int32_t *table = row_table(j->step, t);
        m3_bf16_row_to_f32(j->iq + ((int64_t)t * j->heads + h) * j->dim, q, j->dim);
        for (int b = 0; b < j->step->max_blocks; b++) {
            if (j->step->host.slots[t] < 0 || b >= nblocks) {
                out[b] = -INFINITY;
                continue;
            }
            out[b] = m3_index_block_score(q, j->icache, table[b], m3_block_keys(kv_len, b), j->dim,
                                          j->scale, k);
        }
    }
}

float m3_index_block_score(const float *q, const uint16_t *icache, int64_t page, int64_t count,
                           int dim, float scale, float *kbuf) {
    float best = -INFINITY;
    for (int64_t o = 0; o < count; o++) {
        m3_bf16_row_to_f32(icache + cache_offset(page, o, 1, 0, dim), kbuf, dim);
        float d = m3_dot_f32(q, kbuf, dim);
        if (d > best || isnan(d))
            best = d;
        if (isnan(best))
            break; /* NaN wins the max; selection ranks it lowest */
    }
    return best * scale;
}

m3_status m3_cpu_index_scores(m3_backend *be, const m3_step *step, int heads, int dim,
                              const uint16_t *iq, const uint16_t *icache, float scale,
                              float *scores) {
    m3_cpu *cpu = m3_cpu_of(be);
    M3_TRY(m3_cpu_thread_scratch(cpu, (size_t)dim * 2));
    score_job j = {cpu, step, heads, dim, iq, icache, scale, scores};
    m3_pool_for(cpu->pool, (int64_t)step->rows * heads, 1, score_chunk, &j);
    return M3_OK;
}

/* ------------------------------------------------------------ selection */

typedef struct select_job {
    m3_cpu *cpu;
    const m3_step *step;
    int heads;
    const float *scores;
    const m3_select_params *p;
    int32_t *selected;
} select_job;

static void select_chunk(void *ctx, int64_t begin, int64_t end, int thread) {
    const select_job *j = ctx;
    int32_t *cand = (int32_t *)j->cpu->thread_buf[thread];
    for (int64_t item = begin; item < end; item++) {
        int t = (int)(item / j->heads);
        int32_t *out = j->selected + item * j->p->topk;
        if (j->step->host.slots[t] < 0) {
            for (int i = 0; i < j->p->topk; i++)
                out[i] = -1;
            continue;
        }
        int64_t kv_len = row_kv_len(j->step, t);
        int nblocks = (int)((kv_len + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
        m3_select_row(j->scores + item * j->step->max_blocks, nblocks, j->p, out, cand);
    }
}

m3_status m3_cpu_select_blocks(m3_backend *be, const m3_step *step, int heads,
                               const float *scores, const m3_select_params *p,
                               int32_t *selected) {
    m3_cpu *cpu = m3_cpu_of(be);
    M3_TRY(m3_cpu_thread_scratch(cpu, (size_t)p->topk + 1));
    select_job j = {cpu, step, heads, scores, p, selected};
    m3_pool_for(cpu->pool, (int64_t)step->rows * heads, 4, select_chunk, &j);
    return M3_OK;
}

/* ------------------------------------------------------------ attention */

typedef struct attn_job {
    m3_cpu *cpu;
    const m3_step *step;
    int q_heads, kv_heads, dim;
    const uint16_t *q, *kcache, *vcache;
    const int32_t *selected;
    int topk;
    float scale;
    uint16_t *out;
    int64_t max_keys;
} attn_job;

/* Softmax attention of one query head (see cpu.h). */
void m3_attend_head(const float *q, int g, int kv_heads, int dim, const uint16_t *kcache,
                    const uint16_t *vcache, const int32_t *table, const int32_t *blocks,
                    int nblocks, int64_t kv_len, float scale, float *buf, uint16_t *out) {
    float *acc_f = buf, *kv = buf + 2 * dim, *s = buf + 3 * dim; /* acc: dim doubles */
    int64_t n = 0;
    float m = -INFINITY;
    for (int i = 0; i < nblocks; i++) {
        int b = blocks[i];
        int64_t count = m3_block_keys(kv_len, b);
        for (int64_t o = 0; o < count; o++) {
            m3_bf16_row_to_f32(kcache + cache_offset(table[b], o, kv_heads, g, dim), kv, dim);
            s[n] = m3_dot_f32(q, kv, dim) * scale;
            m = fmaxf(m, s[n]);
            n++;
        }
    }
    double sum_d = 0;
    for (int64_t i = 0; i < n; i++) {
        s[i] = m3_exp_f32(s[i] - m);
        sum_d += s[i];
    }
    float sum = (float)sum_d;
    /* normalise the weights first, then mix the values: p = e / sum e,
     * out = sum p v accumulated in double and rounded once */
    double *acc = (double *)acc_f;
    memset(acc, 0, (size_t)dim * sizeof *acc);
    n = 0;
    for (int i = 0; i < nblocks; i++) {
        int b = blocks[i];
        int64_t count = m3_block_keys(kv_len, b);
        for (int64_t o = 0; o < count; o++, n++) {
            float p = s[n] / sum;
            m3_bf16_row_to_f32(vcache + cache_offset(table[b], o, kv_heads, g, dim), kv, dim);
            for (int d = 0; d < dim; d++)
                acc[d] += (double)p * (double)kv[d];
        }
    }
    for (int d = 0; d < dim; d++)
        out[d] = m3_f32_to_bf16((float)acc[d]);
}

static void attn_chunk(void *ctx, int64_t begin, int64_t end, int thread) {
    const attn_job *j = ctx;
    int dim = j->dim, group = j->q_heads / j->kv_heads;
    float *q = j->cpu->thread_buf[thread];
    int32_t *all_blocks = (int32_t *)(q + dim);
    /* keep the double accumulator 8-byte aligned */
    float *buf = q + (dim + j->max_keys / M3_PAGE_TOKENS + 2 + 1) / 2 * 2;
    for (int64_t item = begin; item < end; item++) {
        int t = (int)(item / j->q_heads), h = (int)(item % j->q_heads), g = h / group;
        uint16_t *out = j->out + item * dim;
        if (j->step->host.slots[t] < 0) {
            memset(out, 0, (size_t)dim * sizeof *out);
            continue;
        }
        int64_t kv_len = row_kv_len(j->step, t);
        const int32_t *blocks;
        int nblocks;
        if (j->selected) {
            blocks = j->selected + ((int64_t)t * j->kv_heads + g) * j->topk;
            for (nblocks = 0; nblocks < j->topk && blocks[nblocks] >= 0; nblocks++)
                ;
        } else {
            nblocks = (int)((kv_len + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
            for (int b = 0; b < nblocks; b++)
                all_blocks[b] = b;
            blocks = all_blocks;
        }
        m3_bf16_row_to_f32(j->q + item * dim, q, dim);
        m3_attend_head(q, g, j->kv_heads, dim, j->kcache, j->vcache, row_table(j->step, t), blocks,
                       nblocks, kv_len, j->scale, buf, out);
    }
}

m3_status m3_cpu_attention(m3_backend *be, const m3_step *step, int q_heads, int kv_heads,
                           int dim, const uint16_t *q, const uint16_t *kcache,
                           const uint16_t *vcache, const int32_t *selected, int topk, float scale,
                           uint16_t *out) {
    m3_cpu *cpu = m3_cpu_of(be);
    int64_t max_keys = 0;
    for (int t = 0; t < step->rows; t++)
        if (row_kv_len(step, t) > max_keys)
            max_keys = row_kv_len(step, t);
    if (selected && (int64_t)topk * M3_PAGE_TOKENS < max_keys)
        max_keys = (int64_t)topk * M3_PAGE_TOKENS;
    max_keys = (max_keys + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS * M3_PAGE_TOKENS;
    /* q, block ids, output accumulator (doubles), one key, the scores */
    size_t floats = (size_t)dim * 5 + 4 + (size_t)(max_keys / M3_PAGE_TOKENS + 2) + (size_t)max_keys;
    M3_TRY(m3_cpu_thread_scratch(cpu, floats));
    attn_job j = {cpu, step, q_heads, kv_heads, dim, q, kcache, vcache,
                  selected, topk, scale, out, max_keys};
    m3_pool_for(cpu->pool, (int64_t)step->rows * q_heads, 1, attn_chunk, &j);
    return M3_OK;
}
