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
 */
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "check.h"
#include "core/tensor.h"
#include "decode/step.h"

#define N_BE 2
#define PAGE M3_PAGE_TOKENS
#define TOL_F32 1e-6
#define TOL_BF16 1e-3
#define BF16_NAN 0x7fc0u
#define F32_NAN_BITS 0xffffffffu
#define SEL_POISON 0x5a5a5a5au /* not -1: -1 is a valid padding value */

/* The backends under test: results must not depend on the thread count. */
static m3_backend *g_be[N_BE];
static const int g_threads[N_BE] = {1, 3};

/* ------------------------------------------------------------ helpers */

static uint64_t g_rng;

static uint64_t rng_u64(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_sym(float amp) {
    return (float)(((double)(rng_u64() >> 11) * 0x1p-53 * 2.0 - 1.0) * amp);
}
static int rng_below(int n) { return (int)(rng_u64() % (uint64_t)n); }

static void *xalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "test_cpu_ops: out of memory\n");
        exit(2);
    }
    return p;
}

/* bf16 written independently of core/bf16.h: the reference must not share
 * the library's rounding code. Round to nearest, ties to even; NaN stays
 * NaN (quiet), overflow carries into the exponent (to inf). */
static float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x40u);
    uint32_t upper = u >> 16, lower = u & 0xffffu;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u)))
        upper++;
    return (uint16_t)upper;
}
static float rbf(float f) { return bf2f(f2bf(f)); }

static uint16_t *rand_bf16(int64_t n, float amp) {
    uint16_t *p = xalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        p[i] = f2bf(rng_sym(amp));
    return p;
}
static void fill16(uint16_t *p, int64_t n, uint16_t v) {
    for (int64_t i = 0; i < n; i++)
        p[i] = v;
}
static void fill32(void *p, int64_t n, uint32_t v) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)p + 4 * i, &v, 4);
}
static uint16_t *dup16(const uint16_t *src, int64_t n) {
    uint16_t *p = xalloc((size_t)n * 2);
    memcpy(p, src, (size_t)n * 2);
    return p;
}
static uint16_t *poisoned16(int64_t n) {
    uint16_t *p = xalloc((size_t)n * 2);
    fill16(p, n, BF16_NAN);
    return p;
}
static void free_all(void **p, int n) {
    for (int i = 0; i < n; i++)
        free(p[i]);
}

/* ------------------------------------------------------------ comparing */

typedef struct diff {
    int64_t mismatches, first; /* elements not bit-identical; the first */
    double rel_l2;             /* over elements whose reference is finite */
    bool bad_special;          /* NaN/inf where the reference is finite, or vice versa */
} diff;

static bool same_f32(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y || (isnan(a) && isnan(b));
}

static diff diff_f32(const float *got, const float *ref, int64_t n) {
    diff d = {0, -1, 0.0, false};
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!same_f32(got[i], ref[i]) && d.mismatches++ == 0)
            d.first = i;
        if (!isfinite(ref[i]) || !isfinite(got[i])) {
            d.bad_special |= !same_f32(got[i], ref[i]);
            continue;
        }
        double e = (double)got[i] - (double)ref[i];
        num += e * e;
        den += (double)ref[i] * (double)ref[i];
    }
    d.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
    return d;
}

/* The verdict: exact (identical math), and within tol as a second check. */
static void expect_close(const char *what, int line, const float *got, const float *ref,
                         int64_t n, double tol) {
    diff d = diff_f32(got, ref, n);
    if (d.mismatches || d.bad_special || d.rel_l2 > tol)
        fprintf(stderr,
                "  line %d, %s: %lld of %lld differ (first [%lld]: got %.9g want %.9g), "
                "rel L2 %.3g (tol %.0e)%s\n",
                line, what, (long long)d.mismatches, (long long)n, (long long)d.first,
                d.first >= 0 ? got[d.first] : 0.0, d.first >= 0 ? ref[d.first] : 0.0, d.rel_l2,
                tol, d.bad_special ? ", NaN/inf mismatch" : "");
    CHECK(d.mismatches == 0);
    CHECK(!d.bad_special && d.rel_l2 <= tol);
}

#define EXPECT_F32(what, got, ref, n) expect_close(what, __LINE__, got, ref, n, TOL_F32)
#define EXPECT_BF16(what, got, ref, n) expect_bf16(what, __LINE__, got, ref, n)

static void expect_bf16(const char *what, int line, const uint16_t *got, const uint16_t *ref,
                        int64_t n) {
    float *g = xalloc((size_t)n * 4), *r = xalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) {
        g[i] = bf2f(got[i]);
        r[i] = bf2f(ref[i]);
    }
    expect_close(what, line, g, r, n, TOL_BF16);
    free(g);
    free(r);
}

#define EXPECT_SAME(what, a, b, bytes) expect_same(what, __LINE__, a, b, bytes)
static void expect_same(const char *what, int line, const void *a, const void *b, size_t bytes) {
    bool same = memcmp(a, b, bytes) == 0;
    if (!same)
        fprintf(stderr, "  line %d, %s: 1-thread and 3-thread outputs differ\n", line, what);
    CHECK(same);
}

/* A hand-computed expectation: the bf16 value itself, exactly. */
#define EXPECT_BF16_IS(got, want) expect_bf16_is(__LINE__, got, want)
static void expect_bf16_is(int line, uint16_t got, float want) {
    bool ok = bf2f(got) == want;
    if (!ok)
        fprintf(stderr, "  line %d: got %.9g, hand-computed %.9g\n", line, bf2f(got), want);
    CHECK(ok);
}

/* ------------------------------------------------------------ tensors */

static m3_tensor vec_bf16(uint16_t *data, int64_t n) {
    int64_t ne[1] = {n};
    return m3_tensor_make(M3_DT_BF16, 1, ne, data);
}
static m3_linear lin_bf16(uint16_t *w, int64_t N, int64_t K) {
    int64_t ne[2] = {N, K};
    m3_linear l = {m3_tensor_make(M3_DT_BF16, 2, ne, w), {0}, 0, 0};
    return l;
}
static m3_linear lin_mxfp8(uint8_t *q, uint8_t *s, int64_t N, int64_t K) {
    int64_t ne[2] = {N, K}, nes[2] = {N, K / 32};
    m3_linear l = {m3_tensor_make(M3_DT_F8_E4M3, 2, ne, q), m3_tensor_make(M3_DT_U8, 2, nes, s),
                   0, 0};
    return l;
}

/* A finite random e4m3 byte (exponent field <= 10: never the NaN code;
 * exponent 0 gives subnormals). */
static uint8_t rand_e4m3(void) {
    return (uint8_t)(rng_below(2) << 7 | rng_below(11) << 3 | rng_below(8));
}

/* e4m3fn decoded from the format's definition (bias 7, subnormals
 * man/8 * 2^-6, S.1111.111 NaN), independently of core/bf16.h. */
static double ref_e4m3(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7)
        return NAN;
    double v = e ? ldexp(8 + m, e - 10) : ldexp(m, -9);
    return (b & 0x80) ? -v : v;
}

/* Row n of a linear weight in double (bf16, or MXFP8 element x 2^(s-127)). */
static void ref_weight_row(const m3_linear *l, int64_t n, double *dst) {
    int64_t K = l->w.ne[1];
    const char *row = (const char *)l->w.data + n * l->w.nb[0];
    for (int64_t k = 0; k < K; k++) {
        if (l->w.dtype == M3_DT_BF16) {
            dst[k] = bf2f(((const uint16_t *)row)[k]);
        } else {
            uint8_t s = ((const uint8_t *)l->scale.data)[n * l->scale.nb[0] + k / 32];
            dst[k] = ref_e4m3(((const uint8_t *)row)[k]) * (s == 255 ? NAN : ldexp(1, s - 127));
        }
    }
}

