/*
 * Indexer context parallelism on the GPU (src/cuda/cuda_cp.cu) against the
 * CPU core (src/cp/indexer_cp.c) on the same random inputs: the owned-block
 * scores bit for bit (GPU output poisoned first, every entry must be
 * written), the local top-k keys exactly, the merged selection exactly and
 * equal to the world-1 selection; worlds 1, 2, 3, 4, 8, query_len 1 and 8,
 * forced-block configurations (0,0), (1,1), (1,2), (2,4), random values
 * with a NaN key and 0/1 values full of ties, lengths of 0, below one
 * block, not multiples of 128 and far past the forced blocks. Then graph
 * capture with a one-token dummy batch replayed on the real lengths (equal
 * to eager), bad lengths and pages (an error naming the value, no fault),
 * and every host-side check. Without a usable CUDA device: "SKIP: no CUDA
 * device: <reason>", exit 77.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "test_data.h"
#include "core/bf16.h"
#include "core/status.h"
#include "cp/indexer_cp.h"
#include "cuda/cuda_cp.h"

#define D 128
#define BLK 128
#define HEADS 4
#define BATCH 5
#define MAX_SEQ 33000 /* 258 global blocks */
#define PAGES 64
#define TABLE_W 260

static m3_backend *g_gpu;

typedef struct dataset {
    int qlen, tokens;
    uint16_t *q;     /* [tokens, HEADS, D] */
    uint16_t *cache; /* [PAGES, BLK, D] */
    int32_t table[BATCH][TABLE_W];
    int32_t lens[BATCH];
    float scale;
    /* device copies */
    void *dq, *dcache, *dtable, *dlens;
} dataset;

static void *dev(size_t bytes) {
    void *p = NULL;
    if (g_gpu->ops->alloc(g_gpu, bytes, &p)) {
        fprintf(stderr, "device alloc of %zu bytes: %s\n", bytes, m3_last_error());
        exit(1);
    }
    return p;
}

static void up(void *d, const void *h, size_t bytes) {
    if (g_gpu->ops->upload(g_gpu, d, h, bytes)) {
        fprintf(stderr, "upload: %s\n", m3_last_error());
        exit(1);
    }
}

static void down(void *h, const void *d, size_t bytes) {
    if (g_gpu->ops->download(g_gpu, h, d, bytes)) {
        fprintf(stderr, "download: %s\n", m3_last_error());
        exit(1);
    }
}

/* release n device buffers */
static void release_all(void *const *bufs, int n) {
    for (int i = 0; i < n; i++)
        g_gpu->ops->release(g_gpu, bufs[i]);
}

/* mode 0: random values with a NaN key; mode 1: 0/1 values (ties) */
static void make_dataset(dataset *d, int qlen, int mode) {
    static const int32_t lens[BATCH] = {5, 0, 200, 33000, 20111};
    d->qlen = qlen;
    d->tokens = BATCH * qlen;
    size_t nq = (size_t)d->tokens * HEADS * D, nc = (size_t)PAGES * BLK * D;
    d->q = malloc(nq * 2);
    d->cache = malloc(nc * 2);
    for (size_t i = 0; i < nq; i++)
        d->q[i] = m3_f32_to_bf16(mode ? 1.0f : rndf());
    for (size_t i = 0; i < nc; i++)
        d->cache[i] = m3_f32_to_bf16(mode ? (float)(rnd() % 16 == 0) : rndf());
    if (!mode)
        d->cache[(3 * BLK + 17) * D + 5] = m3_f32_to_bf16(NAN); /* page 3, offset 17 */
    for (int i = 0; i < BATCH; i++) {
        d->lens[i] = i == 1 && qlen > 1 ? 3 : lens[i]; /* qlen 8: rows before the start */
        for (int b = 0; b < TABLE_W; b++)
            d->table[i][b] = (int32_t)(rnd() % PAGES);
    }
    d->table[3][5] = 3; /* the NaN key where it competes */
    d->scale = (float)(1.0 / sqrt((double)D) * 1.4426950408889634);
    d->dq = dev(nq * 2);
    d->dcache = dev(nc * 2);
    d->dtable = dev(sizeof d->table);
    d->dlens = dev(sizeof d->lens);
    up(d->dq, d->q, nq * 2);
    up(d->dcache, d->cache, nc * 2);
    up(d->dtable, d->table, sizeof d->table);
    up(d->dlens, d->lens, sizeof d->lens);
}

