/*
 * Row kernels of the CPU backend: the scalar math of SPEC §2.3 and §3 for
 * one row or one head at a time. The ops in the other cpu_*.c files loop
 * these over rows and heads on the worker pool.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/bf16.h"
#include "cpu/cpu.h"

double m3_dot_f64(const float *a, const float *b, int64_t n) {
    /* Accumulated in double and rounded to fp32 once: the products of fp32
     * operands are exact in double, so the result is the correctly rounded
     * fp32 sum whatever the order (see docs/ARCHITECTURE.md, "Precision").
     * Eight lanes vectorise without reordering any single lane's sum. */
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += (double)a[i + j] * (double)b[i + j];
    for (int j = 0; i < n; i++, j++)
        acc[j] += (double)a[i] * (double)b[i];
    for (int w = 4; w >= 1; w /= 2)
        for (int j = 0; j < w; j++)
            acc[j] += acc[j + w];
    return acc[0];
}

float m3_dot_f32(const float *a, const float *b, int64_t n) { return (float)m3_dot_f64(a, b, n); }

void m3_bf16_row_to_f32(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &u, sizeof u);
    }
}

void m3_linear_row_f32(const m3_linear *w, int64_t n, float *dst) {
    int64_t K = w->w.ne[1];
    const char *row = (const char *)w->w.data + n * w->w.nb[0];
    if (w->w.dtype == M3_DT_BF16) {
        m3_bf16_row_to_f32((const uint16_t *)row, dst, K);
        return;
    }
    /* MXFP8: e4m3 element x 2^(s - 127) per 32 columns */
    const uint8_t *q = (const uint8_t *)row;
    const uint8_t *s = (const uint8_t *)w->scale.data + n * w->scale.nb[0];
    for (int64_t b = 0; b < K / 32; b++) {
        float scale = m3_e8m0_to_f32(s[b]);
        for (int j = 0; j < 32; j++)
            dst[b * 32 + j] = m3_e4m3_to_f32(q[b * 32 + j]) * scale;
    }
}

void m3_gemma_norm_f32(const float *x, const uint16_t *w, int64_t dim, float eps, float *y) {
    double ss = 0;
    for (int64_t i = 0; i < dim; i++)
        ss += (double)x[i] * (double)x[i];
    float ms = (float)(ss / (double)dim); /* mean of squares, rounded once */
    float r = 1.0f / sqrtf(ms + eps);
    for (int64_t i = 0; i < dim; i++)
        y[i] = x[i] * r * (1.0f + m3_bf16_to_f32(w[i]));
}

void m3_rope_table(int64_t position, const m3_rope *rope, float *cos_out, float *sin_out) {
    int half = rope->rotary_dim / 2;
    for (int i = 0; i < half; i++) {
        /* in double: at positions near 2^20 an fp32 angle is off by
         * hundredths of a radian (SPEC §2.3) */
        double inv_freq = pow(rope->theta, -(double)(2 * i) / (double)rope->rotary_dim);
        double angle = (double)position * inv_freq;
        cos_out[i] = (float)cos(angle);
        sin_out[i] = (float)sin(angle);
    }
}

void m3_rope_apply(float *x, int rotary_dim, const float *cos_t, const float *sin_t) {
    int half = rotary_dim / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos_t[i] - b * sin_t[i];
        x[i + half] = b * cos_t[i] + a * sin_t[i];
    }
}

float m3_exp_f32(float x) { return (float)exp((double)x); }

float m3_sigmoid_f32(float x) { return 1.0f / (1.0f + m3_exp_f32(-x)); }

float m3_swiglu_oai(float gate, float up, const m3_swiglu *act) {
    /* fminf/fmaxf would turn a NaN input into a number; these comparisons
     * keep it NaN */
    float g = gate > act->limit ? act->limit : gate;
    float u = up > act->limit ? act->limit : up < -act->limit ? -act->limit : up;
    return g * m3_sigmoid_f32(act->alpha * g) * (u + 1.0f);
}

void m3_route_row(const float *logits, const float *bias, int num_experts, int top_k,
                  int32_t *ids, float *weights) {
    /* insertion into a list kept best-first; a strictly greater key moves an
     * expert ahead, so among equal keys the lower id stays first */
    float keys[64];
    int n = 0;
    for (int e = 0; e < num_experts; e++) {
        float s = m3_sigmoid_f32(logits[e]);
        float key = s + (bias ? bias[e] : 0.0f);
        if (isnan(key))
            key = -INFINITY;
        if (n == top_k && !(key > keys[n - 1]))
            continue;
        int pos = n < top_k ? n++ : top_k - 1;
        while (pos > 0 && key > keys[pos - 1]) {
            keys[pos] = keys[pos - 1];
            ids[pos] = ids[pos - 1];
            pos--;
        }
        keys[pos] = key;
        ids[pos] = e;
    }
    float sum = 0;
    for (int i = 0; i < top_k; i++) {
        weights[i] = m3_sigmoid_f32(logits[ids[i]]);
        sum += weights[i];
    }
    for (int i = 0; i < top_k; i++)
        weights[i] /= sum;
}

/* a ranks above b: higher score, NaN lowest, ties to the higher block id */
static int block_better(const float *scores, int32_t a, int32_t b) {
    float sa = scores[a], sb = scores[b];
    bool na = isnan(sa), nb = isnan(sb);
    if (na != nb)
        return nb;
    if (!na && sa != sb)
        return sa > sb;
    return a > b;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void m3_select_row(const float *scores, int nblocks, const m3_select_params *p, int32_t *out,
                   int32_t *cand) {
    int n = 0;
    if (nblocks <= p->topk) {
        for (int b = 0; b < nblocks; b++)
            out[n++] = b;
    } else {
        /* forced: init blocks [0, init) and local blocks [nblocks - local, nblocks) */
        int init_end = p->init_blocks < nblocks ? p->init_blocks : nblocks;
        int local_begin = nblocks - p->local_blocks > 0 ? nblocks - p->local_blocks : 0;
        if (local_begin < init_end)
            local_begin = init_end;
        for (int b = 0; b < init_end; b++)
            out[n++] = b;
        for (int b = local_begin; b < nblocks; b++)
            out[n++] = b;
        /* the best of the rest: a best-first list of at most `room` ids */
        int room = p->topk - n, kept = 0;
        for (int b = init_end; b < local_begin && room > 0; b++) {
            if (kept == room && !block_better(scores, b, cand[kept - 1]))
                continue;
            int pos = kept < room ? kept++ : room - 1;
            while (pos > 0 && block_better(scores, b, cand[pos - 1])) {
                cand[pos] = cand[pos - 1];
                pos--;
            }
            cand[pos] = b;
        }
        for (int i = 0; i < kept; i++)
            out[n++] = cand[i];
        qsort(out, (size_t)n, sizeof *out, cmp_i32);
    }
    for (int i = n; i < p->topk; i++)
        out[i] = -1;
}
