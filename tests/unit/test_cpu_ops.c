/*
 * Unit tests of the CPU backend's op table (backend/backend.h). The CPU
 * backend is the reference every GPU kernel and fused path is checked
 * against, so each of its ops is checked here against a second,
 * straightforward C implementation written in this file from SPEC §2.3 / §3
 * with the same rounding points and the precision convention of
 * docs/ARCHITECTURE.md: every dot product and reduction (projections,
 * router, q·k, p·v, index scores, the norms' mean of squares, the softmax
 * sum) accumulated in double and rounded to fp32 once; elementwise math in
 * fp32 with no fused multiply-adds, exp (softmax, sigmoid) the correctly
 * rounded fp32 exponential (float)exp((double)x); the MoE combine and the
 * routing-weight sum in fp32 in routing-rank order. These are the rules
 * the backend header and the numpy reference (tests/reference/m3_ref.py)
 * state.
 *
 * Method, per op: fresh inputs from a seeded generator (bf16 values of
 * order one; M3_TEST_SEED varies them), outputs poisoned with NaN bit
 * patterns first so that an unwritten element fails, the op run on a
 * 1-thread and a 3-thread backend (outputs must be bitwise identical: the
 * backend promises thread-count independence), and the result compared
 * with the reference. As the math is identical, the comparison is exact
 * (bits equal, NaN only where the reference has NaN); the stated
 * tolerances, relative L2 error <= 1e-6 for fp32 and <= 1e-3 for bf16
 * outputs with a NaN or inf never passing for a finite reference, are
 * checked as a second, coarser verdict so that a failure says whether the
 * difference is rounding-level or gross. Selections (blocks) are compared
 * exactly. Each op family also has a tiny hand-computed example, so that
 * one formula error shared by the reference and the library cannot cancel.
 * Two conventions get targeted inputs because random data rarely shows
 * them: a softmax whose bf16 output differs between libm's expf and the
 * correctly rounded exp, and MoE experts nobody routes to whose weights
 * are NaN or memory that faults on any access (so "not read" is checked,
 * not just "did not reach the output").
 *
 * This program checks the dense ops (embedding, gather, add + norm, linear,
 * per-head norm + RoPE, cache writes) and the DSpark Markov step
 * (draft_argmax); test_cpu_attention_ops.c the sparse
 * attention ops (index scores, block selection, attention) and
 * test_cpu_moe_ops.c SwiGLU and the MoE; cpu_ops_check.h holds what they
 * share.
 */
#include "core/bf16.h"
#include "cpu_ops_check.h"

/* ------------------------------------------------------------ embed, gather */

static void test_embed(void) {
    enum { V = 37, H = 96, PADW = 8, ROWS = 7 };
    /* a table whose rows are strided (nb[0] > H*2): the op must honour nb */
    uint16_t *table = rand_bf16((int64_t)V * (H + PADW), 1.0f);
    m3_tensor t = {.dtype = M3_DT_BF16, .ndim = 2, .ne = {V, H},
                   .nb = {(H + PADW) * 2, 2}, .data = table};
    int32_t tokens[ROWS] = {0, V - 1, 5, 5, 17, 0, 36};
    uint16_t *out[N_BE], *ref = xalloc(ROWS * H * 2);
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < H; h++)
            ref[r * H + h] = table[tokens[r] * (H + PADW) + h];
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(ROWS * H);
        CHECK_OK(g_be[i]->ops->embed(g_be[i], ROWS, tokens, &t, 0, out[i]));
    }
    EXPECT_BF16("embed", out[0], ref, ROWS * H);
    EXPECT_SAME("embed", out[0], out[1], ROWS * H * 2);

    /* hand: rows {1,2},{3,4}; tokens 1,0,1 -> 3,4,1,2,3,4 */
    uint16_t tiny[4] = {f2bf(1), f2bf(2), f2bf(3), f2bf(4)}, got[6];
    int64_t ne[2] = {2, 2};
    m3_tensor tt = m3_tensor_make(M3_DT_BF16, 2, ne, tiny);
    int32_t tok[3] = {1, 0, 1};
    fill16(got, 6, BF16_NAN);
    CHECK_OK(g_be[1]->ops->embed(g_be[1], 3, tok, &tt, 0, got));
    const float want[6] = {3, 4, 1, 2, 3, 4};
    for (int k = 0; k < 6; k++)
        EXPECT_BF16_IS(got[k], want[k]);
    /* a TP rank's slice [5, 7): token 6 is its row 1, tokens 1 and 0 are
     * another rank's (zero rows) */
    int32_t tok_tp[3] = {6, 1, 0};
    fill16(got, 6, BF16_NAN);
    CHECK_OK(g_be[1]->ops->embed(g_be[1], 3, tok_tp, &tt, 5, got));
    const float want_tp[6] = {3, 4, 0, 0, 0, 0};
    for (int k = 0; k < 6; k++)
        EXPECT_BF16_IS(got[k], want_tp[k]);
    free(table);
    free(ref);
    free_all((void **)out, N_BE);
}

