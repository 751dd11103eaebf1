/*
 * The CPU backend: the reference implementation of every op in
 * backend/backend.h, threaded over a worker pool. Memory is host memory;
 * weights are the mmap'd views themselves (no copy). This file holds the
 * backend table, memory, scratch, and the elementwise and per-row ops;
 * matrix products, attention and MoE live in their own cpu_*.c files.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/bf16.h"
#include "core/status.h"
#include "cpu/cpu.h"

/* ------------------------------------------------------------ memory */

static m3_status cpu_alloc(m3_backend *be, size_t bytes, void **ptr) {
    /* 64-byte alignment: whole cache lines, and vector loads never split */
    size_t rounded = (bytes + 63) / 64 * 64;
    *ptr = aligned_alloc(64, rounded ? rounded : 64);
    if (!*ptr)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory allocating %zu bytes", bytes);
    return M3_OK;
}

static void cpu_release(m3_backend *be, void *ptr) { free(ptr); }

static m3_status cpu_copy(m3_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes)
        memmove(dst, src, bytes);
    return M3_OK;
}

static m3_status cpu_sync(m3_backend *be) { return M3_OK; }

static m3_status cpu_load_weights(m3_backend *be, const m3_config *cfg, const m3_weights *host,
                                  m3_weights *out) {
    *out = *host; /* the mmap'd views are the CPU's weights */
    return M3_OK;
}

static void cpu_unload_weights(m3_backend *be, const m3_config *cfg, m3_weights *w) {
    memset(w, 0, sizeof *w);
}

m3_status m3_cpu_thread_scratch(m3_cpu *cpu, size_t floats) {
    if (floats <= cpu->thread_buf_floats)
        return M3_OK;
    floats = floats + floats / 2;
    for (int i = 0; i < cpu->n_threads; i++) {
        free(cpu->thread_buf[i]);
        cpu->thread_buf[i] = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!cpu->thread_buf[i]) {
            cpu->thread_buf_floats = 0;
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory for %zu floats of thread scratch",
                           floats);
        }
    }
    cpu->thread_buf_floats = floats;
    return M3_OK;
}

m3_status m3_cpu_scratch(m3_cpu *cpu, int slot, size_t bytes, void **out) {
    if (bytes > cpu->scratch_bytes[slot]) {
        size_t want = bytes + bytes / 2;
        free(cpu->scratch[slot]);
        cpu->scratch[slot] = aligned_alloc(64, (want + 63) / 64 * 64);
        cpu->scratch_bytes[slot] = cpu->scratch[slot] ? want : 0;
        if (!cpu->scratch[slot])
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory for %zu bytes of scratch", bytes);
    }
    *out = cpu->scratch[slot];
    return M3_OK;
}

/* ------------------------------------------------------------ simple ops */

static m3_status cpu_embed(m3_backend *be, int rows, const int32_t *tokens,
                           const m3_tensor *table, int64_t vocab_start, uint16_t *out) {
    int64_t H = table->ne[1];
    for (int t = 0; t < rows; t++) {
        int64_t i = (int64_t)tokens[t] - vocab_start;
        if (i >= 0 && i < table->ne[0])
            memcpy(out + t * H, (const char *)table->data + i * table->nb[0],
                   (size_t)H * sizeof *out);
        else /* another rank's slice of the vocabulary */
            memset(out + t * H, 0, (size_t)H * sizeof *out);
    }
    return M3_OK;
}

static m3_status cpu_round_bf16(m3_backend *be, int64_t n, m3_dtype in_dtype, const void *in,
                                uint16_t *out) {
    if (in_dtype != M3_DT_F32 && in_dtype != M3_DT_F64)
        return m3_fail(M3_ERR_INTERNAL, "round_bf16: input dtype %s", m3_dtype_name(in_dtype));
    for (int64_t i = 0; i < n; i++)
        out[i] = m3_f32_to_bf16(in_dtype == M3_DT_F64 ? (float)((const double *)in)[i]
                                                      : ((const float *)in)[i]);
    return M3_OK;
}

