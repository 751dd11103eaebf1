/*
 * GPU-vs-CPU tests of every op in the backend table (backend/backend.h),
 * SPEC §8: the CPU backend is the reference, and each CUDA op must agree
 * with it on fresh random inputs. Per case: seeded inputs (bf16 values of
 * order one, never zero; M3_TEST_SEED varies them), the CPU op run on host
 * copies, the same bytes uploaded to the GPU, the GPU output poisoned with
 * NaN bit patterns (and GUARD more poisoned bytes past its end), the CUDA op
 * run and synchronised (so an asynchronous fault is charged to it), the
 * output downloaded and compared.
 *
 * Verdicts, one line per case (op, shape, max abs error, relative L2 error,
 * mismatching elements, PASS/FAIL), then a per-op summary table; the exit
 * status is 1 on any failure:
 *   - bf16 outputs of math done in a different order (norms, projections,
 *     RoPE, attention, SwiGLU, MoE): relative L2 <= 1e-2 (TOL_BF16).
 *   - fp32 outputs of the linear op: relative L2 <= 1e-5 (TOL_F32: the
 *     same products summed in another order); linear_group's outputs
 *     bitwise those of each linear alone. (That a decode row's linear and
 *     attention outputs do not depend on the step's row count is
 *     test_cuda_rows.c's.)
 *   - copies (embed, gather_rows, cache_write) and one bf16 addition (the
 *     add_rmsnorm residual, add_rows): bit-exact.
 *   - index scores: both sides accumulate in fp64 and round once, so they
 *     must be equal element for element; mismatches are counted.
 *   - block selections (given the same scores) and greedy tokens: exact.
 *   - NaN never passes: a NaN or inf where the reference is finite (or the
 *     other way round) fails whatever the error norm; the guard bytes past
 *     every output must still hold the poison.
 * Outputs of padded rows (negative slot) are ignored, as the caller ignores
 * them; padded rows must not write the cache. MoE rows whose expert choice
 * is a near-tie (key gap < 1e-4) are drawn again: the GPU's fp32 router may
 * break such a tie the other way, which is not an error of any kernel.
 *
 * Shapes: decode row counts 1..16, prefill chunks of 100-300 rows, and the
 * `tiny` / `small` presets' layers over a whole 700-token prompt (the
 * shapes test_cuda_model.c runs end to end).
 *
 * Step metadata: the GPU's m3_step carries its arrays in device memory
 * (dev) and, in host, decoy arrays (every row padded, position 0), because
 * cuda/cuda_internal.h requires ops to read dev only (graph replays change
 * the values behind a captured step): an op that reads host fails here.
 *
 * Without a usable CUDA device the program prints "SKIP: no CUDA device:
 * <reason>" and exits 77, which ctest counts as skipped.
 *
 * The harness (inputs, poisoned outputs, comparisons, the summary, step
 * metadata) is in ops_harness.h; this file holds the cases.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "core/bf16.h"
#include "core/tensor.h"
#include "decode/step.h"
#include "gpu_common.h"
#include "m3.h"

#include "ops_harness.h"

/* ------------------------------------------------------------ embed, gather */

static void embed_case(int V, int H, int rows) {
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d V %d H %d", rows, V, H);
    int64_t ne[2] = {V, H}, n = (int64_t)rows * H;
    uint16_t *table = rand_bf16((int64_t)V * H, 1.0f), *ref = halloc((size_t)n * 2);
    int32_t *tok = halloc((size_t)rows * 4);
    for (int t = 0; t < rows; t++) /* both ends of the table, repeats */
        tok[t] = t == 0 ? V - 1 : t == 1 ? 0 : rng_below(V);
    m3_tensor tc = m3_tensor_make(M3_DT_BF16, 2, ne, table);
    cpu_must(g_cpu->ops->embed(g_cpu, rows, tok, &tc, 0, ref), "CPU embed");
    m3_tensor tg = m3_tensor_make(M3_DT_BF16, 2, ne, dev_from(table, (size_t)V * H * 2));
    void *out = dev_buf(NULL, (size_t)n * 2);
    m3_status st = gpu_done(g_gpu->ops->embed(g_gpu, rows, dev_from(tok, (size_t)rows * 4), &tg, 0, out));
    report_bf16_out("embed", shape, st, out, ref, n, EXACT);
    release_all();
}

static void gather_case(int n_src, int dim, int n) {
    char shape[96];
    snprintf(shape, sizeof shape, "n %d of %d rows, dim %d", n, n_src, dim);
    uint16_t *src = rand_bf16((int64_t)n_src * dim, 1.0f), *ref = halloc((size_t)n * dim * 2);
    int32_t *idx = halloc((size_t)n * 4);
    for (int i = 0; i < n; i++) /* repeats and out-of-order rows */
        idx[i] = i == 0 ? n_src - 1 : rng_below(n_src);
    cpu_must(g_cpu->ops->gather_rows(g_cpu, n, idx, dim, src, ref), "CPU gather_rows");
    void *out = dev_buf(NULL, (size_t)n * dim * 2);
    m3_status st = gpu_done(g_gpu->ops->gather_rows(g_gpu, n, dev_from(idx, (size_t)n * 4), dim,
                                                    dev_from(src, (size_t)n_src * dim * 2), out));
    report_bf16_out("gather_rows", shape, st, out, ref, (int64_t)n * dim, EXACT);
    release_all();
}

/* add_rows into a slice of wider rows (a layer tap's place in the
 * drafter's context row): each row's dim values poisoned first, the rest
 * of the row random and left as it was */
static void add_rows_case(int rows, int dim, int64_t stride, int64_t offset) {
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d dim %d stride %lld at %lld", rows, dim,
             (long long)stride, (long long)offset);
    int64_t n = (int64_t)rows * dim, n_out = (int64_t)rows * stride;
    uint16_t *a = rand_bf16(n, 1.0f), *b = rand_bf16(n, 1.0f);
    uint16_t *ref = rand_bf16(n_out, 1.0f);
    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dim; i++)
            ref[t * stride + offset + i] = BF16_NAN;
    uint16_t *prev = hdup(ref, (size_t)n_out * 2);
    cpu_must(g_cpu->ops->add_rows(g_cpu, rows, dim, a, b, stride, ref + offset), "CPU add_rows");
    uint16_t *out = dev_buf(prev, (size_t)n_out * 2);
    m3_status st = gpu_done(g_gpu->ops->add_rows(g_gpu, rows, dim, dev_from(a, (size_t)n * 2),
                                                 dev_from(b, (size_t)n * 2), stride, out + offset));
    report_bf16_out("add_rows", shape, st, out, ref, n_out, EXACT);
    release_all();
}

