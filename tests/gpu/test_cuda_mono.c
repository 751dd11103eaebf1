/*
 * The mono path's CUDA executor (cuda/cuda_mono.h) against the stock layer
 * (decode/forward.c m3_stock_layer on the CUDA backend), SPEC §5 and §8.
 *
 * Models: checkpoints synthesized into temporary folders, six variants:
 *   small         the `small` preset (hidden 1024, 32 query / 2 KV heads,
 *                 16 experts top-4, a shared expert, top-4 blocks with one
 *                 init and one local block), bf16
 *   small-mxfp8   the same in MXFP8 (e4m3 + exponents per 32 columns)
 *   small-kv4     no shared expert, 4 KV / index heads (8 query heads per
 *                 group), top-8 blocks with no init and one local block
 *   tiny          the `tiny` preset (hidden 256, 4 query / 2 KV heads: a
 *                 group smaller than the 16-head attention tile, 8 experts
 *                 top-2, top-3 blocks)
 *   small-top16   `small` with M3's selection, top-16 blocks with no init
 *                 and one local block, over prompts of 2200..4200 tokens
 *                 (18-33 pages)
 *   small-long    the same over prompts of 16600..20000 tokens (130-157
 *                 pages: the selection's radix select)
 * Each is loaded into a CUDA engine (graphs off) with 16 sequences
 * prefilled to 600..1500 tokens (small-top16: 2200..4200; never a multiple
 * of 128; more blocks than top-k, so the indexer really selects). The decode steps are built with
 * m3_engine_build (padded to the graph widths: 3 rows run as 4 with a
 * padded row, 5 as 8), never committed, so every case sees the same
 * contexts.
 *
 * Cases, for every sparse MoE layer and 1, 2, 3, 5, 8, 16 rows:
 *   (1) stock vs mono: the same hidden / residual inputs (row i's inputs
 *       depend only on (variant, layer, i)) through m3_stock_layer and
 *       through m3_cuda_mono_layer; the K, V and index cache entries at the
 *       rows' slots are poisoned (NaN) between the two runs, so the mono
 *       path must write them. Hidden and residual of the real rows:
 *       relative L2 <= 1e-2 (TOL), NaN never passes. A row beyond the bound
 *       is a WARN only when its routing is a near-tie (the gap between the
 *       K-th and K+1-th router key, recomputed in double on the host from
 *       the stock path's post-attention norm output, below 1e-3: the two
 *       paths' o_proj inputs differ by fp32 summation order, which can flip
 *       such a choice); otherwise FAIL. Cache entries: relative L2 <= 1e-2
 *       and no NaN (bit-identical counts printed: the projections and the
 *       per-head norm + RoPE follow the stock arithmetic). The fault word
 *       must stay clear.
 *   (2) nothing else is written: on the first sparse layer the whole
 *       K / V / index cache of the layer is downloaded before and after the
 *       mono run; every byte outside the real rows' slots must be equal
 *       (padded rows write nothing, nothing strays).
 *   (3) batch invariance: row i's mono outputs are the same bits whatever
 *       the step's row count (WARN if not, FAIL if beyond TOL).
 *   (4) graphs: on the first sparse layer, the mono layer captured into a
 *       CUDA graph (backend graph_begin / graph_end), replayed twice (inputs
 *       re-uploaded before each), then run eagerly again: hidden, residual
 *       and the cache entries bit-identical to the eager run (the device
 *       counters reset themselves at the end of every launch).
 * Faults and refusals (first variant only):
 *   (5) set_fault / read_fault / clear_fault round trip; check_fault on a
 *       clear word does nothing.
 *   (6) a real row's slot past the page pool sets M3_MONO_FAULT_SLOT (row,
 *       layer and slot recorded) without crashing; after clearing it and
 *       restoring the slot, the layer gives the reference bits again.
 *   (7) a block table entry past the pool sets M3_MONO_FAULT_PAGE likewise.
 *   (8) a planted fault followed by check_fault in a child process (this
 *       program re-executed with --fault-child, since the device-side
 *       assert ends the CUDA context): the child must die or exit non-zero,
 *       and its output must hold "m3: mono fault: planted (layer 7, row -1,
 *       value 0)" (the name from m3_mono_fault_name, so host and device
 *       names agree).
 *   (9) refusals with clear errors: a dense layer, 17 rows, a block table
 *       wider than the executor's capacity, an unsupported head_dim at
 *       create; m3_mono_fault_name names every code distinctly.
 *
 * One line per check, a summary, exit 1 on any failure. M3_TEST_SEED varies
 * the inputs; M3_TEST_VARIANT=<name> runs one variant. Without a usable
 * CUDA device: "SKIP: no CUDA device: <reason>", exit 77.
 */
#include <dirent.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cache/cache.h"
#include "core/bf16.h"
#include "core/status.h"
#include "cuda/cuda_mono.h"
#include "decode/engine.h"
#include "gpu_common.h"
#include "m3.h"
#include "model/model.h"
#include "mono/fault.h"
#include "mono_check.h"

#define TOL 1e-2
#define NEAR_TIE 1e-3
#define NSEQ 16
#define MAXR 16
#define PAGE M3_PAGE_TOKENS
#define BF16_POISON 0x7fc1u

static const int k_rows[] = {1, 2, 3, 5, 8, 16};
#define N_ROWCASES ((int)(sizeof k_rows / sizeof *k_rows))

typedef struct variant {
    const char *name, *preset;
    bool mxfp8, no_shared;
    int kv_heads, topk, init, local; /* 0: the preset's */
    int min_len, max_len;            /* the prompts' lengths; 0: 600..1500 */
} variant;

