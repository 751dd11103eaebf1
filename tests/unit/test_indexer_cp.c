/*
 * Indexer context parallelism (src/cp): the owned-block scores against a
 * direct reference, the chunk rule, the packed keys, and the merged
 * selection against the single-rank m3_select_row over full scores, bit for
 * bit, with ranks as threads; and every input check.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "test_data.h"
#include "core/bf16.h"
#include "core/status.h"
#include "cp/indexer_cp.h"
#include "cpu/cpu.h"
#include "dist/comm.h"

#define D 128
#define BLK 128
#define HEADS 2
#define BATCH 5
#define MAX_SEQ 1500 /* 12 global blocks */
#define PAGES 16

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* one data set: queries, index cache, table, lengths */
typedef struct dataset {
    int qlen, tokens;
    uint16_t *q;      /* [tokens, HEADS, D] */
    uint16_t *cache;  /* [PAGES, BLK, D] */
    int32_t table[BATCH][16];
    int32_t lens[BATCH];
    float scale;
    float *ref; /* [HEADS, tokens, 12] direct reference (-inf past the reach) */
} dataset;

static int64_t row_kv(const dataset *d, int t) {
    return (int64_t)d->lens[t / d->qlen] - d->qlen + t % d->qlen + 1;
}
static int row_nblocks(const dataset *d, int t) {
    int64_t kv = row_kv(d, t);
    return kv > 0 ? (int)cdiv(kv, BLK) : 0;
}

/* mode 0: random values with a NaN key; mode 1: 0/1 values, ties everywhere */
static void make_dataset(dataset *d, int qlen, int mode) {
    static const int32_t lens[BATCH] = {5, 3, 200, 1500, 1111};
    int nb_global = (int)cdiv(MAX_SEQ, BLK);
    d->qlen = qlen;
    d->tokens = BATCH * qlen;
    d->q = malloc(sizeof(uint16_t) * d->tokens * HEADS * D);
    d->cache = malloc(sizeof(uint16_t) * PAGES * BLK * D);
    for (int i = 0; i < d->tokens * HEADS * D; i++)
        d->q[i] = m3_f32_to_bf16(mode ? 1.0f : rndf());
    for (int i = 0; i < PAGES * BLK * D; i++)
        d->cache[i] = m3_f32_to_bf16(mode ? (float)(rnd() % 16 == 0) : rndf());
    if (!mode)
        d->cache[(3 * BLK + 17) * D + 5] = m3_f32_to_bf16(NAN); /* page 3, offset 17 */
    for (int i = 0; i < BATCH; i++) {
        d->lens[i] = qlen == 1 && i == 1 ? 0 : lens[i]; /* an empty request */
        for (int b = 0; b < 16; b++)
            d->table[i][b] = (int32_t)(rnd() % PAGES); /* pages may repeat: ties */
    }
    /* the NaN key's page where it competes (past init/local, topk < nblocks) */
    d->table[3][5] = 3;
    d->table[4][3] = 3;
    d->scale = (float)(1.0 / sqrt((double)D) * 1.4426950408889634);
    d->ref = malloc(sizeof(float) * HEADS * d->tokens * nb_global);
    for (int h = 0; h < HEADS; h++)
        for (int t = 0; t < d->tokens; t++) {
            int64_t kv = row_kv(d, t);
            for (int b = 0; b < nb_global; b++) {
                float best = -INFINITY;
                for (int64_t p = (int64_t)b * BLK; p < kv && p < (int64_t)(b + 1) * BLK; p++) {
                    const uint16_t *k =
                        d->cache + ((int64_t)d->table[t / qlen][b] * BLK + p % BLK) * D;
                    const uint16_t *qq = d->q + ((int64_t)t * HEADS + h) * D;
                    double s = 0;
                    for (int e = 0; e < D; e++)
                        s += (double)m3_bf16_to_f32(qq[e]) * (double)m3_bf16_to_f32(k[e]);
                    float f = (float)s;
                    if (isnan(f) || isnan(best))
                        best = NAN;
                    else if (f > best)
                        best = f;
                }
                d->ref[((int64_t)h * d->tokens + t) * nb_global + b] = best * d->scale;
            }
        }
}