static void test_embed_gather(void) {
    embed_case(1000, 1024, 1);
    embed_case(8192, 1024, 16);
    embed_case(512, 6144, 100);
    gather_case(16, 1024, 1);
    gather_case(700, 1024, 16);
    gather_case(300, 6144, 37);
    add_rows_case(1, 1024, 1024, 0);
    add_rows_case(8, 6144, 3 * 6144, 6144);
    add_rows_case(37, 1000, 2 * 1000, 1000);
}

/* ------------------------------------------------------------ add_rmsnorm */

static void norm_case(int rows, int dim, bool with_add) {
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d dim %d %s", rows, dim, with_add ? "add" : "no add");
    int64_t n = (int64_t)rows * dim;
    float eps = 1e-6f;
    uint16_t *add = with_add ? rand_bf16(n, 1.0f) : NULL, *res0 = rand_bf16(n, 1.0f);
    uint16_t *w = rand_bf16(dim, 0.5f), *res_ref = hdup(res0, (size_t)n * 2);
    uint16_t *out_ref = halloc((size_t)n * 2);
    for (int t = 0; t < rows; t++) /* rows of different scales */
        for (int i = 0; i < dim; i++)
            res0[(int64_t)t * dim + i] = res_ref[(int64_t)t * dim + i] = m3_f32_to_bf16(
                m3_bf16_to_f32(res0[(int64_t)t * dim + i]) * ldexpf(1.0f, t % 5 - 2));
    int64_t ne[1] = {dim};
    m3_tensor wc = m3_tensor_make(M3_DT_BF16, 1, ne, w);
    cpu_must(g_cpu->ops->add_rmsnorm(g_cpu, rows, dim, add, res_ref, &wc, eps, out_ref),
             "CPU add_rmsnorm");
    m3_tensor wg = m3_tensor_make(M3_DT_BF16, 1, ne, dev_from(w, (size_t)dim * 2));
    void *res = dev_buf(res0, (size_t)n * 2), *out = dev_buf(NULL, (size_t)n * 2);
    void *dadd = add ? dev_from(add, (size_t)n * 2) : NULL;
    m3_status st = gpu_done(g_gpu->ops->add_rmsnorm(g_gpu, rows, dim, dadd, res, &wg, eps, out));
    if (st) {
        report_error("add_rmsnorm", shape, st);
    } else {
        bool g1, g2;
        uint16_t *got_res = dev_fetch(res, (size_t)n * 2, &g1);
        uint16_t *got = dev_fetch(out, (size_t)n * 2, &g2);
        cmp c = compare_bf16(got, out_ref, n);
        report("add_rmsnorm", shape, &c, TOL_BF16, g2, " (wrote past the end)");
        /* residual = bf16(add + residual): one rounding of one sum, exact */
        cmp r = compare_bf16(got_res, res_ref, n);
        report("add_rmsnorm.res", shape, &r, EXACT, g1, " (wrote past the end)");
    }
    release_all();
}

static void test_add_rmsnorm(void) {
    norm_case(1, 6144, true);
    norm_case(5, 1024, true);
    norm_case(5, 1024, false);
    norm_case(16, 256, true);
    norm_case(100, 1024, true);
    norm_case(3, 200, true); /* a width no vector kernel divides evenly */
}

/* ------------------------------------------------------------ linear */

/* A finite, non-zero e4m3 byte: exponent field 1..10. */
/* One product: rows x [N, K] with output dtype out; misalign puts x one
 * element past an aligned address (the scalar path). */
static void linear_run(const char *op, int rows, const uint16_t *x, const m3_linear *hw,
                       const m3_linear *dw, m3_dtype out, bool misalign) {
    int64_t N = hw->w.ne[0], K = hw->w.ne[1], n = rows * N;
    size_t osz = out == M3_DT_F32 ? 4 : 2;
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d N %lld K %lld %s->%s%s", rows, (long long)N,
             (long long)K, hw->w.dtype == M3_DT_BF16 ? "bf16" : "mxfp8",
             out == M3_DT_F32 ? "f32" : "bf16", misalign ? " x+1" : "");
    void *ref = halloc((size_t)n * osz);
    cpu_must(g_cpu->ops->linear(g_cpu, rows, x, hw, out, ref), "CPU linear");
    uint16_t *dx = dalloc((size_t)(rows * K + 8) * 2);
    if (misalign)
        dx += 1;
    if (g_gpu->ops->upload(g_gpu, dx, x, (size_t)(rows * K) * 2))
        die("upload");
    void *dout = dev_buf(NULL, (size_t)n * osz);
    m3_status st = gpu_done(g_gpu->ops->linear(g_gpu, rows, dx, dw, out, dout));
    if (st) {
        report_error(op, shape, st);
        return;
    }
    bool guard;
    void *got = dev_fetch(dout, (size_t)n * osz, &guard);
    cmp c = out == M3_DT_F32 ? gpu_compare_f32(got, ref, n) : compare_bf16(got, ref, n);
    report(op, shape, &c, out == M3_DT_F32 ? TOL_F32 : TOL_BF16, guard, " (wrote past the end)");
}

static void linear_weight_cases(int64_t N, int64_t K, bool fp8) {
    static const int rows_list[] = {1, 2, 3, 5, 8, 13, 16, 24, 32, 48, 100};
    m3_linear hw = make_linear(N, K, fp8, 1.0f), dw = linear_to_gpu(&hw);
    for (size_t i = 0; i < sizeof rows_list / sizeof *rows_list; i++) {
        int rows = rows_list[i];
        uint16_t *x = rand_bf16(rows * K, 1.0f);
        linear_run("linear", rows, x, &hw, &dw, M3_DT_BF16, false);
        linear_run("linear", rows, x, &hw, &dw, M3_DT_F32, false);
    }
    /* unaligned activations: the vector kernels cannot take them */
    uint16_t *x = rand_bf16(5 * K, 1.0f);
    linear_run("linear", 5, x, &hw, &dw, M3_DT_BF16, true);
    release_all();
}

/* Prefill-sized products of the model presets: lm_head of `tiny` (bf16,
 * f32 logits), q_proj of `small`, an MXFP8 projection. */
