/*
 * `m3 bench draft`: the time of one DSpark draft step (SPEC §7) on the GPU,
 * whole and in its three parts (the draft layers with the final norm, the
 * target's lm_head over the block's rows, the Markov head's B steps), each
 * against its floor: the fewest bytes the part must read (the draft layers'
 * weights and each request's context K/V, the lm_head once for all rows,
 * W2 and a logits row per request for each Markov step) divided by the
 * streaming read bandwidth measured in the same run. Each part is captured
 * as its own graph and replayed; the parts' sum against the whole step says
 * what the boundaries between them cost.
 */
#ifndef M3_BENCH_BENCH_DRAFT_H
#define M3_BENCH_BENCH_DRAFT_H

#include <stdint.h>

#include "bench/bench_layer.h"
#include "m3.h"
#include "spec/drafter.h" /* M3_MAX_DRAFT_REQS */

/* The parts, in m3_draft_part's order (spec/drafter.h). */
#define M3_BENCH_DRAFT_PARTS 4

typedef struct m3_bench_draft_opts {
    const char *model_dir, *draft_dir;
    int requests[M3_BENCH_MAX_POINTS], n_requests;
    int64_t contexts[M3_BENCH_MAX_POINTS];
    int n_contexts;
    int iters;                 /* timed graph replays per part */
    int gpu;
} m3_bench_draft_opts;

typedef struct m3_bench_draft_point {
    int requests;
    int64_t context;
    double median_us[M3_BENCH_DRAFT_PARTS], min_us[M3_BENCH_DRAFT_PARTS];
    double bytes[M3_BENCH_DRAFT_PARTS], floor_us[M3_BENCH_DRAFT_PARTS];
} m3_bench_draft_point;

typedef struct m3_bench_draft_result {
    double read_gb_per_s;
    int block, layers;
    m3_bench_draft_point points[M3_BENCH_MAX_POINTS * M3_BENCH_MAX_POINTS];
    int n_points;
} m3_bench_draft_result;

/* The parts' names: "step", "layers", "head", "markov". */
const char *m3_bench_draft_part_name(int part);

/* Every (context, requests) point; progress lines on stderr. */
m3_status m3_bench_draft(const m3_bench_draft_opts *opts, m3_bench_draft_result *out);

#endif