static const variant k_variants[] = {
    {"small", "small", false, false, 0, 0, 0, 0, 0, 0},
    {"small-mxfp8", "small", true, false, 0, 0, 0, 0, 0, 0},
    {"small-kv4", "small", false, true, 4, 8, 0, 1, 0, 0},
    {"tiny", "tiny", false, false, 0, 0, 0, 0, 0, 0},
    /* M3's selection: top-16 of 18-33 pages (the others keep every page
     * up to 12), one index head per KV head as on a TP-4 rank */
    {"small-top16", "small", false, false, 0, 16, 0, 1, 2200, 4200},
    /* top-16 of 130-157 pages: more than 128 candidates, so the selection
     * takes its radix select (cuda_async.cuh) */
    {"small-long", "small", false, false, 0, 16, 0, 1, 16600, 20000},
};

/* ------------------------------------------------------------ results */

static int g_checks, g_fails, g_warns;

static void record(const char *variant, const char *test, const char *verdict, const char *fmt,
                   ...) {
    char value[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(value, sizeof value, fmt, ap);
    va_end(ap);
    g_checks++;
    g_fails += !strcmp(verdict, "FAIL");
    g_warns += !strcmp(verdict, "WARN");
    printf("%-12s %-34s %-4s  %s\n", variant, test, verdict, value);
    fflush(stdout);
}

/* ------------------------------------------------------------ context */

typedef struct ctx {
    const variant *v;
    m3_config cfg;
    char dir[512];
    m3_model *model;
    m3_engine *eng;
    m3_cuda_mono *mono;
    m3_backend *be;
    int H, Nkv, Di, D;
    m3_seq seqs[NSEQ];
    int64_t lens[NSEQ];
    uint32_t epoch;
    uint64_t seed;
    int first_sparse;
    /* batch invariance: row i's first mono outputs per layer */
    uint16_t *bi_hidden, *bi_residual; /* [layers][NSEQ][H] */
    bool *bi_have;                     /* [layers][NSEQ] */
    int bi_rows, bi_identical;
    double bi_max_rel;
} ctx;

static bool ok(const ctx *c, const char *test, m3_status st, const char *what) {
    if (st == M3_OK)
        return true;
    record(c->v->name, test, "FAIL", "%s: %s: %s", what, m3_status_name(st), m3_last_error());
    return false;
}

static uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t s = a ^ (b * 0x9e3779b97f4a7c15ull);
    return gpu_rng_next(&s);
}

/* row i's layer input: hidden in (-1, 1), residual in (-2, 2) */
static void row_input(const ctx *c, int layer, int i, uint16_t *h, uint16_t *r) {
    uint64_t s = mix(c->seed, (uint64_t)layer * 1000 + (uint64_t)i);
    for (int k = 0; k < c->H; k++) {
        double u1 = (double)(gpu_rng_next(&s) >> 11) * 0x1p-53;
        double u2 = (double)(gpu_rng_next(&s) >> 11) * 0x1p-53;
        h[k] = m3_f32_to_bf16((float)(2.0 * u1 - 1.0));
        r[k] = m3_f32_to_bf16((float)(4.0 * u2 - 2.0));
    }
}

static m3_status upload(ctx *c, void *dst, const void *src, size_t bytes) {
    return c->be->ops->upload(c->be, dst, src, bytes);
}

static m3_status download(ctx *c, void *dst, const void *src, size_t bytes) {
    return c->be->ops->download(c->be, dst, src, bytes);
}

/* ------------------------------------------------------------ cache entries */

/* The K, V (every KV head) and index entries of the rows' slots: [n][2 Nkv + 1][128]. */
static size_t entry_elems(const ctx *c, int n) { return (size_t)n * (2 * c->Nkv + 1) * c->D; }

static uint16_t *entry_ptr(const ctx *c, const m3_cache_layer *cl, int64_t slot, int e) {
    return mono_entry_ptr(cl, slot, e, c->Nkv, c->D, c->Di);
}

static m3_status entries_get(ctx *c, const m3_cache_layer *cl, const int64_t *slots, int n,
                             uint16_t *out) {
    int per = 2 * c->Nkv + 1;
    for (int i = 0; i < n; i++)
        for (int e = 0; e < per; e++)
            M3_TRY(download(c, out + ((size_t)i * per + e) * c->D, entry_ptr(c, cl, slots[i], e),
                            (size_t)c->D * 2));
    return M3_OK;
}

static m3_status entries_poison(ctx *c, const m3_cache_layer *cl, const int64_t *slots, int n) {
    uint16_t nan[256];
    for (int k = 0; k < 256; k++)
        nan[k] = BF16_POISON;
    int per = 2 * c->Nkv + 1;
    for (int i = 0; i < n; i++)
        for (int e = 0; e < per; e++)
            M3_TRY(upload(c, entry_ptr(c, cl, slots[i], e), nan, (size_t)c->D * 2));
    return M3_OK;
}

/* The whole layer cache (K, V, index) into one host buffer. */
typedef struct snapshot {
    uint8_t *k, *v, *idx;
    size_t kv_bytes, idx_bytes;
} snapshot;

static m3_status snap(ctx *c, const m3_cache_layer *cl, snapshot *s) {
    s->kv_bytes = (size_t)c->eng->cache.n_pages * c->Nkv * PAGE * c->D * 2;
    s->idx_bytes = (size_t)c->eng->cache.n_pages * PAGE * c->Di * 2;
    s->k = gpu_xmalloc(s->kv_bytes), s->v = gpu_xmalloc(s->kv_bytes), s->idx = gpu_xmalloc(s->idx_bytes);
    M3_TRY(download(c, s->k, cl->k, s->kv_bytes));
    M3_TRY(download(c, s->v, cl->v, s->kv_bytes));
    return download(c, s->idx, cl->index, s->idx_bytes);
}

