/*
 * Small helpers the tests share for making inputs and comparing outputs: a
 * xorshift generator (each test seeds it, so its data is a fixed function
 * of the seed) and a bitwise float comparison that takes any two NaNs as
 * equal (a NaN's payload is the hardware's, not the SPEC's).
 */
#ifndef M3_TESTS_TEST_DATA_H
#define M3_TESTS_TEST_DATA_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

static uint64_t test_rng_state = 0x9e3779b97f4a7c15ull;

static inline void test_seed(uint64_t seed) { test_rng_state = seed ? seed : 1; }

static inline uint32_t rnd(void) {
    test_rng_state ^= test_rng_state << 13;
    test_rng_state ^= test_rng_state >> 7;
    test_rng_state ^= test_rng_state << 17;
    return (uint32_t)(test_rng_state >> 32);
}

/* uniform over {-1, -0.999, ..., 1} */
static inline float rndf(void) { return (float)(rnd() % 2001) / 1000.0f - 1.0f; }

/* equal bits, or both NaN */
static inline bool same_bits(float a, float b) {
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    return memcmp(&a, &b, sizeof a) == 0;
}

#endif