/* sum a[i] b[i] in double, in order, rounded to fp32 once. */
static float ref_dot(const double *a, const double *b, int64_t n) {
    double acc = 0;
    for (int64_t i = 0; i < n; i++)
        acc += a[i] * b[i];
    return (float)acc;
}

/* out[t, n] = x[t] . w[n] in fp32 (not rounded to bf16). */
static void ref_linear(int rows, const uint16_t *x, const m3_linear *l, float *out) {
    int64_t N = l->w.ne[0], K = l->w.ne[1];
    double *xd = xalloc((size_t)K * 8), *wd = xalloc((size_t)K * 8);
    for (int64_t n = 0; n < N; n++) {
        ref_weight_row(l, n, wd);
        for (int t = 0; t < rows; t++) {
            for (int64_t k = 0; k < K; k++)
                xd[k] = bf2f(x[t * K + k]);
            out[t * N + n] = ref_dot(xd, wd, K);
        }
    }
    free(xd);
    free(wd);
}

/* Gemma RMSNorm of one fp32 row, exactly as SPEC §2.3 and cpu.h state it:
 * ms = (float)(sum_double(x^2) / dim), r = 1/sqrtf(ms + eps), (x*r)*(1+w). */
static void ref_norm_row(const float *x, const uint16_t *w, int dim, float eps, float *y) {
    double ss = 0;
    for (int i = 0; i < dim; i++)
        ss += (double)x[i] * (double)x[i];
    float ms = (float)(ss / dim);
    float r = 1.0f / sqrtf(ms + eps);
    for (int i = 0; i < dim; i++)
        y[i] = (x[i] * r) * (1.0f + bf2f(w[i]));
}

/* The correctly rounded fp32 exp (libm's expf is one ulp off on about one
 * input in 13000, enough to flip a bf16 rounding now and then). */
static float ref_exp(float x) { return (float)exp((double)x); }

/* SwiGLU-OAI with the clamps written as comparisons, so NaN propagates
 * (as np.minimum / np.clip do in the numpy reference). */
static float ref_swiglu(float gate, float up, const m3_swiglu *a) {
    float g = gate > a->limit ? a->limit : gate;
    float u = up > a->limit ? a->limit : (up < -a->limit ? -a->limit : up);
    float sig = 1.0f / (1.0f + ref_exp(-a->alpha * g));
    return g * sig * (u + 1.0f);
}

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

/* ------------------------------------------------------------ step metadata */

/* A hand-built step: requests r with lens[r] tokens, the last qlens[r] of
 * them this step's rows, then `pad` padded rows (slot -1, position 0,
 * request 0). Blocks map to pages drawn from a shuffled pool, so requests
 * have different, non-contiguous block tables. host == dev (CPU backend). */
typedef struct tstep {
    m3_step st;
    void *mem[7];
} tstep;

static void tstep_build(tstep *s, int n_reqs, const int *lens, const int *qlens, int pad,
                        int max_blocks, int n_pages) {
    int rows = pad;
    for (int r = 0; r < n_reqs; r++)
        rows += qlens[r];
    m3_step_arrays *h = &s->st.host;
    memset(s, 0, sizeof *s);
    s->mem[0] = h->tokens = xalloc((size_t)rows * 4);
    s->mem[1] = h->positions = xalloc((size_t)rows * 8);
    s->mem[2] = h->slots = xalloc((size_t)rows * 8);
    s->mem[3] = h->row_req = xalloc((size_t)rows * 4);
    s->mem[4] = h->seq_lens = xalloc((size_t)n_reqs * 4);
    s->mem[5] = h->query_start = xalloc((size_t)(n_reqs + 1) * 4);
    s->mem[6] = h->block_table = xalloc((size_t)n_reqs * max_blocks * 4);
    int32_t *perm = xalloc((size_t)n_pages * 4);
    for (int p = 0; p < n_pages; p++)
        perm[p] = p;
    for (int p = n_pages - 1; p > 0; p--) {
        int q = rng_below(p + 1);
        int32_t tmp = perm[p];
        perm[p] = perm[q];
        perm[q] = tmp;
    }
    int t = 0, next_page = 0;
    for (int r = 0; r < n_reqs; r++) {
        int nb = (lens[r] + PAGE - 1) / PAGE;
        for (int b = 0; b < max_blocks; b++)
            h->block_table[r * max_blocks + b] = b < nb ? perm[next_page++] : -1;
        h->seq_lens[r] = lens[r];
        h->query_start[r] = t;
        for (int i = 0; i < qlens[r]; i++, t++) {
            int64_t p = lens[r] - qlens[r] + i;
            h->tokens[t] = 0;
            h->positions[t] = p;
            h->slots[t] = (int64_t)h->block_table[r * max_blocks + p / PAGE] * PAGE + p % PAGE;
            h->row_req[t] = r;
        }
        if (qlens[r] > s->st.max_query_len)
            s->st.max_query_len = qlens[r];
        if (qlens[r] > 1)
            s->st.n_prefill++;
        else
            s->st.n_decode++;
    }
    h->query_start[n_reqs] = t;
    for (; t < rows; t++) {
        h->tokens[t] = 0;
        h->positions[t] = 0;
        h->slots[t] = -1;
        h->row_req[t] = 0;
    }
    free(perm);
    s->st.rows = rows;
    s->st.n_reqs = n_reqs;
    s->st.max_blocks = max_blocks;
    s->st.n_pages = n_pages;
    s->st.graph_mode = M3_GRAPH_NONE;
    s->st.dev = s->st.host;
}

static void tstep_free(tstep *s) { free_all(s->mem, 7); }

/* Element offset of (token at position pos of request r, head) in a
 * [pages, heads, 128, dim] cache. */
static int64_t cache_at(const m3_step *st, int r, int64_t pos, int heads, int head, int dim) {
    int64_t page = st->host.block_table[r * st->max_blocks + pos / PAGE];
    return ((page * heads + head) * PAGE + pos % PAGE) * dim;
}

/* A cache that is NaN everywhere except the requests' tokens (random), so
 * that reading any slot a request does not own shows up as NaN. */
static uint16_t *make_cache(const m3_step *st, const int *lens, int heads, int dim, float amp) {
    int64_t n = st->n_pages * heads * PAGE * dim;
    uint16_t *c = poisoned16(n);
    for (int r = 0; r < st->n_reqs; r++)
        for (int64_t p = 0; p < lens[r]; p++)
            for (int h = 0; h < heads; h++) {
                uint16_t *e = c + cache_at(st, r, p, heads, h, dim);
                for (int i = 0; i < dim; i++)
                    e[i] = f2bf(rng_sym(amp));
            }
    return c;
}

/* ------------------------------------------------------------ index_scores */

/* scores [rows, heads, max_blocks] of the real rows (padded rows' outputs
 * are ignored by the caller, so they are left as the library wrote them). */