static void snap_free(snapshot *s) { free(s->k), free(s->v), free(s->idx); }

static bool slot_is_real(const int64_t *slots, int n, int64_t slot) {
    for (int i = 0; i < n; i++)
        if (slots[i] == slot)
            return true;
    return false;
}

/* Bytes that differ outside the real rows' slots. */
static int64_t snap_stray(const ctx *c, const snapshot *a, const snapshot *b,
                          const int64_t *slots, int n) {
    int64_t stray = 0;
    size_t row = (size_t)c->D * 2;
    for (int which = 0; which < 3; which++) {
        const uint8_t *x = which == 0 ? a->k : which == 1 ? a->v : a->idx;
        const uint8_t *y = which == 0 ? b->k : which == 1 ? b->v : b->idx;
        size_t bytes = which < 2 ? a->kv_bytes : a->idx_bytes;
        int heads = which < 2 ? c->Nkv : 1;
        for (size_t r = 0; r < bytes / row; r++) {
            if (!memcmp(x + r * row, y + r * row, row))
                continue;
            /* row r of [pages, heads, 128, D]: its slot */
            int64_t off = (int64_t)(r % PAGE), page = (int64_t)(r / PAGE / heads);
            if (!slot_is_real(slots, n, page * PAGE + off))
                stray++;
        }
    }
    return stray;
}

/* ------------------------------------------------------------ routing near-ties */

/* ------------------------------------------------------------ comparisons */

static gpu_cmp cmp_bf16(const uint16_t *got, const uint16_t *ref, int64_t n) {
    float *g = gpu_xmalloc((size_t)n * 4), *r = gpu_xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        g[i] = m3_bf16_to_f32(got[i]), r[i] = m3_bf16_to_f32(ref[i]);
    gpu_cmp c = gpu_compare_f32(g, r, n);
    free(g), free(r);
    return c;
}

static bool cmp_pass(const gpu_cmp *c) { return c->bad_special == 0 && c->rel_l2 <= TOL; }

/* ------------------------------------------------------------ one case */

typedef struct outputs {
    uint16_t *hidden, *residual, *entries;
} outputs;

static void outputs_alloc(const ctx *c, outputs *o) {
    o->hidden = gpu_xmalloc((size_t)MAXR * c->H * 2);
    o->residual = gpu_xmalloc((size_t)MAXR * c->H * 2);
    o->entries = gpu_xmalloc(entry_elems(c, MAXR) * 2);
}

static void outputs_free(outputs *o) { free(o->hidden), free(o->residual), free(o->entries); }

/* Build the decode step of sequences [0, n) (padded to the graph width). */
static m3_status build_step(ctx *c, int n) {
    static int32_t toks[NSEQ];
    m3_request reqs[NSEQ];
    for (int i = 0; i < n; i++) {
        toks[i] = (int32_t)((i * 37 + 11) % c->cfg.vocab_size);
        reqs[i] = (m3_request){c->seqs[i], &toks[i], 1};
    }
    return m3_engine_build(c->eng, reqs, n, true);
}

/* Upload the layer inputs of the built step (real rows from row_input,
 * padded rows garbage) into the engine's hidden / residual. */
static m3_status put_inputs(ctx *c, int layer, int n, uint16_t *h, uint16_t *r) {
    int R = c->eng->step.rows;
    for (int i = 0; i < R; i++) {
        if (i < n) {
            row_input(c, layer, i, h + (size_t)i * c->H, r + (size_t)i * c->H);
        } else { /* padded: finite garbage that must not reach a real row */
            for (int k = 0; k < c->H; k++) {
                h[(size_t)i * c->H + k] = m3_f32_to_bf16(1000.0f + (float)k);
                r[(size_t)i * c->H + k] = m3_f32_to_bf16(-3.0f);
            }
        }
    }
    M3_TRY(upload(c, c->eng->s.hidden, h, (size_t)R * c->H * 2));
    return upload(c, c->eng->s.residual, r, (size_t)R * c->H * 2);
}

static m3_status mono_run(ctx *c, int layer, int n, outputs *o) {
    m3_engine *e = c->eng;
    M3_TRY(m3_cuda_mono_layer(c->mono, &e->step, layer, &e->w.layers[layer],
                              &e->cache.layers[layer], false, c->epoch++, e->s.hidden,
                              e->s.residual));
    M3_TRY(c->be->ops->sync(c->be));
    M3_TRY(download(c, o->hidden, e->s.hidden, (size_t)n * c->H * 2));
    M3_TRY(download(c, o->residual, e->s.residual, (size_t)n * c->H * 2));
    return entries_get(c, &e->cache.layers[layer], e->step.host.slots, n, o->entries);
}

static bool outputs_equal(const ctx *c, const outputs *a, const outputs *b, int n) {
    size_t hb = (size_t)n * c->H * 2;
    return !memcmp(a->hidden, b->hidden, hb) && !memcmp(a->residual, b->residual, hb) &&
           !memcmp(a->entries, b->entries, entry_elems(c, n) * 2);
}

static bool fault_clear(ctx *c, const char *test) {
    int32_t f[4];
    if (!ok(c, test, m3_cuda_mono_read_fault(c->mono, f), "read_fault"))
        return false;
    if (f[0] != 0) {
        record(c->v->name, test, "FAIL", "fault word set: %s (layer %d, row %d, value %d)",
               m3_mono_fault_name(f[0]), f[1], f[2], f[3]);
        m3_cuda_mono_clear_fault(c->mono);
        return false;
    }
    return true;
}