static void free_dataset(dataset *d) {
    free(d->q);
    free(d->cache);
    release_all((void *const[]){d->dq, d->dcache, d->dtable, d->dlens}, 4);
}

static m3_cp_score_inputs host_inputs(dataset *d) {
    return m3_cp_host_inputs(d->tokens, HEADS, D, PAGES, BATCH, TABLE_W, d->q, d->cache,
                             &d->table[0][0], d->lens);
}

static m3_cuda_cp_inputs dev_inputs(dataset *d) {
    m3_cuda_cp_inputs in = {0};
    in.q = d->dq;
    in.q_row = HEADS * D;
    in.icache = d->dcache;
    in.pages = PAGES;
    in.table = d->dtable;
    in.table_row = TABLE_W;
    in.lens = d->dlens;
    in.batch = BATCH;
    in.query_len = d->qlen;
    in.heads = HEADS;
    return in;
}

static const m3_select_params FORCED[] = {{8, 0, 0}, {8, 1, 1}, {8, 1, 2}, {8, 2, 4}};
#define NFORCED ((int)(sizeof FORCED / sizeof FORCED[0]))

/* One world: every rank's scores and keys on the GPU against the CPU core,
 * then the GPU merge against the CPU merge; sel_out (per forced config,
 * [items, topk]) receives the merged selection. */
static void check_world(dataset *d, int world, int32_t *sel_out[NFORCED]) {
    const int64_t local = m3_cp_local_blocks(MAX_SEQ, world), T = d->tokens;
    const int64_t items = (int64_t)HEADS * T, ns = items * local;
    m3_cp_score_inputs hin = host_inputs(d);
    m3_cuda_cp_inputs din = dev_inputs(d);
    float *ref = malloc(ns * sizeof(float)), *got = malloc(ns * sizeof(float));
    float *dscores = dev(ns * sizeof(float));
    int *derr = dev(16);
    uint64_t *dkeys = dev((size_t)NFORCED * world * items * 8 * sizeof(uint64_t));
    int32_t *dsel = dev((size_t)items * 8 * 4);
    uint64_t *hkeys = malloc((size_t)NFORCED * world * items * 8 * sizeof(uint64_t));
    uint64_t *gkeys = malloc((size_t)items * 8 * sizeof(uint64_t));
    int32_t *hsel = malloc((size_t)items * 8 * 4);
    int zero[4] = {0, 0, 0, 0}, bad_scores = 0, bad_keys = 0, bad_sel = 0;
    up(derr, zero, 16);
    for (int r = 0; r < world; r++) {
        int64_t ne[3] = {HEADS, T, local};
        m3_tensor out = m3_tensor_make(M3_DT_F32, 3, ne, ref);
        CHECK_OK(m3_cp_context_scores(&hin, MAX_SEQ, r, world, d->qlen, d->scale, &out));
        for (int64_t i = 0; i < ns; i++)
            got[i] = NAN;
        up(dscores, got, ns * sizeof(float)); /* poison */
        CHECK_OK(m3_cuda_cp_scores(g_gpu, &din, MAX_SEQ, r, world, d->scale, dscores, derr));
        down(got, dscores, ns * sizeof(float));
        for (int64_t i = 0; i < ns; i++)
            bad_scores += !same_bits(got[i], ref[i]);
        for (int f = 0; f < NFORCED; f++) {
            const int k = FORCED[f].topk;
            uint64_t *mine = hkeys + ((int64_t)f * world + r) * items * 8; /* [f][r][items][8] */
            CHECK_OK(m3_cp_local_topk(&out, d->lens, BATCH, d->qlen, MAX_SEQ, r, world, &FORCED[f],
                                      mine));
            CHECK_OK(m3_cuda_cp_local_topk(g_gpu, &din, MAX_SEQ, r, world, &FORCED[f], dscores,
                                           dkeys + ((int64_t)f * world + r) * items * k, derr));
            (void)k;
        }
    }
    CHECK_OK(m3_cuda_cp_error(g_gpu, derr));
    for (int f = 0; f < NFORCED; f++) {
        const int k = FORCED[f].topk;
        for (int r = 0; r < world; r++) {
            down(gkeys, dkeys + ((int64_t)f * world + r) * items * k, (size_t)items * k * 8);
            const uint64_t *mine = hkeys + ((int64_t)f * world + r) * items * 8;
            for (int64_t i = 0; i < items * k; i++)
                bad_keys += gkeys[i] != mine[i];
        }
        /* the gathered keys [world][items][k] are rank-major already */
        CHECK_OK(m3_cuda_cp_merge(g_gpu, dkeys + (int64_t)f * world * items * k, world, items, k,
                                  dsel));
        down(sel_out[f], dsel, (size_t)items * k * 4);
        m3_cp_merge_topk(hkeys + (int64_t)f * world * items * 8, world, items, k, 0, items, hsel);
        for (int64_t i = 0; i < items * k; i++)
            bad_sel += sel_out[f][i] != hsel[i];
    }
    if (bad_scores || bad_keys || bad_sel)
        fprintf(stderr, "world %d qlen %d: %d scores, %d keys, %d selections differ\n", world,
                d->qlen, bad_scores, bad_keys, bad_sel);
    CHECK(bad_scores == 0);
    CHECK(bad_keys == 0);
    CHECK(bad_sel == 0);
    free(ref);
    free(got);
    free(hkeys);
    free(gkeys);
    free(hsel);
    release_all((void *const[]){dscores, derr, dkeys, dsel}, 4);
}