static void linear_prefill_cases(void) {
    m3_linear hw = make_linear(512, 256, false, 1.0f), dw = linear_to_gpu(&hw);
    uint16_t *x = rand_bf16(700 * 256, 1.0f);
    linear_run("linear", 700, x, &hw, &dw, M3_DT_F32, false);
    m3_linear qw = make_linear(4096, 1024, false, 1.0f), dq = linear_to_gpu(&qw);
    uint16_t *xq = rand_bf16(700 * 1024, 1.0f);
    linear_run("linear", 700, xq, &qw, &dq, M3_DT_BF16, false);
    m3_linear fw = make_linear(256, 1024, true, 1.0f), df = linear_to_gpu(&fw);
    linear_run("linear", 700, xq, &fw, &df, M3_DT_BF16, false);
    release_all();
}

/* linear_group: n weights of one x (a layer's q, k, v and index
 * projections: one launch once their tiles fill the GPU; fewer tiles: one
 * linear each); each output must be the bits of its linear alone, and
 * within tolerance of the CPU. */
static void linear_group_case(int n, const int64_t *Ns, int64_t K, bool fp8, int rows) {
    m3_linear hw[6], dw[6];
    const m3_linear *wp[6];
    void *outs[6], *alone[6];
    uint16_t *x = rand_bf16(rows * K, 1.0f), *dx = dev_from(x, (size_t)(rows * K) * 2);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        hw[i] = make_linear(Ns[i], K, fp8, 1.0f);
        dw[i] = linear_to_gpu(&hw[i]);
        wp[i] = &dw[i];
        outs[i] = dev_buf(NULL, (size_t)rows * Ns[i] * 2);
        alone[i] = dev_buf(NULL, (size_t)rows * Ns[i] * 2);
        total += Ns[i];
    }
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d, %d weights, N %lld, K %lld %s", rows, n,
             (long long)total, (long long)K, fp8 ? "mxfp8" : "bf16");
    m3_status st = gpu_done(g_gpu->ops->linear_group(g_gpu, rows, dx, n, wp, M3_DT_BF16, outs));
    for (int i = 0; !st && i < n; i++)
        st = gpu_done(g_gpu->ops->linear(g_gpu, rows, dx, &dw[i], M3_DT_BF16, alone[i]));
    if (st) {
        report_error("linear group", shape, st);
        release_all();
        return;
    }
    for (int i = 0; i < n; i++) {
        int64_t m = (int64_t)rows * Ns[i];
        bool guard, guard2;
        uint16_t *got = dev_fetch(outs[i], (size_t)m * 2, &guard);
        uint16_t *one = dev_fetch(alone[i], (size_t)m * 2, &guard2);
        uint16_t *ref = halloc((size_t)m * 2);
        cpu_must(g_cpu->ops->linear(g_cpu, rows, x, &hw[i], M3_DT_BF16, ref), "CPU linear");
        char what[120];
        snprintf(what, sizeof what, "%s: #%d vs alone, bits", shape, i);
        cmp c = compare_bf16(got, one, m);
        report("linear group", what, &c, EXACT, guard && guard2, " (wrote past the end)");
        snprintf(what, sizeof what, "%s: #%d vs CPU", shape, i);
        c = compare_bf16(got, ref, m);
        report("linear group", what, &c, TOL_BF16, guard, " (wrote past the end)");
    }
    release_all();
}

static void test_linear_group(void) {
    static const int64_t qkv_index[] = {2048, 128, 128, 128, 128}, gate_up[] = {1544, 1544},
                         narrow[] = {128, 136, 40};
    for (int rows = 1; rows <= 16; rows += 7) { /* 1, 8, 15 */
        linear_group_case(5, qkv_index, 1024, false, rows);
        linear_group_case(2, gate_up, 768, rows == 8, rows);
        linear_group_case(3, narrow, 512, false, rows); /* one linear each */
    }
}

static void test_linear(void) {
    /* N not a multiple of a CTA's output rows; K = 200: not a multiple of 8,
     * the scalar fallback (bf16 only: MXFP8 needs K % 32 == 0) */
    linear_weight_cases(520, 1024, false);
    linear_weight_cases(264, 6144, false);
    /* more 16-row tiles than multiprocessors: a CTA per tile (4 chunks; 1) */
    linear_weight_cases(4104, 1024, false);
    linear_weight_cases(4104, 768, false);
    linear_weight_cases(4104, 1024, true);
    linear_weight_cases(77, 200, false);
    linear_weight_cases(520, 1024, true);
    linear_weight_cases(264, 6144, true);
    linear_weight_cases(77, 96, true);
    linear_prefill_cases();
}

/* ------------------------------------------------------------ head_norm_rope */

static void rope_case(int rows, int heads, int dim, int rotary, int gap, const int64_t *pos) {
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d heads %d dim %d rot %d gap %d maxpos %lld", rows,
             heads, dim, rotary, gap, (long long)pos[rows - 1]);
    float eps = 1e-6f;
    m3_rope rope = {rotary, 5000000.0};
    int64_t stride = (int64_t)heads * dim + gap, n = rows * stride, ne[1] = {dim};
    /* the gap between rows is random like the rest and must stay untouched */
    uint16_t *x0 = rand_bf16(n, 2.0f), *w = rand_bf16(dim, 0.5f), *ref = hdup(x0, (size_t)n * 2);
    m3_tensor wc = m3_tensor_make(M3_DT_BF16, 1, ne, w);
    cpu_must(g_cpu->ops->head_norm_rope(g_cpu, rows, heads, dim, ref, stride, &wc, eps, pos, &rope),
             "CPU head_norm_rope");
    m3_tensor wg = m3_tensor_make(M3_DT_BF16, 1, ne, dev_from(w, (size_t)dim * 2));
    void *dx = dev_buf(x0, (size_t)n * 2), *dpos = dev_from(pos, (size_t)rows * 8);
    m3_status st = gpu_done(
        g_gpu->ops->head_norm_rope(g_gpu, rows, heads, dim, dx, stride, &wg, eps, dpos, &rope));
    if (st) {
        report_error("head_norm_rope", shape, st);
    } else {
        bool guard, gap_ok = true;
        uint16_t *got = dev_fetch(dx, (size_t)n * 2, &guard);
        for (int t = 0; t < rows; t++)
            for (int i = heads * dim; i < stride; i++)
                gap_ok &= got[t * stride + i] == x0[t * stride + i];
        cmp c = compare_bf16(got, ref, n);
        report("head_norm_rope", shape, &c, TOL_BF16, guard && gap_ok,
               gap_ok ? " (wrote past the end)" : " (wrote into the gap between rows)");
    }
    release_all();
}