/* (4) capture, replay twice, eager again: all bit-identical to ref */
static void graph_case(ctx *c, int layer, int n, const outputs *ref, uint16_t *h, uint16_t *r) {
    char test[64];
    snprintf(test, sizeof test, "(4) graph L%d rows %d", layer, n);
    m3_engine *e = c->eng;
    const m3_backend_ops *op = c->be->ops;
    outputs got;
    outputs_alloc(c, &got);
    void *graph = NULL;
    int same = 0, runs = 0;
    if (!ok(c, test, put_inputs(c, layer, n, h, r), "inputs") ||
        !ok(c, test, op->graph_begin(c->be), "graph_begin"))
        goto out;
    m3_status cap = m3_cuda_mono_layer(c->mono, &e->step, layer, &e->w.layers[layer],
                                       &e->cache.layers[layer], false, c->epoch, e->s.hidden,
                                       e->s.residual);
    m3_status end = op->graph_end(c->be, cap == M3_OK, &graph);
    if (!ok(c, test, cap, "mono layer (capture)") || !ok(c, test, end, "graph_end") || !graph)
        goto out;
    for (int rep = 0; rep < 2; rep++) {
        if (!ok(c, test, put_inputs(c, layer, n, h, r), "inputs") ||
            !ok(c, test, op->graph_launch(c->be, graph), "graph_launch") ||
            !ok(c, test, op->sync(c->be), "sync after replay"))
            goto out;
        if (!ok(c, test, download(c, got.hidden, e->s.hidden, (size_t)n * c->H * 2), "download") ||
            !ok(c, test, download(c, got.residual, e->s.residual, (size_t)n * c->H * 2),
                "download") ||
            !ok(c, test,
                entries_get(c, &e->cache.layers[layer], e->step.host.slots, n, got.entries),
                "entries"))
            goto out;
        same += outputs_equal(c, &got, ref, n);
        runs++;
    }
    if (!ok(c, test, put_inputs(c, layer, n, h, r), "inputs") ||
        !ok(c, test, mono_run(c, layer, n, &got), "eager after replays"))
        goto out;
    same += outputs_equal(c, &got, ref, n);
    runs++;
    if (fault_clear(c, test))
        record(c->v->name, test, same == runs ? "PASS" : "FAIL",
               "%d/%d runs (2 replays, 1 eager after) bit-identical to the eager run", same, runs);
out:
    if (graph)
        op->graph_free(c->be, graph);
    outputs_free(&got);
}

/* (1) - (3) for one layer and row count */
static void layer_case(ctx *c, int layer, int n) {
    char test[64];
    snprintf(test, sizeof test, "(1) stock vs mono L%d rows %d", layer, n);
    m3_engine *e = c->eng;
    const m3_cache_layer *cl = &e->cache.layers[layer];
    int H = c->H;
    uint16_t *h = gpu_xmalloc((size_t)MAXR * H * 2), *r = gpu_xmalloc((size_t)MAXR * H * 2);
    uint16_t *x2 = gpu_xmalloc((size_t)MAXR * H * 2);
    outputs ref, got;
    outputs_alloc(c, &ref);
    outputs_alloc(c, &got);
    snapshot before = {0}, after = {0};
    bool whole = layer == c->first_sparse;
    if (!ok(c, test, build_step(c, n), "build step"))
        goto out;
    const int64_t *slots = e->step.host.slots;
    /* stock */
    if (!ok(c, test, put_inputs(c, layer, n, h, r), "inputs") ||
        !ok(c, test, m3_stock_layer(e, &e->step, layer, false), "stock layer") ||
        !ok(c, test, c->be->ops->sync(c->be), "stock sync") ||
        !ok(c, test, download(c, ref.hidden, e->s.hidden, (size_t)n * H * 2), "download") ||
        !ok(c, test, download(c, ref.residual, e->s.residual, (size_t)n * H * 2), "download") ||
        !ok(c, test, download(c, x2, e->s.x, (size_t)n * H * 2), "download") ||
        !ok(c, test, entries_get(c, cl, slots, n, ref.entries), "entries") ||
        !ok(c, test, entries_poison(c, cl, slots, n), "poison"))
        goto out;
    if (whole && !ok(c, test, snap(c, cl, &before), "snapshot"))
        goto out;
    /* mono */
    if (!ok(c, test, put_inputs(c, layer, n, h, r), "inputs") ||
        !ok(c, test, mono_run(c, layer, n, &got), "mono layer") || !fault_clear(c, test))
        goto out;
    if (whole && !ok(c, test, snap(c, cl, &after), "snapshot"))
        goto out;

    /* (1) hidden / residual per row, routing near-ties explained */
    int near = 0, warn_rows = 0, fail_rows = 0;
    double worst = 0;
    for (int i = 0; i < n; i++) {
        gpu_cmp hr = cmp_bf16(got.hidden + (size_t)i * H, ref.hidden + (size_t)i * H, H);
        worst = hr.rel_l2 > worst ? hr.rel_l2 : worst;
        if (cmp_pass(&hr))
            continue;
        double gap =
            hr.bad_special ? INFINITY : mono_route_gap(c->model, layer, x2 + (size_t)i * H);
        if (gap < NEAR_TIE) {
            near++, warn_rows++;
            printf("       row %d: hidden relL2 %.2e with a routing near-tie (key gap %.1e)\n", i,
                   hr.rel_l2, gap);
        } else {
            fail_rows++;
            printf("       row %d: hidden relL2 %.2e, %lld NaN/inf, routing key gap %.1e\n", i,
                   hr.rel_l2, (long long)hr.bad_special, gap);
        }
    }
    gpu_cmp ha = cmp_bf16(got.hidden, ref.hidden, (int64_t)n * H);
    gpu_cmp ra = cmp_bf16(got.residual, ref.residual, (int64_t)n * H);
    size_t ne = entry_elems(c, n);
    gpu_cmp ea = cmp_bf16(got.entries, ref.entries, (int64_t)ne);
    int64_t same_e = 0;
    for (size_t k = 0; k < ne; k++)
        same_e += got.entries[k] == ref.entries[k];
    bool pass = fail_rows == 0 && cmp_pass(&ra) && cmp_pass(&ea) && ha.bad_special == 0;
    record(c->v->name, test, !pass ? "FAIL" : warn_rows ? "WARN" : "PASS",
           "hidden relL2 %.2e (worst row %.2e), residual %.2e, cache %.2e (%lld/%zu equal)%s",
           ha.rel_l2, worst, ra.rel_l2, ea.rel_l2, (long long)same_e, ne,
           near ? "; near-tie rows beyond TOL" : "");

    /* (2) nothing but the real rows' slots changed */
    if (whole) {
        snprintf(test, sizeof test, "(2) stray writes L%d rows %d", layer, n);
        int64_t stray = snap_stray(c, &before, &after, slots, n);
        record(c->v->name, test, stray ? "FAIL" : "PASS",
               "%lld cache rows changed outside the %d real slots (%d padded rows)",
               (long long)stray, n, e->step.rows - n);
    }

    /* (3) batch invariance bookkeeping */
    for (int i = 0; i < n; i++) {
        size_t at = ((size_t)layer * NSEQ + i) * H;
        bool *have = &c->bi_have[layer * NSEQ + i];
        if (!*have) {
            memcpy(c->bi_hidden + at, got.hidden + (size_t)i * H, (size_t)H * 2);
            memcpy(c->bi_residual + at, got.residual + (size_t)i * H, (size_t)H * 2);
            *have = true;
            continue;
        }
        c->bi_rows++;
        bool same = !memcmp(c->bi_hidden + at, got.hidden + (size_t)i * H, (size_t)H * 2) &&
                    !memcmp(c->bi_residual + at, got.residual + (size_t)i * H, (size_t)H * 2);
        c->bi_identical += same;
        if (!same) {
            gpu_cmp d = cmp_bf16(got.hidden + (size_t)i * H, c->bi_hidden + at, H);
            double rel = d.bad_special ? INFINITY : d.rel_l2;
            c->bi_max_rel = rel > c->bi_max_rel ? rel : c->bi_max_rel;
        }
    }

    if (whole)
        graph_case(c, layer, n, &got, h, r);
out:
    if (whole) {
        snap_free(&before);
        snap_free(&after);
    }
    outputs_free(&ref);
    outputs_free(&got);
    free(h), free(r), free(x2);
}