static void test_gather_rows(void) {
    enum { SRC = 20, DIM = 70, N = 9 };
    uint16_t *src = rand_bf16(SRC * DIM, 1.0f), *out[N_BE], *ref = xalloc(N * DIM * 2);
    int32_t idx[N] = {3, 0, 19, 3, 7, 7, 12, 1, 0};
    for (int r = 0; r < N; r++)
        memcpy(ref + r * DIM, src + idx[r] * DIM, DIM * 2);
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(N * DIM);
        CHECK_OK(g_be[i]->ops->gather_rows(g_be[i], N, idx, DIM, src, out[i]));
    }
    EXPECT_BF16("gather_rows", out[0], ref, N * DIM);
    EXPECT_SAME("gather_rows", out[0], out[1], N * DIM * 2);

    /* hand: rows {1,2},{3,4},{5,6}; idx 2,0 -> 5,6,1,2 */
    uint16_t tiny[6] = {f2bf(1), f2bf(2), f2bf(3), f2bf(4), f2bf(5), f2bf(6)}, got[4];
    int32_t ti[2] = {2, 0};
    fill16(got, 4, BF16_NAN);
    CHECK_OK(g_be[1]->ops->gather_rows(g_be[1], 2, ti, 2, tiny, got));
    const float want[4] = {5, 6, 1, 2};
    for (int k = 0; k < 4; k++)
        EXPECT_BF16_IS(got[k], want[k]);
    free(src);
    free(ref);
    free_all((void **)out, N_BE);
}

/* ------------------------------------------------------------ add_rmsnorm */

static void norm_case(int rows, int dim, bool with_add) {
    float eps = 1e-6f;
    uint16_t *add = with_add ? rand_bf16((int64_t)rows * dim, 1.0f) : NULL;
    uint16_t *res0 = rand_bf16((int64_t)rows * dim, 1.0f), *w = rand_bf16(dim, 0.5f);
    /* rows of different scales (1/4 .. 4), so r differs per row */
    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dim; i++)
            res0[t * dim + i] = f2bf(bf2f(res0[t * dim + i]) * ldexpf(1.0f, t % 5 - 2));
    int64_t n = (int64_t)rows * dim;
    uint16_t *res_ref = dup16(res0, n), *out_ref = xalloc((size_t)n * 2);
    float *x = xalloc((size_t)dim * 4), *y = xalloc((size_t)dim * 4);
    for (int t = 0; t < rows; t++) {
        for (int i = 0; i < dim; i++) {
            int64_t k = (int64_t)t * dim + i;
            if (add) /* the residual is a rounding point */
                res_ref[k] = f2bf(bf2f(add[k]) + bf2f(res0[k]));
            x[i] = bf2f(res_ref[k]);
        }
        ref_norm_row(x, w, dim, eps, y);
        for (int i = 0; i < dim; i++)
            out_ref[(int64_t)t * dim + i] = f2bf(y[i]);
    }
    m3_tensor wt = vec_bf16(w, dim);
    uint16_t *res[N_BE], *out[N_BE];
    for (int i = 0; i < N_BE; i++) {
        res[i] = dup16(res0, n);
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->add_rmsnorm(g_be[i], rows, dim, add, res[i], &wt, eps, out[i]));
    }
    const char *what = with_add ? "add_rmsnorm (add)" : "add_rmsnorm (no add)";
    EXPECT_BF16(what, res[0], res_ref, n); /* without add: untouched */
    EXPECT_BF16(what, out[0], out_ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    EXPECT_SAME(what, res[0], res[1], (size_t)n * 2);
    free(add);
    free(res0);
    free(w);
    free(res_ref);
    free(out_ref);
    free(x);
    free(y);
    free_all((void **)res, N_BE);
    free_all((void **)out, N_BE);
}

