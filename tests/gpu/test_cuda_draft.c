/*
 * DSpark speculative decoding on the GPU (docs/DSPARK.md).
 *
 * 1. The draft_attention op against the CPU's on fresh random inputs: query
 *    and block rows, a paged context cache behind a shuffled block table,
 *    one request a call and several (each its own position and table),
 *    positions at page edges and past them, with and without a key window;
 *    the output poisoned (NaN) with guard bytes past its end; relative L2
 *    within TOL_OP (fp32 arithmetic in another order, then bf16 outputs),
 *    no NaN. Contexts from 256 keys (the default) take the split kernels;
 *    every case runs again on a backend that splits from one key
 *    (M3_DRAFT_SPLIT_FROM=1), so they see every shape, window and head
 *    dim, query passes of 128 and more included, once in the split
 *    kernel's build for one CTA a multiprocessor and once in the one for
 *    two (M3_DRAFT_SPLIT_TWO_FROM 0 and 1), and on one that never splits
 *    (the short-context kernel over long contexts).
 * 2. The draft_argmax op (the Markov head's step) against the CPU's: rows
 *    with the bias and without, ties at the maximum, NaN, +-inf, a row of
 *    NaN only (token 0) and of -inf only; the row written back bitwise as
 *    the CPU's (a NaN as a NaN: its payload is the hardware's) and the
 *    same token, the token's word poisoned first.
 * 2b. The draft_markov op (the Markov step in one launch) against the
 *    three ops it replaces on the GPU: rows and tokens bit for bit, at
 *    ranks of one K chunk and of four, ties, NaN rows.
 * 3. Whole runs on the tiny preset: speculative decoding on the GPU gives
 *    plain greedy decoding's tokens on the same GPU (both stock: a step with
 *    taps runs stock), for a random drafter and a windowed one; the GPU's
 *    draft logits agree with the CPU's over the rows both runs computed
 *    from the same inputs (steps at the same position and anchor, rows up
 *    to the first draft a near tie flipped): the median row within
 *    TOL_RUN, rows beyond it reported; the run whose verify steps and
 *    draft steps replay CUDA graphs (taps and all) gives the same tokens
 *    and draft logits, bit for bit, as the same run on an engine without
 *    graphs; the fused drafter layers (M3_DRAFT_LAYERS=fused, which this
 *    test sets) against the stock ops, bit for bit (7 rows; the whole
 *    runs keep the attention unsplit, as the fused layers' is), and the
 *    random drafter's run again with the stock ops' attention split over
 *    CTAs at every position (against the CPU within TOL_RUN, against the
 *    fused layers within TOL).
 * 4. A batch of three prompts decoded speculatively together, two a
 *    cycle and all three (24-row verify steps): graphs (verify steps
 *    replayed too)
 *    against eager bit for bit, the draft logits against the CPU's as in
 *    3, the fused drafter layers against the stock ops (bit for bit at 14
 *    rows a step, within TOL at 21), each request's tokens against its
 *    plain run alone
 *    (reported); and plain batched generation of 20 prompts, more than a
 *    decode step takes. (The acceptance rule is host code, driven through every branch
 *    by the CPU's test_speculate; here drafts are accepted only where the
 *    random models happen to agree.)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "core/bf16.h"
#include "gpu_common.h"
#include "m3.h"

#define TOL 1e-2
#define TOL_OP 1e-3
/* whole runs, GPU against CPU: the drafter's context is the target's taps,
 * so its rows carry the target's whole-model noise (routing near-ties
 * included), as test_cuda_model's logits do: its bound, on the median row */
#define TOL_RUN 2e-2
/* the windowed drafter (16 keys): 0.025 on the median row on an H100,
 * while its op cases agree within 1e-4, and the same weights with a
 * 1,024-key window (wider than the context) agree as the unwindowed
 * drafter does, 0.009 (forty-sixth session): the few keys, not the
 * window's code, carry the taps' noise (16 keys average it less);
 * bounded so that a broken run (0.7-0.8 seen) still fails */
#define TOL_RUN_WINDOW 5e-2
#define GUARD 4096
#define NEVER_SPLIT "1000000000" /* M3_DRAFT_SPLIT_FROM: the short-context kernel only */
#define POISON 0x7fc17fc1u

static m3_backend *g_cpu, *g_gpu;
static const char *g_split_tag = ""; /* "(split from 1) ": the op cases' second round */
static bool g_split_runs; /* run_case: the stock drafter's attention splits at every position */
static uint64_t g_rng;
static int g_cases, g_fails;

static double rng_unit(void) { return (double)(gpu_rng_next(&g_rng) >> 11) * 0x1p-53; }
static int rng_below(int n) { return (int)(gpu_rng_next(&g_rng) % (uint64_t)n); }

static uint16_t *rand_bf16(int64_t n) {
    uint16_t *p = gpu_xmalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        p[i] = m3_f32_to_bf16((float)(2.0 * rng_unit() - 1.0));
    return p;
}

static void *up(const void *h, size_t bytes, size_t extra) {
    void *d = NULL;
    unsigned char *stage = gpu_xmalloc(bytes + extra);
    const uint32_t w = POISON;
    for (size_t i = 0; i < bytes + extra; i++)
        stage[i] = ((const unsigned char *)&w)[i % 4];
    if (h)
        memcpy(stage, h, bytes);
    if (g_gpu->ops->alloc(g_gpu, bytes + extra, &d) ||
        g_gpu->ops->upload(g_gpu, d, stage, bytes + extra)) {
        fprintf(stderr, "test_cuda_draft: FATAL: GPU memory: %s\n", m3_last_error());
        exit(1);
    }
    free(stage);
    return d;
}

/* cap: the block table's capacity the op is told (its launches are sized
 * by it, as a graph replayed at any position needs): n_blocks + 40 pages,
 * so the long-context kernels are launched in every case (and leave at
 * once where the context is short). requests: the op's requests, one
 * after another in every array; request 0 at position p, the others at
 * random positions up to p, each with its own shuffled block table into
 * the one cache. */
