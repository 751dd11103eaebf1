/*
 * Shared by the GPU tests (tests/gpu/test_*.c): the skip rule for machines
 * without a usable CUDA device, the seeded generator, and the comparison of
 * a GPU result with the CPU reference (relative L2 error, largest absolute
 * error, element mismatches, NaN/inf that the reference does not have).
 * Header-only (static inline) so each test stays one translation unit.
 */
#ifndef M3_TESTS_GPU_COMMON_H
#define M3_TESTS_GPU_COMMON_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "m3.h"

/* ctest's SKIP_RETURN_CODE for these tests */
#define GPU_TEST_SKIP 77

/* No usable device (none, no driver, not Hopper, a build without CUDA):
 * a skip. Any other failure to start the backend (a stream or cuBLAS that
 * will not initialise on a present GPU) is a failure, not a skip. */
static inline bool gpu_no_device(m3_status st) {
    return st == M3_ERR_UNSUPPORTED ||
           (st == M3_ERR_DEVICE && strstr(m3_last_error(), "no usable CUDA device"));
}

/* Probe GPU 0 with a throwaway backend. Returns 0 when it is usable; else
 * prints the skip line (exit code GPU_TEST_SKIP) or the failure (1) and
 * returns that exit code. */
static inline int gpu_probe(const char *test) {
    m3_backend *be = NULL;
    m3_status st = m3_cuda_backend_create(0, &be);
    if (!st) {
        be->ops->destroy(be);
        return 0;
    }
    if (gpu_no_device(st)) {
        printf("SKIP: no CUDA device: %s\n", m3_last_error());
        return GPU_TEST_SKIP;
    }
    fprintf(stderr, "%s: FAILED: creating the CUDA backend: %s: %s\n", test, m3_status_name(st),
            m3_last_error());
    return 1;
}

/* ------------------------------------------------------------ random */

/* splitmix64; seeded from M3_TEST_SEED when set */
static inline uint64_t gpu_rng_next(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t gpu_test_seed(uint64_t fallback) {
    const char *env = getenv("M3_TEST_SEED");
    return env ? strtoull(env, NULL, 0) : fallback;
}

/* ------------------------------------------------------------ comparing */

typedef struct gpu_cmp {
    int64_t n, mismatch, bad_special;
    double max_abs, rel_l2;
} gpu_cmp;

/* got against ref: mismatch counts values not equal (NaN equals NaN, +0
 * equals -0); bad_special counts NaN or inf on either side where the other
 * side differs (they never pass); max_abs and rel_l2 = |got - ref|_2 /
 * |ref|_2 over the pairs where both are finite. */
static inline gpu_cmp gpu_compare_f32(const float *got, const float *ref, int64_t n) {
    gpu_cmp c = {n, 0, 0, 0.0, 0.0};
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        float g = got[i], r = ref[i];
        bool same = g == r || (isnan(g) && isnan(r));
        c.mismatch += !same;
        if (!isfinite(g) || !isfinite(r)) {
            c.bad_special += !same;
            continue;
        }
        double e = fabs((double)g - (double)r);
        c.max_abs = e > c.max_abs ? e : c.max_abs;
        num += e * e;
        den += (double)r * (double)r;
    }
    c.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
    return c;
}

/* The lowest id of the largest non-NaN value; -1 when all are NaN (the
 * greedy sampling contract). */
static inline int32_t gpu_argmax(const float *l, int n) {
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (!isnan(l[i]) && (best < 0 || l[i] > l[best]))
            best = i;
    return best;
}

#endif
