/*
 * Tests for decode/sample.c, m3_sample and m3_rng_seed: greedy decoding is
 * the argmax with ties to the lowest id and never a NaN; temperature
 * sampling repeats for a seed and differs between seeds; top_k = 1 is
 * greedy at any temperature; top-k keeps the k best and top-p the smallest
 * prefix whose mass reaches p; over 20000 draws the frequencies match
 * softmax(logits / T) (renormalised over what top-k / top-p keep) within a
 * few percent; and bad arguments fail with M3_ERR_INVALID_ARG naming the
 * value. Draws use fixed seeds, so every run checks the same numbers.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static m3_sampler sampler(float temperature, int top_k, float top_p) {
    m3_sampler s = {temperature, top_k, top_p, 0};
    return s;
}

/* One draw; -1 on failure (the CHECK reports it). */
static int32_t draw(const m3_sampler *s, m3_rng *rng, const float *logits, int vocab) {
    int32_t tok = -1;
    m3_status st = m3_sample(s, rng, logits, vocab, &tok);
    /* checked only on failure, so the check count stays readable */
    if (st != M3_OK) {
        CHECK(st == M3_OK);
        fprintf(stderr, "  m3_sample: %s\n", m3_last_error());
        return -1;
    }
    if (tok < 0 || tok >= vocab) {
        CHECK(tok >= 0 && tok < vocab);
        return -1;
    }
    return tok;
}

/* Counts of n draws into hist[vocab]. */
static void histogram(const m3_sampler *s, uint64_t seed, const float *logits, int vocab, int n,
                      int *hist) {
    m3_rng rng;
    m3_rng_seed(&rng, seed);
    memset(hist, 0, (size_t)vocab * sizeof *hist);
    for (int i = 0; i < n; i++) {
        int32_t t = draw(s, &rng, logits, vocab);
        if (t < 0)
            return;
        hist[t]++;
    }
}

static void test_greedy(void) {
    m3_sampler g = sampler(0, 0, 1);
    int32_t tok = -1;
    const float a[] = {0.5f, 2.0f, -1.0f, 1.5f};
    CHECK_OK(m3_sample(&g, NULL, a, 4, &tok)); /* greedy needs no generator */
    CHECK(tok == 1);
    const float ties[] = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
    CHECK_OK(m3_sample(&g, NULL, ties, 5, &tok));
    CHECK(tok == 1);
    const float neg[] = {-7.0f, -2.0f, -2.0f, -3.0f};
    CHECK_OK(m3_sample(&g, NULL, neg, 4, &tok));
    CHECK(tok == 1);
    const float infs[] = {-INFINITY, -INFINITY, -5.0f, INFINITY, INFINITY};
    CHECK_OK(m3_sample(&g, NULL, infs, 5, &tok));
    CHECK(tok == 3);
    const float all_neg_inf[] = {-INFINITY, -INFINITY, -INFINITY};
    CHECK_OK(m3_sample(&g, NULL, all_neg_inf, 3, &tok));
    CHECK(tok == 0);
    const float one[] = {-3.0f};
    CHECK_OK(m3_sample(&g, NULL, one, 1, &tok));
    CHECK(tok == 0);

    /* NaN is never the argmax, wherever it sits */
    const float nan_first[] = {NAN, 1.0f, 0.0f};
    CHECK_OK(m3_sample(&g, NULL, nan_first, 3, &tok));
    CHECK(tok == 1);
    const float nan_mid[] = {-1.0f, NAN, -2.0f, NAN};
    CHECK_OK(m3_sample(&g, NULL, nan_mid, 4, &tok));
    CHECK(tok == 0);
    const float nan_but_one[] = {NAN, NAN, NAN, -100.0f, NAN};
    CHECK_OK(m3_sample(&g, NULL, nan_but_one, 5, &tok));
    CHECK(tok == 3);

    /* all NaN: nothing can be chosen, greedy or not */
    const float all_nan[] = {NAN, NAN, NAN};
    tok = 42;
    CHECK_FAILS(m3_sample(&g, NULL, all_nan, 3, &tok), M3_ERR_FAULT, "NaN");
    m3_sampler t = sampler(1.0f, 0, 1);
    m3_rng rng;
    m3_rng_seed(&rng, 1);
    CHECK_FAILS(m3_sample(&t, &rng, all_nan, 3, &tok), M3_ERR_FAULT, "NaN");
    CHECK(tok == 42);

    /* a large vocab with the maximum near the end */
    enum { V = 200064 };
    float *big = malloc(V * sizeof *big);
    if (big) {
        for (int i = 0; i < V; i++)
            big[i] = (float)((i * 7919) % 1000) * 1e-3f;
        big[V - 2] = 5.0f;
        CHECK_OK(m3_sample(&g, NULL, big, V, &tok));
        CHECK(tok == V - 2);
        free(big);
    }
}