/* ------------------------------------------------------------ faults */

/* (5) set / read / clear; check on a clear word */
static void fault_round_trip(ctx *c) {
    const char *name = c->v->name;
    const m3_backend_ops *op = c->be->ops;
    int32_t f[4];
    const char *t5 = "(5) fault word round trip";
    if (ok(c, t5, m3_cuda_mono_set_fault(c->mono, M3_MONO_FAULT_PLANTED, 5), "set_fault") &&
        ok(c, t5, m3_cuda_mono_read_fault(c->mono, f), "read_fault")) {
        bool set_ok = f[0] == M3_MONO_FAULT_PLANTED && f[1] == 5 && f[2] == -1;
        /* a second fault does not replace the first */
        m3_cuda_mono_set_fault(c->mono, M3_MONO_FAULT_ABORTED, 9);
        int32_t g[4] = {0};
        m3_cuda_mono_read_fault(c->mono, g);
        bool sticky = g[0] == M3_MONO_FAULT_PLANTED && g[1] == 5;
        int32_t z[4] = {1, 1, 1, 1};
        bool cleared = ok(c, t5, m3_cuda_mono_clear_fault(c->mono), "clear_fault") &&
                       ok(c, t5, m3_cuda_mono_read_fault(c->mono, z), "read_fault") && z[0] == 0;
        bool check_ok = ok(c, t5, m3_cuda_mono_check_fault(c->mono), "check_fault") &&
                        ok(c, t5, op->sync(c->be), "sync after check on a clear word");
        record(name, t5, set_ok && sticky && cleared && check_ok ? "PASS" : "FAIL",
               "set [%d %d %d %d], sticky %s, cleared %s, check on clear word %s", f[0], f[1],
               f[2], f[3], sticky ? "yes" : "NO", cleared ? "yes" : "NO",
               check_ok ? "ran" : "FAILED");
    }
}

/* one mono run of the layer on the step's (uploaded) tables, then the fault
 * word into f */
static m3_status run_read_fault(ctx *c, int layer, int n, uint16_t *h, uint16_t *r,
                                int32_t f[4]) {
    m3_engine *e = c->eng;
    m3_status s = put_inputs(c, layer, n, h, r);
    if (!s)
        s = m3_cuda_mono_layer(c->mono, &e->step, layer, &e->w.layers[layer],
                               &e->cache.layers[layer], false, c->epoch++, e->s.hidden,
                               e->s.residual);
    if (!s)
        s = c->be->ops->sync(c->be);
    return s ? s : m3_cuda_mono_read_fault(c->mono, f);
}

/* after a fault: cleared, the next run gives the reference bits */
static bool clean_again(ctx *c, const char *t, int layer, int n, uint16_t *h, uint16_t *r,
                        const outputs *ref, outputs *got) {
    return ok(c, t, m3_cuda_mono_clear_fault(c->mono), "clear") &&
           ok(c, t, put_inputs(c, layer, n, h, r), "inputs") &&
           ok(c, t, mono_run(c, layer, n, got), "run after clearing") && fault_clear(c, t) &&
           outputs_equal(c, got, ref, n);
}

