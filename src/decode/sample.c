/*
 * Sampling a token from logits: greedy (temperature 0: the argmax, lowest
 * id on ties, NaN never chosen), or temperature with optional top-k and
 * top-p filtering, drawn with a seeded PCG32 generator so runs repeat.
 */
#include <math.h>
#include <stdlib.h>

#include "core/status.h"
#include "m3.h"

void m3_rng_seed(m3_rng *rng, uint64_t seed) {
    rng->state = 0;
    rng->inc = (seed << 1) | 1u;
    rng->state = rng->state * 6364136223846793005ull + rng->inc;
    rng->state += 0x853c49e6748fea9bull ^ seed;
    rng->state = rng->state * 6364136223846793005ull + rng->inc;
}

static uint32_t pcg32(m3_rng *rng) {
    uint64_t old = rng->state;
    rng->state = old * 6364136223846793005ull + rng->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    uint32_t rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((32 - rot) & 31));
}

/* uniform in [0, 1) with 53 random bits */
static double uniform01(m3_rng *rng) {
    uint64_t hi = pcg32(rng), lo = pcg32(rng);
    return (double)(((hi << 32) | lo) >> 11) * (1.0 / 9007199254740992.0);
}

typedef struct cand {
    float logit;
    int32_t id;
} cand;

/* descending logit, then ascending id */
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit < y->logit ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* the greedy choice: lowest id on ties, NaN never chosen; -1 when every
 * value is NaN */
static int32_t argmax(const float *logits, int vocab) {
    int32_t best = -1;
    for (int i = 0; i < vocab; i++)
        if (!isnan(logits[i]) && (best < 0 || logits[i] > logits[best]))
            best = i;
    return best;
}

m3_status m3_sampler_check(const m3_sampler *s) {
    if (!s)
        return m3_fail(M3_ERR_INVALID_ARG, "no sampler");
    if (!(s->temperature >= 0) || !isfinite(s->temperature))
        return m3_fail(M3_ERR_INVALID_ARG, "temperature = %g: must be >= 0", s->temperature);
    if (!(s->top_p > 0 && s->top_p <= 1))
        return m3_fail(M3_ERR_INVALID_ARG, "top_p = %g: must be in (0, 1]", s->top_p);
    if (s->top_k < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "top_k = %d: must be >= 0", s->top_k);
    return M3_OK;
}

m3_status m3_sample(const m3_sampler *s, m3_rng *rng, const float *logits, int vocab,
                    int32_t *token) {
    if (!s || !logits || vocab < 1 || !token)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "m3_sample: sampler, logits, vocab and a token pointer are required");
    M3_TRY(m3_sampler_check(s));
    if (s->temperature > 0 && !rng)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_sample: temperature %g needs a generator",
                       s->temperature);
    int32_t best = argmax(logits, vocab);
    if (best < 0)
        return m3_fail(M3_ERR_FAULT, "every logit is NaN");
    if (s->temperature == 0) {
        *token = best;
        return M3_OK;
    }
    cand *c = malloc((size_t)vocab * sizeof *c);
    if (!c)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory sampling");
    int n = 0;
    for (int i = 0; i < vocab; i++)
        if (!isnan(logits[i]))
            c[n++] = (cand){logits[i], i};
    qsort(c, (size_t)n, sizeof *c, cand_cmp);
    if (s->top_k > 0 && s->top_k < n)
        n = s->top_k;
    /* softmax over the kept candidates, in double */
    double *p = malloc((size_t)n * sizeof *p), sum = 0;
    if (!p) {
        free(c);
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory sampling");
    }
    for (int i = 0; i < n; i++) {
        /* relative to the best; inf - inf (several +inf, or all -inf) is a
         * tie with the best, weight 1 */
        double d = (double)c[i].logit - (double)c[0].logit;
        p[i] = isnan(d) ? 1.0 : exp(d / s->temperature);
        sum += p[i];
    }
    if (s->top_p < 1) { /* the smallest prefix whose mass reaches top_p */
        double acc = 0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            acc += p[i] / sum;
            if (acc >= s->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0;
        for (int i = 0; i < n; i++)
            sum += p[i];
    }
    double r = uniform01(rng) * sum, acc = 0;
    *token = c[n - 1].id;
    for (int i = 0; i < n; i++) {
        acc += p[i];
        if (r < acc) {
            *token = c[i].id;
            break;
        }
    }
    free(p);
    free(c);
    return M3_OK;
}