/* 2-element norms worked by hand. */
static void norm_tiny(void) {
    m3_backend *be = g_be[1];
    /* residual {0.5,0.5} + add {1.5,-2.5} = {2,-2}; ms 4, r 0.5, x*r {1,-1};
     * w {0.5,-0.5}: y = {1.5, -0.5} */
    uint16_t add[2] = {f2bf(1.5f), f2bf(-2.5f)}, res[2] = {f2bf(0.5f), f2bf(0.5f)};
    uint16_t w[2] = {f2bf(0.5f), f2bf(-0.5f)}, out[2] = {BF16_NAN, BF16_NAN};
    m3_tensor wt = vec_bf16(w, 2);
    CHECK_OK(be->ops->add_rmsnorm(be, 1, 2, add, res, &wt, 0.0f, out));
    EXPECT_BF16_IS(res[0], 2.0f);
    EXPECT_BF16_IS(res[1], -2.0f);
    EXPECT_BF16_IS(out[0], 1.5f);
    EXPECT_BF16_IS(out[1], -0.5f);
    /* {3,4}, w 0: ms 12.5, y = {3,4}/sqrt(12.5) = {0.848528, 1.131371}
     * -> bf16 {0.84765625, 1.1328125} */
    uint16_t res2[2] = {f2bf(3), f2bf(4)}, w0[2] = {0, 0};
    wt = vec_bf16(w0, 2);
    CHECK_OK(be->ops->add_rmsnorm(be, 1, 2, NULL, res2, &wt, 0.0f, out));
    EXPECT_BF16_IS(out[0], 0.84765625f);
    EXPECT_BF16_IS(out[1], 1.1328125f);
    /* eps inside the root: {1,1}, eps 3 -> 1/sqrt(1+3) = 0.5 */
    uint16_t res3[2] = {f2bf(1), f2bf(1)};
    CHECK_OK(be->ops->add_rmsnorm(be, 1, 2, NULL, res3, &wt, 3.0f, out));
    EXPECT_BF16_IS(out[0], 0.5f);
    EXPECT_BF16_IS(out[1], 0.5f);
}

static void test_add_rmsnorm(void) {
    norm_case(5, 200, true);
    norm_case(5, 200, false);
    norm_case(1, 6144, true);  /* the M3 hidden size */
    norm_case(48, 2048, true); /* enough rows that every thread takes some */
    norm_tiny();
}

/* ------------------------------------------------------------ linear */

static void linear_case(const char *what, int rows, const m3_linear *l) {
    int64_t N = l->w.ne[0], K = l->w.ne[1], n = rows * N;
    uint16_t *x = rand_bf16(rows * K, 1.0f);
    float *ref = xalloc((size_t)n * 4);
    ref_linear(rows, x, l, ref);
    uint16_t *ref16 = xalloc((size_t)n * 2);
    for (int64_t k = 0; k < n; k++)
        ref16[k] = f2bf(ref[k]);
    void *out[N_BE];
    for (int pass = 0; pass < 2; pass++) { /* bf16, then f32 output */
        m3_dtype dt = pass ? M3_DT_F32 : M3_DT_BF16;
        size_t bytes = (size_t)n * (pass ? 4 : 2);
        for (int i = 0; i < N_BE; i++) {
            out[i] = xalloc(bytes);
            if (pass)
                fill32(out[i], n, F32_NAN_BITS);
            else
                fill16(out[i], n, BF16_NAN);
            CHECK_OK(g_be[i]->ops->linear(g_be[i], rows, x, l, dt, out[i]));
        }
        if (pass)
            EXPECT_F32(what, out[0], ref, n);
        else
            EXPECT_BF16(what, out[0], ref16, n);
        EXPECT_SAME(what, out[0], out[1], bytes);
        free_all(out, N_BE);
    }
    free(x);
    free(ref);
    free(ref16);
}