static void test_head_norm_rope(void) {
    /* ascending positions, the last one reported in the shape: up to
     * 2^20 - 1, where an fp32 angle would be visibly off */
    int64_t pos[9] = {0, 1, 127, 128, 4095, 65537, 524288 + 12345, (1 << 20) - 2, (1 << 20) - 1};
    rope_case(9, 32, 128, 64, 0, pos);   /* q: 32 heads */
    rope_case(9, 2, 128, 64, 64, pos);   /* k, inside a wider row */
    rope_case(9, 1, 128, 64, 0, pos);    /* the index key */
    rope_case(9, 16, 64, 32, 8, pos);    /* head_dim 64 */
    int64_t many[100];
    for (int t = 0; t < 100; t++)
        many[t] = t * 10000 + rng_below(10000);
    rope_case(100, 4, 128, 64, 0, many); /* a prefill of index queries */
}

/* ------------------------------------------------------------ cache_write */

static void cache_case(int rows, const int64_t *slots, int pages, int heads, int dim, int gap) {
    char shape[96];
    snprintf(shape, sizeof shape, "rows %d pages %d heads %d dim %d gap %d", rows, pages, heads,
             dim, gap);
    int64_t stride = (int64_t)heads * dim + gap, cn = (int64_t)pages * heads * PAGE * dim;
    uint16_t *src = rand_bf16(rows * stride, 1.0f), *c0 = rand_bf16(cn, 1.0f);
    uint16_t *ref = hdup(c0, (size_t)cn * 2);
    cpu_must(g_cpu->ops->cache_write(g_cpu, rows, slots, heads, dim, src, stride, ref),
             "CPU cache_write");
    void *dc = dev_buf(c0, (size_t)cn * 2);
    m3_status st = gpu_done(g_gpu->ops->cache_write(
        g_gpu, rows, dev_from(slots, (size_t)rows * 8), heads, dim,
        dev_from(src, (size_t)rows * stride * 2), stride, dc));
    if (st) {
        report_error("cache_write", shape, st);
    } else {
        /* the whole cache: written slots hold the rows, every other slot
         * (those of padded rows included) is untouched */
        bool guard;
        uint16_t *got = dev_fetch(dc, (size_t)cn * 2, &guard);
        cmp c = compare_bf16(got, ref, cn);
        report("cache_write", shape, &c, EXACT, guard, " (wrote past the end)");
    }
    release_all();
}

static void test_cache_write(void) {
    /* negative slots are padded rows: nothing written */
    int64_t s1[8] = {130, -1, 0, 767, 257, -7, 5, 640};
    cache_case(8, s1, 6, 2, 128, 64);
    cache_case(8, s1, 6, 1, 128, 0); /* the index cache */
    cache_case(8, s1, 6, 16, 64, 0);
    int64_t s2[300];
    for (int t = 0; t < 300; t++) /* a prefill over three pages, a padded tail */
        s2[t] = t < 290 ? 2 * PAGE + t : -1;
    cache_case(300, s2, 6, 2, 128, 0);
}

/* ------------------------------------------------------------ index_scores */

static void index_case(const char *what, int n_reqs, const int *lens, const int *ql, int pad,
                       int heads, int max_blocks, bool with_nan) {
    enum { DIM = 128 };
    pstep s;
    pstep_build(&s, n_reqs, lens, ql, pad, max_blocks, pages_for(n_reqs, lens, 3));
    const m3_step *st = &s.cpu;
    char shape[96];
    snprintf(shape, sizeof shape, "%s: %d reqs, rows %d, heads %d, width %d", what, n_reqs,
             st->rows, heads, max_blocks);
    uint16_t *ic = make_cache(st, 1, DIM, 1.0f);
    uint16_t *iq = rand_bf16((int64_t)st->rows * heads * DIM, 1.0f);
    /* keys a request's first row must not see yet: 4x its head-0 query, so
     * reading one would win the max */
    for (int r = 0, t = 0; r < n_reqs; t += ql[r], r++)
        for (int64_t p = lens[r] - ql[r] + 1; p < lens[r]; p++)
            for (int i = 0; i < DIM; i++)
                ic[cache_at(st, r, p, 1, 0, DIM) + i] =
                    m3_f32_to_bf16(4.0f * m3_bf16_to_f32(iq[(int64_t)t * heads * DIM + i]));
    if (with_nan) { /* a NaN query element (row 0, head 1); a NaN key in the last request */
        iq[(0 * heads + 1) * DIM + 7] = BF16_NAN;
        ic[cache_at(st, n_reqs - 1, lens[n_reqs - 1] / 2, 1, 0, DIM) + 3] = BF16_NAN;
    }
    float scale = (float)(1.0 / sqrt((double)DIM) * 1.4426950408889634);
    int64_t n = (int64_t)st->rows * heads * max_blocks, icn = st->n_pages * PAGE * DIM;
    float *ref = halloc((size_t)n * 4);
    cpu_must(g_cpu->ops->index_scores(g_cpu, st, heads, DIM, iq, ic, scale, ref),
             "CPU index_scores");
    void *out = dev_buf(NULL, (size_t)n * 4);
    m3_status e = gpu_done(g_gpu->ops->index_scores(
        g_gpu, &s.gpu, heads, DIM, dev_from(iq, (size_t)st->rows * heads * DIM * 2),
        dev_from(ic, (size_t)icn * 2), scale, out));
    if (e) {
        report_error("index_scores", shape, e);
    } else {
        bool guard;
        float *got = dev_fetch(out, (size_t)n * 4, &guard);
        mask_padded(got, ref, st, (size_t)heads * max_blocks * 4);
        cmp c = gpu_compare_f32(got, ref, n);
        report("index_scores", shape, &c, EXACT, guard, " (wrote past the end)");
    }
    release_all();
}

static void test_index_scores(void) {
    /* contexts from 1 token to 40 blocks; partial last blocks; an exactly
     * full block; decode and multi-row requests; a padded row */
    int lens[8] = {1, 5, 128, 129, 300, 1000, 40 * PAGE, 40 * PAGE - 77};
    int ql[8] = {1, 1, 1, 2, 3, 1, 4, 1};
    index_case("mixed", 8, lens, ql, 1, 4, 48, false);
    index_case("mixed, NaN", 8, lens, ql, 1, 4, 48, true);
    index_case("2 heads, width 256", 8, lens, ql, 2, 2, 256, false);
    int plen[2] = {2000, 700}, pql[2] = {200, 1}; /* a prefill chunk: rows mask within a block */
    index_case("prefill", 2, plen, pql, 1, 2, 16, false);
    int zlen[1] = {700}, zql[1] = {700}; /* a whole 700-token prompt */
    index_case("prompt", 1, zlen, zql, 0, 2, 8, false);
}