static void free_dataset(dataset *d) {
    free(d->q);
    free(d->cache);
    free(d->ref);
}

static m3_cp_score_inputs inputs_of(dataset *d) {
    return m3_cp_host_inputs(d->tokens, HEADS, D, PAGES, BATCH, 16, d->q, d->cache, &d->table[0][0],
                             d->lens);
}

/* ------------------------------------------------------------ ranks */

static const m3_select_params FORCED[] = {{8, 0, 0}, {8, 1, 1}, {8, 1, 2}, {8, 2, 4}, {6, 2, 4}};
#define NFORCED ((int)(sizeof FORCED / sizeof FORCED[0]))

typedef struct rank_job {
    m3_comm *comm;
    dataset *d;
    int pad_t, pad_l; /* out is [HEADS, tokens + pad_t, local + pad_l] */
    float *scores;
    int32_t *sel[NFORCED]; /* [HEADS, tokens, topk] */
    m3_status st;
    char err[256];
} rank_job;

static void *rank_main(void *arg) {
    rank_job *j = arg;
    dataset *d = j->d;
    int world = j->comm->world;
    int64_t local = m3_cp_local_blocks(MAX_SEQ, world);
    m3_cp_score_inputs in = inputs_of(d);
    int64_t ne[3] = {HEADS, d->tokens + j->pad_t, local + j->pad_l};
    size_t n = (size_t)(ne[0] * ne[1] * ne[2]);
    j->scores = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        j->scores[i] = NAN; /* poison: every entry must be written */
    m3_tensor out = m3_tensor_make(M3_DT_F32, 3, ne, j->scores);
    j->st = m3_cp_context_scores(&in, MAX_SEQ, j->comm->rank, world, d->qlen, d->scale, &out);
    for (int f = 0; f < NFORCED && !j->st; f++) {
        j->sel[f] = malloc(sizeof(int32_t) * HEADS * d->tokens * FORCED[f].topk);
        j->st = m3_cp_select_blocks(j->comm, &out, d->lens, BATCH, d->qlen, MAX_SEQ, &FORCED[f],
                                    j->sel[f]);
    }
    if (j->st)
        snprintf(j->err, sizeof j->err, "%s", m3_last_error());
    return NULL;
}

