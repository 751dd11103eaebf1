/*
 * What the benchmarks share (bench_layer.c, bench_draft.c): the bytes a
 * weight occupies (a floor counts them) and a series of timings' summary
 * (median, minimum, drift).
 */
#ifndef M3_BENCH_BENCH_UTIL_H
#define M3_BENCH_BENCH_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/tensor.h"

/* Bytes of a tensor (0 when absent). */
static inline double bench_tensor_bytes(const m3_tensor *t) {
    return t->data ? (double)m3_tensor_nelem(t) * (double)m3_dtype_size(t->dtype) : 0;
}

/* Bytes of a linear: its weight and, for MXFP8, its scales. */
static inline double bench_linear_bytes(const m3_linear *l) {
    return bench_tensor_bytes(&l->w) + bench_tensor_bytes(&l->scale);
}

/* qsort's order of doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A series of timings in the order they were taken: its median and
 * minimum, and the medians of its first and last thirds (NAN under 3
 * values), so that a series still warming up shows first_third above
 * last_third. */
typedef struct bench_series {
    double median, min, first_third, last_third;
} bench_series;

/* The median of v[0..n) (n >= 1), through tmp (n doubles, left sorted). */
static inline double bench_median_via(const double *v, int n, double *tmp) {
    memcpy(tmp, v, (size_t)n * sizeof *tmp);
    qsort(tmp, (size_t)n, sizeof *tmp, bench_cmp_double);
    return tmp[n / 2];
}

/* v: n >= 1 timings in order (not changed); tmp: n doubles of scratch. */
static inline bench_series bench_series_of(const double *v, int n, double *tmp) {
    bench_series s = {NAN, NAN, NAN, NAN};
    const int third = n / 3;
    if (third >= 1) {
        s.first_third = bench_median_via(v, third, tmp);
        s.last_third = bench_median_via(v + n - third, third, tmp);
    }
    if (n >= 1) {
        s.median = bench_median_via(v, n, tmp);
        s.min = tmp[0];
    }
    return s;
}

#endif