static m3_status cpu_gather_rows(m3_backend *be, int n, const int32_t *idx, int dim,
                                 const uint16_t *src, uint16_t *dst) {
    for (int i = 0; i < n; i++)
        memmove(dst + (int64_t)i * dim, src + (int64_t)idx[i] * dim, (size_t)dim * sizeof *dst);
    return M3_OK;
}

static m3_status cpu_add_rows(m3_backend *be, int rows, int dim, const uint16_t *a,
                              const uint16_t *b, int64_t out_stride, uint16_t *out) {
    (void)be;
    if (rows > 0 && out_stride < dim)
        return m3_fail(M3_ERR_INTERNAL, "add_rows: out_stride %lld is below the row width %d",
                       (long long)out_stride, dim);
    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dim; i++) {
            int64_t k = (int64_t)t * dim + i;
            out[(int64_t)t * out_stride + i] =
                m3_f32_to_bf16(m3_bf16_to_f32(a[k]) + m3_bf16_to_f32(b[k]));
        }
    return M3_OK;
}

typedef struct norm_job {
    m3_cpu *cpu;
    int dim;
    const uint16_t *add;
    uint16_t *residual;
    const uint16_t *w;
    float eps;
    uint16_t *out;
} norm_job;

void m3_add_norm_row(const uint16_t *add, uint16_t *res, const uint16_t *w, int dim, float eps,
                     float *scratch, uint16_t *out, float *out_f32) {
    float *x = scratch, *y = x + dim;
    for (int i = 0; i < dim; i++) {
        float v = m3_bf16_to_f32(res[i]);
        if (add) { /* the residual is a rounding point */
            v = m3_round_bf16(m3_bf16_to_f32(add[i]) + v);
            res[i] = m3_f32_to_bf16(v);
        }
        x[i] = v;
    }
    m3_gemma_norm_f32(x, w, dim, eps, y);
    for (int i = 0; i < dim; i++) {
        uint16_t b = m3_f32_to_bf16(y[i]);
        if (out)
            out[i] = b;
        if (out_f32)
            out_f32[i] = m3_bf16_to_f32(b);
    }
}

static void norm_rows(void *ctx, int64_t begin, int64_t end, int thread) {
    const norm_job *j = ctx;
    for (int64_t t = begin; t < end; t++)
        m3_add_norm_row(j->add ? j->add + t * j->dim : NULL, j->residual + t * j->dim, j->w, j->dim,
                        j->eps, j->cpu->thread_buf[thread], j->out + t * j->dim, NULL);
}

static m3_status cpu_add_rmsnorm(m3_backend *be, int rows, int dim, const uint16_t *add,
                                 uint16_t *residual, const m3_tensor *w, float eps,
                                 uint16_t *out) {
    m3_cpu *cpu = m3_cpu_of(be);
    M3_TRY(m3_cpu_thread_scratch(cpu, (size_t)dim * 2));
    norm_job j = {cpu, dim, add, residual, w->data, eps, out};
    m3_pool_for(cpu->pool, rows, 1, norm_rows, &j);
    return M3_OK;
}

typedef struct rope_job {
    m3_cpu *cpu;
    int heads, dim;
    uint16_t *x;
    int64_t row_stride;
    const uint16_t *w;
    float eps;
    const int64_t *positions;
    const m3_rope *rope;
} rope_job;

void m3_head_norm_rope_row(uint16_t *head, const uint16_t *w, int dim, float eps, int rotary_dim,
                           const float *cos_t, const float *sin_t, float *scratch) {
    float *x = scratch, *y = x + dim;
    m3_bf16_row_to_f32(head, x, dim);
    m3_gemma_norm_f32(x, w, dim, eps, y);
    m3_rope_apply(y, rotary_dim, cos_t, sin_t);
    for (int i = 0; i < dim; i++) /* one rounding for norm + RoPE */
        head[i] = m3_f32_to_bf16(y[i]);
}

static void rope_rows(void *ctx, int64_t begin, int64_t end, int thread) {
    const rope_job *j = ctx;
    float *cos_t = j->cpu->thread_buf[thread], *sin_t = cos_t + j->dim;
    float *x = sin_t + j->dim;
    for (int64_t t = begin; t < end; t++) {
        m3_rope_table(j->positions[t], j->rope, cos_t, sin_t);
        for (int h = 0; h < j->heads; h++)
            m3_head_norm_rope_row(j->x + t * j->row_stride + (int64_t)h * j->dim, j->w, j->dim,
                                  j->eps, j->rope->rotary_dim, cos_t, sin_t, x);
    }
}