/* Hand-computed products, bf16 and MXFP8 weights. */
static void linear_tiny(void) {
    m3_backend *be = g_be[1];
    /* x {1,2}, W {{3,4},{-1,0.5}} -> {11, 0} */
    uint16_t x[2] = {f2bf(1), f2bf(2)}, w[4] = {f2bf(3), f2bf(4), f2bf(-1), f2bf(0.5f)};
    m3_linear l = lin_bf16(w, 2, 2);
    float out[3];
    fill32(out, 3, F32_NAN_BITS);
    CHECK_OK(be->ops->linear(be, 1, x, &l, M3_DT_F32, out));
    CHECK(out[0] == 11.0f && out[1] == 0.0f);

    /* MXFP8, K = 64 (two scale blocks), x all ones:
     * row 0: 1.0 (0x38) everywhere, scales 2^1, 2^-2: 32*2 + 32*0.25 = 72
     * row 1: subnormal 2^-9 (0x01) at k=0 and k=32, scales 2^9, 2^10: 1 + 2 = 3
     * row 2: -2 (0xC0) at k=0, 1.5 (0x3C) at k=1..31, scale 2^-1: 22.25;
     *        448 (0x7E, the largest normal) at k=63, scale 2^-7: 3.5 -> 25.75 */
    uint8_t q[3 * 64] = {0}, s[6] = {128, 125, 136, 137, 126, 120};
    memset(q, 0x38, 64);
    q[64] = 0x01;
    q[64 + 32] = 0x01;
    q[128] = 0xC0;
    memset(q + 129, 0x3C, 31);
    q[128 + 63] = 0x7E;
    uint16_t ones[64];
    fill16(ones, 64, f2bf(1));
    l = lin_mxfp8(q, s, 3, 64);
    fill32(out, 3, F32_NAN_BITS);
    CHECK_OK(be->ops->linear(be, 1, ones, &l, M3_DT_F32, out));
    CHECK(out[0] == 72.0f && out[1] == 3.0f && out[2] == 25.75f);
    uint16_t o16[3];
    fill16(o16, 3, BF16_NAN);
    CHECK_OK(be->ops->linear(be, 1, ones, &l, M3_DT_BF16, o16));
    EXPECT_BF16_IS(o16[0], 72.0f);
    EXPECT_BF16_IS(o16[2], 25.75f);
}

static void test_linear(void) {
    /* N = 37: not a multiple of the 4 weight rows a pass widens */
    uint16_t *wb = rand_bf16(37 * 96, 0.5f);
    m3_linear lb = lin_bf16(wb, 37, 96);
    linear_case("linear bf16, 1 row", 1, &lb);
    linear_case("linear bf16, 5 rows", 5, &lb);
    /* a view of rows [3, 3+20) of the same weight */
    m3_linear lv = m3_linear_rows_view(&lb, 3, 20);
    linear_case("linear bf16 row view", 3, &lv);

    uint8_t *q = xalloc(37 * 128), *s = xalloc(37 * 4);
    for (int k = 0; k < 37 * 128; k++)
        q[k] = rand_e4m3();
    for (int k = 0; k < 37 * 4; k++)
        s[k] = (uint8_t)(121 + rng_below(6)); /* 2^-6 .. 2^-1 */
    m3_linear lq = lin_mxfp8(q, s, 37, 128);
    linear_case("linear mxfp8, 1 row", 1, &lq);
    linear_case("linear mxfp8, 6 rows", 6, &lq);

    /* wide enough that the weight rows are split over every thread */
    uint16_t *wb2 = rand_bf16(256 * 512, 0.2f);
    m3_linear lb2 = lin_bf16(wb2, 256, 512);
    linear_case("linear bf16 256x512", 4, &lb2);
    uint8_t *q2 = xalloc(256 * 512), *s2 = xalloc(256 * 16);
    for (int k = 0; k < 256 * 512; k++)
        q2[k] = rand_e4m3();
    for (int k = 0; k < 256 * 16; k++)
        s2[k] = (uint8_t)(120 + rng_below(4));
    m3_linear lq2 = lin_mxfp8(q2, s2, 256, 512);
    linear_case("linear mxfp8 256x512", 3, &lq2);
    linear_tiny();
    free(wb);
    free(q);
    free(s);
    free(wb2);
    free(q2);
    free(s2);
}

/* ------------------------------------------------------------ head_norm_rope */