/* (6) a real row's slot past the pool */
static void fault_slot(ctx *c, int layer, int n, uint16_t *h, uint16_t *r, const outputs *ref,
                       outputs *got) {
    const char *name = c->v->name, *t6 = "(6) slot past the pool";
    m3_step *st = &c->eng->step;
    int R = st->rows;
    int64_t pool = (int64_t)st->n_pages * PAGE;
    int32_t f[4];
    int64_t saved = st->host.slots[1], bad = pool + 7;
    st->host.slots[1] = bad;
    m3_status s = upload(c, st->dev.slots, st->host.slots, (size_t)R * 8);
    m3_status s2 = s ? s : run_read_fault(c, layer, n, h, r, f);
    st->host.slots[1] = saved;
    upload(c, st->dev.slots, st->host.slots, (size_t)R * 8);
    if (ok(c, t6, s, "faulty run") && ok(c, t6, s2, "read_fault")) {
        bool hit = f[0] == M3_MONO_FAULT_SLOT && f[1] == layer && f[2] == 1 &&
                   f[3] == (int32_t)(bad > INT32_MAX ? INT32_MAX : bad);
        bool again = clean_again(c, t6, layer, n, h, r, ref, got);
        record(name, t6, hit && again ? "PASS" : "FAIL",
               "fault [%s, layer %d, row %d, value %d] (want slot, %d, 1, %lld); next run %s",
               m3_mono_fault_name(f[0]), f[1], f[2], f[3], layer, (long long)bad,
               again ? "gives the reference bits" : "DIFFERS");
    }
}

/* (7) a block table page past the pool */
static void fault_page(ctx *c, int layer, int n, uint16_t *h, uint16_t *r, const outputs *ref,
                       outputs *got) {
    const char *name = c->v->name, *t7 = "(7) block table page past the pool";
    m3_step *st = &c->eng->step;
    int32_t f[4];
    int width = st->max_blocks;
    int32_t saved = st->host.block_table[0], bad = (int32_t)st->n_pages + 3;
    st->host.block_table[0] = bad; /* request 0, block 0 */
    size_t tb = (size_t)st->n_reqs * width * 4;
    m3_status s = upload(c, st->dev.block_table, st->host.block_table, tb);
    m3_status s2 = s ? s : run_read_fault(c, layer, n, h, r, f);
    st->host.block_table[0] = saved;
    upload(c, st->dev.block_table, st->host.block_table, tb);
    if (ok(c, t7, s, "faulty run") && ok(c, t7, s2, "read_fault")) {
        bool hit = f[0] == M3_MONO_FAULT_PAGE && f[1] == layer && f[2] == 0 && f[3] == bad;
        bool again = clean_again(c, t7, layer, n, h, r, ref, got);
        record(name, t7, hit && again ? "PASS" : "FAIL",
               "fault [%s, layer %d, row %d, value %d] (want page, %d, 0, %d); next run %s",
               m3_mono_fault_name(f[0]), f[1], f[2], f[3], layer, bad,
               again ? "gives the reference bits" : "DIFFERS");
    }
}

/* (9) refusals with clear errors: a dense layer, too many rows, a table
 * wider than the executor's capacity, an unsupported head_dim; every fault
 * code has its own name */
static void refusal_cases(ctx *c, int layer) {
    const char *name = c->v->name;
    m3_engine *e = c->eng;
    m3_step *st = &e->step;
    const char *t9 = "(9) refusals";
    int dense = -1;
    for (int i = 0; i < c->cfg.num_layers; i++)
        if (!c->cfg.layer_sparse[i] || !c->cfg.layer_moe[i])
            dense = i;
    int good = 0, want = 0;
    char why[160] = "";
    if (dense >= 0) {
        want++;
        m3_status s = m3_cuda_mono_layer(c->mono, st, dense, &e->w.layers[dense],
                                         &e->cache.layers[dense], dense == 0, 0, e->s.hidden,
                                         e->s.residual);
        if (s == M3_ERR_UNSUPPORTED && strstr(m3_last_error(), "sparse attention + MoE"))
            good++;
        else
            snprintf(why, sizeof why, "dense layer: %s \"%s\"", m3_status_name(s),
                     m3_last_error());
    }
    m3_step wide = *st;
    wide.rows = MAXR + 1;
    want++;
    m3_status s = m3_cuda_mono_layer(c->mono, &wide, layer, &e->w.layers[layer],
                                     &e->cache.layers[layer], false, 0, e->s.hidden,
                                     e->s.residual);
    if (s == M3_ERR_INVALID_ARG && strstr(m3_last_error(), "rows"))
        good++;
    else
        snprintf(why, sizeof why, "17 rows: %s \"%s\"", m3_status_name(s), m3_last_error());
    wide = *st;
    wide.max_blocks = e->max_blocks + 1;
    want++;
    s = m3_cuda_mono_layer(c->mono, &wide, layer, &e->w.layers[layer],
                           &e->cache.layers[layer], false, 0, e->s.hidden, e->s.residual);
    if (s == M3_ERR_INVALID_ARG && strstr(m3_last_error(), "capacity"))
        good++;
    else
        snprintf(why, sizeof why, "wide table: %s \"%s\"", m3_status_name(s),
                 m3_last_error());
    m3_config bad = c->cfg;
    bad.head_dim = 64;
    m3_cuda_mono *m2 = NULL;
    want++;
    s = m3_cuda_mono_create(c->be, &bad, e->max_blocks, 0, 1, &m2);
    if (s == M3_ERR_UNSUPPORTED && !m2 && strstr(m3_last_error(), "head_dim"))
        good++;
    else
        snprintf(why, sizeof why, "head_dim 64: %s \"%s\"", m3_status_name(s),
                 m3_last_error());
    m3_cuda_mono_free(m2);
    /* every fault code has its own name */
    want++;
    bool names = true;
    for (int a = 0; a <= M3_MONO_FAULT_PLANTED; a++)
        for (int b = 0; b < a; b++)
            names = names && m3_mono_fault_name(a) && m3_mono_fault_name(a)[0] &&
                    strcmp(m3_mono_fault_name(a), m3_mono_fault_name(b));
    names = names && m3_mono_fault_name(99) != NULL;
    good += names;
    if (!names)
        snprintf(why, sizeof why, "fault names are not distinct");
    record(name, t9, good == want ? "PASS" : "FAIL", "%d/%d refused with clear errors%s%s",
           good, want, why[0] ? ": " : "", why);
    fault_clear(c, t9); /* nothing launched */
}