static void op_case(int requests, int rows, int q_heads, int kv_heads, int dim, int64_t p,
                    int64_t window) {
    int n_blocks = (int)((p + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS), n_pages = n_blocks + 3;
    int cap = n_blocks + 40;
    int32_t *pages = gpu_xmalloc((size_t)requests * cap * 4);
    for (int i = 0; i < requests; i++)
        for (int b = 0; b < cap; b++) /* a shuffled table: page n_pages - 1 - b (+ i) */
            pages[(size_t)i * cap + b] = (n_pages - 1 - b % n_pages + i) % n_pages;
    int64_t qn = (int64_t)requests * rows * q_heads * dim;
    int64_t bn = (int64_t)requests * rows * kv_heads * dim;
    int64_t cn = (int64_t)n_pages * kv_heads * M3_PAGE_TOKENS * dim;
    uint16_t *q = rand_bf16(qn), *bk = rand_bf16(bn), *bv = rand_bf16(bn);
    uint16_t *kc = rand_bf16(cn), *vc = rand_bf16(cn), *ref = gpu_xmalloc((size_t)qn * 2);
    float scale = (float)(1.0 / sqrt((double)dim));
    /* the rows' positions (the op reads each request's first) */
    int64_t *pos = gpu_xmalloc((size_t)requests * rows * 8);
    for (int i = 0; i < requests; i++) {
        int64_t pi = i ? (int64_t)(rng_unit() * (double)(p + 1)) : p;
        for (int t = 0; t < rows; t++)
            pos[(size_t)i * rows + t] = pi + t;
    }
    if (g_cpu->ops->draft_attention(g_cpu, requests, rows, q_heads, kv_heads, dim, q, bk, bv, kc,
                                    vc, pages, cap, pos, window, scale, ref)) {
        fprintf(stderr, "test_cuda_draft: FATAL: the CPU op: %s\n", m3_last_error());
        exit(1);
    }
    void *dq = up(q, (size_t)qn * 2, 0), *dbk = up(bk, (size_t)bn * 2, 0);
    void *dbv = up(bv, (size_t)bn * 2, 0), *dkc = up(kc, (size_t)cn * 2, 0);
    void *dvc = up(vc, (size_t)cn * 2, 0), *dpages = up(pages, (size_t)requests * cap * 4, 0);
    void *dout = up(NULL, (size_t)qn * 2, GUARD);
    void *dpos = up(pos, (size_t)requests * rows * 8, 0);
    m3_status st = g_gpu->ops->draft_attention(g_gpu, requests, rows, q_heads, kv_heads, dim, dq,
                                               dbk, dbv, dkc, dvc, dpages, cap, dpos, window,
                                               scale, dout);
    if (!st)
        st = g_gpu->ops->sync(g_gpu);
    char shape[128];
    char reqs[32] = "";
    if (requests > 1)
        snprintf(reqs, sizeof reqs, "%d requests x ", requests);
    snprintf(shape, sizeof shape, "%s%d rows, %d/%d heads, dim %d, p %lld, window %lld", reqs,
             rows, q_heads, kv_heads, dim, (long long)p, (long long)window);
    g_cases++;
    if (st) {
        printf("draft_attention %s%-52s FAIL: %s\n", g_split_tag, shape, m3_last_error());
        g_fails++;
    } else {
        unsigned char *got = gpu_xmalloc((size_t)qn * 2 + GUARD);
        if (g_gpu->ops->download(g_gpu, got, dout, (size_t)qn * 2 + GUARD))
            exit(1);
        bool guard = true;
        const uint32_t w = POISON;
        for (size_t i = (size_t)qn * 2; i < (size_t)qn * 2 + GUARD; i++)
            guard &= got[i] == ((const unsigned char *)&w)[i % 4];
        float *g = gpu_xmalloc((size_t)qn * 4), *r = gpu_xmalloc((size_t)qn * 4);
        for (int64_t i = 0; i < qn; i++) {
            g[i] = m3_bf16_to_f32(((const uint16_t *)got)[i]);
            r[i] = m3_bf16_to_f32(ref[i]);
        }
        gpu_cmp c = gpu_compare_f32(g, r, qn);
        bool pass = guard && c.bad_special == 0 && c.rel_l2 <= TOL_OP;
        printf("draft_attention %s%-52s relL2 %-9.3g %s%s\n", g_split_tag, shape, c.rel_l2,
               pass ? "PASS" : "FAIL",
               guard ? "" : " (wrote past the end)");
        g_fails += !pass;
        free(got);
        free(g);
        free(r);
    }
    void *dev[] = {dq, dbk, dbv, dkc, dvc, dpages, dout, dpos};
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
        g_gpu->ops->release(g_gpu, dev[i]);
    free(pages);
    free(pos);
    free(q);
    free(bk);
    free(bv);
    free(kc);
    free(vc);
    free(ref);
}

static void test_op(void) {
    static const int64_t positions[] = {0, 1, 127, 128, 300, 3000};
    static const struct {
        int q, kv, dim;
    } heads[] = {{4, 2, 128}, {16, 1, 128}, {8, 8, 64}, {6, 2, 32}, {4, 4, 256},
                 /* the kernel's other loads: 3, 5 and 6 dims a lane */
                 {4, 2, 96},   {2, 1, 160},  {4, 1, 192}};
    for (size_t h = 0; h < sizeof heads / sizeof *heads; h++)
        for (size_t i = 0; i < sizeof positions / sizeof *positions; i++) {
            int rows = (int)(1 + (h + i) % 3 * 7) > 15 ? 15 : (int)(1 + (h + i) % 3 * 7);
            int64_t window = (i % 2) ? 0 : rows + rng_below(200);
            op_case(1, rows, heads[h].q, heads[h].kv, heads[h].dim, positions[i], window);
        }
    /* long contexts (split over CTAs by default), with and without a
     * window, at the split sizes' edges, 7 and 15 rows */
    static const struct {
        int rows, q, kv, dim;
        int64_t p, window;
    } longs[] = {{7, 16, 1, 128, 2048, 0},    {7, 16, 1, 128, 2047, 0},
                 {7, 16, 1, 128, 9001, 0},    {7, 16, 1, 128, 20000, 4096},
                 {15, 8, 2, 64, 33000, 0},    {3, 4, 4, 256, 12345, 2100},
                 {7, 4, 1, 96, 5000, 0},      {1, 2, 1, 32, 70000, 0},
                 /* 256 and 448 queries a KV head (2 and 4 passes of 128) */
                 {16, 16, 1, 128, 5000, 0},   {7, 64, 1, 128, 3000, 1000},
                 {5, 4, 2, 160, 4100, 0},     {2, 4, 1, 224, 3000, 2500},
                 {4, 8, 1, 192, 2500, 0}};
    for (size_t i = 0; i < sizeof longs / sizeof *longs; i++)
        op_case(1, longs[i].rows, longs[i].q, longs[i].kv, longs[i].dim, longs[i].p,
                longs[i].window);
    /* several requests in one call, each at its own position and block
     * table (the drafter's batch: 7 rows a request), short and long */
    static const struct {
        int requests, rows, q, kv, dim;
        int64_t p, window;
    } batches[] = {{3, 7, 16, 1, 128, 200, 0},   {8, 7, 16, 1, 128, 5000, 0},
                   {3, 7, 8, 2, 64, 3000, 700},  {8, 7, 16, 4, 128, 300, 0},
                   {2, 15, 16, 1, 128, 2500, 0}, {3, 1, 4, 1, 256, 4000, 0}};
    for (size_t i = 0; i < sizeof batches / sizeof *batches; i++)
        op_case(batches[i].requests, batches[i].rows, batches[i].q, batches[i].kv,
                batches[i].dim, batches[i].p, batches[i].window);
}

/* kind 0: random; 1: ties at the maximum; 2: NaN scattered, +-inf; 3: NaN
 * only; 4: -inf only */
static void argmax_case(int V, bool with_bias, int kind) {
    float *row = gpu_xmalloc((size_t)V * 4), *bias = gpu_xmalloc((size_t)V * 4);
    for (int v = 0; v < V; v++) {
        row[v] = (float)(8.0 * rng_unit() - 4.0);
        bias[v] = (float)(2.0 * rng_unit() - 1.0);
    }
    if (kind == 1) /* the maximum at several ids, the bias level there */
        for (int i = 0; i < 5; i++) {
            int v = rng_below(V);
            row[v] = 9.0f;
            bias[v] = 0.5f;
        }
    if (kind == 2)
        for (int i = 0; i < V / 50 + 2; i++) {
            int v = rng_below(V);
            row[v] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
        }
    if (kind >= 3)
        for (int v = 0; v < V; v++)
            row[v] = kind == 3 ? NAN : -INFINITY;
    float *ref = gpu_xmalloc((size_t)V * 4);
    memcpy(ref, row, (size_t)V * 4);
    int32_t ref_tok = -7;
    if (g_cpu->ops->draft_argmax(g_cpu, V, ref, with_bias ? bias : NULL, &ref_tok)) {
        fprintf(stderr, "test_cuda_draft: FATAL: the CPU op: %s\n", m3_last_error());
        exit(1);
    }
    void *drow = up(row, (size_t)V * 4, 0), *dbias = up(bias, (size_t)V * 4, 0);
    void *dtok = up(NULL, 4, GUARD); /* poisoned */
    m3_status st = g_gpu->ops->draft_argmax(g_gpu, V, drow, with_bias ? dbias : NULL, dtok);
    if (!st)
        st = g_gpu->ops->sync(g_gpu);
    char what[96];
    snprintf(what, sizeof what, "vocab %d, %s, kind %d", V, with_bias ? "bias" : "no bias", kind);
    g_cases++;
    if (st) {
        printf("draft_argmax %-40s FAIL: %s\n", what, m3_last_error());
        g_fails++;
    } else {
        float *got = gpu_xmalloc((size_t)V * 4);
        unsigned char tok[4 + GUARD];
        if (g_gpu->ops->download(g_gpu, got, drow, (size_t)V * 4) ||
            g_gpu->ops->download(g_gpu, tok, dtok, sizeof tok))
            exit(1);
        bool guard = true;
        const uint32_t w = POISON;
        for (size_t i = 4; i < sizeof tok; i++)
            guard &= tok[i] == ((const unsigned char *)&w)[i % 4];
        int32_t t;
        memcpy(&t, tok, 4);
        /* bitwise, except that a NaN's payload is the hardware's own */
        bool row_same = true;
        for (int v = 0; v < V && row_same; v++)
            row_same = isnan(got[v]) ? isnan(ref[v]) : !memcmp(&got[v], &ref[v], 4);
        bool pass = guard && row_same && t == ref_tok && t >= 0 && t < V;
        printf("draft_argmax %-40s token %d (CPU %d), row %s: %s%s\n", what, t, ref_tok,
               row_same ? "bitwise the CPU's" : "DIFFERS", pass ? "PASS" : "FAIL",
               guard ? "" : " (wrote past the token)");
        g_fails += !pass;
        free(got);
    }
    g_gpu->ops->release(g_gpu, drow);
    g_gpu->ops->release(g_gpu, dbias);
    g_gpu->ops->release(g_gpu, dtok);
    free(row);
    free(bias);
    free(ref);
}

static void test_argmax(void) {
    static const int vocabs[] = {1, 7, 4096, 12345, 200064};
    for (size_t i = 0; i < sizeof vocabs / sizeof *vocabs; i++)
        for (int kind = 0; kind < 5; kind++)
            argmax_case(vocabs[i], (kind + (int)i) % 2 == 0, kind);
    argmax_case(200064, true, 1);
    argmax_case(200064, false, 2);
}

/* A [V, R] bf16 weight at d on the GPU. */
static m3_tensor markov_tensor(void *d, int V, int R) {
    m3_tensor t = {M3_DT_BF16, 2, {V, R}, {(int64_t)R * 2, 2}, d, "markov"};
    return t;
}

/* The draft_markov op (the Markov step in one launch) against the three
 * ops it replaces on the same GPU (gather_rows, linear, draft_argmax per
 * request): the rows bit for bit (gaps between them untouched) and the
 * tokens, the token words poisoned first. kind 0: random; 1: a tie at the
 * maximum (equal W2 rows and rows at several ids); 2: NaN and +-inf in
 * the rows, one row NaN only (token 0). */
static void markov_case(int V, int R, int n, int kind) {
    const int64_t stride = V + 37; /* rows apart: the gaps must stay as they are */
    uint16_t *w1 = rand_bf16((int64_t)V * R), *w2 = rand_bf16((int64_t)V * R);
    float *rows = gpu_xmalloc((size_t)n * stride * 4);
    int32_t prev[M3_MAX_MARKOV_REQS];
    for (int64_t i = 0; i < n * stride; i++)
        rows[i] = (float)(8.0 * rng_unit() - 4.0);
    for (int g = 0; g < n; g++)
        prev[g] = rng_below(V);
    if (kind == 1)
        for (int g = 0; g < n; g++) {
            int v0 = rng_below(V);
            for (int i = 0; i < 4 && V > 1; i++) {
                int v = rng_below(V);
                memcpy(w2 + (int64_t)v * R, w2 + (int64_t)v0 * R, (size_t)R * 2);
                rows[g * stride + v] = 40.0f;
            }
            rows[g * stride + v0] = 40.0f;
        }
    if (kind == 2)
        for (int g = 0; g < n; g++)
            for (int i = 0; i < V / 50 + 2; i++)
                rows[g * stride + rng_below(V)] =
                    i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
    if (kind == 2)
        for (int v = 0; v < V; v++)
            rows[(n - 1) * stride + v] = NAN;
    size_t wbytes = (size_t)V * R * 2, rbytes = (size_t)n * stride * 4;
    void *d1 = up(w1, wbytes, 0), *d2 = up(w2, wbytes, 0), *dprev = up(prev, (size_t)n * 4, 0);
    void *rows_ops = up(rows, rbytes, 0), *rows_one = up(rows, rbytes, 0);
    void *tok_ops = up(NULL, (size_t)n * 4, GUARD), *tok_one = up(NULL, (size_t)n * 4, GUARD);
    void *w1rows = up(NULL, (size_t)n * R * 2, 0), *bias = up(NULL, (size_t)n * V * 4, 0);
    m3_tensor t1 = markov_tensor(d1, V, R), t2 = markov_tensor(d2, V, R);
    m3_linear lin = {t2, {0}, 0, 0};
    const m3_backend_ops *op = g_gpu->ops;
    /* the three ops, as the drafter runs them without draft_markov */
    m3_status st = op->gather_rows(g_gpu, n, dprev, R, d1, w1rows);
    if (!st)
        st = op->linear(g_gpu, n, w1rows, &lin, M3_DT_F32, bias);
    for (int g = 0; !st && g < n; g++)
        st = op->draft_argmax(g_gpu, V, (float *)rows_ops + g * stride,
                              (float *)bias + (size_t)g * V, (int32_t *)tok_ops + g);
    if (!st)
        st = op->draft_markov(g_gpu, 0, &t1, &t2, NULL, NULL, 0, NULL);
    if (!st)
        st = op->draft_markov(g_gpu, n, &t1, &t2, dprev, rows_one, stride, tok_one);
    if (!st)
        st = op->sync(g_gpu);
    char what[96];
    snprintf(what, sizeof what, "vocab %d, rank %d, %d requests, kind %d", V, R, n, kind);
    g_cases++;
    if (st) {
        printf("draft_markov %-44s FAIL: %s\n", what, m3_last_error());
        g_fails++;
    } else {
        float *a = gpu_xmalloc(rbytes), *b = gpu_xmalloc(rbytes);
        size_t tb = (size_t)n * 4 + GUARD;
        unsigned char *ta = gpu_xmalloc(tb), *tbuf = gpu_xmalloc(tb);
        if (op->download(g_gpu, a, rows_ops, rbytes) || op->download(g_gpu, b, rows_one, rbytes) ||
            op->download(g_gpu, ta, tok_ops, tb) || op->download(g_gpu, tbuf, tok_one, tb))
            exit(1);
        bool same = true, gaps = true, guard = true, toks = true;
        for (int64_t i = 0; i < n * stride; i++) {
            bool nan = isnan(a[i]) && isnan(b[i]);
            same &= nan || !memcmp(&a[i], &b[i], 4);
            if (i % stride >= V) /* a gap: still the input's value */
                gaps &= !memcmp(&b[i], &rows[i], 4);
        }
        const uint32_t w = POISON;
        for (size_t i = (size_t)n * 4; i < tb; i++)
            guard &= tbuf[i] == ((const unsigned char *)&w)[i % 4];
        int32_t t_ops[M3_MAX_MARKOV_REQS], t_one[M3_MAX_MARKOV_REQS];
        memcpy(t_ops, ta, (size_t)n * 4);
        memcpy(t_one, tbuf, (size_t)n * 4);
        for (int g = 0; g < n; g++)
            toks &= t_ops[g] == t_one[g] && t_one[g] >= 0 && t_one[g] < V;
        if (kind == 2)
            toks &= t_one[n - 1] == 0;
        bool pass = same && gaps && guard && toks;
        printf("draft_markov %-44s tokens %s (first %d), rows %s: %s%s%s\n", what,
               toks ? "the ops'" : "DIFFER", t_one[0], same ? "bitwise the ops'" : "DIFFER",
               pass ? "PASS" : "FAIL", gaps ? "" : " (wrote between rows)",
               guard ? "" : " (wrote past the tokens)");
        g_fails += !pass;
        free(a), free(b), free(ta), free(tbuf);
    }
    void *bufs[] = {d1, d2, dprev, rows_ops, rows_one, tok_ops, tok_one, w1rows, bias};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        op->release(g_gpu, bufs[i]);
    free(w1), free(w2), free(rows);
}

static void test_markov(void) {
    /* {1000, 64}: the linear op's split-K partials (8 chunks, fewer tiles
     * than multiprocessors) */
    static const int shapes[][2] = {{7, 8}, {4099, 256}, {12345, 64}, {3000, 1024}, {1000, 64}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int kind = 0; kind < 3; kind++)
            markov_case(shapes[i][0], shapes[i][1], 1 + (int)(i * 3 + kind) % 8, kind);
    markov_case(200064, 256, 1, 0);
    markov_case(200064, 256, 8, 1);
    /* shapes the linear op's tensor cores do not take: refused, not run */
    m3_tensor t = markov_tensor(NULL, 100, 12);
    g_cases++;
    m3_status st = g_gpu->ops->draft_markov(g_gpu, 0, &t, &t, NULL, NULL, 0, NULL);
    bool pass = st == M3_ERR_UNSUPPORTED;
    printf("draft_markov rank 12 (not a multiple of 8) refused: %s (%s)\n", pass ? "PASS" : "FAIL",
           m3_last_error());
    g_fails += !pass;
}

/* ------------------------------------------------------------ whole runs */

#define N_PROMPT 300
#define N_GEN 24

/* max_rows 0: 64 for one sequence, else 16 (a batch: two requests' 8 rows
 * a verify step) */
static m3_engine *engine_rows(m3_model *m, m3_device dev, bool graphs, int max_seqs,
                              int max_rows) {
    m3_engine_opts o = m3_engine_defaults();
    o.device = dev;
    o.graphs = graphs;
    o.threads = 4;
    o.max_rows = max_rows ? max_rows : max_seqs > 1 ? 16 : 64;
    o.max_seqs = max_seqs;
    o.max_tokens = (int64_t)max_seqs * (N_PROMPT + N_GEN + 128);
    o.decode = M3_DECODE_STOCK;
    m3_engine *e = NULL;
    if (m3_engine_create(m, &o, &e))
        fprintf(stderr, "engine: %s\n", m3_last_error());
    return e;
}

static m3_engine *engine_seqs(m3_model *m, m3_device dev, bool graphs, int max_seqs) {
    return engine_rows(m, dev, graphs, max_seqs, 0);
}

static m3_engine *engine(m3_model *m, m3_device dev, bool graphs) {
    return engine_seqs(m, dev, graphs, 1);
}

/* draft logits [steps, B, V] of a speculative run; NULL on failure */
static int64_t g_kernel_steps; /* the last spec_run's draft steps in the fused kernels */
static m3_spec_step *g_steps;  /* the last spec_run's steps (taken by the caller) */

static float *spec_run(m3_engine *e, m3_drafter *d, const int32_t *prompt, int32_t *tokens,
                       int *n_steps, int64_t *draft_replays) {
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = N_GEN;
    go.stop_at_eos = false;
    m3_gen_result res;
    m3_spec_stats s = {.keep_steps = true, .keep_draft_logits = true};
    m3_status st = m3_generate_speculative(e, d, prompt, N_PROMPT, &go, &res, &s);
    if (st) {
        fprintf(stderr, "speculative run: %s\n", m3_last_error());
        return NULL;
    }
    memcpy(tokens, res.tokens, N_GEN * sizeof *tokens);
    printf("  %d draft steps (%lld in the fused drafter kernels%s%s), %lld of %lld drafts "
           "accepted\n", s.n_steps, (long long)s.kernel_draft_steps,
           s.draft_kernels_off[0] ? ": off, " : "", s.draft_kernels_off, (long long)s.accepted,
           (long long)s.drafted);
    g_kernel_steps = s.kernel_draft_steps;
    free(res.tokens);
    free(g_steps);
    g_steps = s.steps;
    *n_steps = s.n_steps;
    *draft_replays = s.draft_replays;
    return s.draft_logits;
}

/* Two runs' draft logits over the rows both computed from the same inputs:
 * request by request, the steps in order while they start at the same
 * position and anchor, and in each step the rows up to and including the
 * first whose draft differs (row j's Markov bias comes from draft j - 1:
 * past a draft that a near tie flipped, the rows are not comparable).
 * Returns the relative L2 over all of them; rows: how many, median: the
 * median row's relative L2, beyond: rows beyond `bound` (1.0 and every row
 * beyond where a value is NaN in one run). */
typedef struct row_cmp {
    int rows, beyond;
    double median;
} row_cmp;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double agreeing_rel(const m3_spec_step *sa, const float *la, int na,
                           const m3_spec_step *sb, const float *lb, int nb, int B, int V,
                           double bound, row_cmp *out) {
    static double per_row[8192];
    double num = 0, den = 0;
    bool bad = false;
    *out = (row_cmp){0};
    for (int r = 0; r < 8; r++) {
        int i = 0, k = 0;
        for (;;) {
            while (i < na && sa[i].request != r)
                i++;
            while (k < nb && sb[k].request != r)
                k++;
            if (i >= na || k >= nb || sa[i].pos != sb[k].pos || sa[i].anchor != sb[k].anchor)
                break;
            for (int j = 0; j < B; j++) {
                const float *x = la + ((size_t)i * B + j) * V, *y = lb + ((size_t)k * B + j) * V;
                double rn = 0, rd = 0;
                for (int v = 0; v < V; v++) {
                    bad = bad || isnan(x[v]) || isnan(y[v]);
                    rn += ((double)x[v] - y[v]) * ((double)x[v] - y[v]);
                    rd += (double)y[v] * y[v];
                }
                num += rn;
                den += rd;
                double rel = rd > 0 ? sqrt(rn / rd) : 0.0;
                out->beyond += rel > bound;
                if (out->rows < (int)(sizeof per_row / sizeof *per_row))
                    per_row[out->rows] = rel;
                out->rows++;
                if (sa[i].drafts[j] != sb[k].drafts[j])
                    break;
            }
            i++;
            k++;
        }
    }
    int n = out->rows < 8192 ? out->rows : 8192;
    qsort(per_row, (size_t)n, sizeof *per_row, cmp_double);
    out->median = n ? per_row[n / 2] : 0.0;
    if (bad) {
        out->median = 1.0;
        out->beyond = out->rows;
        return 1.0;
    }
    return den > 0 ? sqrt(num / den) : 0.0;
}

/* bound: the median row's bound for the draft logits GPU vs CPU (TOL_RUN;
 * TOL_RUN_WINDOW for the windowed drafter) */
static void run_case(const char *what, m3_model *m, const char *draft_dir, double bound) {
    m3_drafter *d = NULL;
    g_cases++;
    if (m3_drafter_load(draft_dir, m, NULL, &d)) {
        printf("%s: FAIL: loading the drafter: %s\n", what, m3_last_error());
        g_fails++;
        return;
    }
    int V = m3_model_config(m)->vocab_size, B = m3_drafter_block(d);
    int32_t prompt[N_PROMPT], plain[N_GEN], gpu_tok[N_GEN], cpu_tok[N_GEN], eager_tok[N_GEN];
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 41 + 3) % V);
    m3_engine *eg = engine(m, M3_DEVICE_CUDA, true), *ec = engine(m, M3_DEVICE_CPU, false);
    m3_engine *ee = engine(m, M3_DEVICE_CUDA, false);
    gpu_trace t;
    bool ok = eg && ec && ee && gpu_trace_init(&t, N_GEN, V);
    ok = ok && !gpu_generate(eg, prompt, N_PROMPT, &t);
    if (ok)
        memcpy(plain, t.tok, sizeof plain);
    int gs = 0, cs = 0, es = 0;
    int64_t draft_replays = 0, eager_draft_replays = 0, cpu_draft_replays = 0;
    int64_t replays0 = eg ? m3_engine_get_stats(eg).graph_replays : 0;
    printf("%s, GPU:\n", what);
    float *gl = ok ? spec_run(eg, d, prompt, gpu_tok, &gs, &draft_replays) : NULL;
    m3_spec_step *g_run = g_steps;
    g_steps = NULL;
    int64_t replays = eg ? m3_engine_get_stats(eg).graph_replays - replays0 : 0;
    printf("%s, GPU without graphs:\n", what);
    float *el = ok ? spec_run(ee, d, prompt, eager_tok, &es, &eager_draft_replays) : NULL;
    /* the Markov head as three ops a row instead of draft_markov: the same
     * bits */
    printf("%s, GPU, the Markov head's ops (M3_DRAFT_MARKOV=ops):\n", what);
    int32_t ops_tok[N_GEN];
    int os = 0;
    int64_t ops_replays = 0;
    setenv("M3_DRAFT_MARKOV", "ops", 1);
    float *ol = ok ? spec_run(eg, d, prompt, ops_tok, &os, &ops_replays) : NULL;
    unsetenv("M3_DRAFT_MARKOV");
    bool ops_same = gl && ol && os == gs && !memcmp(ops_tok, gpu_tok, sizeof gpu_tok) &&
                    !memcmp(ol, gl, (size_t)gs * B * V * sizeof *gl);
    printf("%s: draft_markov vs its three ops: tokens and draft logits %s: %s\n", what,
           ops_same ? "bit-identical" : "DIFFER", ops_same ? "PASS" : "FAIL");
    g_cases++;
    g_fails += !ops_same;
    free(ol);
    /* the fused drafter layers (this run's default on the GPU: the tiny
     * preset's shapes, 7 rows) against the stock drafter's ops: the same
     * bits (at up to 16 rows both run the MMA linear's sums), unless the
     * stock ops split the attention over CTAs (g_split_runs: the fused
     * layers never do), then within TOL over the rows both computed alike */
    {
        int32_t lay_tok[N_GEN];
        int ls = 0;
        int64_t lay_replays = 0;
        int64_t g_steps_fused = 0;
        printf("%s, GPU, the fused drafter layers:\n", what);
        float *fl = ok ? spec_run(eg, d, prompt, lay_tok, &ls, &lay_replays) : NULL;
        g_steps_fused = g_kernel_steps;
        m3_spec_step *f_run = g_steps;
        g_steps = NULL;
        printf("%s, GPU, the stock drafter's ops (M3_DRAFT_LAYERS=ops):\n", what);
        setenv("M3_DRAFT_LAYERS", "ops", 1);
        int32_t sop_tok[N_GEN];
        int ss = 0;
        int64_t sop_replays = 0;
        float *sl = ok ? spec_run(eg, d, prompt, sop_tok, &ss, &sop_replays) : NULL;
        int64_t ops_steps = g_kernel_steps;
        setenv("M3_DRAFT_LAYERS", "fused", 1);
        bool lay_same = fl && sl && ls == ss && !memcmp(lay_tok, sop_tok, sizeof lay_tok) &&
                        !memcmp(fl, sl, (size_t)ls * B * V * sizeof *fl);
        bool ran = g_steps_fused == ls && ls > 0 && ops_steps == 0;
        row_cmp lc = {0};
        double lay_rel = fl && sl ? agreeing_rel(f_run, fl, ls, g_steps, sl, ss, B, V, TOL, &lc)
                                  : 1.0;
        bool lay_pass = ran && (g_split_runs ? lc.rows > 0 && lay_rel <= TOL : lay_same);
        printf("%s: fused drafter layers (%lld of %d steps) vs the stock ops (%lld): tokens and "
               "draft logits %s, relL2 %.3g over %d rows (%s): %s\n", what,
               (long long)g_steps_fused, ls, (long long)ops_steps,
               lay_same ? "bit-identical" : "differ", lay_rel, lc.rows,
               g_split_runs ? "tolerance" : "bits required", lay_pass ? "PASS" : "FAIL");
        g_cases++;
        g_fails += !lay_pass;
        free(f_run);
        free(fl);
        free(sl);
    }
    printf("%s, CPU:\n", what);
    float *cl = ok ? spec_run(ec, d, prompt, cpu_tok, &cs, &cpu_draft_replays) : NULL;
    m3_spec_step *c_run = g_steps;
    g_steps = NULL;
    ok = ok && gl && cl && el;
    bool same = ok && !memcmp(plain, gpu_tok, sizeof plain);
    /* verify steps (their taps written inside them) and draft steps
     * replayed from graphs against the same run stepped eagerly: the same
     * bits; the engines without graphs replayed nothing */
    bool graph_same = ok && gs == es && !memcmp(gpu_tok, eager_tok, sizeof gpu_tok) &&
                      !memcmp(gl, el, (size_t)gs * B * V * sizeof *gl);
    bool replayed = replays > 0 && draft_replays > 0 && !eager_draft_replays &&
                    !cpu_draft_replays;
    printf("%s: graphs vs eager: %lld verify and %lld draft steps replayed (eager %lld, CPU "
           "%lld), tokens and draft logits %s: %s\n",
           what, (long long)replays, (long long)draft_replays, (long long)eager_draft_replays,
           (long long)cpu_draft_replays, graph_same ? "bit-identical" : "DIFFER",
           graph_same && replayed ? "PASS" : "FAIL");
    g_cases++;
    g_fails += !(graph_same && replayed);
    /* the draft logits of the steps both runs share (their anchors agree
     * while their tokens do) */
    row_cmp rc = {0};
    double rel = ok && g_run && c_run
                     ? agreeing_rel(g_run, gl, gs, c_run, cl, cs, B, V, bound, &rc)
                     : 1.0;
    bool pass = ok && same && rc.rows > 0 && rc.median <= bound;
    printf("%s: GPU speculative tokens %s plain greedy's; draft logits GPU vs CPU over the %d rows "
           "both computed alike: relL2 %.3g, median row %.3g, %d rows beyond %.0e%s: %s\n", what,
           same ? "equal" : "DIFFER from", rc.rows, rel, rc.median, rc.beyond, bound,
           rc.beyond ? " (WARN: rows beyond it)" : "",
           pass ? "PASS" : "FAIL");
    free(g_run);
    free(c_run);
    g_fails += !pass;
    free(gl);
    free(cl);
    free(el);
    if (eg && ec && ee)
        gpu_trace_free(&t);
    m3_engine_free(ee);
    m3_engine_free(eg);
    m3_engine_free(ec);
    m3_drafter_free(d);
}


