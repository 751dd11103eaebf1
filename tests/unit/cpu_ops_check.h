/*
 * The CPU backend op tests' shared parts (test_cpu_ops.c describes the
 * method): the seeded generator, bf16 / fp32 helpers, poisoned outputs, the
 * comparisons and their verdicts, tensor views, the reference arithmetic
 * (dots and norms in double, rounded once), and one main for the three
 * programs (test_cpu_ops, test_cpu_attention_ops, test_cpu_moe_ops).
 * Header-only: every program includes it once.
 */
#ifndef M3_TESTS_CPU_OPS_CHECK_H
#define M3_TESTS_CPU_OPS_CHECK_H

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

static inline uint64_t rng_u64(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline float rng_sym(float amp) {
    return (float)(((double)(rng_u64() >> 11) * 0x1p-53 * 2.0 - 1.0) * amp);
}
static inline int rng_below(int n) { return (int)(rng_u64() % (uint64_t)n); }

static inline void *xalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "cpu_ops_check: out of memory\n");
        exit(2);
    }
    return p;
}

/* bf16 written independently of core/bf16.h: the reference must not share
 * the library's rounding code. Round to nearest, ties to even; NaN stays
 * NaN (quiet), overflow carries into the exponent (to inf). */
static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x40u);
    uint32_t upper = u >> 16, lower = u & 0xffffu;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u)))
        upper++;
    return (uint16_t)upper;
}
static inline float rbf(float f) { return bf2f(f2bf(f)); }

static inline uint16_t *rand_bf16(int64_t n, float amp) {
    uint16_t *p = xalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        p[i] = f2bf(rng_sym(amp));
    return p;
}
static inline void fill16(uint16_t *p, int64_t n, uint16_t v) {
    for (int64_t i = 0; i < n; i++)
        p[i] = v;
}
static inline void fill32(void *p, int64_t n, uint32_t v) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)p + 4 * i, &v, 4);
}
static inline uint16_t *dup16(const uint16_t *src, int64_t n) {
    uint16_t *p = xalloc((size_t)n * 2);
    memcpy(p, src, (size_t)n * 2);
    return p;
}
static inline uint16_t *poisoned16(int64_t n) {
    uint16_t *p = xalloc((size_t)n * 2);
    fill16(p, n, BF16_NAN);
    return p;
}
static inline void free_all(void **p, int n) {
    for (int i = 0; i < n; i++)
        free(p[i]);
}

/* ------------------------------------------------------------ comparing */

typedef struct diff {
    int64_t mismatches, first; /* elements not bit-identical; the first */
    double rel_l2;             /* over elements whose reference is finite */
    bool bad_special;          /* NaN/inf where the reference is finite, or vice versa */
} diff;

static inline bool same_f32(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y || (isnan(a) && isnan(b));
}

static inline diff diff_f32(const float *got, const float *ref, int64_t n) {
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
static inline void expect_close(const char *what, int line, const float *got, const float *ref,
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

static inline void expect_bf16(const char *what, int line, const uint16_t *got, const uint16_t *ref,
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
static inline void expect_same(const char *what, int line, const void *a, const void *b, size_t bytes) {
    bool same = memcmp(a, b, bytes) == 0;
    if (!same)
        fprintf(stderr, "  line %d, %s: 1-thread and 3-thread outputs differ\n", line, what);
    CHECK(same);
}

/* A hand-computed expectation: the bf16 value itself, exactly. */
#define EXPECT_BF16_IS(got, want) expect_bf16_is(__LINE__, got, want)
static inline void expect_bf16_is(int line, uint16_t got, float want) {
    bool ok = bf2f(got) == want;
    if (!ok)
        fprintf(stderr, "  line %d: got %.9g, hand-computed %.9g\n", line, bf2f(got), want);
    CHECK(ok);
}

/* ------------------------------------------------------------ tensors */

static inline m3_tensor vec_bf16(uint16_t *data, int64_t n) {
    int64_t ne[1] = {n};
    return m3_tensor_make(M3_DT_BF16, 1, ne, data);
}
static inline m3_linear lin_bf16(uint16_t *w, int64_t N, int64_t K) {
    int64_t ne[2] = {N, K};
    m3_linear l = {m3_tensor_make(M3_DT_BF16, 2, ne, w), {0}, 0, 0};
    return l;
}
static inline m3_linear lin_mxfp8(uint8_t *q, uint8_t *s, int64_t N, int64_t K) {
    int64_t ne[2] = {N, K}, nes[2] = {N, K / 32};
    m3_linear l = {m3_tensor_make(M3_DT_F8_E4M3, 2, ne, q), m3_tensor_make(M3_DT_U8, 2, nes, s),
                   0, 0};
    return l;
}

/* A finite random e4m3 byte (exponent field <= 10: never the NaN code;
 * exponent 0 gives subnormals). */
static inline uint8_t rand_e4m3(void) {
    return (uint8_t)(rng_below(2) << 7 | rng_below(11) << 3 | rng_below(8));
}

/* e4m3fn decoded from the format's definition (bias 7, subnormals
 * man/8 * 2^-6, S.1111.111 NaN), independently of core/bf16.h. */
static inline double ref_e4m3(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7)
        return NAN;
    double v = e ? ldexp(8 + m, e - 10) : ldexp(m, -9);
    return (b & 0x80) ? -v : v;
}

/* Row n of a linear weight in double (bf16, or MXFP8 element x 2^(s-127)). */
static inline void ref_weight_row(const m3_linear *l, int64_t n, double *dst) {
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
static inline float ref_dot(const double *a, const double *b, int64_t n) {
    double acc = 0;
    for (int64_t i = 0; i < n; i++)
        acc += a[i] * b[i];
    return (float)acc;
}

/* out[t, n] = x[t] . w[n] in fp32 (not rounded to bf16). */
static inline void ref_linear(int rows, const uint16_t *x, const m3_linear *l, float *out) {
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
static inline void ref_norm_row(const float *x, const uint16_t *w, int dim, float eps, float *y) {
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
static inline float ref_exp(float x) { return (float)exp((double)x); }

/* SwiGLU-OAI with the clamps written as comparisons, so NaN propagates
 * (as np.minimum / np.clip do in the numpy reference). */
static inline float ref_swiglu(float gate, float up, const m3_swiglu *a) {
    float g = gate > a->limit ? a->limit : gate;
    float u = up > a->limit ? a->limit : (up < -a->limit ? -a->limit : up);
    float sig = 1.0f / (1.0f + ref_exp(-a->alpha * g));
    return g * sig * (u + 1.0f);
}

/* Seed the generator (M3_TEST_SEED), create the 1- and 3-thread backends,
 * run the tests, and report. */
static inline int cpu_ops_main(const char *name, void (*const tests[])(void), int n_tests) {
    const char *env = getenv("M3_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : 0x5eed0003ull;
    g_rng = seed;
    printf("%s: seed %llu (set M3_TEST_SEED to vary)\n", name, (unsigned long long)seed);
    for (int i = 0; i < N_BE; i++) {
        CHECK_OK(m3_cpu_backend_create(g_threads[i], &g_be[i]));
        if (!g_be[i])
            return check_summary(name);
    }
    for (int i = 0; i < n_tests; i++)
        tests[i]();
    for (int i = 0; i < N_BE; i++)
        g_be[i]->ops->destroy(g_be[i]);
    return check_summary(name);
}

#endif