static void test_seeds(void) {
    /* near-uniform over 16 tokens, so two streams agree by chance ~16^-64 */
    float logits[16];
    for (int i = 0; i < 16; i++)
        logits[i] = 0.01f * (float)i;
    m3_sampler s = sampler(1.0f, 0, 1);
    int32_t a[64], b[64], c[64];
    m3_rng ra, rb, rc;
    m3_rng_seed(&ra, 1234);
    m3_rng_seed(&rb, 1234);
    m3_rng_seed(&rc, 1235);
    for (int i = 0; i < 64; i++) {
        a[i] = draw(&s, &ra, logits, 16);
        b[i] = draw(&s, &rb, logits, 16);
        c[i] = draw(&s, &rc, logits, 16);
    }
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(a, c, sizeof a) != 0);
    /* the generator state is all that matters: seeding again replays */
    m3_rng_seed(&ra, 1234);
    int same = 1;
    for (int i = 0; i < 64; i++)
        same &= draw(&s, &ra, logits, 16) == a[i];
    CHECK(same);
    /* seed 0 and seeds differing only in high bits are distinct streams */
    m3_rng r0, rh;
    m3_rng_seed(&r0, 0);
    m3_rng_seed(&rh, 1ull << 63);
    int diff = 0;
    for (int i = 0; i < 64; i++)
        diff += draw(&s, &r0, logits, 16) != draw(&s, &rh, logits, 16);
    CHECK(diff > 0);
}

/* top_k = 1 leaves one candidate, the greedy one, whatever the temperature */
static void test_top_k_one_is_greedy(void) {
    enum { V = 50 };
    const float temps[] = {1e-4f, 0.3f, 1.0f, 7.0f, 1e4f};
    uint32_t x = 99;
    m3_rng rng;
    m3_rng_seed(&rng, 5);
    m3_sampler g = sampler(0, 0, 1);
    int mismatches = 0;
    for (int trial = 0; trial < 60; trial++) {
        float logits[V];
        for (int i = 0; i < V; i++) {
            x = x * 1664525u + 1013904223u;
            /* few distinct values, so ties for the maximum are common */
            logits[i] = (float)((x >> 16) % 6);
            if ((x >> 8) % 13 == 0)
                logits[i] = NAN;
        }
        int32_t want = -1;
        CHECK_OK(m3_sample(&g, NULL, logits, V, &want));
        for (int k = 0; k < 5; k++) {
            m3_sampler s = sampler(temps[k], 1, (k % 2) ? 1.0f : 0.3f);
            mismatches += draw(&s, &rng, logits, V) != want;
        }
    }
    CHECK(mismatches == 0);
}