static void ref_head_norm_rope(int rows, int heads, int dim, uint16_t *x, int64_t stride,
                               const uint16_t *w, float eps, const int64_t *pos,
                               const m3_rope *rope) {
    int half = rope->rotary_dim / 2;
    float *c = xalloc((size_t)dim * 4), *s = xalloc((size_t)dim * 4);
    float *xf = xalloc((size_t)dim * 4), *y = xalloc((size_t)dim * 4);
    for (int t = 0; t < rows; t++) {
        for (int i = 0; i < half; i++) { /* the angle in double, cos/sin rounded */
            double inv_freq = pow(rope->theta, -(2.0 * i) / rope->rotary_dim);
            double ang = (double)pos[t] * inv_freq;
            c[i] = (float)cos(ang);
            s[i] = (float)sin(ang);
        }
        for (int h = 0; h < heads; h++) {
            uint16_t *hx = x + t * stride + (int64_t)h * dim;
            for (int i = 0; i < dim; i++)
                xf[i] = bf2f(hx[i]);
            ref_norm_row(xf, w, dim, eps, y);
            for (int i = 0; i < half; i++) {
                float a = y[i], b = y[i + half];
                y[i] = a * c[i] - b * s[i];
                y[i + half] = b * c[i] + a * s[i];
            }
            for (int i = 0; i < dim; i++)
                hx[i] = f2bf(y[i]);
        }
    }
    free(c);
    free(s);
    free(xf);
    free(y);
}

static void rope_case(const char *what, int rows, int heads, int dim, int gap,
                      const int64_t *pos, const m3_rope *rope) {
    float eps = 1e-6f;
    int64_t stride = (int64_t)heads * dim + gap, n = rows * stride;
    /* the gap between rows must stay untouched: it is random like the rest */
    uint16_t *x0 = rand_bf16(n, 2.0f), *w = rand_bf16(dim, 0.5f), *ref = dup16(x0, n);
    ref_head_norm_rope(rows, heads, dim, ref, stride, w, eps, pos, rope);
    m3_tensor wt = vec_bf16(w, dim);
    uint16_t *x[N_BE];
    for (int i = 0; i < N_BE; i++) {
        x[i] = dup16(x0, n);
        CHECK_OK(g_be[i]->ops->head_norm_rope(g_be[i], rows, heads, dim, x[i], stride, &wt, eps,
                                              pos, rope));
    }
    EXPECT_BF16(what, x[0], ref, n);
    EXPECT_SAME(what, x[0], x[1], (size_t)n * 2);
    free(x0);
    free(w);
    free(ref);
    free_all((void **)x, N_BE);
}

/* dim 4, rotary 2 (one pair, inv_freq 1: the angle is the position), eps 0:
 * row 0 at position 0, x {2,2,2,2}, w {0,0,1,-0.5}: normed {1,1,2,0.5}, no
 * rotation; row 1 at position 1, x {1,1,1,1}: {cos1 - sin1, cos1 + sin1,
 * 2, 0.5} = {-0.301169, 1.381773, 2, 0.5} -> bf16 {-0.30078125, 1.3828125}. */
static void rope_tiny(void) {
    m3_backend *be = g_be[1];
    uint16_t x[8], w[4] = {0, 0, f2bf(1), f2bf(-0.5f)};
    fill16(x, 4, f2bf(2));
    fill16(x + 4, 4, f2bf(1));
    int64_t pos[2] = {0, 1};
    m3_rope rope = {2, 10000.0};
    m3_tensor wt = vec_bf16(w, 4);
    CHECK_OK(be->ops->head_norm_rope(be, 2, 1, 4, x, 4, &wt, 0.0f, pos, &rope));
    const float want[8] = {1, 1, 2, 0.5f, -0.30078125f, 1.3828125f, 2, 0.5f};
    for (int k = 0; k < 8; k++)
        EXPECT_BF16_IS(x[k], want[k]);
}

static void test_head_norm_rope(void) {
    /* M3 shapes (dim 128, rotary 64, theta 5e6); positions up to 2^20 - 1,
     * where an fp32 angle would be visibly off */
    int64_t pos[5] = {0, 1, 777, 131072 + 5, (1 << 20) - 1};
    m3_rope m3r = {64, 5000000.0};
    rope_case("head_norm_rope M3", 5, 3, 128, 40, pos, &m3r);
    rope_case("head_norm_rope one head", 5, 1, 128, 0, pos, &m3r);
    m3_rope full = {64, 10000.0};
    rope_case("head_norm_rope full rotary", 4, 2, 64, 8, pos + 1, &full);
    int64_t many[40];
    for (int t = 0; t < 40; t++)
        many[t] = (int64_t)(rng_u64() % (1u << 20));
    rope_case("head_norm_rope 40 rows, 8 heads", 40, 8, 128, 128, many, &m3r);
    rope_tiny();
}