static void ref_index_scores(const m3_step *st, int heads, int dim, const uint16_t *iq,
                             const uint16_t *ic, float scale, const float *got, float *ref) {
    double *q = xalloc((size_t)dim * 8), *k = xalloc((size_t)dim * 8);
    for (int t = 0; t < st->rows; t++) {
        int64_t kv_len = st->host.positions[t] + 1, nb = (kv_len + PAGE - 1) / PAGE;
        for (int h = 0; h < heads; h++) {
            float *out = ref + ((int64_t)t * heads + h) * st->max_blocks;
            if (st->host.slots[t] < 0) {
                memcpy(out, got + (out - ref), (size_t)st->max_blocks * 4);
                continue;
            }
            for (int i = 0; i < dim; i++)
                q[i] = bf2f(iq[((int64_t)t * heads + h) * dim + i]);
            for (int b = 0; b < st->max_blocks; b++) {
                float best = -INFINITY;
                for (int64_t p = (int64_t)b * PAGE; b < nb && p < kv_len && p < (b + 1) * PAGE;
                     p++) {
                    const uint16_t *e = ic + cache_at(st, st->host.row_req[t], p, 1, 0, dim);
                    for (int i = 0; i < dim; i++)
                        k[i] = bf2f(e[i]);
                    float d = ref_dot(q, k, dim);
                    if (isnan(d) || isnan(best))
                        best = NAN; /* NaN propagates through the max */
                    else if (d > best)
                        best = d;
                }
                out[b] = best * scale; /* -inf past the visible blocks */
            }
        }
    }
    free(q);
    free(k);
}

static void run_index_scores(const char *what, const m3_step *st, int heads, int dim,
                             const uint16_t *iq, const uint16_t *ic, float scale, float **out) {
    int64_t n = (int64_t)st->rows * heads * st->max_blocks;
    for (int i = 0; i < N_BE; i++) {
        out[i] = xalloc((size_t)n * 4);
        fill32(out[i], n, F32_NAN_BITS);
        CHECK_OK(g_be[i]->ops->index_scores(g_be[i], st, heads, dim, iq, ic, scale, out[i]));
    }
    float *ref = xalloc((size_t)n * 4);
    ref_index_scores(st, heads, dim, iq, ic, scale, out[0], ref);
    EXPECT_F32(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 4);
    free(ref);
}

/* dim 2, one row at position 2: keys {1,0},{0,1},{-1,-1} (position 3, not
 * yet visible, is {10,10}); iq {1,2}: dots 1, 2, -3 -> max 2, times scale
 * 0.5 = 1; block 1 is not visible: -inf. */
static void index_tiny(void) {
    int lens[1] = {3}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, 2, 2);
    uint16_t ic[2 * PAGE * 2];
    fill16(ic, 2 * PAGE * 2, BF16_NAN);
    const float keys[4][2] = {{1, 0}, {0, 1}, {-1, -1}, {10, 10}};
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 2; i++)
            ic[cache_at(&s.st, 0, p, 1, 0, 2) + i] = f2bf(keys[p][i]);
    uint16_t iq[2] = {f2bf(1), f2bf(2)};
    float sc[2];
    fill32(sc, 2, F32_NAN_BITS);
    CHECK_OK(g_be[1]->ops->index_scores(g_be[1], &s.st, 1, 2, iq, ic, 0.5f, sc));
    CHECK(sc[0] == 1.0f);
    CHECK(sc[1] == -INFINITY);
    tstep_free(&s);
}

static void test_index_scores(void) {
    enum { HEADS = 2, DIM = 128, MAXB = 10, NREQ = 4 };
    /* partial last blocks (300, 1000, 5), an exactly full block (128) */
    int lens[NREQ] = {300, 128, 1000, 5}, ql[NREQ] = {3, 1, 2, 1};
    tstep s;
    tstep_build(&s, NREQ, lens, ql, 2, MAXB, 16); /* 13 pages used, 3 spare (NaN) */
    const m3_step *st = &s.st;
    uint16_t *ic = make_cache(st, lens, 1, DIM, 1.0f);
    uint16_t *iq = rand_bf16((int64_t)st->rows * HEADS * DIM, 1.0f);
    /* keys a request's first row must not see yet: 4x that row's head-0
     * query, so that reading one would win its max */
    for (int r = 0, t = 0; r < NREQ; t += ql[r], r++)
        for (int64_t p = lens[r] - ql[r] + 1; p < lens[r]; p++)
            for (int i = 0; i < DIM; i++)
                ic[cache_at(st, r, p, 1, 0, DIM) + i] =
                    f2bf(4.0f * bf2f(iq[(int64_t)t * HEADS * DIM + i]));
    float scale = (float)(1.0 / sqrt(DIM) * 1.4426950408889634); /* formed in double */
    float *out[N_BE];
    run_index_scores("index_scores", st, HEADS, DIM, iq, ic, scale, out);
    for (int t = 0; t < 7; t++) /* the real rows' -inf tails */
        CHECK(out[0][((int64_t)t * HEADS + 1) * MAXB + (MAXB - 1)] == -INFINITY);
    free_all((void **)out, N_BE);

    /* NaN propagates: a NaN in row 0's head-1 query makes all its visible
     * blocks NaN; a NaN key in request 2's block 4 makes that block NaN for
     * both of its rows and both heads */
    iq[(0 * HEADS + 1) * DIM + 7] = BF16_NAN;
    ic[cache_at(st, 2, 4 * PAGE + 10, 1, 0, DIM) + 3] = BF16_NAN;
    run_index_scores("index_scores NaN", st, HEADS, DIM, iq, ic, scale, out);
    for (int b = 0; b < MAXB; b++)
        CHECK(b < 3 ? isnan(out[0][1 * MAXB + b]) : out[0][1 * MAXB + b] == -INFINITY);
    for (int t = 4; t < 6; t++)
        for (int h = 0; h < HEADS; h++)
            CHECK(isnan(out[0][((int64_t)t * HEADS + h) * MAXB + 4]));
    free_all((void **)out, N_BE);
    free(ic);
    free(iq);
    tstep_free(&s);
    index_tiny();
}

/* ------------------------------------------------------------ select_blocks */

/* a outranks b: forced blocks first, then score (NaN lowest), ties to the
 * higher block id (also between two NaNs, and between forced blocks). */
static bool ref_outranks(const float *sc, int nb, const m3_select_params *p, int a, int b) {
    bool fa = a < p->init_blocks || a >= nb - p->local_blocks;
    bool fb = b < p->init_blocks || b >= nb - p->local_blocks;
    if (fa != fb)
        return fa;
    if (!fa) {
        bool na = isnan(sc[a]), nbn = isnan(sc[b]);
        if (na != nbn)
            return nbn;
        if (!na && sc[a] != sc[b])
            return sc[a] > sc[b];
    }
    return a > b;
}

/* The best min(topk, nb) visible blocks, ascending, -1 padded. */
static void ref_select_row(const float *sc, int nb, const m3_select_params *p, int32_t *out) {
    bool taken[512] = {false};
    for (int k = 0; k < p->topk && k < nb; k++) {
        int best = -1;
        for (int b = 0; b < nb; b++)
            if (!taken[b] && (best < 0 || ref_outranks(sc, nb, p, b, best)))
                best = b;
        taken[best] = true;
    }
    int n = 0;
    for (int b = 0; b < nb; b++)
        if (taken[b])
            out[n++] = b;
    while (n < p->topk)
        out[n++] = -1;
}

/* Requests lens/ql (and 2 padded rows), heads index heads, tables maxb
 * blocks wide. */