/* ------------------------------------------------------------ a batch */

#define N_BATCH 3

typedef struct batch_run {
    int32_t tokens[N_BATCH][N_GEN];
    m3_spec_stats s;
} batch_run;

static bool batch_spec(m3_engine *e, m3_drafter *d, const int32_t *const *prompts,
                       const int *lens, batch_run *out) {
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = N_GEN;
    go.stop_at_eos = false;
    m3_gen_result res[N_BATCH];
    out->s = (m3_spec_stats){.keep_steps = true, .keep_draft_logits = true};
    if (!e || m3_generate_speculative_batch(e, d, N_BATCH, prompts, lens, &go, res, &out->s)) {
        fprintf(stderr, "batch run: %s\n", m3_last_error());
        return false;
    }
    for (int r = 0; r < N_BATCH; r++) {
        memcpy(out->tokens[r], res[r].tokens, sizeof out->tokens[r]);
        free(res[r].tokens);
    }
    printf("  %lld cycles in %lld steps, %lld of %lld drafts accepted, %lld draft steps "
           "replayed\n", (long long)out->s.cycles, (long long)out->s.batch_steps,
           (long long)out->s.accepted, (long long)out->s.drafted,
           (long long)out->s.draft_replays);
    return true;
}

/* Three prompts of different lengths decoded speculatively together, two
 * requests a cycle (max_rows 16: a draft step of 14 rows, a verify step of
 * 16 whose graph bucket also serves one request's 16 rows), then the
 * third: on the GPU with graphs (a draft step graph per request count, a
 * verify graph per row count) bit for bit the same run as without; each
 * request's first draft step (the same context and anchor on both devices
 * when their first tokens agree) against the CPU
 * batch within bf16 noise; each request's tokens against plain batched
 * decoding's (equal: a cycle verifies in steps of at most 16 rows); and
 * against its plain greedy run alone on the GPU (equal unless a near tie
 * flips where the stock path's rows depend on the batch, its prefill's
 * included: reported, not failed). */