/* ------------------------------------------------------------ select_blocks */

/* select_case's scores: false, few distinct values (ties); true, spread
 * (random floats, some NaN and -inf); g_sel_equal, one value for every
 * visible block (the keys differ only in the block id: the radix select
 * finds one bucket in each of its first four passes) */
static bool g_sel_spread, g_sel_equal;

static void select_case(const char *what, const m3_select_params *p, int n_reqs, const int *lens,
                        const int *ql, int heads, int max_blocks) {
    pstep s;
    pstep_build(&s, n_reqs, lens, ql, 2, max_blocks, pages_for(n_reqs, lens, 0));
    const m3_step *st = &s.cpu;
    char shape[96];
    snprintf(shape, sizeof shape, "%s: topk %d init %d local %d, rows %d heads %d", what, p->topk,
             p->init_blocks, p->local_blocks, st->rows, heads);
    int64_t n = (int64_t)st->rows * heads * max_blocks, nsel = (int64_t)st->rows * heads * p->topk;
    float *sc = halloc((size_t)n * 4);
    for (int t = 0; t < st->rows; t++) {
        int nb = (int)((st->host.positions[t] + PAGE) / PAGE);
        for (int64_t k = (int64_t)t * heads * max_blocks; k < (int64_t)(t + 1) * heads * max_blocks;
             k++) {
            int b = (int)(k % max_blocks), u = rng_below(16);
            /* few distinct values (ties), NaN, -inf; past the visible
             * blocks a large score the op must ignore */
            sc[k] = b >= nb                  ? 1e30f
                    : g_sel_equal            ? 0.75f
                    : u == 0                 ? NAN
                    : u == 1                 ? -INFINITY
                    : g_sel_spread           ? (float)rng_below(1 << 20) / 4096.0f - 128.0f
                                             : (float)(u % 5 - 2);
        }
    }
    int32_t *ref = halloc((size_t)nsel * 4);
    cpu_must(g_cpu->ops->select_blocks(g_cpu, st, heads, sc, p, ref), "CPU select_blocks");
    void *out = dev_buf(NULL, (size_t)nsel * 4);
    m3_status e = gpu_done(
        g_gpu->ops->select_blocks(g_gpu, &s.gpu, heads, dev_from(sc, (size_t)n * 4), p, out));
    if (e) {
        report_error("select_blocks", shape, e);
    } else {
        bool guard;
        int32_t *got = dev_fetch(out, (size_t)nsel * 4, &guard);
        mask_padded(got, ref, st, (size_t)heads * p->topk * 4);
        cmp c = compare_i32(got, ref, nsel);
        report("select_blocks", shape, &c, EXACT, guard, " (wrote past the end)");
    }
    release_all();
}

static void test_select_blocks(void) {
    m3_select_params m3 = {16, 0, 1}, a = {4, 1, 2}, tiny = {3, 1, 1}, wide = {8, 1, 1};
    /* 1 block (fewer than topk), exactly topk, a partial block, more */
    int lens[6] = {100, 4 * PAGE, 5 * PAGE - 3, 11 * PAGE, 20 * PAGE, 16 * PAGE + 1};
    int ql[6] = {1, 1, 2, 1, 3, 1};
    select_case("mixed", &m3, 6, lens, ql, 4, 24);
    select_case("mixed", &a, 6, lens, ql, 2, 24);
    select_case("mixed", &tiny, 6, lens, ql, 2, 24);
    select_case("mixed", &wide, 6, lens, ql, 4, 24);
    /* M3's selection over 16 decode requests of up to 200 blocks, a table
     * as wide as a graph engine's */
    int big[16], one[16];
    for (int r = 0; r < 16; r++)
        big[r] = 1 + rng_below(200 * PAGE), one[r] = 1;
    select_case("16 decode rows", &m3, 16, big, one, 4, 256);
    int plen[1] = {3000}, pql[1] = {64}; /* a prefill chunk */
    select_case("prefill", &m3, 1, plen, pql, 2, 24);
    m3_select_params small = {4, 1, 1};
    int zlen[1] = {700}, zql[1] = {700}; /* a whole 700-token prompt */
    select_case("prompt", &tiny, 1, zlen, zql, 2, 8);
    select_case("prompt", &small, 1, zlen, zql, 2, 8);
    /* long rows, more than 128 candidates (the radix select), rooms of
     * 15, 32 and 62 */
    const m3_select_params rooms[3] = {m3, {33, 0, 1}, {64, 1, 1}};
    int llen[4] = {129 * PAGE + 5, 600 * PAGE, 1500 * PAGE + 77, 2047 * PAGE}, lql[4] = {1, 1, 1, 1};
    for (int spread = 0; spread < 2; spread++) {
        g_sel_spread = spread;
        for (int r = 0; r < 3; r++)
            select_case(spread ? "long rows, spread" : "long rows, ties", &rooms[r], 4, llen, lql,
                        2, 2048);
    }
    /* rows of 8-59 rounds of the stock kernel's 512 threads, the longest
     * past its staged scores (96 KiB: 24,576 blocks, so read from global
     * memory), and every visible score equal */
    int xlen[3] = {4100 * PAGE + 9, 9000 * PAGE, 30000 * PAGE - 1}, xql[3] = {1, 1, 1};
    for (int mode = 0; mode < 3; mode++) {
        g_sel_spread = mode == 1, g_sel_equal = mode == 2;
        for (int r = 0; r < 3; r += 2)
            select_case(mode == 0   ? "very long rows, ties"
                        : mode == 1 ? "very long rows, spread"
                                    : "very long rows, equal",
                        &rooms[r], 3, xlen, xql, 2, 30000);
    }
    select_case("long rows, equal", &rooms[1], 4, llen, lql, 2, 2048);
    g_sel_spread = g_sel_equal = false;
}

/* ------------------------------------------------------------ attention */