static void check_world(dataset *d, int world) {
    m3_comm *comms[M3_MAX_TP];
    CHECK_OK(m3_comm_create_threads(world, 20000, comms));
    rank_job jobs[M3_MAX_TP];
    pthread_t th[M3_MAX_TP];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < world; r++) {
        jobs[r].comm = comms[r];
        jobs[r].d = d;
        jobs[r].pad_t = r % 2;
        jobs[r].pad_l = r % 3;
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (int r = 0; r < world; r++)
        pthread_join(th[r], NULL);
    int nbg = (int)cdiv(MAX_SEQ, BLK);
    int64_t local = m3_cp_local_blocks(MAX_SEQ, world);
    int bad_scores = 0, bad_pad = 0, bad_sel = 0;
    for (int r = 0; r < world; r++) {
        rank_job *j = &jobs[r];
        CHECK(j->st == M3_OK);
        if (j->st) {
            fprintf(stderr, "world %d rank %d: %s\n", world, r, j->err);
            continue;
        }
        int64_t T = d->tokens + j->pad_t, Lc = local + j->pad_l;
        for (int h = 0; h < HEADS; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t l = 0; l < Lc; l++) {
                    float got = j->scores[(h * T + t) * Lc + l];
                    if (t >= d->tokens || l >= local) {
                        bad_pad += !isnan(got); /* outside the view: untouched */
                        continue;
                    }
                    int64_t g = l * world + r;
                    float want = g < nbg && g < row_nblocks(d, (int)t)
                                     ? d->ref[(h * d->tokens + t) * nbg + g]
                                     : -INFINITY;
                    bad_scores += !same_bits(got, want);
                    /* never the poison unless the score itself is NaN */
                    bad_scores += isnan(got) && !isnan(want);
                }
        for (int f = 0; f < NFORCED; f++) {
            int topk = FORCED[f].topk;
            int32_t want[16], cand[16];
            for (int h = 0; h < HEADS; h++)
                for (int t = 0; t < d->tokens; t++) {
                    m3_select_row(d->ref + ((int64_t)h * d->tokens + t) * nbg, row_nblocks(d, t),
                                  &FORCED[f], want, cand);
                    const int32_t *got = j->sel[f] + ((int64_t)h * d->tokens + t) * topk;
                    bad_sel += memcmp(got, want, sizeof(int32_t) * topk) != 0;
                }
        }
    }
    if (bad_scores || bad_pad || bad_sel)
        fprintf(stderr, "world %d qlen %d: %d bad scores, %d touched pads, %d bad selections\n",
                world, d->qlen, bad_scores, bad_pad, bad_sel);
    CHECK(bad_scores == 0);
    CHECK(bad_pad == 0);
    CHECK(bad_sel == 0);
    for (int r = 0; r < world; r++) {
        free(jobs[r].scores);
        for (int f = 0; f < NFORCED; f++)
            free(jobs[r].sel[f]);
    }
    for (int r = 0; r < world; r++)
        m3_comm_free(comms[r]);
}

static void test_worlds(void) {
    static const int worlds[] = {1, 2, 3, 4, 8};
    for (int mode = 0; mode < 2; mode++)
        for (int qi = 0; qi < 2; qi++) {
            dataset d;
            make_dataset(&d, qi ? 8 : 1, mode);
            for (int w = 0; w < 5; w++)
                check_world(&d, worlds[w]);
            free_dataset(&d);
        }
}

/* the ties data set really ties, and the random one holds a NaN score */
static void test_dataset_shape(void) {
    dataset d;
    make_dataset(&d, 1, 1);
    int nbg = (int)cdiv(MAX_SEQ, BLK), ties = 0;
    const float *row = d.ref + 3 * nbg; /* head 0, request 3 (length 1500) */
    for (int a = 0; a < nbg; a++)
        for (int b = a + 1; b < nbg; b++)
            ties += row[a] == row[b];
    CHECK(ties >= 3);
    free_dataset(&d);
    make_dataset(&d, 1, 0);
    int nans = 0;
    for (int i = 0; i < HEADS * d.tokens * nbg; i++)
        nans += isnan(d.ref[i]);
    CHECK(nans > 0);
    free_dataset(&d);
}

/* ------------------------------------------------------------ pieces */