/* ------------------------------------------------------------ cache_write */

static void test_cache_write(void) {
    enum { PAGES = 4, HEADS = 2, DIM = 16, ROWS = 6, GAP = 8 };
    const int64_t stride = HEADS * DIM + GAP, cn = (int64_t)PAGES * HEADS * PAGE * DIM;
    int64_t slots[ROWS] = {130, -1, 0, 511, 257, -7}; /* negative: padded, skipped */
    uint16_t *src = rand_bf16(ROWS * stride, 1.0f), *c0 = rand_bf16(cn, 1.0f);
    uint16_t *ref = dup16(c0, cn), *cache[N_BE];
    for (int t = 0; t < ROWS; t++) {
        if (slots[t] < 0)
            continue;
        int64_t page = slots[t] / PAGE, off = slots[t] % PAGE;
        for (int h = 0; h < HEADS; h++)
            memcpy(ref + ((page * HEADS + h) * PAGE + off) * DIM, src + t * stride + h * DIM,
                   DIM * 2);
    }
    for (int i = 0; i < N_BE; i++) {
        cache[i] = dup16(c0, cn);
        CHECK_OK(g_be[i]->ops->cache_write(g_be[i], ROWS, slots, HEADS, DIM, src, stride,
                                           cache[i]));
    }
    /* the whole cache: written slots hold the rows, every other slot is untouched */
    EXPECT_BF16("cache_write", cache[0], ref, cn);
    EXPECT_SAME("cache_write", cache[0], cache[1], (size_t)cn * 2);
    /* hand: slot 130 is page 1, offset 2; head 1, element 5 */
    CHECK(cache[0][((1 * HEADS + 1) * PAGE + 2) * DIM + 5] == src[0 * stride + 1 * DIM + 5]);
    free(src);
    free(c0);
    free(ref);
    free_all((void **)cache, N_BE);
}

