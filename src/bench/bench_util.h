/*
 * What the benchmarks share (bench_layer.c, bench_draft.c): the bytes a
 * weight occupies (a floor counts them) and the order of timings for a
 * median.
 */
#ifndef M3_BENCH_BENCH_UTIL_H
#define M3_BENCH_BENCH_UTIL_H

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

#endif