static void attn_case(const char *what, const attn_shape *a, int n_reqs, const int *lens,
                      const int *ql, int pad) {
    pstep s;
    pstep_build(&s, n_reqs, lens, ql, pad, a->max_blocks, pages_for(n_reqs, lens, 2));
    const m3_step *st = &s.cpu;
    char shape[96];
    snprintf(shape, sizeof shape, "%s %s: %d reqs, %d+%d rows, %d/%d heads, dim %d", what,
             a->topk ? "sparse" : "dense", n_reqs, st->rows - pad, pad, a->q_heads, a->kv_heads,
             a->dim);
    uint16_t *kc = make_cache(st, a->kv_heads, a->dim, 1.0f);
    uint16_t *vc = make_cache(st, a->kv_heads, a->dim, 1.0f);
    int64_t n = (int64_t)st->rows * a->q_heads * a->dim;
    int64_t cn = st->n_pages * a->kv_heads * PAGE * a->dim;
    uint16_t *q = rand_bf16(n, 2.0f), *ref = halloc((size_t)n * 2);
    int32_t *sel = a->topk ? make_selection(st, a->kv_heads, a->topk) : NULL;
    float scale = (float)(1.0 / sqrt((double)a->dim));
    cpu_must(g_cpu->ops->attention(g_cpu, st, a->q_heads, a->kv_heads, a->dim, q, kc, vc, sel,
                                   a->topk, scale, ref),
             "CPU attention");
    void *dsel = sel ? dev_from(sel, (size_t)st->rows * a->kv_heads * a->topk * 4) : NULL;
    void *out = dev_buf(NULL, (size_t)n * 2);
    m3_status e = gpu_done(g_gpu->ops->attention(
        g_gpu, &s.gpu, a->q_heads, a->kv_heads, a->dim, dev_from(q, (size_t)n * 2),
        dev_from(kc, (size_t)cn * 2), dev_from(vc, (size_t)cn * 2), dsel, a->topk, scale, out));
    if (e) {
        report_error("attention", shape, e);
    } else {
        bool guard;
        uint16_t *got = dev_fetch(out, (size_t)n * 2, &guard);
        mask_padded(got, ref, st, (size_t)a->q_heads * a->dim * 2);
        cmp c = compare_bf16(got, ref, n);
        report("attention", shape, &c, TOL_BF16, guard, " (wrote past the end)");
    }
    release_all();
}

/* Decode steps of `rows` one-row requests with contexts up to 3000 tokens
 * (1, 128 and 129 among them), one padded row. */
static void attn_decode(const attn_shape *a, int rows) {
    int lens[16], ql[16];
    static const int special[4] = {1, 128, 129, 3000};
    for (int r = 0; r < rows; r++) {
        lens[r] = r < 4 ? special[(r + rows) % 4] : 1 + rng_below(3000);
        ql[r] = 1;
    }
    attn_case("decode", a, rows, lens, ql, rows < 16 ? 1 : 0);
}

static void test_attention(void) {
    static const int rows_list[] = {1, 2, 3, 5, 8, 16};
    for (int dim = 128; dim >= 64; dim /= 2)
        for (int sparse = 0; sparse < 2; sparse++) {
            attn_shape a = {32, 2, dim, sparse ? 16 : 0, 32};
            for (size_t i = 0; i < sizeof rows_list / sizeof *rows_list; i++)
                attn_decode(&a, rows_list[i]);
        }
    /* speculative-verify-like steps: 2 requests of 8 rows; a table as wide
     * as a graph engine's (256 blocks) */
    int vlen[2] = {1500, 260}, vql[2] = {8, 8};
    attn_shape wide = {32, 2, 128, 16, 256}, wide_dense = {32, 2, 128, 0, 256};
    attn_case("2x8 rows", &wide, 2, vlen, vql, 0);
    attn_case("2x8 rows", &wide_dense, 2, vlen, vql, 0);
    /* a prefill chunk of 300 rows (positions 900..1199) beside a decode row */
    int plen[2] = {1200, 2500}, pql[2] = {300, 1};
    attn_shape pre = {32, 2, 128, 16, 24}, pre_dense = {32, 2, 128, 0, 24};
    attn_case("prefill", &pre, 2, plen, pql, 1);
    attn_case("prefill", &pre_dense, 2, plen, pql, 1);
    /* the M3 rank shape: 16 query heads on one KV head */
    attn_shape rank = {16, 1, 128, 16, 32};
    attn_decode(&rank, 4);
    /* whole 700-token prompts in the `tiny` (4/2 heads, top 3) and `small`
     * (32/2 heads, top 4) shapes */
    int zlen[1] = {700}, zql[1] = {700};
    attn_shape tiny_s = {4, 2, 128, 3, 8}, tiny_d = {4, 2, 128, 0, 8};
    attn_shape small_s = {32, 2, 128, 4, 8}, small_d = {32, 2, 128, 0, 8};
    attn_case("prompt", &tiny_s, 1, zlen, zql, 0);
    attn_case("prompt", &tiny_d, 1, zlen, zql, 0);
    attn_case("prompt", &small_s, 1, zlen, zql, 0);
    attn_case("prompt", &small_d, 1, zlen, zql, 0);
}

/* ------------------------------------------------------------ swiglu */

static void swiglu_run(const char *what, int64_t n, const uint16_t *gate, const uint16_t *up) {
    char shape[96];
    snprintf(shape, sizeof shape, "%s, n %lld", what, (long long)n);
    m3_swiglu act = {1.702f, 7.0f};
    uint16_t *ref = halloc((size_t)n * 2);
    cpu_must(g_cpu->ops->swiglu(g_cpu, n, gate, up, &act, ref), "CPU swiglu");
    void *out = dev_buf(NULL, (size_t)n * 2);
    m3_status e = gpu_done(g_gpu->ops->swiglu(g_gpu, n, dev_from(gate, (size_t)n * 2),
                                              dev_from(up, (size_t)n * 2), &act, out));
    if (e) {
        report_error("swiglu", shape, e);
    } else {
        bool guard;
        uint16_t *got = dev_fetch(out, (size_t)n * 2, &guard);
        cmp c = compare_bf16(got, ref, n);
        report("swiglu", shape, &c, TOL_BF16, guard, " (wrote past the end)");
    }
    release_all();
}