static void test_chunks(void) {
    CHECK(m3_cp_score_chunks(1, 0) == 1);
    CHECK(m3_cp_score_chunks(7, -3) == 1);
    CHECK(m3_cp_score_chunk_size(7, 0) == 1);
    /* worked values of the rule (TARGET_GRID 4096, MIN_BLOCKS 2) */
    CHECK(m3_cp_score_chunks(1, 1000) == 500);
    CHECK(m3_cp_score_chunk_size(1, 1000) == 2);
    CHECK(m3_cp_score_chunks(64, 1000) == 63);
    CHECK(m3_cp_score_chunk_size(64, 1000) == 16);
    CHECK(m3_cp_score_chunks(2000, 1000) == 2);
    CHECK(m3_cp_score_chunk_size(2000, 1000) == 512);
    CHECK(m3_cp_score_chunks(1, 5) == 3);
    CHECK(m3_cp_score_chunks(0, 64) == 32);
    /* the tuning override: the old constants' values, then back */
    CHECK_OK(m3_cp_set_chunk_rule(1024, 16));
    CHECK(m3_cp_score_chunks(1, 1000) == 63);
    CHECK(m3_cp_score_chunk_size(64, 1000) == 64);
    CHECK_FAILS(m3_cp_set_chunk_rule(0, 16), M3_ERR_INVALID_ARG, "target grid 0");
    CHECK_FAILS(m3_cp_set_chunk_rule(1024, 0), M3_ERR_INVALID_ARG, "min blocks 0");
    CHECK_OK(m3_cp_set_chunk_rule(M3_CP_SCORE_TARGET_GRID, M3_CP_SCORE_MIN_BLOCKS));
    CHECK(m3_cp_score_chunks(1, 1000) == 500);
    static const int64_t batches[] = {0, 1, 2, 3, 7, 16, 64, 100, 1000, 5000};
    int bad = 0;
    for (int bi = 0; bi < 10; bi++)
        for (int64_t local = 1; local <= 600; local++) {
            int64_t c = m3_cp_score_chunks(batches[bi], local);
            int64_t cap = cdiv(local, M3_CP_SCORE_MIN_BLOCKS);
            bad += c < 1 || c > local || c > cap;
            bad += cdiv(local, cdiv(local, c)) != c; /* a fixed point of the round trip */
            int64_t size = m3_cp_score_chunk_size(batches[bi], local);
            int64_t progs = cdiv(local, size);
            bad += (size & (size - 1)) != 0;         /* a power of two */
            bad += progs * size < local;             /* spans the shard */
            bad += (progs - 1) * size >= local;      /* no empty program */
            bad += progs > c;                        /* never more programs than chunks */
            if (bi > 0) /* more requests, no more chunks each */
                bad += c > m3_cp_score_chunks(batches[bi - 1], local);
        }
    CHECK(bad == 0);
}

static void test_keys(void) {
    CHECK(m3_cp_pack_key(-0.0f, 5, false) == m3_cp_pack_key(0.0f, 5, false));
    CHECK(m3_cp_pack_key(1.0f, 5, false) > m3_cp_pack_key(0.5f, 9, false));
    CHECK(m3_cp_pack_key(-1.0f, 9, false) < m3_cp_pack_key(-0.5f, 2, false));
    CHECK(m3_cp_pack_key(INFINITY, 2, false) > m3_cp_pack_key(3e38f, 9, false));
    CHECK(m3_cp_pack_key(-INFINITY, 2, false) > m3_cp_pack_key(NAN, 9, false));
    CHECK(m3_cp_pack_key(-NAN, 2, false) == m3_cp_pack_key(NAN, 2, false));
    CHECK(m3_cp_pack_key(NAN, 0, false) > M3_CP_KEY_NONE);
    CHECK(m3_cp_pack_key(2.0f, 7, false) > m3_cp_pack_key(2.0f, 6, false)); /* tie: higher id */
    CHECK(m3_cp_pack_key(NAN, 7, false) > m3_cp_pack_key(NAN, 6, false));
    CHECK(m3_cp_pack_key(NAN, 0, true) > m3_cp_pack_key(INFINITY, 100, false));
    CHECK(m3_cp_key_block(m3_cp_pack_key(1.5f, 1234567, false)) == 1234567);
    CHECK(m3_cp_global_blocks(1) == 1 && m3_cp_global_blocks(128) == 1 &&
          m3_cp_global_blocks(129) == 2);
    CHECK(m3_cp_local_blocks(1500, 8) == 2 && m3_cp_local_blocks(1500, 3) == 4);

    /* merge: two ranks' best-first lists, padded */
    uint64_t g[2][1][4] = {
        {{m3_cp_pack_key(5, 0, true), m3_cp_pack_key(3, 4, false), m3_cp_pack_key(1, 2, false),
          0}},
        {{m3_cp_pack_key(3, 5, false), m3_cp_pack_key(3, 3, false), 0, 0}}};
    int32_t out[4];
    m3_cp_merge_topk(&g[0][0][0], 2, 1, 4, 0, 1, out);
    CHECK(out[0] == 0 && out[1] == 3 && out[2] == 4 && out[3] == 5);
    uint64_t e[2][4] = {{m3_cp_pack_key(1, 1, false), 0, 0, 0}, {0, 0, 0, 0}};
    m3_cp_merge_topk(&e[0][0], 2, 1, 4, 0, 1, out);
    CHECK(out[0] == 1 && out[1] == -1 && out[2] == -1 && out[3] == -1);
}

