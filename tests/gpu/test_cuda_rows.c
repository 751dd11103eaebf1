/*
 * Row-count invariance of the CUDA ops a decode row passes through whose
 * work is cut by the step's shape: the linear (its MMA kernel) and the
 * attention (its key splits). Up to the backend's exact_rows (16; 32 or 64
 * with M3_LINEAR_MMA_ROWS) a row's outputs must be the same bits whatever
 * the step's row count, because a speculative verify step of several
 * requests must give each row the tokens of a plain decode step
 * (spec/speculate.c verifies in steps of at most exact_rows rows). The
 * other ops work a row (or a block, a head) at a time in one order, which
 * test_cuda_ops.c's CPU comparisons cover.
 *
 * Each case runs R = max(16, exact_rows) rows once as the reference, then
 * the first rows of the same inputs (for attention, the first whole
 * requests: a step's prefix of requests is a step), and demands equal bits
 * (mismatching elements are counted; any fails). The reference run is also
 * checked against the CPU backend, so equal garbage cannot pass. Outputs
 * are poisoned first and guard bytes checked, as in test_cuda_ops.c.
 *
 * Without a usable CUDA device the program prints "SKIP: no CUDA device:
 * <reason>" and exits 77, which ctest counts as skipped.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/bf16.h"
#include "core/tensor.h"
#include "decode/step.h"
#include "gpu_common.h"
#include "m3.h"

#include "ops_harness.h"

/* the rows of the reference run: every count up to exact_rows is covered */
static int ref_rows(void) { return g_gpu->exact_rows > 16 ? g_gpu->exact_rows : 16; }

/* ------------------------------------------------------------ linear */

/* Decode row counts: row i's fp32 sums are the same bits whatever the
 * step's row count (1-16, or the backend's exact_rows where
 * M3_LINEAR_MMA_ROWS raises it to 32 or 64), as a speculative verify step
 * must give the tokens of plain decode steps (1 row). The reference is the
 * run of that many rows; each count runs the first rows of the same x. */
static void linear_rows_invariance(const m3_linear *hw, const m3_linear *dw) {
    static const int counts[] = {1, 3, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48};
    const int R = ref_rows();
    int64_t N = hw->w.ne[0], K = hw->w.ne[1];
    uint16_t *x = rand_bf16(R * K, 1.0f), *dx = dev_from(x, (size_t)(R * K) * 2);
    void *d16 = dev_buf(NULL, (size_t)R * N * 4);
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d N %lld K %lld %s->f32", R, (long long)N,
             (long long)K, hw->w.dtype == M3_DT_BF16 ? "bf16" : "mxfp8");
    m3_status st = gpu_done(g_gpu->ops->linear(g_gpu, R, dx, dw, M3_DT_F32, d16));
    if (st) {
        report_error("linear rows", shape, st);
        return;
    }
    bool guard;
    float *ref = dev_fetch(d16, (size_t)R * N * 4, &guard);
    float *cpu = halloc((size_t)R * N * 4);
    cpu_must(g_cpu->ops->linear(g_cpu, R, x, hw, M3_DT_F32, cpu), "CPU linear");
    cmp cc = gpu_compare_f32(ref, cpu, (int64_t)R * N);
    report("linear rows", shape, &cc, TOL_F32, guard, " (wrote past the end)");
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
        int rows = counts[i];
        if (rows >= R)
            break;
        snprintf(shape, sizeof shape, "rows %d vs %d, N %lld K %lld %s->f32, bits", rows, R,
                 (long long)N, (long long)K, hw->w.dtype == M3_DT_BF16 ? "bf16" : "mxfp8");
        void *d = dev_buf(NULL, (size_t)rows * N * 4);
        st = gpu_done(g_gpu->ops->linear(g_gpu, rows, dx, dw, M3_DT_F32, d));
        if (st) {
            report_error("linear rows", shape, st);
            continue;
        }
        float *got = dev_fetch(d, (size_t)rows * N * 4, &guard);
        cmp c = gpu_compare_f32(got, ref, (int64_t)rows * N);
        report("linear rows", shape, &c, EXACT, guard, " (wrote past the end)");
    }
    /* the weight's first Nv rows as a weight of their own (a TP rank's
     * column slice): fewer tiles, so another launch shape, the same bits */
    const int64_t Nv = N < 264 ? N : 264;
    m3_linear v = *dw;
    v.w.ne[0] = Nv;
    if (v.scale.data)
        v.scale.ne[0] = Nv;
    snprintf(shape, sizeof shape, "rows 16, N %lld of %lld K %lld %s->f32, bits", (long long)Nv,
             (long long)N, (long long)K, hw->w.dtype == M3_DT_BF16 ? "bf16" : "mxfp8");
    void *dv = dev_buf(NULL, (size_t)16 * Nv * 4);
    st = gpu_done(g_gpu->ops->linear(g_gpu, 16, dx, &v, M3_DT_F32, dv));
    if (st) {
        report_error("linear rows", shape, st);
        return;
    }
    float *got = dev_fetch(dv, (size_t)16 * Nv * 4, &guard), *want = halloc((size_t)16 * Nv * 4);
    for (int t = 0; t < 16; t++)
        memcpy(want + t * Nv, ref + t * N, (size_t)Nv * 4);
    cmp c = gpu_compare_f32(got, want, 16 * Nv);
    report("linear rows", shape, &c, EXACT, guard, " (wrote past the end)");
}