static void select_case(const char *what, const m3_select_params *p, int n_reqs, const int *lens,
                        const int *ql, int heads, int maxb) {
    tstep s;
    int pages = 0;
    for (int r = 0; r < n_reqs; r++)
        pages += (lens[r] + PAGE - 1) / PAGE;
    tstep_build(&s, n_reqs, lens, ql, 2, maxb, pages);
    const m3_step *st = &s.st;
    int64_t n = (int64_t)st->rows * heads * maxb, nsel = (int64_t)st->rows * heads * p->topk;
    float *sc = xalloc((size_t)n * 4);
    for (int t = 0; t < st->rows; t++) {
        int nb = (int)((st->host.positions[t] + PAGE) / PAGE);
        for (int64_t k = (int64_t)t * heads * maxb; k < (int64_t)(t + 1) * heads * maxb; k++) {
            int b = (int)(k % maxb);
            /* few distinct values (many ties), some NaN; past the visible
             * blocks a large score the op must ignore */
            sc[k] = b >= nb ? 1e30f : rng_below(8) == 0 ? NAN : (float)(rng_below(6) - 2);
        }
    }
    int32_t *out[N_BE], *ref = xalloc((size_t)nsel * 4);
    for (int i = 0; i < N_BE; i++) {
        out[i] = xalloc((size_t)nsel * 4);
        fill32(out[i], nsel, SEL_POISON);
        CHECK_OK(g_be[i]->ops->select_blocks(g_be[i], st, heads, sc, p, out[i]));
    }
    for (int t = 0; t < st->rows; t++)
        for (int h = 0; h < heads; h++) {
            int32_t *r = ref + ((int64_t)t * heads + h) * p->topk;
            int nb = (int)((st->host.positions[t] + PAGE) / PAGE);
            if (st->host.slots[t] < 0) /* padded rows select nothing */
                for (int k = 0; k < p->topk; k++)
                    r[k] = -1;
            else
                ref_select_row(sc + ((int64_t)t * heads + h) * maxb, nb, p, r);
        }
    bool same = memcmp(out[0], ref, (size_t)nsel * 4) == 0;
    for (int64_t k = 0; !same && k < nsel; k++)
        if (out[0][k] != ref[k]) {
            fprintf(stderr, "  %s: selected[%lld] = %d, want %d\n", what, (long long)k,
                    out[0][k], ref[k]);
            break;
        }
    CHECK(same);
    EXPECT_SAME(what, out[0], out[1], (size_t)nsel * 4);
    free(sc);
    free(ref);
    free_all((void **)out, N_BE);
    tstep_free(&s);
}

/* One row with nb visible blocks and the given scores. */
static void select_hand(int nb, const float *scores, int topk, int init, int local,
                        const int32_t *want) {
    int lens[1] = {nb * PAGE}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, nb, nb);
    m3_select_params p = {topk, init, local};
    int32_t got[8];
    fill32(got, 8, SEL_POISON);
    CHECK_OK(g_be[1]->ops->select_blocks(g_be[1], &s.st, 1, scores, &p, got));
    bool ok = memcmp(got, want, (size_t)topk * 4) == 0;
    if (!ok)
        fprintf(stderr, "  select_blocks hand case (nb %d, topk %d): got %d %d %d ...\n", nb,
                topk, got[0], got[1], got[2]);
    CHECK(ok);
    tstep_free(&s);
}

static void test_select_blocks(void) {
    m3_select_params a = {4, 1, 2}, m3 = {3, 0, 1}, wide = {8, 1, 1}, m3full = {16, 0, 1};
    /* 1 block (fewer than topk), exactly topk, ... 20 blocks */
    int lens[5] = {100, 4 * PAGE, 5 * PAGE - 3, 11 * PAGE, 20 * PAGE}, ql[5] = {1, 1, 2, 1, 3};
    select_case("select_blocks topk 4 init 1 local 2", &a, 5, lens, ql, 2, 24);
    select_case("select_blocks topk 3 init 0 local 1", &m3, 5, lens, ql, 2, 24);
    select_case("select_blocks topk 8", &wide, 5, lens, ql, 2, 24);
    /* M3's selection (top 16, local 1) over 64 rows of up to 200 blocks:
     * enough work that every thread takes some */
    int big_lens[16], big_ql[16];
    for (int r = 0; r < 16; r++) {
        big_lens[r] = 1 + rng_below(200 * PAGE);
        big_ql[r] = big_lens[r] < 4 ? big_lens[r] : 4;
    }
    select_case("select_blocks M3, 64 rows", &m3full, 16, big_lens, big_ql, 4, 200);
    /* forced 0 and 5; then 3 beats 2 on the tie at 3 */
    const float s1[6] = {5, 1, 3, 3, 0, 2};
    select_hand(6, s1, 3, 1, 1, (const int32_t[]){0, 3, 5});
    /* NaN lowest: forced 6, then 2 (block 4), 1 (block 1) */
    const float s2[7] = {NAN, 1, NAN, 0.5f, 2, -1, 7};
    select_hand(7, s2, 3, 0, 1, (const int32_t[]){1, 4, 6});
    /* all tied: the higher id */
    const float s3[5] = {1, 1, 1, 1, 1};
    select_hand(5, s3, 2, 0, 1, (const int32_t[]){3, 4});
    /* a forced block with the lowest score still counts inside the top-k */
    const float s4[5] = {-100, 5, 6, 7, 1};
    select_hand(5, s4, 3, 1, 1, (const int32_t[]){0, 3, 4});
    /* fewer visible blocks than topk: all of them, -1 padded */
    const float s5[2] = {NAN, -3};
    select_hand(2, s5, 3, 0, 1, (const int32_t[]){0, 1, -1});
}

/* ------------------------------------------------------------ attention */

typedef struct attn_in {
    const m3_step *st;
    int q_heads, kv_heads, dim;
    const uint16_t *q, *kc, *vc;
    float scale;
} attn_in;

/* One query head over the keys of blocks[0..nb) (positions < kv_len):
 * s = (float)dot * scale, e = exp(s - max) (fp32, correctly rounded), the
 * sum of e in double rounded once, p = e / sum, out = bf16((float)
 * sum_double(p v)), keys in block order. */
static void ref_attend(const attn_in *in, int t, int h, const int32_t *blocks, int nb,
                       uint16_t *out) {
    int dim = in->dim, g = h / (in->q_heads / in->kv_heads), r = in->st->host.row_req[t];
    int64_t kv_len = in->st->host.positions[t] + 1;
    double *q = xalloc((size_t)dim * 8), *k = xalloc((size_t)dim * 8);
    double *acc = xalloc((size_t)dim * 8);
    float *s = xalloc((size_t)(nb * PAGE + 1) * 4);
    int64_t *pos = xalloc((size_t)(nb * PAGE + 1) * 8), n = 0;
    for (int i = 0; i < dim; i++)
        q[i] = bf2f(in->q[((int64_t)t * in->q_heads + h) * dim + i]);
    float m = -INFINITY;
    for (int i = 0; i < nb; i++)
        for (int64_t p = (int64_t)blocks[i] * PAGE; p < kv_len && p < (blocks[i] + 1) * PAGE; p++) {
            const uint16_t *e = in->kc + cache_at(in->st, r, p, in->kv_heads, g, dim);
            for (int d = 0; d < dim; d++)
                k[d] = bf2f(e[d]);
            s[n] = ref_dot(q, k, dim) * in->scale;
            m = s[n] > m ? s[n] : m;
            pos[n++] = p;
        }
    double sum = 0;
    for (int64_t j = 0; j < n; j++) {
        s[j] = ref_exp(s[j] - m);
        sum += s[j];
    }
    float fsum = (float)sum;
    memset(acc, 0, (size_t)dim * 8);
    for (int64_t j = 0; j < n; j++) {
        float p = s[j] / fsum;
        const uint16_t *v = in->vc + cache_at(in->st, r, pos[j], in->kv_heads, g, dim);
        for (int d = 0; d < dim; d++)
            acc[d] += (double)p * (double)bf2f(v[d]);
    }
    for (int d = 0; d < dim; d++)
        out[d] = f2bf((float)acc[d]);
    free(q);
    free(k);
    free(acc);
    free(s);
    free(pos);
}