static void fault_cases(ctx *c) {
    fault_round_trip(c);
    int layer = c->first_sparse, n = 2;
    /* reference bits of the 2-row step */
    outputs ref, got;
    outputs_alloc(c, &ref);
    outputs_alloc(c, &got);
    uint16_t *h = gpu_xmalloc((size_t)MAXR * c->H * 2), *r = gpu_xmalloc((size_t)MAXR * c->H * 2);
    const char *t6 = "(6) slot past the pool";
    if (!ok(c, t6, build_step(c, n), "build step") ||
        !ok(c, t6, put_inputs(c, layer, n, h, r), "inputs") ||
        !ok(c, t6, mono_run(c, layer, n, &ref), "reference run") || !fault_clear(c, t6))
        goto out;
    fault_slot(c, layer, n, h, r, &ref, &got);
    fault_page(c, layer, n, h, r, &ref, &got);
    refusal_cases(c, layer);
out:
    outputs_free(&ref);
    outputs_free(&got);
    free(h), free(r);
}

/* (8) the child: plant a fault and check it; the device-side assert must
 * end the process's CUDA context with the fault's message. */
static int fault_child(void) {
    m3_backend *be = NULL;
    m3_config cfg;
    m3_cuda_mono *m = NULL;
    m3_status st = m3_cuda_backend_create(0, &be);
    if (!st)
        st = m3_preset("small", &cfg);
    if (!st)
        st = m3_cuda_mono_create(be, &cfg, 64, 0, 1, &m);
    if (!st)
        st = m3_cuda_mono_set_fault(m, M3_MONO_FAULT_PLANTED, 7);
    if (!st)
        st = m3_cuda_mono_check_fault(m);
    if (st) {
        printf("child: setup failed: %s: %s\n", m3_status_name(st), m3_last_error());
        return 2;
    }
    st = be->ops->sync(be);
    printf("child: sync after check_fault -> %s: %s\n", m3_status_name(st), m3_last_error());
    fflush(stdout);
    return st == M3_OK ? 0 : 3;
}

static void trap_case(const char *name) {
    const char *t8 = "(8) planted fault traps (child)";
    char *argv[] = {"test_cuda_mono", "--fault-child", NULL};
    char out[8192];
    int status = 0;
    bool hung = false;
    if (!gpu_run_child(argv, 300, out, sizeof out, &status, &hung)) {
        record(name, t8, "FAIL", "could not run the child");
        return;
    }
    char want[160];
    snprintf(want, sizeof want, "m3: mono fault: %s (layer 7, row -1, value 0)",
             m3_mono_fault_name(M3_MONO_FAULT_PLANTED));
    bool died = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
    bool code_ok = !(WIFEXITED(status) && WEXITSTATUS(status) == 2); /* 2: setup failed */
    bool msg = strstr(out, want) != NULL;
    bool pass = !hung && died && code_ok && msg;
    record(name, t8, pass ? "PASS" : "FAIL", "child %s %d%s; message %s",
           WIFSIGNALED(status) ? "signal" : "exit",
           WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status),
           hung ? " (HUNG: killed)" : "", msg ? "found" : "MISSING");
    if (!pass)
        printf("       child output:\n%s\n", out);
}

/* ------------------------------------------------------------ setup */