static void check_dataset(int qlen, int mode) {
    dataset d;
    make_dataset(&d, qlen, mode);
    const int64_t items = (int64_t)HEADS * d.tokens;
    static const int worlds[] = {1, 2, 3, 4, 8};
    int32_t *base[NFORCED], *sel[NFORCED];
    for (int f = 0; f < NFORCED; f++) {
        base[f] = malloc((size_t)items * 8 * 4);
        sel[f] = malloc((size_t)items * 8 * 4);
    }
    for (int w = 0; w < 5; w++) {
        check_world(&d, worlds[w], w == 0 ? base : sel);
        if (w == 0)
            continue;
        for (int f = 0; f < NFORCED; f++) { /* merged == single rank, bit for bit */
            int diff = 0;
            for (int64_t i = 0; i < items * FORCED[f].topk; i++)
                diff += sel[f][i] != base[f][i];
            if (diff)
                fprintf(stderr, "world %d forced %d: %d blocks differ from world 1\n", worlds[w],
                        f, diff);
            CHECK(diff == 0);
        }
    }
    for (int f = 0; f < NFORCED; f++) {
        free(base[f]);
        free(sel[f]);
    }
    free_dataset(&d);
}

/* Every rank's scores and keys, one after the other on this GPU, then the
 * merge of the keys (rank-major in keys, as the gather lays them out). */
static m3_status run_ranks(const m3_cuda_cp_inputs *din, float scale, int world, float *const *sc,
                           uint64_t *keys, int64_t items, const m3_select_params *p,
                           int32_t *dsel, int *derr) {
    m3_status st = M3_OK;
    for (int r = 0; r < world && !st; r++) {
        st = m3_cuda_cp_scores(g_gpu, din, MAX_SEQ, r, world, scale, sc[r], derr);
        if (!st)
            st = m3_cuda_cp_local_topk(g_gpu, din, MAX_SEQ, r, world, p, sc[r],
                                       keys + (int64_t)r * items * p->topk, derr);
    }
    return st ? st : m3_cuda_cp_merge(g_gpu, keys, world, items, p->topk, dsel);
}