/* Runs attention on both backends and compares the real rows with the
 * reference (padded rows' outputs are ignored by the caller). */
static void attn_check(const char *what, const attn_in *in, const int32_t *sel, int topk,
                       uint16_t **out) {
    const m3_step *st = in->st;
    int64_t n = (int64_t)st->rows * in->q_heads * in->dim;
    uint16_t *ref = xalloc((size_t)n * 2);
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->attention(g_be[i], st, in->q_heads, in->kv_heads, in->dim, in->q,
                                         in->kc, in->vc, sel, topk, in->scale, out[i]));
    }
    int32_t all[64];
    for (int t = 0; t < st->rows; t++)
        for (int h = 0; h < in->q_heads; h++) {
            uint16_t *r = ref + ((int64_t)t * in->q_heads + h) * in->dim;
            if (st->host.slots[t] < 0) {
                memcpy(r, out[0] + (r - ref), (size_t)in->dim * 2);
                continue;
            }
            int nb = 0, g = h / (in->q_heads / in->kv_heads);
            const int32_t *blocks = all;
            if (sel) {
                blocks = sel + ((int64_t)t * in->kv_heads + g) * topk;
                while (nb < topk && blocks[nb] >= 0)
                    nb++;
            } else {
                for (; nb * PAGE <= st->host.positions[t]; nb++)
                    all[nb] = nb;
            }
            ref_attend(in, t, h, blocks, nb, r);
        }
    EXPECT_BF16(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    free(ref);
}

/* Per (row, KV group) a random non-empty set of at most topk visible
 * blocks (ascending, -1 padded), different for each group; or, with
 * all_visible, every visible block. Padded rows: all -1. */
static int32_t *make_selection(const m3_step *st, int kv_heads, int topk, bool all_visible) {
    int32_t *sel = xalloc((size_t)st->rows * kv_heads * topk * 4);
    for (int t = 0; t < st->rows; t++)
        for (int g = 0; g < kv_heads; g++) {
            int32_t *o = sel + ((int64_t)t * kv_heads + g) * topk;
            int nb = (int)((st->host.positions[t] + PAGE) / PAGE), n = 0;
            int want = all_visible ? nb : 1 + rng_below(nb < topk ? nb : topk);
            for (int b = 0; b < nb && st->host.slots[t] >= 0; b++) /* pick want of nb */
                if (rng_below(nb - b) < want - n || all_visible)
                    o[n++] = b;
            while (n < topk)
                o[n++] = -1;
        }
    return sel;
}

/* q {1,0}; keys {0,0}, {1,0}; values {1,0}, {0,1}; scale 1: scores 0 and 1,
 * p = {1/(1+e), e/(1+e)} = {0.268941, 0.731059} -> bf16 {0.26953125,
 * 0.73046875}. The key at position 2 is not visible yet (NaN value). */
static void attn_tiny(void) {
    int lens[1] = {3}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, 1, 1);
    s.st.host.positions[0] = 1; /* the row at position 1 of a 3-token sequence */
    uint16_t kc[PAGE * 2], vc[PAGE * 2], q[2] = {f2bf(1), 0}, out[2] = {BF16_NAN, BF16_NAN};
    fill16(kc, PAGE * 2, BF16_NAN);
    fill16(vc, PAGE * 2, BF16_NAN);
    kc[0] = kc[1] = kc[3] = 0;
    kc[2] = f2bf(1);
    vc[0] = f2bf(1), vc[1] = 0, vc[2] = 0, vc[3] = f2bf(1);
    kc[4] = f2bf(100), kc[5] = 0;
    CHECK_OK(g_be[1]->ops->attention(g_be[1], &s.st, 1, 1, 2, q, kc, vc, NULL, 0, 1.0f, out));
    EXPECT_BF16_IS(out[0], 0.26953125f);
    EXPECT_BF16_IS(out[1], 0.73046875f);
    tstep_free(&s);
}

/* The bf16 output of two keys with scores 0 and x, values a and b, as
 * ref_attend computes it from e = exp(x): sum = (float)(1 + e) in double,
 * p = {1/sum, e/sum}, (float)(p0 a + p1 b) in double, rounded to bf16. */
static uint16_t two_key_mix(float e, float a, float b) {
    float sum = (float)(1.0 + (double)e);
    return f2bf((float)((double)(1.0f / sum) * a + (double)(e / sum) * b));
}

/* The exp convention, pinned: libm's expf is one ulp off on about one
 * fp32 input in 13000, which the softmax can carry into a bf16 output.
 * Two keys with scores 0 and x (q {1,0}, keys {0,0} and {1,0}, scale x)
 * where expf(x) != (float)exp((double)x), and values searched so that the
 * two exps give different bf16 outputs: the op must give the correctly
 * rounded exp's (cpu.h m3_exp_f32; the numpy reference's exp_f32). */
static void attn_exp_convention(void) {
    float x = -0.7f;
    while (expf(x) == ref_exp(x) && x > -20.0f)
        x = nextafterf(x, -INFINITY);
    float ea = expf(x), eb = ref_exp(x);
    uint16_t va = 0, vb = 0;
    bool found = false;
    /* values b in [0.5, 8) and a near -b e, so that the mix nearly cancels
     * and its bf16 ulp is small next to the exps' difference */
    for (uint32_t b = 0x3f00; b < 0x4100 && !found; b++) {
        int near = f2bf(-bf2f((uint16_t)b) * eb);
        for (int a = near - 16; a <= near + 16 && !found; a++)
            if (two_key_mix(ea, bf2f((uint16_t)a), bf2f((uint16_t)b)) !=
                two_key_mix(eb, bf2f((uint16_t)a), bf2f((uint16_t)b)))
                va = (uint16_t)a, vb = (uint16_t)b, found = true;
    }
    if (!found) { /* libm agrees with the correctly rounded exp here */
        printf("test_cpu_ops: no softmax input tells the exp conventions apart\n");
        return;
    }
    int lens[1] = {2}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, 1, 1);
    uint16_t kc[PAGE * 2], vc[PAGE * 2], q[2] = {f2bf(1), 0}, out[2] = {BF16_NAN, BF16_NAN};
    fill16(kc, PAGE * 2, BF16_NAN);
    fill16(vc, PAGE * 2, BF16_NAN);
    kc[0] = kc[1] = kc[3] = 0, kc[2] = f2bf(1);
    vc[0] = va, vc[2] = vb, vc[1] = vc[3] = 0;
    CHECK_OK(g_be[0]->ops->attention(g_be[0], &s.st, 1, 1, 2, q, kc, vc, NULL, 0, x, out));
    uint16_t want = two_key_mix(eb, bf2f(va), bf2f(vb));
    if (out[0] != want)
        fprintf(stderr, "  attention, scores {0, %a}, values {%g, %g}: got %g, want %g (the "
                "correctly rounded exp)\n", x, bf2f(va), bf2f(vb), bf2f(out[0]), bf2f(want));
    CHECK(out[0] == want);
    tstep_free(&s);
}