/* out == NULL data: a dense buffer is allocated and filled */
static void test_allocated_out(void) {
    dataset d;
    make_dataset(&d, 1, 0);
    m3_cp_score_inputs in = inputs_of(&d);
    m3_tensor out = {0};
    CHECK_OK(m3_cp_context_scores(&in, MAX_SEQ, 1, 2, 1, d.scale, &out));
    CHECK(out.data && out.ne[0] == HEADS && out.ne[1] == d.tokens && out.ne[2] == 6);
    int bad = 0, nbg = (int)cdiv(MAX_SEQ, BLK);
    for (int h = 0; h < HEADS && out.data; h++)
        for (int t = 0; t < d.tokens; t++)
            for (int l = 0; l < 6; l++) {
                int g = l * 2 + 1;
                float want = g < row_nblocks(&d, t) ? d.ref[(h * d.tokens + t) * nbg + g]
                                                     : -INFINITY;
                bad += !same_bits(((float *)out.data)[(h * d.tokens + t) * 6 + l], want);
            }
    CHECK(bad == 0);
    free(out.data);
    free_dataset(&d);
}

/* ------------------------------------------------------------ errors */

static void test_input_checks(void) {
    dataset d;
    make_dataset(&d, 1, 0);
    m3_cp_score_inputs ok = inputs_of(&d), in;
    CHECK_OK(m3_cp_check_context_score_inputs(&ok));
#define BAD(mutate, substr)                                                          \
    do {                                                                             \
        in = ok;                                                                     \
        mutate;                                                                      \
        CHECK_FAILS(m3_cp_check_context_score_inputs(&in), M3_ERR_INVALID_ARG, substr); \
    } while (0)
    BAD(in.q.data = NULL, "missing data");
    BAD(in.lens.data = NULL, "missing data");
    BAD(in.q.dtype = M3_DT_F32, "index queries must be BF16, got F32");
    BAD(in.q.ne[2] = 64, "index queries must be [tokens, heads, 128], got ndim 3, last dim 64");
    BAD(in.q.ndim = 2, "index queries must be [tokens, heads, 128], got ndim 2");
    BAD(in.q.nb[2] = 4, "index queries' last dim must be contiguous, got stride 4");
    BAD(in.q.ne[1] = 0, "at least one head");
    BAD(in.icache.ne[1] = 64, "index cache must be [pages, 128, 128]");
    BAD(in.icache.ndim = 4, "index cache must be [pages, 128, 128], got ndim 4");
    BAD(in.icache.ne[0] = 0, "index cache must be non-empty, got 0 pages");
    BAD(in.icache.dtype = M3_DT_F8_E4M3, "index cache must be BF16 for CP scoring");
    BAD(in.icache.nb[0] *= 2, "index cache must be contiguous");
    BAD(in.table.dtype = M3_DT_I64, "block table must be I32, got I64");
    BAD(in.table.ndim = 1, "block table must be 2-D");
    BAD(in.table.nb[1] = 8, "block table must have unit inner stride, got 8");
    BAD(in.table.nb[0] = 4, "block table rows overlap");
    BAD(in.lens.dtype = M3_DT_I64, "lengths must be I32, got I64");
    BAD(in.lens.ndim = 2, "lengths must be 1-D");
    BAD(in.lens.nb[0] = 8, "lengths must be contiguous, got stride 8");
    BAD(in.table_device = 0, "all score inputs must be on one device");
    BAD(in.lens_device = 1, "lengths 1");
#undef BAD
    free_dataset(&d);
}

