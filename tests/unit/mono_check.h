/*
 * How close a layer's two discrete choices are to a tie, for the tests that
 * compare the mono path with the stock path where their sums differ in
 * order (CUDA): the gap between the K-th and (K+1)-th router key, and
 * between the last chosen and the first passed-over block score. A gap
 * within rounding means either choice is right, so a row whose outputs
 * part there is a near-tie, not a fault. Also where a slot's cache entries
 * live, for the tests that read them back, the relative L2 error of bf16
 * rows, and a preset synthesized at M3's selection shape, for the walks
 * (test_mono_walk, test_cuda_walk). Header-only (static inline) so
 * each test stays one translation unit.
 */
#ifndef M3_TESTS_MONO_CHECK_H
#define M3_TESTS_MONO_CHECK_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cache/cache.h"
#include "core/bf16.h"
#include "model/model.h"

/* The gap between the K-th and the (K+1)-th router key of x (bf16 [H], the
 * post-attention norm's output), in double on the host weights of the
 * model's layer (SPEC §2.3: sigmoid scores plus the routing bias). */
static inline double mono_route_gap(const m3_model *model, int layer, const uint16_t *x) {
    const m3_config *c = &model->cfg;
    const m3_layer_weights *hw = &model->w.layers[layer];
    const float *w = hw->router.data, *bias = hw->router_bias.data;
    int E = c->num_experts, K = c->experts_per_tok, H = c->hidden_size;
    if (K >= E)
        return INFINITY;
    double *keys = malloc((size_t)E * sizeof *keys);
    if (!keys)
        return NAN;
    for (int e = 0; e < E; e++) {
        double l = 0;
        for (int k = 0; k < H; k++)
            l += (double)w[(size_t)e * H + k] * m3_bf16_to_f32(x[k]);
        keys[e] = 1.0 / (1.0 + exp(-l)) + (bias ? bias[e] : 0.0);
    }
    for (int i = 0; i <= K; i++) /* partial selection sort of the top K + 1 */
        for (int j = i + 1; j < E; j++)
            if (keys[j] > keys[i]) {
                double t = keys[i];
                keys[i] = keys[j];
                keys[j] = t;
            }
    double gap = keys[K - 1] - keys[K];
    free(keys);
    return gap;
}

/* The relative gap between the last block one index head chooses and the
 * best one it passes over, from its block scores ([nblocks], the stock
 * path's), under SPEC §3's rule: the first `init` and last `local` blocks
 * are forced, the rest compete for the remaining topk - forced places.
 * INFINITY when nothing competes (nblocks <= topk). */
static inline double mono_select_gap(const float *scores, int nblocks, int topk, int init,
                                     int local) {
    if (nblocks <= topk)
        return INFINITY;
    int init_end = init < nblocks ? init : nblocks;
    int local_begin = nblocks - local > init_end ? nblocks - local : init_end;
    int room = topk - init_end - (nblocks - local_begin), n = local_begin - init_end;
    if (room <= 0 || room >= n)
        return INFINITY;
    float *c = malloc((size_t)n * sizeof *c);
    if (!c)
        return NAN;
    for (int i = 0; i < n; i++)
        c[i] = scores[init_end + i];
    for (int i = 0; i <= room; i++) /* the top room + 1 */
        for (int j = i + 1; j < n; j++)
            if (c[j] > c[i]) {
                float t = c[i];
                c[i] = c[j];
                c[j] = t;
            }
    double scale = fabs((double)c[room - 1]) > 1e-30 ? fabs((double)c[room - 1]) : 1e-30;
    double gap = ((double)c[room - 1] - (double)c[room]) / scale;
    free(c);
    return gap;
}

/* Where a slot's cache entry e lives in a layer's cache: e < Nkv the K row
 * of KV head e, then the V rows, then the index key (bf16 rows of D, D and
 * Di values, pages of M3_PAGE_TOKENS slots). */
static inline uint16_t *mono_entry_ptr(const m3_cache_layer *cl, int64_t slot, int e, int Nkv,
                                       int D, int Di) {
    int64_t page = slot / M3_PAGE_TOKENS, off = slot % M3_PAGE_TOKENS;
    if (e < Nkv)
        return (uint16_t *)cl->k + ((page * Nkv + e) * M3_PAGE_TOKENS + off) * D;
    if (e < 2 * Nkv)
        return (uint16_t *)cl->v + ((page * Nkv + (e - Nkv)) * M3_PAGE_TOKENS + off) * D;
    return (uint16_t *)cl->index + (page * M3_PAGE_TOKENS + off) * Di;
}

/* Relative L2 error of n bf16 values against ref (absolute where ref is
 * all zeros); *nan is set where got is not finite and ref is. */
static inline double mono_rel_l2(const uint16_t *got, const uint16_t *ref, int n, bool *nan) {
    double d = 0, r = 0;
    for (int i = 0; i < n; i++) {
        double g = m3_bf16_to_f32(got[i]), f = m3_bf16_to_f32(ref[i]);
        if (!isfinite(g) && isfinite(f))
            *nan = true;
        d += (g - f) * (g - f), r += f * f;
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* Synthesize preset into a new temporary folder (dir, of size bytes; ""
 * when none was made): with topk > 0, M3's selection shape (top-topk
 * blocks, no init block, one local block). */
static inline m3_status mono_synth_preset(const char *preset, int topk, uint64_t seed,
                                          char *dir, size_t size) {
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, size, "%s/m3_walk_XXXXXX", tmp);
    if (!mkdtemp(dir)) {
        dir[0] = 0; /* nothing to remove */
        return m3_fail(M3_ERR_IO, "cannot create a folder under %s", tmp);
    }
    m3_config cfg;
    M3_TRY(m3_preset(preset, &cfg));
    if (topk)
        cfg.topk_blocks = topk, cfg.init_blocks = 0, cfg.local_blocks = 1;
    m3_synth_opts so = {seed, false, 0};
    return m3_synth(&cfg, dir, &so);
}

#endif