static void test_attention(void) {
    enum { QH = 8, KVH = 2, DIM = 128, NREQ = 4, TOPK = 3 };
    int lens[NREQ] = {200, 1, 700, 129}, ql[NREQ] = {3, 1, 2, 1};
    tstep s;
    tstep_build(&s, NREQ, lens, ql, 1, 8, 13); /* 11 pages used, 2 spare */
    const m3_step *st = &s.st;
    uint16_t *kc = make_cache(st, lens, KVH, DIM, 1.0f), *vc = make_cache(st, lens, KVH, DIM, 1.0f);
    uint16_t *q = rand_bf16((int64_t)st->rows * QH * DIM, 3.0f);
    attn_in in = {st, QH, KVH, DIM, q, kc, vc, (float)(1.0 / sqrt(DIM))};
    uint16_t *dense[N_BE], *sparse[N_BE];
    attn_check("attention dense", &in, NULL, 0, dense);

    /* sparse: head h reads the blocks its group h / 4 selected */
    int32_t *sel = make_selection(st, KVH, TOPK, false);
    attn_check("attention sparse", &in, sel, TOPK, sparse);
    free_all((void **)sparse, N_BE);
    free(sel);

    /* every visible block selected: bit-identical to dense */
    sel = make_selection(st, KVH, 8, true);
    attn_check("attention all blocks selected", &in, sel, 8, sparse);
    int64_t real = (int64_t)(st->rows - 1) * QH * DIM; /* the last row is padding */
    EXPECT_SAME("attention sparse(all) vs dense", sparse[0], dense[0], (size_t)real * 2);
    free_all((void **)sparse, N_BE);
    free_all((void **)dense, N_BE);
    free(sel);
    free(kc);
    free(vc);
    free(q);
    tstep_free(&s);
    attn_tiny();
    attn_exp_convention();
}

/* ------------------------------------------------------------ swiglu */

static void swiglu_case(const char *what, int64_t n, const m3_swiglu *act) {
    /* beyond the limit on both sides, so both clamps are exercised */
    uint16_t *gate = rand_bf16(n, 12.0f), *up = rand_bf16(n, 12.0f), *ref = xalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        ref[i] = f2bf(ref_swiglu(bf2f(gate[i]), bf2f(up[i]), act));
    uint16_t *out[N_BE];
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->swiglu(g_be[i], n, gate, up, act, out[i]));
    }
    EXPECT_BF16(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    free(gate);
    free(up);
    free(ref);
    free_all((void **)out, N_BE);
}

/* Every bf16 gate bit pattern (NaNs, infinities, subnormals included)
 * against 8 random up values each: the elementwise math and its exp and
 * clamp conventions, exhaustively over the gate. */
static void swiglu_sweep(const m3_swiglu *act) {
    const int64_t n = 65536 * 8;
    uint16_t *gate = xalloc((size_t)n * 2), *up = rand_bf16(n, 9.0f), *ref = xalloc((size_t)n * 2);
    uint16_t *out[N_BE];
    for (int64_t i = 0; i < n; i++) {
        gate[i] = (uint16_t)(i % 65536);
        ref[i] = f2bf(ref_swiglu(bf2f(gate[i]), bf2f(up[i]), act));
    }
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->swiglu(g_be[i], n, gate, up, act, out[i]));
    }
    EXPECT_BF16("swiglu every gate", out[0], ref, n);
    EXPECT_SAME("swiglu every gate", out[0], out[1], (size_t)n * 2);
    free(gate);
    free(up);
    free(ref);
    free_all((void **)out, N_BE);
}

static void test_swiglu(void) {
    m3_swiglu m3a = {1.702f, 7.0f}, other = {1.0f, 3.0f};
    swiglu_case("swiglu", 40000, &m3a); /* several chunks of the pool */
    swiglu_case("swiglu alpha 1 limit 3", 1000, &other);
    swiglu_sweep(&m3a);

    /* hand, alpha 1.702, limit 7:
     * (1, 0):    1 * sigmoid(1.702)                  = 0.845796  -> 0.84765625
     * (10, 10):  g 7, u 7: 7 * sigmoid(11.914) * 8    = 55.99963  -> 56
     * (-10, 0):  gate not clamped from below: -10 * sigmoid(-17.02)
     *            = -4.05796e-7 -> -4.0605664e-7 (clamped at -7: -4.7e-5)
     * (1, -10):  u clamped to -7: 0.845796 * -6       = -5.074775 -> -5.0625
     * (-10,-10): -4.05796e-7 * -6 = 2.434776e-6       -> 2.4288893e-6
     * (8, 0.5):  7 * sigmoid(11.914) * 1.5            = 10.49993  -> 10.5
     * (0, 5):    0 */
    const float g[7] = {1, 10, -10, 1, -10, 8, 0}, u[7] = {0, 10, 0, -10, -10, 0.5f, 5};
    const float want[7] = {0.84765625f, 56, -4.0605664e-7f, -5.0625f, 2.4288893e-6f, 10.5f, 0};
    uint16_t gb[7], ub[7], out[7];
    for (int k = 0; k < 7; k++) {
        gb[k] = f2bf(g[k]);
        ub[k] = f2bf(u[k]);
    }
    fill16(out, 7, BF16_NAN);
    CHECK_OK(g_be[1]->ops->swiglu(g_be[1], 7, gb, ub, &m3a, out));
    for (int k = 0; k < 7; k++)
        EXPECT_BF16_IS(out[k], want[k]);

    /* NaN never turns into a number (SPEC §8; np.minimum / np.clip in the
     * numpy reference propagate it): a NaN gate or up gives a NaN output */
    uint16_t ng[2] = {BF16_NAN, f2bf(1)}, nu[2] = {f2bf(1), BF16_NAN}, no[2] = {0, 0};
    CHECK_OK(g_be[1]->ops->swiglu(g_be[1], 2, ng, nu, &m3a, no));
    if (!isnan(bf2f(no[0])) || !isnan(bf2f(no[1])))
        fprintf(stderr, "  swiglu(NaN, 1) = %g, swiglu(1, NaN) = %g: NaN input lost\n",
                bf2f(no[0]), bf2f(no[1]));
    CHECK(isnan(bf2f(no[0])));
    CHECK(isnan(bf2f(no[1])));
}

/* ------------------------------------------------------------ moe */

/* An MoE layer's weights, built by hand; `mem` owns every buffer. */
typedef struct moe_fx {
    int H, I, Is, E;
    m3_layer_weights lw;
    m3_linear lin[3 * 16 + 3];
    void *mem[3 * 2 * 16 + 3 * 2 + 2];
    int n_mem;
    void *maps[8]; /* guarded (PROT_NONE) mappings */
    size_t map_bytes[8];
    int n_maps;
} moe_fx;

/* How an expert's weights are made: live random values; all NaN (a read
 * that reaches an output shows); or memory that faults on any access (a
 * read at all shows, even one whose result is dropped). */
enum fx_kind { FX_LIVE, FX_NAN, FX_GUARDED };

static void *fx_guarded(moe_fx *f, size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "test_cpu_ops: mmap failed\n");
        exit(2);
    }
    f->maps[f->n_maps] = p;
    f->map_bytes[f->n_maps++] = bytes;
    return p;
}

static void moe_fx_free(moe_fx *f) {
    free_all(f->mem, f->n_mem);
    for (int i = 0; i < f->n_maps; i++)
        munmap(f->maps[i], f->map_bytes[i]);
}

/* A fault inside moe means it touched a guarded expert's weights. */
static void on_guard_fault(int sig) {
    static const char msg[] = "test_cpu_ops: FAILED: moe read the weights of an expert that no "
                              "row routed to (guarded memory faulted)\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    (void)sig;
    _exit(1);
}

static void *fx_keep(moe_fx *f, void *p) {
    f->mem[f->n_mem++] = p;
    return p;
}