static void test_linear_rows(void) {
    /* the shapes of test_cuda_ops.c's vector-path linears, and 8,456 rows:
     * 529 wide CTAs, more than two waves of two a multiprocessor on an H100
     * or H200, the last tile half past the weight */
    static const struct {
        int64_t N, K;
        bool fp8;
    } shapes[] = {{520, 1024, false}, {264, 6144, false}, {4104, 1024, false},
                  {4104, 768, false}, {4104, 1024, true}, {520, 1024, true},
                  {264, 6144, true},  {77, 96, true},     {8456, 1024, false},
                  {8456, 1024, true}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        m3_linear hw = make_linear(shapes[i].N, shapes[i].K, shapes[i].fp8, 1.0f);
        m3_linear dw = linear_to_gpu(&hw);
        linear_rows_invariance(&hw, &dw);
        release_all();
    }
}

/* ------------------------------------------------------------ attention */

/* R / ql rows of requests of ql rows each (1: decode; 8: a verify step of
 * a 7-token draft block), contexts of up to ~6K tokens; the first c
 * requests' rows run alone must give the reference's bits. */
static void attn_rows_invariance(const attn_shape *a, int ql_each) {
    const int R = ref_rows(), n_reqs = R / ql_each;
    int lens[64], ql[64];
    for (int r = 0; r < n_reqs; r++) {
        lens[r] = ql_each + rng_below(a->max_blocks * PAGE - ql_each);
        ql[r] = ql_each;
    }
    pstep s;
    pstep_build(&s, n_reqs, lens, ql, 0, a->max_blocks, pages_for(n_reqs, lens, 2));
    const m3_step *st = &s.cpu;
    uint16_t *kc = make_cache(st, a->kv_heads, a->dim, 1.0f);
    uint16_t *vc = make_cache(st, a->kv_heads, a->dim, 1.0f);
    const int64_t row_elems = (int64_t)a->q_heads * a->dim;
    int64_t n = st->rows * row_elems, cn = st->n_pages * a->kv_heads * PAGE * a->dim;
    uint16_t *q = rand_bf16(n, 2.0f), *cpu = halloc((size_t)n * 2);
    int32_t *sel = a->topk ? make_selection(st, a->kv_heads, a->topk) : NULL;
    float scale = (float)(1.0 / sqrt((double)a->dim));
    char shape[112];
    snprintf(shape, sizeof shape, "%s dim %d, %d reqs x %d rows, %d/%d heads", 
             a->topk ? "sparse" : "dense", a->dim, n_reqs, ql_each, a->q_heads, a->kv_heads);
    cpu_must(g_cpu->ops->attention(g_cpu, st, a->q_heads, a->kv_heads, a->dim, q, kc, vc, sel,
                                   a->topk, scale, cpu),
             "CPU attention");
    void *dsel = sel ? dev_from(sel, (size_t)st->rows * a->kv_heads * a->topk * 4) : NULL;
    void *dq = dev_from(q, (size_t)n * 2), *dk = dev_from(kc, (size_t)cn * 2);
    void *dv = dev_from(vc, (size_t)cn * 2), *out = dev_buf(NULL, (size_t)n * 2);
    m3_status e = gpu_done(g_gpu->ops->attention(g_gpu, &s.gpu, a->q_heads, a->kv_heads, a->dim,
                                                 dq, dk, dv, dsel, a->topk, scale, out));
    if (e) {
        report_error("attention rows", shape, e);
        release_all();
        return;
    }
    bool guard;
    uint16_t *ref = dev_fetch(out, (size_t)n * 2, &guard);
    cmp c = compare_bf16(ref, cpu, n);
    report("attention rows", shape, &c, TOL_BF16, guard, " (wrote past the end)");
    const int counts[] = {1, 2, 3, n_reqs / 2, n_reqs / 2 + 1, n_reqs - 1};
    int last = 0;
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
        int reqs = counts[i];
        if (reqs <= last || reqs >= n_reqs)
            continue;
        last = reqs;
        m3_step sub = s.gpu; /* the first reqs requests: every array a prefix */
        sub.rows = reqs * ql_each;
        sub.n_reqs = reqs;
        sub.n_prefill = ql_each > 1 ? reqs : 0;
        sub.n_decode = ql_each > 1 ? 0 : reqs;
        sub.max_query_len = ql_each;
        int64_t m = sub.rows * row_elems;
        void *o = dev_buf(NULL, (size_t)m * 2);
        char what[160];
        snprintf(what, sizeof what, "%s: the first %d rows, bits", shape, sub.rows);
        e = gpu_done(g_gpu->ops->attention(g_gpu, &sub, a->q_heads, a->kv_heads, a->dim, dq, dk,
                                           dv, dsel, a->topk, scale, o));
        if (e) {
            report_error("attention rows", what, e);
            continue;
        }
        uint16_t *got = dev_fetch(o, (size_t)m * 2, &guard);
        c = compare_bf16(got, ref, m);
        report("attention rows", what, &c, EXACT, guard, " (wrote past the end)");
    }
    release_all();
}

static void test_attention_rows(void) {
    for (int dim = 128; dim >= 64; dim /= 2)
        for (int sparse = 0; sparse < 2; sparse++) {
            /* 48 blocks: a row's keys split many ways, as at long contexts */
            attn_shape a = {32, 2, dim, sparse ? 16 : 0, 48};
            attn_rows_invariance(&a, 1);
            attn_rows_invariance(&a, 8);
        }
    /* the M3 rank shape: 16 query heads on one KV head */
    attn_shape rank = {16, 1, 128, 16, 48};
    attn_rows_invariance(&rank, 1);
    attn_rows_invariance(&rank, 8);
}

/* ------------------------------------------------------------ main */

int main(void) {
    int rc = harness_open("test_cuda_rows", 0x5eed0b75ull);
    if (rc >= 0)
        return rc;
    printf("test_cuda_rows: exact rows %d\n", g_gpu->exact_rows);
    test_linear_rows();
    test_attention_rows();
    return harness_close("test_cuda_rows");
}