static m3_status cpu_head_norm_rope(m3_backend *be, int rows, int heads, int dim, uint16_t *x,
                                    int64_t row_stride, const m3_tensor *w, float eps,
                                    const int64_t *positions, const m3_rope *rope) {
    m3_cpu *cpu = m3_cpu_of(be);
    M3_TRY(m3_cpu_thread_scratch(cpu, (size_t)dim * 4));
    rope_job j = {cpu, heads, dim, x, row_stride, w->data, eps, positions, rope};
    m3_pool_for(cpu->pool, rows, 1, rope_rows, &j);
    return M3_OK;
}

typedef struct swiglu_job {
    const uint16_t *gate, *up;
    const m3_swiglu *act;
    uint16_t *out;
} swiglu_job;

static void swiglu_range(void *ctx, int64_t begin, int64_t end, int thread) {
    const swiglu_job *j = ctx;
    for (int64_t i = begin; i < end; i++)
        j->out[i] = m3_f32_to_bf16(
            m3_swiglu_oai(m3_bf16_to_f32(j->gate[i]), m3_bf16_to_f32(j->up[i]), j->act));
}

m3_status m3_cpu_swiglu(m3_backend *be, int64_t n, const uint16_t *gate, const uint16_t *up,
                        const m3_swiglu *act, uint16_t *out) {
    swiglu_job j = {gate, up, act, out};
    m3_pool_for(m3_cpu_of(be)->pool, n, 1 << 14, swiglu_range, &j);
    return M3_OK;
}

/* ------------------------------------------------------------ the table */

static void cpu_destroy(m3_backend *be) {
    if (!be)
        return;
    m3_cpu *cpu = be->impl;
    if (cpu) {
        for (int i = 0; cpu->thread_buf && i < cpu->n_threads; i++)
            free(cpu->thread_buf[i]);
        free(cpu->thread_buf);
        for (int i = 0; i < 4; i++)
            free(cpu->scratch[i]);
        m3_pool_free(cpu->pool);
        free(cpu);
    }
    free(be);
}

static const m3_backend_ops cpu_ops = {
    .name = "cpu",
    .host_memory = true,
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
    .load_weights = cpu_load_weights,
    .unload_weights = cpu_unload_weights,
    .embed = cpu_embed,
    .round_bf16 = cpu_round_bf16,
    .gather_rows = cpu_gather_rows,
    .add_rows = cpu_add_rows,
    .add_rmsnorm = cpu_add_rmsnorm,
    .linear = m3_cpu_linear,
    .head_norm_rope = cpu_head_norm_rope,
    .cache_write = m3_cpu_cache_write,
    .index_scores = m3_cpu_index_scores,
    .select_blocks = m3_cpu_select_blocks,
    .attention = m3_cpu_attention,
    .draft_attention = m3_cpu_draft_attention,
    .draft_argmax = m3_cpu_draft_argmax,
    .swiglu = m3_cpu_swiglu,
    .moe = m3_cpu_moe,
};

m3_status m3_cpu_backend_create(int n_threads, m3_backend **out) {
    *out = NULL;
    m3_backend *be = calloc(1, sizeof *be);
    m3_cpu *cpu = calloc(1, sizeof *cpu);
    if (!be || !cpu) {
        free(be);
        free(cpu);
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating the CPU backend");
    }
    be->ops = &cpu_ops;
    be->impl = cpu;
    m3_status st = m3_pool_create(n_threads, &cpu->pool);
    if (!st) {
        cpu->n_threads = m3_pool_size(cpu->pool);
        cpu->thread_buf = calloc((size_t)cpu->n_threads, sizeof *cpu->thread_buf);
        if (!cpu->thread_buf)
            st = m3_fail(M3_ERR_NO_MEMORY, "out of memory creating the CPU backend");
    }
    if (st) {
        cpu_destroy(be);
        return st;
    }
    *out = be;
    return M3_OK;
}
