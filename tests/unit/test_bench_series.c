/*
 * Tests for bench_series_of (bench/bench_util.h), the summary every layer
 * benchmark point reports: the median and minimum of its replays, and the
 * medians of their first and last thirds in the order they ran (the drift a
 * point still warming up shows). Series with known answers: a falling one, a
 * flat one, odd and even thirds, fewer than three values (no thirds), and the
 * input left in its order.
 */
#include <math.h>

#include "bench/bench_util.h"
#include "check.h"

static void test_falling_series(void) {
    const double v[9] = {9, 8, 7, 5, 4, 6, 3, 1, 2};
    double copy[9], tmp[9];
    memcpy(copy, v, sizeof v);
    bench_series s = bench_series_of(v, 9, tmp);
    CHECK(s.median == 5);
    CHECK(s.min == 1);
    CHECK(s.first_third == 8); /* {9, 8, 7} */
    CHECK(s.last_third == 2);  /* {3, 1, 2} */
    CHECK(!memcmp(copy, v, sizeof v)); /* the order the replays ran in is kept */
}

static void test_flat_and_rising(void) {
    double flat[6] = {4, 4, 4, 4, 4, 4}, tmp[10];
    bench_series s = bench_series_of(flat, 6, tmp);
    CHECK(s.median == 4 && s.min == 4 && s.first_third == 4 && s.last_third == 4);
    /* 10 values: thirds of 3 (the middle 4 in neither), median the upper middle */
    const double up[10] = {1, 3, 2, 10, 20, 30, 40, 7, 9, 8};
    s = bench_series_of(up, 10, tmp);
    CHECK(s.first_third == 2);
    CHECK(s.last_third == 8);
    CHECK(s.median == 9); /* sorted: 1 2 3 7 8 9 10 20 30 40 */
    CHECK(s.min == 1);
    /* thirds of 2: the upper of the two */
    const double six[6] = {5, 6, 1, 2, 3, 4};
    s = bench_series_of(six, 6, tmp);
    CHECK(s.first_third == 6 && s.last_third == 4);
}

static void test_short_series(void) {
    double tmp[2];
    const double one[1] = {7}, two[2] = {3, 1};
    bench_series s = bench_series_of(one, 1, tmp);
    CHECK(s.median == 7 && s.min == 7);
    CHECK(isnan(s.first_third) && isnan(s.last_third));
    s = bench_series_of(two, 2, tmp);
    CHECK(s.median == 3 && s.min == 1);
    CHECK(isnan(s.first_third) && isnan(s.last_third));
}

int main(void) {
    test_falling_series();
    test_flat_and_rising();
    test_short_series();
    return check_summary("test_bench_series");
}