/* The test's own bf16 rounding, on values worked out by hand. */
static void test_reference_rounding(void) {
    CHECK(f2bf(1.0f) == 0x3f80);
    CHECK(f2bf(1.0f + 0x1p-8f) == 0x3f80);        /* tie, even stays */
    CHECK(f2bf(1.0f + 3 * 0x1p-8f) == 0x3f82);    /* tie, odd rounds up */
    CHECK(f2bf(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);
    CHECK(f2bf(-2.0f) == 0xc000);
    CHECK(f2bf(3.4e38f) == 0x7f80);               /* rounds up to inf */
    CHECK(isnan(bf2f(f2bf(NAN))));
    CHECK(ref_e4m3(0x38) == 1.0 && ref_e4m3(0x7e) == 448.0 && ref_e4m3(0x01) == 0x1p-9);
    CHECK(ref_e4m3(0xC0) == -2.0 && isnan(ref_e4m3(0xff)));
}

/* m3_f32_to_e4m3 (synth's encoder) against a search over every code: the
 * nearest finite magnitude, ties to the even code, the sign kept; on every
 * code's value, the midpoints between neighbours (the ties) and values a
 * hair either side of them, and random values in range. */
static uint8_t brute_e4m3(float f) {
    float a = fabsf(f), best_err = INFINITY;
    int best = 0;
    for (int c = 0; c < 127; c++) {
        float err = fabsf((float)ref_e4m3((uint8_t)c) - a);
        if (err < best_err || (err == best_err && !(c & 1))) {
            best = c;
            best_err = err;
        }
    }
    return (uint8_t)((f < 0 ? 0x80 : 0) | best);
}

static void test_e4m3_encode(void) {
    int bad = 0;
    for (int c = 0; c < 127; c++) {
        float v = (float)ref_e4m3((uint8_t)c);
        float probes[5] = {v, -v, 0, 0, 0};
        if (c < 126) {
            float mid = (v + (float)ref_e4m3((uint8_t)(c + 1))) / 2; /* exact: few bits */
            probes[2] = mid;
            probes[3] = nextafterf(mid, 0);
            probes[4] = -nextafterf(mid, INFINITY);
        }
        for (int i = 0; i < 5; i++)
            bad += m3_f32_to_e4m3(probes[i]) != brute_e4m3(probes[i]);
    }
    for (int i = 0; i < 20000; i++) {
        float f = rng_sym(448.0f) * (i % 3 ? 1.0f : 0x1p-8f);
        bad += m3_f32_to_e4m3(f) != brute_e4m3(f);
    }
    CHECK(bad == 0);
    CHECK(m3_f32_to_e4m3(448.0f) == 0x7e && m3_f32_to_e4m3(-1.0f) == 0xb8);
    CHECK(m3_f32_to_e4m3(0x1p-10f) == 0x00); /* half the smallest subnormal: tie to 0 */
}

/* ------------------------------------------------------------ draft_argmax */

/* The DSpark Markov step (backend.h): row += bias in fp32, written back;
 * the token is the lowest id of the row's maximum, NaN never chosen, 0 when
 * every value is NaN. */
static void test_draft_argmax(void) {
    enum { V = 1000 };
    float *row = xalloc(V * 4), *bias = xalloc(V * 4), *ref = xalloc(V * 4);
    for (int trial = 0; trial < 6; trial++) {
        for (int v = 0; v < V; v++) {
            row[v] = rng_sym(4.0f);
            bias[v] = rng_sym(1.0f);
        }
        if (trial >= 2) /* NaN scattered, infinities, a tied maximum */
            for (int i = 0; i < 30; i++)
                row[rng_below(V)] = i % 3 == 0 ? NAN : i % 3 == 1 ? -INFINITY : 9.0f;
        if (trial == 3) /* bias 0 at the tied 9s: still tied */
            for (int v = 0; v < V; v++)
                if (row[v] == 9.0f)
                    bias[v] = 0.0f;
        bool with_bias = trial % 2 == 0 || trial == 3;
        int32_t want = -1;
        for (int v = 0; v < V; v++) {
            ref[v] = with_bias ? row[v] + bias[v] : row[v];
            if (!isnan(ref[v]) && (want < 0 || ref[v] > ref[want]))
                want = v;
        }
        for (int i = 0; i < N_BE; i++) {
            float *got = xalloc(V * 4);
            memcpy(got, row, V * 4);
            int32_t tok = -7;
            CHECK_OK(g_be[i]->ops->draft_argmax(g_be[i], V, got, with_bias ? bias : NULL, &tok));
            bool same = true;
            for (int v = 0; v < V; v++)
                same &= isnan(ref[v]) ? isnan(got[v]) : !memcmp(&got[v], &ref[v], 4);
            CHECK(same);
            CHECK(tok == want);
            free(got);
        }
    }
    /* hand: {1, NaN, 3, 3} + {0, 0, 0.5, 0.5} -> {1, NaN, 3.5, 3.5}: token 2;
     * all NaN: token 0; all -inf: token 0 (the lowest of a tied maximum) */
    float h[4] = {1, NAN, 3, 3}, hb[4] = {0, 0, 0.5f, 0.5f};
    int32_t tok = -1;
    CHECK_OK(g_be[0]->ops->draft_argmax(g_be[0], 4, h, hb, &tok));
    CHECK(tok == 2 && h[2] == 3.5f && h[3] == 3.5f && h[0] == 1.0f && isnan(h[1]));
    float nan4[4] = {NAN, NAN, NAN, NAN}, ninf[3] = {-INFINITY, -INFINITY, -INFINITY};
    tok = -1;
    CHECK_OK(g_be[0]->ops->draft_argmax(g_be[0], 4, nan4, NULL, &tok));
    CHECK(tok == 0);
    tok = -1;
    CHECK_OK(g_be[0]->ops->draft_argmax(g_be[0], 3, ninf, NULL, &tok));
    CHECK(tok == 0);
    /* bad arguments name what is wrong */
    CHECK(g_be[0]->ops->draft_argmax(g_be[0], 0, h, NULL, &tok) == M3_ERR_INVALID_ARG);
    free(row);
    free(bias);
    free(ref);
}

int main(void) {
    void (*const tests[])(void) = {test_reference_rounding, test_e4m3_encode, test_embed, test_gather_rows,
                                   test_add_rmsnorm, test_linear, test_head_norm_rope,
                                   test_cache_write, test_draft_argmax};
    return cpu_ops_main("test_cpu_ops", tests, (int)(sizeof tests / sizeof *tests));
}