static void test_swiglu(void) {
    int64_t sizes[3] = {1, 7, (1 << 20) + 3};
    for (int i = 0; i < 3; i++) { /* beyond the limit on both sides: both clamps */
        uint16_t *gate = rand_bf16(sizes[i], 12.0f), *up = rand_bf16(sizes[i], 12.0f);
        swiglu_run("random", sizes[i], gate, up);
    }
    /* every bf16 gate pattern (NaN, inf, subnormals) against random ups */
    int64_t n = 65536 * 4;
    uint16_t *gate = halloc((size_t)n * 2), *up = rand_bf16(n, 9.0f);
    for (int64_t i = 0; i < n; i++)
        gate[i] = (uint16_t)(i % 65536);
    up[3] = BF16_NAN; /* a NaN up must stay NaN */
    swiglu_run("every gate", n, gate, up);
}

/* ------------------------------------------------------------ moe */

typedef struct moe_cfg {
    int E, k, H, I, Is;
    bool shared, bias, fp8;
} moe_cfg;

/* Host weights of one MoE layer. With bias, expert 0 gets bias -100 (never
 * routed) and NaN weights, so a read of it that reached the output shows. */
static m3_layer_weights moe_weights(const moe_cfg *m) {
    m3_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    lw.moe = true;
    int64_t ne[2] = {m->E, m->H}, neb[1] = {m->E};
    float *router = halloc((size_t)m->E * m->H * 4), *bias = halloc((size_t)m->E * 4);
    for (int64_t i = 0; i < (int64_t)m->E * m->H; i++)
        router[i] = rng_val(0.1f);
    for (int e = 0; e < m->E; e++)
        bias[e] = e == 0 ? -100.0f : rng_val(0.2f);
    lw.router = m3_tensor_make(M3_DT_F32, 2, ne, router);
    if (m->bias)
        lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, bias);
    m3_linear *ex = halloc(sizeof(m3_linear) * 3 * (size_t)m->E);
    lw.exp_gate = ex, lw.exp_up = ex + m->E, lw.exp_down = ex + 2 * m->E;
    for (int e = 0; e < m->E; e++) {
        lw.exp_gate[e] = make_linear(m->I, m->H, m->fp8, 2.0f / sqrtf((float)m->H));
        lw.exp_up[e] = make_linear(m->I, m->H, m->fp8, 2.0f / sqrtf((float)m->H));
        lw.exp_down[e] = make_linear(m->H, m->I, m->fp8, 2.0f / sqrtf((float)m->I));
    }
    if (m->bias) {
        m3_linear *z[3] = {&lw.exp_gate[0], &lw.exp_up[0], &lw.exp_down[0]};
        for (int j = 0; j < 3; j++)
            if (m->fp8)
                memset(z[j]->w.data, 0x7f, tensor_bytes(&z[j]->w)); /* e4m3 NaN */
            else
                for (int64_t i = 0; i < m3_tensor_nelem(&z[j]->w); i++)
                    ((uint16_t *)z[j]->w.data)[i] = BF16_NAN;
    }
    if (m->shared) {
        lw.sh_gate = make_linear(m->Is, m->H, false, 2.0f / sqrtf((float)m->H));
        lw.sh_up = make_linear(m->Is, m->H, false, 2.0f / sqrtf((float)m->H));
        lw.sh_down = make_linear(m->H, m->Is, false, 2.0f / sqrtf((float)m->Is));
    }
    return lw;
}

/* The gap between the k-th and (k+1)-th router key of row x, in double. */
static double route_gap(const moe_cfg *m, const m3_layer_weights *hw, const uint16_t *x) {
    double keys[64], kth = 0, next = -INFINITY;
    const float *router = hw->router.data, *bias = hw->router_bias.data;
    for (int e = 0; e < m->E; e++) {
        double l = 0;
        for (int i = 0; i < m->H; i++)
            l += (double)m3_bf16_to_f32(x[i]) * router[(size_t)e * m->H + i];
        keys[e] = 1.0 / (1.0 + exp(-l)) + (bias ? bias[e] : 0.0);
    }
    uint64_t taken = 0;
    for (int j = 0; j <= m->k && j < m->E; j++) {
        int best = -1;
        for (int e = 0; e < m->E; e++)
            if (!(taken >> e & 1) && (best < 0 || keys[e] > keys[best]))
                best = e;
        taken |= 1ull << best;
        *(j < m->k ? &kth : &next) = keys[best];
    }
    return kth - next;
}

/* Rows of x whose expert choice is a near-tie are drawn again: the GPU's
 * fp32 router (and its expf) may break such a tie the other way, which
 * changes the row's output by O(1) without any kernel being wrong. */
static void moe_avoid_ties(const moe_cfg *m, const m3_layer_weights *hw, uint16_t *x, int rows) {
    for (int t = 0; t < rows; t++)
        for (int tries = 0; tries < 20 && route_gap(m, hw, x + (int64_t)t * m->H) < 1e-4;
             tries++)
            for (int i = 0; i < m->H; i++)
                x[(int64_t)t * m->H + i] = m3_f32_to_bf16(rng_val(1.0f));
}

static void moe_rows(const moe_cfg *m, const m3_layer_weights *hw, const m3_layer_weights *dw,
                     int rows) {
    char shape[96];
    snprintf(shape, sizeof shape, "E %d k %d %s%s%s, rows %d, H %d I %d", m->E, m->k,
             m->fp8 ? "mxfp8" : "bf16", m->shared ? " +shared" : "", m->bias ? " +bias" : "",
             rows, m->H, m->I);
    m3_moe_params p = {m->E, m->k, 2.0f, {1.702f, 7.0f}, NULL};
    int64_t n = (int64_t)rows * m->H;
    uint16_t *x = rand_bf16(n, 1.0f), *ref = halloc((size_t)n * 2);
    moe_avoid_ties(m, hw, x, rows);
    cpu_must(g_cpu->ops->moe(g_cpu, rows, x, hw, &p, ref), "CPU moe");
    void *out = dev_buf(NULL, (size_t)n * 2);
    void *dx = dev_from(x, (size_t)n * 2);
    m3_status e = gpu_done(g_gpu->ops->moe(g_gpu, rows, dx, dw, &p, out));
    if (e) {
        report_error("moe", shape, e);
        return;
    }
    bool guard;
    uint16_t *got = dev_fetch(out, (size_t)n * 2, &guard);
    cmp c = compare_bf16(got, ref, n);
    report("moe", shape, &c, TOL_BF16, guard, " (wrote past the end)");
}

/* One layer's weights uploaded through the CUDA backend's own load_weights
 * (experts at the uniform stride its kernels index by), then every row
 * count. */