/* Capture scores + top-k + merge (world 2, both ranks) with every length
 * 1, replay after the real lengths are uploaded: equal to eager. */
static void check_graph(void) {
    dataset d;
    make_dataset(&d, 1, 0);
    const int world = 2, k = 8;
    const int64_t local = m3_cp_local_blocks(MAX_SEQ, world), items = (int64_t)HEADS * d.tokens;
    m3_cuda_cp_inputs din = dev_inputs(&d);
    float *sc[2] = {dev(items * local * 4), dev(items * local * 4)};
    uint64_t *keys = dev((size_t)world * items * k * 8);
    int32_t *dsel = dev((size_t)items * k * 4);
    int *derr = dev(16);
    int zero[4] = {0, 0, 0, 0};
    up(derr, zero, 16);
    int32_t *eager = malloc((size_t)items * k * 4), *replay = malloc((size_t)items * k * 4);
    const m3_select_params *p = &FORCED[1];
    m3_status st = run_ranks(&din, d.scale, world, sc, keys, items, p, dsel, derr);
    CHECK_OK(st);
    down(eager, dsel, (size_t)items * k * 4);
    int32_t ones[BATCH];
    for (int i = 0; i < BATCH; i++)
        ones[i] = 1;
    up(d.dlens, ones, sizeof ones);
    void *graph = NULL;
    CHECK_OK(g_gpu->ops->graph_begin(g_gpu));
    st = run_ranks(&din, d.scale, world, sc, keys, items, p, dsel, derr);
    m3_status end = g_gpu->ops->graph_end(g_gpu, true, &graph);
    CHECK_OK(st);
    CHECK_OK(end);
    if (!st && !end) {
        CHECK_OK(g_gpu->ops->graph_launch(g_gpu, graph)); /* the dummy batch */
        up(d.dlens, d.lens, sizeof d.lens);
        CHECK_OK(g_gpu->ops->graph_launch(g_gpu, graph)); /* the real lengths */
        down(replay, dsel, (size_t)items * k * 4);
        CHECK(memcmp(eager, replay, (size_t)items * k * 4) == 0);
        g_gpu->ops->graph_free(g_gpu, graph);
    }
    CHECK_OK(m3_cuda_cp_error(g_gpu, derr));
    free(eager);
    free(replay);
    release_all((void *const[]){sc[0], sc[1], keys, dsel, derr}, 5);
    free_dataset(&d);
}

/* A page past the pool and a length past max_seq_len: errors naming the
 * value, no fault, nothing read out of bounds. */
static void check_bad_values(void) {
    dataset d;
    make_dataset(&d, 1, 0);
    const int64_t local = m3_cp_local_blocks(MAX_SEQ, 1), items = (int64_t)HEADS * d.tokens;
    m3_cuda_cp_inputs din = dev_inputs(&d);
    float *sc = dev(items * local * 4);
    uint64_t *keys = dev((size_t)items * 8 * 8);
    int *derr = dev(16);
    int zero[4] = {0, 0, 0, 0};
    d.table[2][1] = PAGES + 1000; /* visible (length 200) */
    up(d.dtable, d.table, sizeof d.table);
    up(derr, zero, 16);
    CHECK_OK(m3_cuda_cp_scores(g_gpu, &din, MAX_SEQ, 0, 1, d.scale, sc, derr));
    CHECK_FAILS(m3_cuda_cp_error(g_gpu, derr), M3_ERR_INVALID_ARG, "page 1064 outside the pool");
    float v;
    down(&v, sc + ((int64_t)0 * d.tokens + 2) * local + 1, 4);
    CHECK(isnan(v));
    d.table[2][1] = 0;
    up(d.dtable, d.table, sizeof d.table);
    int32_t lens[BATCH];
    memcpy(lens, d.lens, sizeof lens);
    lens[4] = MAX_SEQ + 7;
    up(d.dlens, lens, sizeof lens);
    up(derr, zero, 16);
    CHECK_OK(m3_cuda_cp_scores(g_gpu, &din, MAX_SEQ, 0, 1, d.scale, sc, derr));
    CHECK_OK(m3_cuda_cp_local_topk(g_gpu, &din, MAX_SEQ, 0, 1, &FORCED[0], sc, keys, derr));
    CHECK_FAILS(m3_cuda_cp_error(g_gpu, derr), M3_ERR_INVALID_ARG, "length 33007");
    down(&v, sc + ((int64_t)0 * d.tokens + 4) * local + 0, 4);
    CHECK(isinf(v) && v < 0); /* clamped to 0: nothing visible */
    release_all((void *const[]){sc, keys, derr}, 3);
    free_dataset(&d);
}