static void test_top_k(void) {
    enum { V = 100 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = sinf((float)i * 1.3f) * 3.0f; /* distinct, scattered */
    /* the 5 best by value */
    int best[5];
    for (int k = 0; k < 5; k++) {
        best[k] = -1;
        for (int i = 0; i < V; i++) {
            int taken = 0;
            for (int j = 0; j < k; j++)
                taken |= best[j] == i;
            if (!taken && (best[k] < 0 || logits[i] > logits[best[k]]))
                best[k] = i;
        }
    }
    /* a hot temperature would spread draws everywhere without the cut */
    m3_sampler s = sampler(50.0f, 5, 1);
    int hist[V];
    histogram(&s, 11, logits, V, 4000, hist);
    int inside = 0;
    for (int k = 0; k < 5; k++) {
        CHECK(hist[best[k]] > 0);
        inside += hist[best[k]];
    }
    CHECK(inside == 4000);

    /* ties at the cut: the lower id is kept (ids 1 and 2 tie for second) */
    const float tie[] = {3.0f, 1.0f, 1.0f, 1.0f, 0.0f};
    m3_sampler s2 = sampler(1.0f, 2, 1);
    int h2[5];
    histogram(&s2, 3, tie, 5, 3000, h2);
    CHECK(h2[0] > 0 && h2[1] > 0 && h2[2] == 0 && h2[3] == 0 && h2[4] == 0);

    /* top_k at or above the vocab is no cut at all */
    const float flat[] = {0.0f, 0.0f, 0.0f};
    m3_sampler s3 = sampler(1.0f, 3, 1);
    int h3[3];
    histogram(&s3, 4, flat, 3, 3000, h3);
    CHECK(h3[0] > 0 && h3[1] > 0 && h3[2] > 0);
    m3_sampler s4 = sampler(1.0f, 1000, 1);
    histogram(&s4, 4, flat, 3, 3000, h3);
    CHECK(h3[0] > 0 && h3[1] > 0 && h3[2] > 0);

    /* NaN is not a candidate: the k best are among the numbers */
    const float with_nan[] = {NAN, 2.0f, NAN, 1.0f, 0.5f};
    m3_sampler s5 = sampler(100.0f, 2, 1);
    int h5[5];
    histogram(&s5, 8, with_nan, 5, 3000, h5);
    CHECK(h5[0] == 0 && h5[2] == 0 && h5[4] == 0 && h5[1] > 0 && h5[3] > 0);
}

static void test_top_p(void) {
    const float logits[] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    int h[3];
    /* 0.5 < 0.6 <= 0.5 + 0.3: the first two are kept, never the third */
    m3_sampler s = sampler(1.0f, 0, 0.6f);
    histogram(&s, 21, logits, 3, 5000, h);
    CHECK(h[2] == 0 && h[0] > 0 && h[1] > 0);
    /* the first alone reaches 0.4 */
    s = sampler(1.0f, 0, 0.4f);
    histogram(&s, 22, logits, 3, 2000, h);
    CHECK(h[0] == 2000);
    /* 0.9 needs all three */
    s = sampler(1.0f, 0, 0.9f);
    histogram(&s, 23, logits, 3, 5000, h);
    CHECK(h[0] > 0 && h[1] > 0 && h[2] > 0);
    /* the mass is measured after the temperature: at T = 0.5 the
     * probabilities are 25/38, 9/38, 4/38, so 0.6 keeps the first alone */
    s = sampler(0.5f, 0, 0.6f);
    histogram(&s, 24, logits, 3, 2000, h);
    CHECK(h[0] == 2000);
    /* and after top-k: top_k = 2 renormalises to 0.625 / 0.375 first, so
     * the 0.6 that kept two tokens above now keeps the first alone */
    s = sampler(1.0f, 2, 0.6f);
    histogram(&s, 25, logits, 3, 2000, h);
    CHECK(h[0] == 2000);
    s = sampler(1.0f, 2, 0.7f);
    histogram(&s, 26, logits, 3, 5000, h);
    CHECK(h[0] > 0 && h[1] > 0 && h[2] == 0);
    /* order is by logit, not by id */
    const float rev[] = {logf(0.2f), logf(0.3f), logf(0.5f)};
    s = sampler(1.0f, 0, 0.6f);
    histogram(&s, 27, rev, 3, 5000, h);
    CHECK(h[0] == 0 && h[1] > 0 && h[2] > 0);
}

/* |frequency - probability| <= tol for every token; probabilities are
 * softmax(logits / T) over the tokens in keep[] (all when keep is NULL). */
static void check_frequencies(const m3_sampler *s, const float *logits, const int *keep, int vocab,
                              uint64_t seed, double tol, const char *what) {
    enum { N = 20000 };
    int hist[16];
    histogram(s, seed, logits, vocab, N, hist);
    double p[16], sum = 0, mx = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (!keep || keep[i])
            mx = fmax(mx, logits[i]);
    for (int i = 0; i < vocab; i++) {
        p[i] = (!keep || keep[i]) ? exp(((double)logits[i] - mx) / s->temperature) : 0;
        sum += p[i];
    }
    for (int i = 0; i < vocab; i++) {
        double f = (double)hist[i] / N, want = p[i] / sum;
        if (fabs(f - want) > tol) {
            CHECK(fabs(f - want) <= tol);
            fprintf(stderr, "  %s: token %d drawn %.4f, softmax %.4f\n", what, i, f, want);
        }
        if (want == 0)
            CHECK(hist[i] == 0);
    }
}

static void test_frequencies(void) {
    const float logits[] = {1.0f, 0.5f, 0.0f, -1.0f, 2.0f, 0.25f};
    /* ~3 standard deviations of a frequency over 20000 draws is <= 0.011 */
    const double tol = 0.015;
    m3_sampler s = sampler(1.0f, 0, 1);
    check_frequencies(&s, logits, NULL, 6, 1, tol, "T=1");
    s = sampler(0.7f, 0, 1);
    check_frequencies(&s, logits, NULL, 6, 2, tol, "T=0.7");
    s = sampler(2.5f, 0, 1);
    check_frequencies(&s, logits, NULL, 6, 3, tol, "T=2.5");
    /* top-k = 3 keeps tokens 4, 0, 1 and renormalises */
    const int k3[] = {1, 1, 0, 0, 1, 0};
    s = sampler(1.0f, 3, 1);
    check_frequencies(&s, logits, k3, 6, 4, tol, "T=1 top_k=3");
    /* top-p: at T = 1 the sorted probabilities are 0.513, 0.189, 0.114,
     * 0.089, 0.069, 0.026 (tokens 4, 0, 1, 5, 2, 3); 0.75 needs the first 3 */
    s = sampler(1.0f, 0, 0.75f);
    check_frequencies(&s, logits, k3, 6, 5, tol, "T=1 top_p=0.75");
    /* NaN tokens take no share */
    const float with_nan[] = {0.0f, NAN, 1.0f, NAN};
    const int no_nan[] = {1, 0, 1, 0};
    s = sampler(1.0f, 0, 1);
    check_frequencies(&s, with_nan, no_nan, 4, 6, tol, "NaN in logits");
    /* very large logits do not overflow (probabilities are relative) */
    const float huge[] = {1e30f, 1e30f - 1e24f, -1e30f};
    s = sampler(1e24f, 0, 1);
    check_frequencies(&s, huge, NULL, 3, 7, tol, "logits near 1e30");
}

/* +inf is the largest logit: it must win at any temperature, as it does
 * under greedy. */
static void test_infinite_logit(void) {
    const float logits[] = {0.0f, INFINITY, 1.0f};
    m3_sampler s = sampler(1.0f, 0, 1);
    int h[3];
    histogram(&s, 9, logits, 3, 200, h);
    CHECK(h[1] == 200);
}

static void test_bad_args(void) {
    const float logits[] = {0.0f, 1.0f};
    m3_rng rng;
    m3_rng_seed(&rng, 1);
    int32_t tok = 7;
    m3_sampler s;

    s = sampler(-1.0f, 0, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "temperature = -1");
    s = sampler(-1e-20f, 0, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "temperature = -1e-20");
    s = sampler(NAN, 0, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "temperature = nan");
    s = sampler(INFINITY, 0, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "temperature = inf");
    s = sampler(1.0f, 0, 0);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_p = 0");
    s = sampler(1.0f, 0, -0.5f);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_p = -0.5");
    s = sampler(1.0f, 0, 1.5f);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_p = 1.5");
    s = sampler(1.0f, 0, NAN);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_p = nan");
    s = sampler(1.0f, -1, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_k = -1");
    /* the checks hold for greedy too: a bad sampler is bad at any temperature */
    s = sampler(0, -3, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_k = -3");
    s = sampler(0, 0, 2.0f);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "top_p = 2");

    s = sampler(1.0f, 0, 1);
    CHECK_FAILS(m3_sample(&s, &rng, logits, 0, &tok), M3_ERR_INVALID_ARG, "vocab");
    CHECK_FAILS(m3_sample(&s, &rng, logits, -4, &tok), M3_ERR_INVALID_ARG, "vocab");
    CHECK_FAILS(m3_sample(&s, &rng, NULL, 2, &tok), M3_ERR_INVALID_ARG, "logits");
    CHECK_FAILS(m3_sample(NULL, &rng, logits, 2, &tok), M3_ERR_INVALID_ARG, "sampler");
    CHECK(tok == 7); /* failures leave the output alone */

    /* the edges that are allowed: top_p exactly 1, top_k 0, temperature 0 */
    s = sampler(0, 0, 1);
    CHECK_OK(m3_sample(&s, &rng, logits, 2, &tok));
    CHECK(tok == 1);
    /* a rejected call does not advance the generator */
    m3_rng a, b;
    m3_rng_seed(&a, 77);
    m3_rng_seed(&b, 77);
    s = sampler(-1.0f, 0, 1);
    CHECK(m3_sample(&s, &a, logits, 2, &tok) == M3_ERR_INVALID_ARG);
    CHECK(a.state == b.state && a.inc == b.inc);

    /* m3_sampler_check: the same settings checks alone (m3_engine_decode
     * runs them before its step, so a bad sampler changes no sequence:
     * fuzz_api's corpus holds the call sequence that showed it did) */
    s = sampler(0.7f, 5, 0.9f);
    CHECK_OK(m3_sampler_check(&s));
    s = sampler(0.7f, 0, 1.5f);
    CHECK_FAILS(m3_sampler_check(&s), M3_ERR_INVALID_ARG, "top_p = 1.5");
    s = sampler(NAN, 0, 1);
    CHECK_FAILS(m3_sampler_check(&s), M3_ERR_INVALID_ARG, "temperature = nan");
    CHECK_FAILS(m3_sampler_check(NULL), M3_ERR_INVALID_ARG, "no sampler");
}

int main(void) {
    test_greedy();
    test_seeds();
    test_top_k_one_is_greedy();
    test_top_k();
    test_top_p();
    test_frequencies();
    test_infinite_logit();
    test_bad_args();
    return check_summary("test_sample");
}