/* max_rows 16: two requests a cycle (a 16-row verify step); 32: all three
 * (24 rows, a verify bucket above the decode steps' 16) */
static void batch_case(const char *what, m3_model *m, const char *draft_dir, int max_rows) {
    m3_drafter *d = NULL;
    g_cases += 2;
    if (m3_drafter_load(draft_dir, m, NULL, &d)) {
        printf("%s: FAIL: loading the drafter: %s\n", what, m3_last_error());
        g_fails += 2;
        return;
    }
    int V = m3_model_config(m)->vocab_size, B = m3_drafter_block(d);
    static int32_t buf[N_BATCH][N_PROMPT];
    const int32_t *prompts[N_BATCH];
    int lens[N_BATCH];
    for (int r = 0; r < N_BATCH; r++) {
        lens[r] = N_PROMPT - 61 * r;
        for (int i = 0; i < lens[r]; i++)
            buf[r][i] = (int32_t)((i * 41 + 3 + 7 * r) % V);
        prompts[r] = buf[r];
    }
    m3_engine *eg = engine_rows(m, M3_DEVICE_CUDA, true, N_BATCH, max_rows);
    m3_engine *ee = engine_rows(m, M3_DEVICE_CUDA, false, N_BATCH, max_rows);
    m3_engine *ec = engine_rows(m, M3_DEVICE_CPU, false, N_BATCH, max_rows);
    batch_run g = {0}, e = {0}, c = {0};
    printf("%s, GPU:\n", what);
    bool ok = batch_spec(eg, d, prompts, lens, &g);
    printf("%s, GPU without graphs:\n", what);
    ok = batch_spec(ee, d, prompts, lens, &e) && ok;
    printf("%s, CPU:\n", what);
    ok = batch_spec(ec, d, prompts, lens, &c) && ok;
    batch_run o = {0};
    printf("%s, GPU, the stock drafter's ops (M3_DRAFT_LAYERS=ops):\n", what);
    setenv("M3_DRAFT_LAYERS", "ops", 1);
    ok = batch_spec(eg, d, prompts, lens, &o) && ok;
    setenv("M3_DRAFT_LAYERS", "fused", 1);
    size_t row = (size_t)B * V;
    bool graph_same = ok && g.s.n_steps == e.s.n_steps && !memcmp(g.tokens, e.tokens,
                                                                  sizeof g.tokens) &&
                      !memcmp(g.s.draft_logits, e.s.draft_logits,
                              (size_t)g.s.n_steps * row * sizeof(float));
    int64_t verify_replays = eg ? m3_engine_get_stats(eg).graph_replays : 0;
    bool replayed = g.s.draft_replays > 0 && !e.s.draft_replays && verify_replays > 0;
    printf("%s: graphs vs eager: %lld draft and %lld target steps replayed, tokens and draft "
           "logits %s: %s\n", what, (long long)g.s.draft_replays, (long long)verify_replays,
           graph_same ? "bit-identical" : "DIFFER",
           graph_same && replayed ? "PASS" : "FAIL");
    g_fails += !(graph_same && replayed);
    /* the fused drafter layers against the stock ops: the same bits where a
     * draft step has at most 16 rows (both sum on the MMA linear), else
     * within bf16 noise (the stock linear is cuBLAS there) */
    bool small = max_rows / (B + 1) * B <= 16;
    bool ran = ok && g.s.kernel_draft_steps > 0 && !o.s.kernel_draft_steps;
    row_cmp lc = {0};
    double lay_rel = ok ? agreeing_rel(g.s.steps, g.s.draft_logits, g.s.n_steps, o.s.steps,
                                       o.s.draft_logits, o.s.n_steps, B, V, TOL, &lc)
                        : 1.0;
    int lay_n = lc.rows;
    bool lay_same = ok && g.s.n_steps == o.s.n_steps &&
                    !memcmp(g.tokens, o.tokens, sizeof g.tokens) &&
                    !memcmp(g.s.draft_logits, o.s.draft_logits,
                            (size_t)g.s.n_steps * row * sizeof(float));
    bool lay_pass = ran && (small ? lay_same : lay_n > 0 && lay_rel <= TOL);
    printf("%s: fused drafter layers (%lld steps) vs the stock ops: %s, relL2 %.3g over the "
           "rows both computed alike (%s): %s\n", what,
           ok ? (long long)g.s.kernel_draft_steps : 0LL,
           lay_same ? "bit-identical" : "differ", lay_rel,
           small ? "bits required" : "tolerance", lay_pass ? "PASS" : "FAIL");
    g_cases++;
    g_fails += !lay_pass;
    row_cmp rc = {0};
    double worst = ok ? agreeing_rel(g.s.steps, g.s.draft_logits, g.s.n_steps, c.s.steps,
                                     c.s.draft_logits, c.s.n_steps, B, V, TOL_RUN, &rc)
                      : 1.0;
    int compared = rc.rows;
    bool pass = ok && compared > 0 && rc.median <= TOL_RUN;
    printf("%s: draft logits GPU vs CPU over the %d rows both computed alike: relL2 %.3g, median "
           "row %.3g, %d rows beyond %.0e: %s\n", what, compared, worst, rc.median, rc.beyond,
           TOL_RUN, pass ? "PASS" : "FAIL");
    g_fails += !pass;
    /* against plain batched decoding of the same prompts on the same
     * engine shape (its prefill alike, its decode steps of 3 rows): the
     * same tokens, since a cycle verifies in steps of at most the
     * backend's exact rows (16: two steps for all three requests' 24 rows,
     * one for two requests' 16; M3_LINEAR_MMA_ROWS=64: one), whose rows
     * round as a decode step's */
    g_cases++;
    m3_engine *ep = engine_rows(m, M3_DEVICE_CUDA, true, N_BATCH, max_rows);
    m3_gen_opts pgo = m3_gen_defaults();
    pgo.max_new_tokens = N_GEN;
    pgo.stop_at_eos = false;
    m3_gen_result pres[N_BATCH];
    memset(pres, 0, sizeof pres);
    bool plain_ok = ok && ep && !m3_generate_batch(ep, N_BATCH, prompts, lens, &pgo, pres);
    int same_plain = 0;
    for (int r = 0; r < N_BATCH; r++) {
        same_plain += plain_ok && pres[r].n_tokens == N_GEN &&
                      !memcmp(pres[r].tokens, g.tokens[r], sizeof g.tokens[r]);
        free(pres[r].tokens);
    }
    int exact = g_gpu->exact_rows > 0 ? g_gpu->exact_rows : 1 << 20;
    int part = exact / (B + 1), per_cycle = max_rows / (B + 1) < N_BATCH ? max_rows / (B + 1)
                                                                     : N_BATCH;
    bool parts_ok = ok && (per_cycle > part ? g.s.verify_steps > g.s.batch_steps
                                            : g.s.verify_steps == g.s.batch_steps);
    bool plain_pass = same_plain == N_BATCH && parts_ok;
    printf("%s: %d of %d requests' tokens equal plain batched decoding's; %lld verify steps "
           "for %lld cycles: %s\n", what, same_plain, N_BATCH,
           ok ? (long long)g.s.verify_steps : 0LL, ok ? (long long)g.s.batch_steps : 0LL,
           plain_pass ? "PASS" : "FAIL");
    g_fails += !plain_pass;
    m3_engine_free(ep);
    /* against each prompt's plain greedy run alone on the GPU */
    int equal = 0;
    gpu_trace t;
    if (ok && gpu_trace_init(&t, N_GEN, V)) {
        for (int r = 0; r < N_BATCH; r++) {
            m3_engine *fresh = engine(m, M3_DEVICE_CUDA, true);
            t.n = 0;
            if (fresh && !gpu_generate(fresh, prompts[r], lens[r], &t))
                equal += !memcmp(t.tok, g.tokens[r], sizeof g.tokens[r]);
            m3_engine_free(fresh);
        }
        gpu_trace_free(&t);
    }
    printf("%s: %d of %d requests' tokens equal their plain greedy run alone%s\n", what, equal,
           N_BATCH, equal == N_BATCH ? "" : " (WARN: the stock path's rows depend on the batch)");
    m3_spec_stats_free(&g.s);
    m3_spec_stats_free(&e.s);
    m3_spec_stats_free(&c.s);
    m3_spec_stats_free(&o.s);
    m3_engine_free(eg);
    m3_engine_free(ee);
    m3_engine_free(ec);
    m3_drafter_free(d);
}