static void test_call_checks(void) {
    dataset d;
    make_dataset(&d, 2, 0);
    m3_cp_score_inputs in = inputs_of(&d);
    int64_t ne[3] = {HEADS, d.tokens, 12};
    float *buf = malloc(sizeof(float) * HEADS * d.tokens * 12);
    m3_tensor out = m3_tensor_make(M3_DT_F32, 3, ne, buf);
    float s = d.scale;
    CHECK_OK(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 2, s, &out));
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 2, s, NULL), M3_ERR_INVALID_ARG,
                "no output view");
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 1, s, &out), M3_ERR_INVALID_ARG,
                "rows 10 != batch 5 x query_len 1");
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 2, 2, 2, s, &out), M3_ERR_INVALID_ARG,
                "rank 2 outside world 2");
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, -1, 2, 2, s, &out), M3_ERR_INVALID_ARG,
                "rank -1 outside world 2");
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 0, 2, s, &out), M3_ERR_INVALID_ARG,
                "rank 0 outside world 0");
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 0, s, &out), M3_ERR_INVALID_ARG,
                "query_len 0 < 1");
    CHECK_FAILS(m3_cp_context_scores(&in, 0, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "max_seq_len 0 outside");
    CHECK_FAILS(m3_cp_context_scores(&in, 16 * BLK + 1, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "block table narrower than max_seq_len: 16 < 17 blocks");
    m3_cp_score_inputs in2 = in;
    in2.table.ne[0] = 4;
    CHECK_FAILS(m3_cp_context_scores(&in2, MAX_SEQ, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "block table has 4 rows for batch 5");
    in2 = in;
    in2.q_device = in2.icache_device = in2.table_device = in2.lens_device = 0;
    CHECK_FAILS(m3_cp_context_scores(&in2, MAX_SEQ, 0, 1, 2, s, &out), M3_ERR_UNSUPPORTED,
                "need host inputs, got device 0");
    /* index heads of another width than the scorer's 128: refused, not read */
    in2 = in;
    in2.q.ne[2] = 64;
    CHECK_FAILS(m3_cp_context_scores(&in2, MAX_SEQ, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "got query dim 64");
    in2 = in;
    in2.icache.ne[2] = 64;
    CHECK_FAILS(m3_cp_context_scores(&in2, MAX_SEQ, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "cache [128, 64]");
    /* lengths past max_seq_len, negative */
    CHECK_FAILS(m3_cp_context_scores(&in, 1400, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "request 3: length 1500 outside [0, max_seq_len 1400]");
    d.lens[2] = -4;
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 2, s, &out), M3_ERR_INVALID_ARG,
                "request 2: length -4 outside");
    d.lens[2] = 200;
    /* block tables pointing outside the pool (only visible blocks are read) */
    int32_t saved = d.table[2][1];
    d.table[2][1] = PAGES;
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 1, 2, 2, s, &out), M3_ERR_INVALID_ARG,
                "request 2 block 1: page 16 outside the pool [0, 16)");
    d.table[2][1] = -7;
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 2, 2, s, &out), M3_ERR_INVALID_ARG,
                "request 2 block 1: page -7 outside the pool");
    d.table[2][1] = saved;
    d.table[2][2] = -1; /* past request 2's 2 blocks: never read */
    CHECK_OK(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 2, s, &out));
    /* a wrong out view */
    m3_tensor o2 = out;
    o2.ne[2] = 5;
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 2, 2, s, &o2), M3_ERR_INVALID_ARG,
                "scores must be F32 [heads 2, >= tokens 10, >= local 6]");
    o2 = out;
    o2.dtype = M3_DT_BF16;
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 2, s, &o2), M3_ERR_INVALID_ARG,
                "scores must be F32");
    o2 = out;
    o2.nb[1] = 6;
    CHECK_FAILS(m3_cp_context_scores(&in, MAX_SEQ, 0, 1, 2, s, &o2), M3_ERR_INVALID_ARG,
                "4-byte aligned");

    /* selection checks */
    uint64_t *keys = malloc(sizeof(uint64_t) * HEADS * d.tokens * 8);
    m3_select_params p = {8, 2, 4};
    CHECK_OK(m3_cp_local_topk(&out, d.lens, BATCH, 2, MAX_SEQ, 0, 1, &p, keys));
    m3_select_params bp = {4, 2, 3};
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 2, MAX_SEQ, 0, 1, &bp, keys),
                M3_ERR_INVALID_ARG, "topk 4, init 2, local 3");
    bp = (m3_select_params){0, 0, 0};
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 2, MAX_SEQ, 0, 1, &bp, keys),
                M3_ERR_INVALID_ARG, "need topk >= 1");
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 2, MAX_SEQ, 3, 2, &p, keys),
                M3_ERR_INVALID_ARG, "rank 3 outside world 2");
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 0, MAX_SEQ, 0, 1, &p, keys),
                M3_ERR_INVALID_ARG, "query_len 0");
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 2, 0, 0, 1, &p, keys),
                M3_ERR_INVALID_ARG, "max_seq_len 0");
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 4, MAX_SEQ, 0, 1, &p, keys),
                M3_ERR_INVALID_ARG, ">= tokens 20");
    d.lens[4] = MAX_SEQ + 1;
    CHECK_FAILS(m3_cp_local_topk(&out, d.lens, BATCH, 2, MAX_SEQ, 0, 1, &p, keys),
                M3_ERR_INVALID_ARG, "request 4: length 1501 outside");
    free(keys);
    free(buf);
    free_dataset(&d);
}