/* A [N, K] linear (bf16 or MXFP8) of the given kind. */
static m3_linear fx_linear(moe_fx *f, int64_t N, int64_t K, bool mxfp8, enum fx_kind kind) {
    if (kind == FX_GUARDED && mxfp8)
        return lin_mxfp8(fx_guarded(f, (size_t)(N * K)), fx_guarded(f, (size_t)(N * K / 32)), N, K);
    if (kind == FX_GUARDED)
        return lin_bf16(fx_guarded(f, (size_t)(N * K * 2)), N, K);
    bool nan = kind == FX_NAN;
    if (!mxfp8) {
        uint16_t *w = fx_keep(f, rand_bf16(N * K, 0.3f));
        if (nan)
            fill16(w, N * K, BF16_NAN);
        return lin_bf16(w, N, K);
    }
    uint8_t *q = fx_keep(f, xalloc((size_t)(N * K))), *s = fx_keep(f, xalloc((size_t)(N * K / 32)));
    for (int64_t k = 0; k < N * K; k++)
        q[k] = nan ? 0x7f : rand_e4m3();
    for (int64_t k = 0; k < N * K / 32; k++)
        s[k] = nan ? 255 : (uint8_t)(120 + rng_below(3)); /* 2^-7 .. 2^-5 */
    return lin_mxfp8(q, s, N, K);
}

/* gate/up/act/down of one expert for one row: bf16 at each rounding point. */
static void ref_ffn(const uint16_t *x, const m3_linear *gate, const m3_linear *up,
                    const m3_linear *down, const m3_swiglu *act, float *out) {
    int64_t W = gate->w.ne[0], H = down->w.ne[0];
    float *g = xalloc((size_t)W * 4), *u = xalloc((size_t)W * 4);
    uint16_t *a = xalloc((size_t)W * 2);
    ref_linear(1, x, gate, g);
    ref_linear(1, x, up, u);
    for (int64_t i = 0; i < W; i++)
        a[i] = f2bf(ref_swiglu(rbf(g[i]), rbf(u[i]), act));
    ref_linear(1, a, down, out);
    for (int64_t h = 0; h < H; h++)
        out[h] = rbf(out[h]);
    free(g);
    free(u);
    free(a);
}

/* Router: ids of the top-k experts by sigmoid(l) + bias, ties to the lower
 * id, NaN keys lowest; weights s / (sum of chosen s in rank order, fp32). */
static void ref_route(const float *logits, const float *bias, int E, int k, int *ids, float *w) {
    float s[64], key[64];
    bool taken[64] = {false};
    for (int e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + ref_exp(-logits[e]));
        key[e] = s[e] + (bias ? bias[e] : 0.0f);
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool better = best < 0 || (!isnan(key[e]) && (isnan(key[best]) || key[e] > key[best]));
            if (!taken[e] && better)
                best = e;
        }
        taken[best] = true;
        ids[j] = best;
    }
    float sum = s[ids[0]];
    for (int j = 1; j < k; j++)
        sum += s[ids[j]];
    for (int j = 0; j < k; j++)
        w[j] = s[ids[j]] / sum;
}

/* y = bf16(scaling * (sum_j w_j e_j in rank order, fp32) + shared). The
 * chosen ids are returned in ids [rows, k] for the caller's checks. */
static void ref_moe(const moe_fx *f, int rows, const uint16_t *x, const m3_moe_params *p,
                    uint16_t *out, int *ids) {
    const m3_layer_weights *lw = &f->lw;
    int k = p->top_k, H = f->H;
    float *logits = xalloc((size_t)f->E * 4), *e = xalloc((size_t)k * H * 4);
    float *sh = xalloc((size_t)H * 4), w[64];
    double *xd = xalloc((size_t)H * 8), *rw = xalloc((size_t)H * 8);
    for (int t = 0; t < rows; t++) {
        const uint16_t *xt = x + (int64_t)t * H;
        for (int i = 0; i < H; i++)
            xd[i] = bf2f(xt[i]);
        for (int ex = 0; ex < f->E; ex++) { /* fp32 router weight, double accumulation */
            for (int i = 0; i < H; i++)
                rw[i] = ((const float *)lw->router.data)[(int64_t)ex * H + i];
            logits[ex] = ref_dot(xd, rw, H);
        }
        ref_route(logits, lw->router_bias.data, f->E, k, ids + t * k, w);
        for (int j = 0; j < k; j++) {
            int ex = ids[t * k + j];
            ref_ffn(xt, &lw->exp_gate[ex], &lw->exp_up[ex], &lw->exp_down[ex], &p->act, e + j * H);
        }
        if (lw->sh_gate.w.data)
            ref_ffn(xt, &lw->sh_gate, &lw->sh_up, &lw->sh_down, &p->act, sh);
        for (int h = 0; h < H; h++) {
            float acc = 0;
            for (int j = 0; j < k; j++)
                acc += w[j] * e[j * H + h];
            float y = p->routed_scaling * acc;
            if (lw->sh_gate.w.data)
                y += sh[h];
            out[(int64_t)t * H + h] = f2bf(y);
        }
    }
    free(logits);
    free(e);
    free(sh);
    free(xd);
    free(rw);
}

/* Random layer: experts of width I (even ids bf16, odd MXFP8), a shared
 * expert of width Is (bf16); experts 0 and 5 get bias -100 so no row
 * routes to them: expert 0's weights are NaN, expert 5's fault on any
 * access. Experts 2 and 6 have the same router row and bias, so their
 * keys always tie (2 must win). */
static void moe_fx_random(moe_fx *f, int E, int H, int I, int Is) {
    memset(f, 0, sizeof *f);
    f->H = H, f->I = I, f->Is = Is, f->E = E;
    float *router = fx_keep(f, xalloc((size_t)E * H * 4));
    float *bias = fx_keep(f, xalloc((size_t)E * 4));
    for (int k = 0; k < E * f->H; k++)
        router[k] = rng_sym(0.3f);
    for (int e = 0; e < E; e++)
        bias[e] = (e == 0 || e == 5) ? -100.0f : rng_sym(0.2f);
    memcpy(router + 6 * f->H, router + 2 * f->H, (size_t)f->H * 4);
    bias[6] = bias[2];
    int64_t ne[2] = {E, f->H}, neb[1] = {E};
    f->lw.moe = true;
    f->lw.router = m3_tensor_make(M3_DT_F32, 2, ne, router);
    f->lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, bias);
    for (int e = 0; e < E; e++) {
        bool fp8 = e % 2 == 1;
        enum fx_kind kind = e == 0 ? FX_NAN : e == 5 ? FX_GUARDED : FX_LIVE;
        f->lin[3 * e] = fx_linear(f, f->I, f->H, fp8, kind);
        f->lin[3 * e + 1] = fx_linear(f, f->I, f->H, fp8, kind);
        f->lin[3 * e + 2] = fx_linear(f, f->H, f->I, fp8, kind);
    }
    f->lin[3 * E] = fx_linear(f, f->Is, f->H, false, FX_LIVE);
    f->lin[3 * E + 1] = fx_linear(f, f->Is, f->H, false, FX_LIVE);
    f->lin[3 * E + 2] = fx_linear(f, f->H, f->Is, false, FX_LIVE);
}

/* Binds the per-expert arrays the layer weights point at (3 per expert,
 * stored interleaved, copied into separate arrays). */