static void check_host_checks(void) {
    dataset d;
    make_dataset(&d, 1, 0);
    m3_cuda_cp_inputs in = dev_inputs(&d);
    m3_select_params p = {8, 1, 1};
    CHECK_OK(m3_cuda_cp_check(&in, MAX_SEQ, 0, 1, &p));
    CHECK_FAILS(m3_cuda_cp_check(&in, MAX_SEQ, 2, 2, &p), M3_ERR_INVALID_ARG, "rank 2 outside");
    CHECK_FAILS(m3_cuda_cp_check(&in, MAX_SEQ, 0, 65, &p), M3_ERR_INVALID_ARG, "world 65");
    CHECK_FAILS(m3_cuda_cp_check(&in, (int64_t)TABLE_W * BLK + 1, 0, 1, &p), M3_ERR_INVALID_ARG,
                "block table narrower");
    CHECK_FAILS(m3_cuda_cp_check(&in, 0, 0, 1, &p), M3_ERR_INVALID_ARG, "max_seq_len 0");
    m3_cuda_cp_inputs bad = in;
    bad.query_len = 17; /* 17 x 4 heads > 64 */
    CHECK_FAILS(m3_cuda_cp_check(&bad, MAX_SEQ, 0, 1, &p), M3_ERR_UNSUPPORTED, "query_len 17");
    bad = in;
    bad.q_row = 100;
    CHECK_FAILS(m3_cuda_cp_check(&bad, MAX_SEQ, 0, 1, &p), M3_ERR_INVALID_ARG, "row stride 100");
    bad = in;
    bad.lens = NULL;
    CHECK_FAILS(m3_cuda_cp_check(&bad, MAX_SEQ, 0, 1, &p), M3_ERR_INVALID_ARG, "null");
    bad = in;
    bad.pages = 0;
    CHECK_FAILS(m3_cuda_cp_check(&bad, MAX_SEQ, 0, 1, &p), M3_ERR_INVALID_ARG, "0 pages");
    bad = in;
    bad.batch = 0;
    CHECK_FAILS(m3_cuda_cp_check(&bad, MAX_SEQ, 0, 1, &p), M3_ERR_INVALID_ARG, "batch 0");
    m3_select_params bp = {4, 3, 2};
    CHECK_FAILS(m3_cuda_cp_check(&in, MAX_SEQ, 0, 1, &bp), M3_ERR_INVALID_ARG, "init + local");
    bp = (m3_select_params){1024, 0, 0};
    CHECK_FAILS(m3_cuda_cp_check(&in, MAX_SEQ, 0, 8, &bp), M3_ERR_UNSUPPORTED, "gathered keys");
    CHECK_FAILS(m3_cuda_cp_merge(g_gpu, NULL, 8, 1, 1024, NULL), M3_ERR_INVALID_ARG, "keys");
    free_dataset(&d);
}

int main(void) {
    test_seed(0x2545f4914f6cdd1dull);
    m3_status st = m3_cuda_backend_create(0, &g_gpu);
    if (st) {
        printf("SKIP: no CUDA device: %s\n", m3_last_error());
        return 77;
    }
    check_host_checks();
    for (int qlen = 1; qlen <= 8; qlen += 7)
        for (int mode = 0; mode < 2; mode++)
            check_dataset(qlen, mode);
    check_graph();
    check_bad_values();
    g_gpu->ops->destroy(g_gpu);
    return check_summary("test_cuda_cp");
}