static void moe_config(const moe_cfg *m, int prefill_rows) {
    static const int rows_list[] = {1, 4, 16, 64};
    m3_layer_weights hw = moe_weights(m);
    m3_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_layers = 1;
    cfg.num_experts = m->E;
    cfg.experts_per_tok = m->k;
    m3_weights host = {.layers = &hw}, dev;
    m3_status st = g_gpu->ops->load_weights(g_gpu, &cfg, &host, &dev);
    if (st) {
        report_error("moe", "load_weights of one MoE layer", st);
        release_all();
        return;
    }
    for (size_t i = 0; i < sizeof rows_list / sizeof *rows_list; i++)
        moe_rows(m, &hw, &dev.layers[0], rows_list[i]);
    if (prefill_rows)
        moe_rows(m, &hw, &dev.layers[0], prefill_rows);
    g_gpu->ops->unload_weights(g_gpu, &cfg, &dev);
    release_all();
}

static void test_moe(void) {
    for (int shape = 0; shape < 2; shape++)
        for (int variant = 0; variant < 8; variant++) {
            moe_cfg m = {shape ? 8 : 16, shape ? 2 : 4, 1024, 256, 256, (variant & 1) != 0,
                         (variant & 2) != 0, (variant & 4) != 0};
            moe_config(&m, 0);
        }
    /* the `tiny` and `small` presets' layers over a 700-token prompt */
    moe_cfg tiny = {8, 2, 256, 128, 128, true, true, false};
    moe_cfg small = {16, 4, 1024, 256, 256, true, true, false};
    moe_config(&tiny, 700);
    moe_config(&small, 700);
}

/* ------------------------------------------------------------ sample */

/* Row r of a greedy test: plain random logits, with by r % 6 a tie for the
 * maximum, NaNs (one where the maximum would be), all NaN, two +inf, only
 * -inf and NaN. */
static void sample_row(float *l, int V, int r) {
    for (int i = 0; i < V; i++)
        l[i] = (float)(rng_unit() * 6.0 - 3.0);
    int a = rng_below(V), b = rng_below(V);
    switch (r % 6) {
    case 1: l[a] = l[b] = 10.0f; break;
    case 2:
        for (int i = 0; i < V; i += 7)
            l[i] = NAN;
        l[a] = NAN, l[b] = 9.0f;
        break;
    case 3:
        if (r == 3)
            for (int i = 0; i < V; i++)
                l[i] = NAN;
        break;
    case 4: l[a] = l[b] = INFINITY; break;
    case 5:
        for (int i = 0; i < V; i++)
            l[i] = i % 3 ? -INFINITY : NAN;
        break;
    default: l[V - 1] = 20.0f; break; /* the last id */
    }
}

static void sample_case(int rows, int V) {
    char shape[96];
    snprintf(shape, sizeof shape, "greedy, rows %d V %d", rows, V);
    float *l = halloc((size_t)rows * V * 4);
    int32_t *ref = halloc((size_t)rows * 4);
    int64_t *counter = halloc((size_t)rows * 8);
    for (int r = 0; r < rows; r++) {
        sample_row(l + (int64_t)r * V, V, r);
        ref[r] = gpu_argmax(l + (int64_t)r * V, V);
        counter[r] = r;
    }
    void *out = dev_buf(NULL, (size_t)rows * 4);
    m3_status e = gpu_done(g_gpu->ops->sample(g_gpu, rows, dev_from(l, (size_t)rows * V * 4), V,
                                              0.0f, 1234, dev_from(counter, (size_t)rows * 8),
                                              out));
    if (e) {
        report_error("sample", shape, e);
    } else {
        bool guard;
        int32_t *got = dev_fetch(out, (size_t)rows * 4, &guard);
        cmp c = compare_i32(got, ref, rows);
        report("sample", shape, &c, EXACT, guard, " (wrote past the end)");
    }
    release_all();
}

/* Temperature 1 with one logit 60 above the rest: the draw is that id
 * (its probability is 1 - V e^-60), and the same keys draw the same. */
static void sample_temperature(int rows, int V) {
    char shape[96];
    snprintf(shape, sizeof shape, "T=1 peaked, rows %d V %d, twice", rows, V);
    float *l = halloc((size_t)rows * V * 4);
    int32_t *ref = halloc((size_t)rows * 4);
    int64_t *counter = halloc((size_t)rows * 8);
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < V; i++)
            l[(int64_t)r * V + i] = (float)rng_unit();
        ref[r] = rng_below(V);
        l[(int64_t)r * V + ref[r]] = 61.0f;
        counter[r] = 1000 + r;
    }
    void *dl = dev_from(l, (size_t)rows * V * 4), *dc = dev_from(counter, (size_t)rows * 8);
    void *o1 = dev_buf(NULL, (size_t)rows * 4), *o2 = dev_buf(NULL, (size_t)rows * 4);
    m3_status e = gpu_done(g_gpu->ops->sample(g_gpu, rows, dl, V, 1.0f, 99, dc, o1));
    if (!e)
        e = gpu_done(g_gpu->ops->sample(g_gpu, rows, dl, V, 1.0f, 99, dc, o2));
    if (e) {
        report_error("sample", shape, e);
    } else {
        bool g1, g2;
        int32_t *t1 = dev_fetch(o1, (size_t)rows * 4, &g1), *t2 = dev_fetch(o2, (size_t)rows * 4, &g2);
        cmp c = compare_i32(t1, ref, rows);
        bool same = memcmp(t1, t2, (size_t)rows * 4) == 0;
        report("sample", shape, &c, EXACT, g1 && g2 && same,
               same ? " (wrote past the end)" : " (same keys drew different tokens)");
    }
    release_all();
}

static void test_sample(void) {
    sample_case(1, 200064);
    sample_case(6, 200064);
    sample_case(16, 8192);
    sample_case(12, 1000);
    sample_case(3, 1);
    sample_temperature(5, 8192);
}

/* ------------------------------------------------------------ main */

int main(void) {
    int rc = harness_open("test_cuda_ops", 0x9e5eed01ull);
    if (rc >= 0)
        return rc;
    printf("test_cuda_ops: bf16 tol %.0e, f32 tol %.0e\n", TOL_BF16, TOL_F32);
    test_embed_gather();
    test_add_rmsnorm();
    test_linear();
    test_linear_group();
    test_head_norm_rope();
    test_cache_write();
    test_index_scores();
    test_select_blocks();
    test_attention();
    test_swiglu();
    test_moe();
    test_sample();
    return harness_close("test_cuda_ops");
}