/* one rank failing its local top-k ends the gather for all, no hang */
typedef struct fail_job {
    m3_comm *c;
    m3_tensor *scores;
    int32_t *lens;
    int32_t *sel;
    m3_status st;
    char err[256];
} fail_job;

static void *fail_main(void *arg) {
    fail_job *j = arg;
    m3_select_params p = {4, 1, 1};
    j->st = m3_cp_select_blocks(j->c, j->scores, j->lens, 1, 1, 256, &p, j->sel);
    snprintf(j->err, sizeof j->err, "%s", j->st ? m3_last_error() : "");
    return NULL;
}

static void test_rank_failure(void) {
    m3_comm *comms[2];
    CHECK_OK(m3_comm_create_threads(2, 20000, comms));
    float sc[1][1][1] = {{{1.0f}}};
    int64_t ne[3] = {1, 1, 1};
    m3_tensor s = m3_tensor_make(M3_DT_F32, 3, ne, sc);
    int32_t good = 100, bad = 300;
    int32_t sel[2][4];
    fail_job jobs[2] = {{comms[0], &s, &good, sel[0], 0, ""}, {comms[1], &s, &bad, sel[1], 0, ""}};
    pthread_t th[2];
    for (int r = 0; r < 2; r++)
        pthread_create(&th[r], NULL, fail_main, &jobs[r]);
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    CHECK(jobs[1].st == M3_ERR_INVALID_ARG && strstr(jobs[1].err, "length 300 outside"));
    CHECK(jobs[0].st != M3_OK && strstr(jobs[0].err, "aborted"));
    m3_comm_free(comms[0]);
    m3_comm_free(comms[1]);
}

int main(void) {
    test_chunks();
    test_keys();
    test_dataset_shape();
    test_allocated_out();
    test_input_checks();
    test_call_checks();
    test_rank_failure();
    test_worlds();
    return check_summary("test_indexer_cp");
}