/* Plain batched generation of 20 prompts on the GPU, more than one decode
 * step takes (16, the rows a step that samples on the device has): every
 * request gets its tokens; three of them against their runs alone
 * (reported: the stock path's rows depend on the batch). */
static void plain_batch_case(m3_model *m) {
    enum { N = 20, LEN = 40 };
    g_cases++;
    int V = m3_model_config(m)->vocab_size;
    static int32_t buf[N][LEN];
    const int32_t *prompts[N];
    int lens[N];
    for (int r = 0; r < N; r++) {
        lens[r] = LEN - r;
        for (int i = 0; i < lens[r]; i++)
            buf[r][i] = (int32_t)((i * 13 + 5 + 11 * r) % V);
        prompts[r] = buf[r];
    }
    m3_engine *e = engine_seqs(m, M3_DEVICE_CUDA, true, N);
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = N_GEN;
    go.stop_at_eos = false;
    m3_gen_result res[N];
    m3_status st = e ? m3_generate_batch(e, N, prompts, lens, &go, res) : M3_ERR_DEVICE;
    bool ok = st == M3_OK;
    for (int r = 0; ok && r < N; r++) {
        ok = res[r].n_tokens == N_GEN;
        for (int i = 0; ok && i < N_GEN; i++)
            ok = res[r].tokens[i] >= 0 && res[r].tokens[i] < V;
    }
    int equal = 0;
    gpu_trace t;
    if (ok && gpu_trace_init(&t, N_GEN, V)) {
        for (int r = 0; r < 3; r++) {
            m3_engine *one = engine(m, M3_DEVICE_CUDA, true);
            t.n = 0;
            if (one && !gpu_generate(one, prompts[r], lens[r], &t))
                equal += !memcmp(t.tok, res[r].tokens, N_GEN * sizeof(int32_t));
            m3_engine_free(one);
        }
        gpu_trace_free(&t);
    }
    printf("plain batch of %d prompts: %s%s; %d of 3 requests equal their runs alone: %s\n", N,
           ok ? "every request has its tokens" : "FAILED: ", ok ? "" : m3_last_error(), equal,
           ok ? "PASS" : "FAIL");
    g_fails += !ok;
    for (int r = 0; st == M3_OK && r < N; r++)
        free(res[r].tokens);
    m3_engine_free(e);
}