static bool setup(ctx *c, uint64_t *rng) {
    const char *t = "setup";
    const variant *v = c->v;
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(c->dir, sizeof c->dir, "%s/m3_gpu_mono_%s_XXXXXX", tmp, v->name);
    if (!mkdtemp(c->dir)) {
        record(v->name, t, "FAIL", "cannot create a folder under %s", tmp);
        c->dir[0] = 0;
        return false;
    }
    if (!ok(c, t, m3_preset(v->preset, &c->cfg), "preset"))
        return false;
    c->cfg.mxfp8 = v->mxfp8;
    if (v->no_shared)
        c->cfg.shared_dim = 0;
    if (v->kv_heads)
        c->cfg.num_kv_heads = c->cfg.index_heads = v->kv_heads;
    if (v->topk) {
        c->cfg.topk_blocks = v->topk;
        c->cfg.init_blocks = v->init;
        c->cfg.local_blocks = v->local;
    }
    m3_synth_opts so = {gpu_rng_next(rng), false, 0};
    if (!ok(c, t, m3_synth(&c->cfg, c->dir, &so), "synth") ||
        !ok(c, t, m3_model_load(c->dir, NULL, &c->model), "load"))
        return false;
    c->cfg = *m3_model_config(c->model);
    c->H = c->cfg.hidden_size;
    c->Nkv = c->cfg.num_kv_heads;
    c->D = c->cfg.head_dim;
    c->Di = c->cfg.index_dim;
    c->seed = gpu_rng_next(rng);
    c->first_sparse = -1;
    for (int i = c->cfg.num_layers - 1; i >= 0; i--)
        if (c->cfg.layer_sparse[i] && c->cfg.layer_moe[i])
            c->first_sparse = i;
    if (c->first_sparse < 0) {
        record(v->name, t, "FAIL", "the model has no sparse MoE layer");
        return false;
    }
    m3_engine_opts o = m3_engine_defaults();
    o.device = M3_DEVICE_CUDA;
    o.graphs = false;
    o.decode = M3_DECODE_STOCK; /* the engine's own mono lifecycle stays off: this test drives
                                   the executor directly */
    o.max_rows = 512;
    o.max_seqs = NSEQ;
    int min_len = v->min_len ? v->min_len : 600, max_len = v->max_len ? v->max_len : 1500;
    o.max_tokens = (int64_t)NSEQ * (max_len + 2 * PAGE);
    if (!ok(c, t, m3_engine_create(c->model, &o, &c->eng), "CUDA engine"))
        return false;
    c->be = c->eng->be;
    if (!ok(c, t,
            m3_cuda_mono_create(c->be, &c->eng->cfg, c->eng->max_blocks, 0, 1, &c->mono),
            "mono create"))
        return false;
    /* prefill: lengths min_len..max_len, never a multiple of 128 */
    int V = c->cfg.vocab_size;
    float *logits = gpu_xmalloc((size_t)V * 4);
    int32_t *prompt = gpu_xmalloc((size_t)(max_len + 1) * 4);
    bool good = true;
    for (int i = 0; i < NSEQ && good; i++) {
        int64_t len = min_len + (i * 577 + 13) % (max_len - min_len);
        if (len % PAGE == 0)
            len++;
        c->lens[i] = len;
        for (int k = 0; k < len; k++)
            prompt[k] = (int32_t)(gpu_rng_next(rng) % (uint64_t)V);
        good = ok(c, t, m3_seq_create(c->eng, &c->seqs[i]), "seq");
        for (int64_t at = 0; good && at < len; at += o.max_rows) {
            int chunk = (int)(len - at < o.max_rows ? len - at : o.max_rows);
            m3_request q = {c->seqs[i], prompt + at, chunk};
            good = ok(c, t, m3_engine_step(c->eng, &q, 1, logits, NULL), "prefill");
        }
    }
    free(logits);
    free(prompt);
    if (!good)
        return false;
    size_t L = (size_t)c->cfg.num_layers;
    c->bi_hidden = gpu_xmalloc(L * NSEQ * c->H * 2);
    c->bi_residual = gpu_xmalloc(L * NSEQ * c->H * 2);
    c->bi_have = calloc(L * NSEQ, 1);
    int64_t lo = c->lens[0], hi = c->lens[0];
    for (int i = 1; i < NSEQ; i++)
        lo = c->lens[i] < lo ? c->lens[i] : lo, hi = c->lens[i] > hi ? c->lens[i] : hi;
    printf("%s: hidden %d, %d/%d q/kv heads, %d experts top-%d, shared %d, top-%d blocks "
           "(init %d, local %d), %s; contexts %lld..%lld tokens\n",
           v->name, c->H, c->cfg.num_q_heads, c->Nkv, c->cfg.num_experts,
           c->cfg.experts_per_tok, c->cfg.shared_dim, c->cfg.topk_blocks, c->cfg.init_blocks,
           c->cfg.local_blocks, c->cfg.mxfp8 ? "MXFP8" : "bf16", (long long)lo, (long long)hi);
    return true;
}

static void teardown(ctx *c) {
    m3_cuda_mono_free(c->mono);
    m3_engine_free(c->eng);
    m3_model_free(c->model);
    if (c->dir[0])
        gpu_remove_dir(c->dir);
    free(c->bi_hidden), free(c->bi_residual), free(c->bi_have);
}

static void run_variant(const variant *v, uint64_t *rng, bool faults) {
    ctx *c = calloc(1, sizeof *c);
    if (!c)
        exit(1);
    c->v = v;
    if (setup(c, rng)) {
        for (int layer = 0; layer < c->cfg.num_layers; layer++) {
            if (!c->cfg.layer_sparse[layer] || !c->cfg.layer_moe[layer])
                continue;
            for (int k = 0; k < N_ROWCASES; k++)
                layer_case(c, layer, k_rows[k]);
        }
        const char *t3 = "(3) batch invariance";
        record(v->name, t3,
               c->bi_identical == c->bi_rows ? "PASS" : c->bi_max_rel <= TOL ? "WARN" : "FAIL",
               "%d/%d rows bit-identical across row counts (max relL2 of the others %.2e)",
               c->bi_identical, c->bi_rows, c->bi_max_rel);
        if (faults)
            fault_cases(c);
    }
    teardown(c);
    free(c);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--fault-child"))
        return fault_child();
    int probe = gpu_probe("test_cuda_mono");
    if (probe)
        return probe;
    uint64_t rng = gpu_test_seed(0x6d0d0c0deull);
    printf("test_cuda_mono: seed %llu (set M3_TEST_SEED to vary); tolerance relL2 %.0e\n",
           (unsigned long long)rng, TOL);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const char *only = getenv("M3_TEST_VARIANT");
    for (size_t i = 0; i < sizeof k_variants / sizeof *k_variants; i++)
        if (!only || !strcmp(only, k_variants[i].name))
            run_variant(&k_variants[i], &rng, i == 0 || (only != NULL));
    trap_case(only ? only : k_variants[0].name);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("test_cuda_mono: %d checks, %d failed, %d warnings (%.1f s)\n", g_checks, g_fails,
           g_warns, (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return g_fails ? 1 : 0;
}