static void moe_fx_bind(moe_fx *f, m3_linear *g, m3_linear *u, m3_linear *d, bool shared) {
    for (int e = 0; e < f->E; e++) {
        g[e] = f->lin[3 * e];
        u[e] = f->lin[3 * e + 1];
        d[e] = f->lin[3 * e + 2];
    }
    f->lw.exp_gate = g, f->lw.exp_up = u, f->lw.exp_down = d;
    m3_linear none = {{0}, {0}, 0, 0};
    f->lw.sh_gate = shared ? f->lin[3 * f->E] : none;
    f->lw.sh_up = shared ? f->lin[3 * f->E + 1] : none;
    f->lw.sh_down = shared ? f->lin[3 * f->E + 2] : none;
}

static void moe_case(const char *what, moe_fx *f, bool shared, int rows) {
    enum { K = 3 };
    m3_linear g[16], u[16], d[16];
    moe_fx_bind(f, g, u, d, shared);
    m3_moe_params p = {f->E, K, 2.0f, {1.702f, 7.0f}, NULL};
    int64_t n = (int64_t)rows * f->H;
    uint16_t *x = rand_bf16(n, 1.0f), *ref = xalloc((size_t)n * 2), *out[N_BE];
    int *ids = xalloc((size_t)rows * K * sizeof *ids);
    ref_moe(f, rows, x, &p, ref, ids);
    struct sigaction guard = {0}, old_segv, old_bus;
    guard.sa_handler = on_guard_fault;
    sigaction(SIGSEGV, &guard, &old_segv);
    sigaction(SIGBUS, &guard, &old_bus);
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->moe(g_be[i], rows, x, &f->lw, &p, out[i]));
    }
    sigaction(SIGSEGV, &old_segv, NULL);
    sigaction(SIGBUS, &old_bus, NULL);
    EXPECT_BF16(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    /* the NaN-weighted experts were never routed to, and never read */
    bool finite = true;
    for (int64_t k = 0; k < n; k++)
        finite &= isfinite(bf2f(out[0][k])) != 0;
    CHECK(finite);
    bool unrouted = true;
    for (int k = 0; k < rows * K; k++)
        unrouted &= ids[k] != 0 && ids[k] != 5;
    CHECK(unrouted);
    free(ids);
    free(x);
    free(ref);
    free_all((void **)out, N_BE);
}

/* Hand-built layers with alpha 0 (sigmoid(0) = 1/2 exactly, act = g (u+1)/2)
 * and H = 2, x = {1, 0}, so each projection picks column 0 of its weight. */
static void moe_tiny(void) {
    m3_backend *be = g_be[1];
    uint16_t x[2] = {f2bf(1), 0}, out[2];
    /* A: router logits {0, 0, 1}, bias {0, -1, 0}, top 2: keys {0.5, -0.5,
     * 0.731059} -> experts 2, 0; weights 0.731059/1.231059 = 0.593838 and
     * 0.406162. Expert 0: g 2, u 1 -> act 2, down {1,-1} -> {2,-2}. Expert
     * 2: g 1, u 3 -> act 2, down {0.5, 0.25} -> {1, 0.5}. Shared: g 4, u 0
     * -> act 2, down {0.25, 1} -> {0.5, 2}. y = 2 (0.593838 {1,0.5} +
     * 0.406162 {2,-2}) + {0.5, 2} = {3.312309, 0.969227} -> {3.3125, 0.96875}.
     * Expert 1 (NaN weights) is not chosen and must not be read. */
    float router[6] = {0, 0, 0, 0, 1, 0}, bias[3] = {0, -1, 0};
    /* experts 0, 1, 2 and (index 3) the shared one */
    const float gw[4][2] = {{2, 0}, {NAN, NAN}, {1, 0}, {4, 0}};
    const float uw[4][2] = {{1, 0}, {NAN, NAN}, {3, 0}, {0, 0}};
    const float dw[4][2] = {{1, -1}, {NAN, NAN}, {0.5f, 0.25f}, {0.25f, 1}};
    uint16_t wg[4][2], wu[4][2], wd[4][2];
    m3_linear lg[4], lu[4], ld[4];
    for (int e = 0; e < 4; e++) {
        for (int i = 0; i < 2; i++)
            wg[e][i] = f2bf(gw[e][i]), wu[e][i] = f2bf(uw[e][i]), wd[e][i] = f2bf(dw[e][i]);
        lg[e] = lin_bf16(wg[e], 1, 2), lu[e] = lin_bf16(wu[e], 1, 2), ld[e] = lin_bf16(wd[e], 2, 1);
    }
    int64_t ne[2] = {3, 2}, neb[1] = {3};
    m3_layer_weights lw = {0};
    lw.moe = true;
    lw.router = m3_tensor_make(M3_DT_F32, 2, ne, router);
    lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, bias);
    lw.exp_gate = lg, lw.exp_up = lu, lw.exp_down = ld;
    lw.sh_gate = lg[3], lw.sh_up = lu[3], lw.sh_down = ld[3];
    m3_moe_params p = {3, 2, 2.0f, {0.0f, 7.0f}, NULL};
    fill16(out, 2, BF16_NAN);
    CHECK_OK(be->ops->moe(be, 1, x, &lw, &p, out));
    EXPECT_BF16_IS(out[0], 3.3125f);
    EXPECT_BF16_IS(out[1], 0.96875f);

    /* B, ties: the same experts 0-2, router all zero, bias {0.2, 0.2, 0.1},
     * top 1: keys {0.7, 0.7, 0.6}, experts 0 and 1 tie and the lower id (0)
     * wins (expert 1 has NaN weights); weight 1, no shared expert, scaling
     * 1: y = expert 0 = {2, -2}. */
    float r0[6] = {0}, b2[3] = {0.2f, 0.2f, 0.1f};
    lw.router = m3_tensor_make(M3_DT_F32, 2, ne, r0);
    lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, b2);
    m3_linear none = {{0}, {0}, 0, 0};
    lw.sh_gate = lw.sh_up = lw.sh_down = none;
    m3_moe_params p1 = {3, 1, 1.0f, {0.0f, 7.0f}, NULL};
    fill16(out, 2, BF16_NAN);
    CHECK_OK(be->ops->moe(be, 1, x, &lw, &p1, out));
    EXPECT_BF16_IS(out[0], 2.0f);
    EXPECT_BF16_IS(out[1], -2.0f);
}

static void test_moe(void) {
    moe_fx f;
    moe_fx_random(&f, 8, 64, 32, 48);
    moe_case("moe with shared expert", &f, true, 6);
    moe_case("moe without shared expert", &f, false, 6);
    moe_case("moe one row", &f, true, 1);
    moe_fx_free(&f);
    /* wider, and enough rows that every thread takes some of the work */
    moe_fx_random(&f, 8, 256, 64, 96);
    moe_case("moe 40 rows", &f, true, 40);
    moe_fx_free(&f);
    moe_tiny();
}

/* ------------------------------------------------------------ main */

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

int main(void) {
    const char *env = getenv("M3_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : 0x5eed0003ull;
    g_rng = seed;
    printf("test_cpu_ops: seed %llu (set M3_TEST_SEED to vary)\n", (unsigned long long)seed);
    for (int i = 0; i < N_BE; i++) {
        CHECK_OK(m3_cpu_backend_create(g_threads[i], &g_be[i]));
        if (!g_be[i])
            return check_summary("test_cpu_ops");
    }
    test_reference_rounding();
    test_embed();
    test_gather_rows();
    test_add_rmsnorm();
    test_linear();
    test_head_norm_rope();
    test_cache_write();
    test_index_scores();
    test_select_blocks();
    test_attention();
    test_swiglu();
    test_moe();
    for (int i = 0; i < N_BE; i++)
        g_be[i]->ops->destroy(g_be[i]);
    return check_summary("test_cpu_ops");
}
