/*
 * Matrix products of the CPU backend: out[t, n] = sum_k x[t, k] w[n, k].
 * Work is split over the weight's rows (each output element belongs to one
 * chunk, so the schedule never changes a bit); a chunk widens four weight
 * rows to fp32 at a time and reuses them for every activation row, so each
 * weight byte is read once per call whatever the row count.
 */
#include <string.h>

#include "core/bf16.h"
#include "core/status.h"
#include "cpu/cpu.h"

#define ROWS_PER_PASS 4

typedef struct linear_job {
    m3_cpu *cpu;
    int rows;
    int64_t K, N;
    const float *x;      /* [rows, K] fp32 */
    const m3_linear *w;  /* bf16 / MXFP8 weights */
    const float *wf32;   /* or fp32 weights [N, K] */
    m3_dtype out_dtype;
    void *out;           /* [rows, N] */
} linear_job;

static void store(const linear_job *j, int t, int64_t n, const float *x, const float *w) {
    int64_t i = (int64_t)t * j->N + n;
    if (j->out_dtype == M3_DT_F64)
        ((double *)j->out)[i] = m3_dot_f64(x, w, j->K);
    else if (j->out_dtype == M3_DT_BF16)
        ((uint16_t *)j->out)[i] = m3_f32_to_bf16(m3_dot_f32(x, w, j->K));
    else
        ((float *)j->out)[i] = m3_dot_f32(x, w, j->K);
}

static void linear_chunk(void *ctx, int64_t begin, int64_t end, int thread) {
    const linear_job *j = ctx;
    float *wrow = j->cpu->thread_buf[thread]; /* [ROWS_PER_PASS, K] */
    for (int64_t n0 = begin; n0 < end; n0 += ROWS_PER_PASS) {
        int nr = end - n0 < ROWS_PER_PASS ? (int)(end - n0) : ROWS_PER_PASS;
        const float *wr[ROWS_PER_PASS];
        for (int r = 0; r < nr; r++) {
            if (j->wf32) {
                wr[r] = j->wf32 + (n0 + r) * j->K;
            } else {
                m3_linear_row_f32(j->w, n0 + r, wrow + r * j->K);
                wr[r] = wrow + r * j->K;
            }
        }
        for (int t = 0; t < j->rows; t++) {
            const float *xt = j->x + (int64_t)t * j->K;
            for (int r = 0; r < nr; r++)
                store(j, t, n0 + r, xt, wr[r]);
        }
    }
}

typedef struct widen_job {
    const uint16_t *src;
    float *dst;
} widen_job;

static void widen_chunk(void *ctx, int64_t begin, int64_t end, int thread) {
    const widen_job *j = ctx;
    m3_bf16_row_to_f32(j->src + begin, j->dst + begin, end - begin);
}

/* x (bf16) widened into the op scratch. */
static m3_status widen_x(m3_cpu *cpu, int rows, int64_t K, const uint16_t *x, float **out) {
    void *buf;
    M3_TRY(m3_cpu_scratch(cpu, M3_SCRATCH_WIDEN, (size_t)rows * (size_t)K * sizeof(float), &buf));
    widen_job wj = {x, buf};
    m3_pool_for(cpu->pool, (int64_t)rows * K, 1 << 14, widen_chunk, &wj);
    *out = buf;
    return M3_OK;
}

static void run_linear(linear_job *j) {
    /* enough rows per chunk to amortise widening, and chunks for all threads */
    m3_pool_for(j->cpu->pool, j->N, ROWS_PER_PASS * 2, linear_chunk, j);
}

m3_status m3_cpu_linear(m3_backend *be, int rows, const uint16_t *x, const m3_linear *w,
                        m3_dtype out_dtype, void *out) {
    m3_cpu *cpu = m3_cpu_of(be);
    int64_t N = w->w.ne[0], K = w->w.ne[1];
    if (rows <= 0)
        return M3_OK;
    if (w->w.dtype != M3_DT_BF16 && w->w.dtype != M3_DT_F8_E4M3)
        return m3_fail(M3_ERR_INTERNAL, "linear: weight %s has dtype %s",
                       w->w.name ? w->w.name : "?", m3_dtype_name(w->w.dtype));
    if (out_dtype != M3_DT_BF16 && out_dtype != M3_DT_F32 && out_dtype != M3_DT_F64)
        return m3_fail(M3_ERR_INTERNAL, "linear: output dtype %s", m3_dtype_name(out_dtype));
    M3_TRY(m3_cpu_thread_scratch(cpu, (size_t)ROWS_PER_PASS * (size_t)K));
    float *xf;
    M3_TRY(widen_x(cpu, rows, K, x, &xf));
    linear_job j = {cpu, rows, K, N, xf, w, NULL, out_dtype, out};
    run_linear(&j);
    return M3_OK;
}

m3_status m3_cpu_linear_f32w(m3_cpu *cpu, int rows, const uint16_t *x, const m3_tensor *w,
                             float *out) {
    int64_t N = w->ne[0], K = w->ne[1];
    if (rows <= 0)
        return M3_OK;
    float *xf;
    M3_TRY(widen_x(cpu, rows, K, x, &xf));
    linear_job j = {cpu, rows, K, N, xf, NULL, (const float *)w->data, M3_DT_F32, out};
    run_linear(&j);
    return M3_OK;
}