int main(void) {
    int rc = gpu_probe("test_cuda_draft");
    if (rc)
        return rc;
    if (m3_cuda_backend_create(0, &g_gpu) || m3_cpu_backend_create(0, &g_cpu)) {
        fprintf(stderr, "test_cuda_draft: FAILED: backends: %s\n", m3_last_error());
        return 1;
    }
    /* the GPU's runs take the fused drafter layers (off by default); the
     * cases that compare them with the stock ops ask for those. Their
     * attention is the short-context kernel's at every position, so the
     * whole runs keep the stock ops' attention there too (the tiny runs'
     * contexts, 300 keys and more, are past the default split), and the
     * two compare bit for bit; one run splits from one key. */
    setenv("M3_DRAFT_LAYERS", "fused", 1);
    setenv("M3_DRAFT_SPLIT_FROM", NEVER_SPLIT, 1);
    g_rng = gpu_test_seed(0xd5a4cull);
    printf("test_cuda_draft: seed %llu (set M3_TEST_SEED to vary)\n", (unsigned long long)g_rng);
    test_op();
    /* every op case again through the split kernels only, in their build
     * for one CTA a multiprocessor and in the one for two (where the head
     * dim has it), and through the short-context kernel only (a backend
     * reads M3_DRAFT_SPLIT_FROM and M3_DRAFT_SPLIT_TWO_FROM when created) */
    static const char *const froms[] = {"1", "1", NEVER_SPLIT};
    static const char *const twos[] = {"0", "1", "0"};
    static const char *const tags[] = {"(split from 1, one CTA an SM) ",
                                       "(split from 1, two CTAs an SM) ", "(never split) "};
    m3_backend *gpu = g_gpu;
    for (int i = 0; i < 3; i++) {
        setenv("M3_DRAFT_SPLIT_FROM", froms[i], 1);
        setenv("M3_DRAFT_SPLIT_TWO_FROM", twos[i], 1);
        if (m3_cuda_backend_create(0, &g_gpu)) {
            fprintf(stderr, "test_cuda_draft: FAILED: backend: %s\n", m3_last_error());
            return 1;
        }
        g_split_tag = tags[i];
        test_op();
        g_gpu->ops->destroy(g_gpu);
    }
    unsetenv("M3_DRAFT_SPLIT_TWO_FROM");
    g_gpu = gpu;
    g_split_tag = "";
    test_argmax();
    test_markov();

    char tdir[512], ddir[600];
    m3_config cfg;
    m3_model *m = NULL;
    if (gpu_synth_model("tiny", "draft", 7, tdir, sizeof tdir, &cfg, &m)) {
        fprintf(stderr, "test_cuda_draft: FAILED: synth: %s\n", m3_last_error());
        return 1;
    }
    snprintf(ddir, sizeof ddir, "%s/draft", tdir);
    m3_synth_draft_opts dopt = {3, 7, 0, false};
    m3_synth_opts so = {9, false, 0};
    if (m3_synth_drafter(&cfg, ddir, &dopt, &so)) {
        fprintf(stderr, "test_cuda_draft: FAILED: drafter synth: %s\n", m3_last_error());
        return 1;
    }
    run_case("random drafter", m, ddir, TOL_RUN);
    /* the same with the drafter's attention split over CTAs at every
     * position (its engines' backends read the switch when created), the
     * fused layers (which never split) against the stock ops within TOL */
    setenv("M3_DRAFT_SPLIT_FROM", "1", 1);
    g_split_runs = true;
    run_case("random drafter, attention split from 1 key", m, ddir, TOL_RUN);
    g_split_runs = false;
    setenv("M3_DRAFT_SPLIT_FROM", NEVER_SPLIT, 1);
    batch_case("random drafter, a batch of 3, two a cycle", m, ddir, 16);
    batch_case("random drafter, a batch of 3, all in one cycle", m, ddir, 32);
    plain_batch_case(m);
    snprintf(ddir, sizeof ddir, "%s/draft_window", tdir);
    dopt.window = 16;
    if (!m3_synth_drafter(&cfg, ddir, &dopt, &so))
        run_case("windowed drafter", m, ddir, TOL_RUN_WINDOW);
    /* the same weights with a window wider than the context (every key
     * seen, as unwindowed): where the 16-key drafter's gap comes from the
     * window's few keys, this one agrees as the unwindowed drafter does */
    snprintf(ddir, sizeof ddir, "%s/draft_window_wide", tdir);
    dopt.window = 1024;
    if (!m3_synth_drafter(&cfg, ddir, &dopt, &so))
        run_case("windowed drafter, 1,024 keys", m, ddir, TOL_RUN);
    m3_model_free(m);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tdir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tdir);
    g_gpu->ops->destroy(g_gpu);
    g_cpu->ops->destroy(g_cpu);
    printf("test_cuda_draft: %d of %d cases failed\n", g_fails, g_cases);
    return g_fails ? 1 : 0;
}
