/*
 * `m3 bench layer`: the time one decode step spends in one layer, against
 * the floor SPEC §9 defines: the fewest bytes the step must read (the
 * layer's attention and router weights, the experts its rows route to,
 * the shared expert, the K/V and index cache it attends over) divided by
 * the streaming read bandwidth measured in the same run.
 */
#ifndef M3_BENCH_BENCH_LAYER_H
#define M3_BENCH_BENCH_LAYER_H

#include <stdbool.h>
#include <stdint.h>

#include "m3.h"

#define M3_BENCH_MAX_POINTS 64

/* Each point's warm-up before its timed replays, in milliseconds: a point
 * measured right after a heavier one (16 rows, then one row at 128K) ran
 * 8% slower over 50 replays with three warm-ups, and at its usual time
 * over 400 (docs/PERF.md, fifty-sixth session). */
#define M3_BENCH_WARMUP_MS 200.0

typedef struct m3_bench_layer_opts {
    const char *model_dir;
    int layer;                 /* -1: the first sparse MoE layer (else the last) */
    int span;                  /* layers timed together from `layer` (0 or 1: one); a
                                * point's figures are then means per layer */
    int rows[M3_BENCH_MAX_POINTS], n_rows;
    int64_t contexts[M3_BENCH_MAX_POINTS];
    int n_contexts;
    const char *path;          /* "stock" or "mono" */
    int iters;                 /* timed replays per point */
    double warmup_ms;          /* replays before them: >= 3, for >= this long */
    int gpu;
    int tp;                    /* > 1: a TP engine, GPUs gpu .. gpu + tp - 1 */
} m3_bench_layer_opts;

typedef struct m3_bench_point {
    int layer, span, rows;     /* layers layer .. layer + span - 1 */
    int64_t context;
    const char *path;
    double median_us, min_us;  /* per layer (a span's time / span), as every figure below */
    double first_third_us, last_third_us; /* medians of the replays' first and last
                                           * thirds in order (NAN under 3 replays) */
    double bytes, floor_us;
    double read_us;            /* one read-only kernel over `bytes` (cuda_bench.h) */
    double weight_bytes, cache_bytes;
    double unique_experts;     /* mean over rotation sets (and a span's layers) */
    int sets;                  /* input sets rotated through */
    int tp;                    /* ranks (the time: the slowest rank's; bytes: one rank's) */
    double allreduce_us;       /* TP > 1: the stock path's all-reduces alone (median) */
} m3_bench_point;

typedef struct m3_bench_layer_result {
    double read_gb_per_s;
    char device[128];
    m3_bench_point points[M3_BENCH_MAX_POINTS * 4];
    int n_points;
} m3_bench_layer_result;

/* Run every (context, rows) point; progress lines on stderr. */
m3_status m3_bench_layer(const m3_bench_layer_opts *opts, m3_bench_layer_result *out);

#endif
