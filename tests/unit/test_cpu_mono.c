/*
 * The CPU mono executor (src/cpu/cpu_mono.c) against the stock path
 * (decode/forward.c m3_stock_layer on the CPU backend), bit for bit.
 *
 * Models: tiny (bf16), tiny MXFP8, and the small preset cut to 3 layers,
 * synthesized into a temporary folder. Caches: 16 sequences past the
 * sparse threshold (topk * 128 plus 1 to 128 tokens, one ending on a page
 * boundary so its decode row opens a page, one on a block's last
 * position, and one 700 tokens past it with more blocks to choose from).
 * On tiny, sequence 0 is prefilled for real with m3_engine_step and the
 * others are clones of its pages, with random keys past its length (real
 * prefill keys at a fraction of the cost: prefill is the slow part under
 * ASan); the long one and every sequence of the other models have random
 * pages.
 *
 * Per decode step (tiny: 1, 2, 3, 5, 8 and 16 rows; tiny MXFP8: 1, 5, 16;
 * small: 3; built with m3_engine_build, padded to powers of two:
 * padded rows have slot -1) and per sparse MoE layer, fresh random
 * hidden/residual (never zero):
 *  - stock: m3_stock_layer on the TP 1 engine's scratch; its outputs and
 *    the K/V/index cache entries at the rows' slots are kept, then those
 *    entries are poisoned (NaN);
 *  - mono at TP 1 on a 1-thread and a 3-thread pool: hidden and residual
 *    of every real row and the cache entries bitwise equal to stock (so
 *    the result does not depend on the thread count, and the cache is
 *    really written: the poisoned entries are read by attention);
 *  - mono at TP 2 and TP 4 (small: TP 2; rank engines' shards, caches
 *    copied head slice by head slice from the TP 1 cache), the ranks on
 *    threads with a shared group: every rank's hidden/residual equal the TP 1 stock ones,
 *    and each rank's cache entries the TP 1 entries of its heads.
 * One layer per model also runs as a first layer (the residual taken as
 * is, hidden not read: poisoned).
 *
 * Faults and errors: a slot past the pool (M3_MONO_FAULT_SLOT) and a
 * block table page past the pool (M3_MONO_FAULT_PAGE) write nothing (the
 * whole layer cache and the outputs unchanged); a planted fault makes the
 * layer do nothing; a peer that never arrives ends in
 * M3_MONO_FAULT_PEER_WAIT within a bounded time; abort_all from another
 * thread ends a rank's wait with M3_MONO_FAULT_ABORTED; after faults are
 * cleared, the same group runs exact steps again (tags need no clearing).
 * Bad arguments (a dense layer, too many rows, a prefill step, NULLs)
 * fail with messages. The pool's run_all/barrier primitives are checked
 * first. Inputs, tokens and random caches come from one seeded generator
 * (M3_TEST_SEED varies them).
 */
#include <ftw.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "core/pool.h"
#include "cpu/cpu.h"
#include "cpu/cpu_mono.h"
#include "decode/engine.h"
#include "model/shard.h"

#define BF16_NAN 0x7fc0u
#define N_SEQS 16
#define MONO_ROWS 16
#define PAGE M3_PAGE_TOKENS

#define TRY(expr)                     \
    do {                              \
        m3_status try_s_ = (expr);    \
        if (try_s_ != M3_OK)          \
            return try_s_;            \
    } while (0)

static char g_tmp[] = "/tmp/m3_test_cpu_mono_XXXXXX";

/* ------------------------------------------------------------ helpers */

static uint64_t g_rng = 0x5eed;

static uint64_t rng_u64(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* a bf16 value of magnitude in [1/64, 2), random sign: never zero */
static uint16_t rng_bf16(void) {
    uint64_t r = rng_u64();
    uint16_t exp = (uint16_t)(121 + r % 7);           /* 2^-6 .. 2^0 */
    uint16_t man = (uint16_t)((r >> 8) & 0x7f);
    uint16_t sign = (uint16_t)(((r >> 20) & 1) << 15);
    return (uint16_t)(sign | (exp << 7) | man);
}

static void fill_rand(uint16_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        p[i] = rng_bf16();
}

static void fill16(uint16_t *p, int64_t n, uint16_t v) {
    for (int64_t i = 0; i < n; i++)
        p[i] = v;
}

static void *xalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

/* ------------------------------------------------------------ pool primitives */

typedef struct pool_job {
    m3_pool *pool;
    int phases;
    int *slots;       /* [threads]: plain writes, published by the barrier */
    atomic_int seen;  /* bit per thread index */
    atomic_int bad;
    atomic_int calls;
} pool_job;

static void pool_pass(void *ctx, int th, int nth) {
    pool_job *j = ctx;
    atomic_fetch_add(&j->calls, 1);
    atomic_fetch_or(&j->seen, 1 << th);
    for (int p = 0; p < j->phases; p++) {
        j->slots[th] = p * 64 + th;
        m3_pool_barrier(j->pool);
        for (int i = 0; i < nth; i++)
            if (j->slots[i] != p * 64 + i)
                atomic_fetch_add(&j->bad, 1);
        m3_pool_barrier(j->pool);
    }
}

typedef struct sum_job {
    atomic_long total;
} sum_job;

static void sum_chunk(void *ctx, int64_t b, int64_t e, int thread) {
    sum_job *j = ctx;
    for (int64_t i = b; i < e; i++)
        atomic_fetch_add(&j->total, (long)i);
}

static void test_pool(void) {
    const int counts[] = {1, 2, 3, 5};
    for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
        int n = counts[c];
        m3_pool *pool = NULL;
        CHECK_OK(m3_pool_create(n, &pool));
        if (!pool)
            continue;
        int slots[8] = {0};
        for (int rep = 0; rep < 3; rep++) {
            pool_job j = {pool, 50, slots, 0, 0, 0};
            m3_pool_run_all(pool, pool_pass, &j);
            CHECK(atomic_load(&j.bad) == 0);
            CHECK(atomic_load(&j.calls) == n);
            CHECK(atomic_load(&j.seen) == (1 << n) - 1);
            /* the ordinary chunked jobs still work between passes */
            sum_job s = {0};
            m3_pool_for(pool, 1000, 7, sum_chunk, &s);
            CHECK(atomic_load(&s.total) == 999L * 1000 / 2);
        }
        m3_pool_free(pool);
    }
    /* no pool: the caller alone, and a barrier returns at once */
    pool_job j = {NULL, 3, (int[1]){0}, 0, 0, 0};
    m3_pool_run_all(NULL, pool_pass, &j);
    CHECK(atomic_load(&j.calls) == 1 && atomic_load(&j.bad) == 0);
}

/* ------------------------------------------------------------ models, engines, caches */

typedef struct model_case {
    const char *name;
    m3_config cfg;
    m3_model *model;
    int n_prefill; /* sequences prefilled for real (0: random caches) */
} model_case;

static m3_status load_case(model_case *mc, const char *preset, int cut, bool mxfp8,
                           const char *name, int n_prefill) {
    mc->name = name;
    mc->n_prefill = n_prefill;
    TRY(m3_preset(preset, &mc->cfg));
    if (cut)
        TRY(m3_config_cut_layers(&mc->cfg, cut));
    mc->cfg.mxfp8 = mxfp8;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, name);
    m3_synth_opts so = {7, false, 0};
    TRY(m3_synth(&mc->cfg, dir, &so));
    m3_model_opts mo = {false};
    return m3_model_load(dir, &mo, &mc->model);
}

static m3_engine *make_engine(m3_model *model, int tp, int threads) {
    m3_engine_opts o = m3_engine_defaults();
    o.threads = threads;
    o.tp = tp;
    o.decode = M3_DECODE_STOCK; /* this test drives the executor itself */
    o.max_tokens = 128 * PAGE;
    o.max_seqs = N_SEQS;
    o.max_rows = 1024;
    o.tp_timeout_ms = 20000;
    m3_engine *e = NULL;
    if (m3_engine_create(model, &o, &e)) {
        fprintf(stderr, "engine (tp %d): %s\n", tp, m3_last_error());
        return NULL;
    }
    return e;
}

static size_t kv_page_elems(const m3_config *c) {
    return (size_t)c->num_kv_heads * PAGE * (size_t)c->head_dim;
}
static size_t index_page_elems(const m3_config *c) { return (size_t)PAGE * (size_t)c->index_dim; }

/* The K, V (every head) and index entries of seq's positions [from, to)
 * in every layer: random. */
static void random_positions(m3_engine *e, m3_seq seq, int64_t from, int64_t to) {
    const m3_config *c = &e->cfg;
    int D = c->head_dim, Di = c->index_dim;
    for (int64_t pos = from; pos < to; pos++) {
        int64_t slot = m3_cache_slot(&e->cache, seq, pos), page = slot / PAGE, off = slot % PAGE;
        for (int l = 0; l < c->num_layers; l++) {
            m3_cache_layer *cl = &e->cache.layers[l];
            for (int h = 0; h < c->num_kv_heads; h++) {
                size_t at = m3_cache_offset(page, off, c->num_kv_heads, h, D);
                fill_rand((uint16_t *)cl->k + at, D);
                fill_rand((uint16_t *)cl->v + at, D);
            }
            if (cl->index)
                fill_rand((uint16_t *)cl->index + m3_cache_offset(page, off, 1, 0, Di), Di);
        }
    }
}

/* seq at len: src's pages (all layers), random past src's length */
static void clone_seq(m3_engine *e, m3_seq dst, m3_seq src, int64_t len) {
    CHECK_OK(m3_engine_set_len(e, dst, len));
    const m3_config *c = &e->cfg;
    const m3_seq_state *d = &e->cache.seqs[dst], *s = &e->cache.seqs[src];
    size_t kv = kv_page_elems(c), ix = index_page_elems(c);
    for (int l = 0; l < c->num_layers; l++) {
        m3_cache_layer *cl = &e->cache.layers[l];
        for (int b = 0; b < d->n_blocks && b < s->n_blocks; b++) {
            size_t pd = (size_t)d->pages[b], ps = (size_t)s->pages[b];
            memcpy((uint16_t *)cl->k + pd * kv, (uint16_t *)cl->k + ps * kv, kv * 2);
            memcpy((uint16_t *)cl->v + pd * kv, (uint16_t *)cl->v + ps * kv, kv * 2);
            if (cl->index)
                memcpy((uint16_t *)cl->index + pd * ix, (uint16_t *)cl->index + ps * ix, ix * 2);
        }
    }
    if (len > s->len)
        random_positions(e, dst, s->len, len);
}

/* seq at len with random keys, values and index keys (all layers) */
static void random_seq(m3_engine *e, m3_seq seq, int64_t len) {
    CHECK_OK(m3_engine_set_len(e, seq, len));
    const m3_config *c = &e->cfg;
    const m3_seq_state *s = &e->cache.seqs[seq];
    size_t kv = kv_page_elems(c), ix = index_page_elems(c);
    for (int l = 0; l < c->num_layers; l++) {
        m3_cache_layer *cl = &e->cache.layers[l];
        for (int b = 0; b < s->n_blocks; b++) {
            size_t p = (size_t)s->pages[b];
            fill_rand((uint16_t *)cl->k + p * kv, (int64_t)kv);
            fill_rand((uint16_t *)cl->v + p * kv, (int64_t)kv);
            if (cl->index)
                fill_rand((uint16_t *)cl->index + p * ix, (int64_t)ix);
        }
    }
}

/* The first KV head a TP rank holds (model/shard.c's rule). */
static int rank_kv0(const m3_config *full, int rank, int tp) {
    m3_config rc = m3_tp_config(full, tp);
    if (full->num_kv_heads >= tp)
        return rank * rc.num_kv_heads;
    return (int)((int64_t)rank * rc.num_q_heads / (full->num_q_heads / full->num_kv_heads));
}

/* A rank engine's copy of seq: its KV heads' slice of the TP 1 cache and
 * the whole index cache, block by block. */
static void copy_to_rank(m3_engine *e1, m3_engine *er, int rank, int tp, m3_seq seq) {
    const m3_config *c = &e1->cfg, *rc = &er->cfg;
    CHECK_OK(m3_engine_set_len(er, seq, e1->cache.seqs[seq].len));
    const m3_seq_state *s1 = &e1->cache.seqs[seq], *sr = &er->cache.seqs[seq];
    int kv0 = rank_kv0(c, rank, tp);
    size_t head = (size_t)PAGE * (size_t)c->head_dim, ix = index_page_elems(c);
    for (int l = 0; l < c->num_layers; l++) {
        m3_cache_layer *a = &e1->cache.layers[l], *b = &er->cache.layers[l];
        for (int blk = 0; blk < s1->n_blocks; blk++) {
            size_t p1 = (size_t)s1->pages[blk], pr = (size_t)sr->pages[blk];
            for (int h = 0; h < rc->num_kv_heads; h++) {
                size_t src = (p1 * (size_t)c->num_kv_heads + (size_t)(kv0 + h)) * head;
                size_t dst = (pr * (size_t)rc->num_kv_heads + (size_t)h) * head;
                memcpy((uint16_t *)b->k + dst, (uint16_t *)a->k + src, head * 2);
                memcpy((uint16_t *)b->v + dst, (uint16_t *)a->v + src, head * 2);
            }
            if (a->index)
                memcpy((uint16_t *)b->index + pr * ix, (uint16_t *)a->index + p1 * ix, ix * 2);
        }
    }
}

/* The cache entries of the step's real rows at layer l: per row, K then V
 * of heads [h0, h0 + nh), then the index key. NULL out: poison them. */
static void slot_entries(m3_engine *e, int l, int h0, int nh, uint16_t *out) {
    const m3_config *c = &e->cfg;
    const m3_step *st = &e->step;
    m3_cache_layer *cl = &e->cache.layers[l];
    int D = c->head_dim, Di = c->index_dim;
    size_t per_row = (size_t)nh * D * 2 + (size_t)Di;
    for (int t = 0; t < st->rows; t++) {
        int64_t slot = st->host.slots[t];
        if (slot < 0)
            continue;
        int64_t page = slot / PAGE, off = slot % PAGE;
        uint16_t *row = out ? out + (size_t)t * per_row : NULL;
        for (int h = 0; h < nh; h++) {
            size_t at = m3_cache_offset(page, off, c->num_kv_heads, h0 + h, D);
            uint16_t *k = (uint16_t *)cl->k + at, *v = (uint16_t *)cl->v + at;
            if (row) {
                memcpy(row + (size_t)h * D, k, (size_t)D * 2);
                memcpy(row + (size_t)(nh + h) * D, v, (size_t)D * 2);
            } else {
                fill16(k, D, BF16_NAN);
                fill16(v, D, BF16_NAN);
            }
        }
        uint16_t *ik = (uint16_t *)cl->index + m3_cache_offset(page, off, 1, 0, Di);
        if (row)
            memcpy(row + (size_t)nh * D * 2, ik, (size_t)Di * 2);
        else
            fill16(ik, Di, BF16_NAN);
    }
}

/* bitwise equality of the real rows (rows of `width` elements) */
static bool same_rows(const m3_step *st, const uint16_t *a, const uint16_t *b, size_t width) {
    for (int t = 0; t < st->rows; t++)
        if (st->host.slots[t] >= 0 &&
            memcmp(a + (size_t)t * width, b + (size_t)t * width, width * 2))
            return false;
    return true;
}

/* ------------------------------------------------------------ TP ranks on threads */

typedef struct rank_arg {
    m3_cpu_mono *m;
    m3_engine *e;
    int layer;
    bool first;
    uint32_t epoch;
    uint16_t *hidden, *residual;
    m3_status st;
    char msg[300];
    double seconds;
} rank_arg;

static void *rank_main(void *p) {
    rank_arg *a = p;
    double t0 = now_s();
    a->st = m3_cpu_mono_layer(a->m, &a->e->step, a->layer, &a->e->w.layers[a->layer],
                              &a->e->cache.layers[a->layer], a->first, a->epoch, a->hidden,
                              a->residual);
    a->seconds = now_s() - t0;
    if (a->st)
        snprintf(a->msg, sizeof a->msg, "%s", m3_last_error());
    return NULL;
}

static void run_ranks(rank_arg *args, int n) {
    pthread_t th[M3_MAX_TP];
    bool started[M3_MAX_TP] = {0};
    for (int r = 1; r < n; r++)
        started[r] = pthread_create(&th[r], NULL, rank_main, &args[r]) == 0;
    rank_main(&args[0]);
    for (int r = 1; r < n; r++) {
        CHECK(started[r]);
        if (started[r])
            pthread_join(th[r], NULL);
    }
    for (int r = 0; r < n; r++)
        if (args[r].st)
            fprintf(stderr, "rank %d: %s\n", r, args[r].msg);
}

/* ------------------------------------------------------------ the comparison */

typedef struct tp_setup {
    int tp;
    m3_engine *front;
    m3_cpu_mono_group *group;
    m3_cpu_mono *mono[M3_MAX_TP];
    uint32_t epoch;
} tp_setup;

typedef struct fixture {
    model_case *mc;
    m3_engine *e1;
    m3_backend *be[2];     /* 1 and 3 threads: the TP 1 executors' pools */
    m3_cpu_mono *mono[2];
    tp_setup tps[2];       /* TP 2, TP 4 */
    m3_seq seqs[N_SEQS];
    int64_t lens[N_SEQS];
} fixture;

static const int g_threads[2] = {1, 3};

static void check_fault_clear(m3_cpu_mono *m, const char *what) {
    const int32_t *w = m3_cpu_mono_fault_word(m);
    int32_t code = __atomic_load_n(&w[0], __ATOMIC_ACQUIRE);
    if (code) {
        fprintf(stderr, "%s: fault %d (%s) layer %d row %d value %d\n", what, code,
                m3_mono_fault_name(code), w[1], w[2], w[3]);
        m3_cpu_mono_clear_fault(m);
    }
    CHECK(code == 0);
}

/* One step's comparison on every sparse MoE layer. */
static void compare_step(fixture *f, const m3_request *reqs, int n_reqs, bool first) {
    m3_engine *e1 = f->e1;
    const m3_config *c = &e1->cfg;
    CHECK_OK(m3_engine_build(e1, reqs, n_reqs, true));
    for (int t = 0; t < 2; t++)
        if (f->tps[t].front)
            for (int r = 0; r < f->tps[t].tp; r++)
                CHECK_OK(m3_engine_build(f->tps[t].front->ranks[r], reqs, n_reqs, true));
    const m3_step *st = &e1->step;
    int T = st->rows, H = c->hidden_size, D = c->head_dim, Di = c->index_dim;
    size_t n = (size_t)T * H;
    size_t per_row = (size_t)c->num_kv_heads * D * 2 + (size_t)Di;
    uint16_t *in_h = xalloc(n * 2), *in_r = xalloc(n * 2);
    uint16_t *ref_h = xalloc(n * 2), *ref_r = xalloc(n * 2);
    uint16_t *got_h = xalloc(n * 2 * M3_MAX_TP), *got_r = xalloc(n * 2 * M3_MAX_TP);
    uint16_t *ref_cache = xalloc((size_t)T * per_row * 2);
    uint16_t *got_cache = xalloc((size_t)T * per_row * 2);
    for (int li = 0; li < c->num_layers; li++) {
        if (!c->layer_sparse[li] || !c->layer_moe[li])
            continue;
        fill_rand(in_h, (int64_t)n);
        fill_rand(in_r, (int64_t)n);
        if (first)
            fill16(in_h, (int64_t)n, BF16_NAN); /* not an input on a first layer */
        /* stock */
        memcpy(e1->s.hidden, in_h, n * 2);
        memcpy(e1->s.residual, in_r, n * 2);
        slot_entries(e1, li, 0, c->num_kv_heads, NULL);
        CHECK_OK(m3_stock_layer(e1, st, li, first));
        memcpy(ref_h, e1->s.hidden, n * 2);
        memcpy(ref_r, e1->s.residual, n * 2);
        slot_entries(e1, li, 0, c->num_kv_heads, ref_cache);
        /* mono at TP 1, 1 and 3 threads */
        for (int x = 0; x < 2; x++) {
            memcpy(got_h, in_h, n * 2);
            memcpy(got_r, in_r, n * 2);
            slot_entries(e1, li, 0, c->num_kv_heads, NULL);
            CHECK_OK(m3_cpu_mono_layer(f->mono[x], st, li, &e1->w.layers[li],
                                       &e1->cache.layers[li], first, 1, got_h, got_r));
            check_fault_clear(f->mono[x], "mono tp 1");
            slot_entries(e1, li, 0, c->num_kv_heads, got_cache);
            bool ok_h = same_rows(st, got_h, ref_h, (size_t)H);
            bool ok_r = same_rows(st, got_r, ref_r, (size_t)H);
            bool ok_c = same_rows(st, got_cache, ref_cache, per_row);
            CHECK(ok_h && ok_r && ok_c);
            if (!(ok_h && ok_r && ok_c))
                fprintf(stderr, "  %s: %d rows, layer %d, %d threads: hidden %s, residual %s, "
                        "cache %s\n", f->mc->name, T, li, g_threads[x], ok_h ? "ok" : "DIFFER",
                        ok_r ? "ok" : "DIFFER", ok_c ? "ok" : "DIFFER");
        }
        /* mono at TP 2 and 4: every rank equals TP 1 stock */
        for (int t = 0; t < 2; t++) {
            tp_setup *tp = &f->tps[t];
            if (!tp->front)
                continue;
            rank_arg args[M3_MAX_TP];
            uint32_t epoch = ++tp->epoch;
            for (int r = 0; r < tp->tp; r++) {
                m3_engine *er = tp->front->ranks[r];
                slot_entries(er, li, 0, er->cfg.num_kv_heads, NULL);
                memcpy(got_h + (size_t)r * n, in_h, n * 2);
                memcpy(got_r + (size_t)r * n, in_r, n * 2);
                args[r] = (rank_arg){tp->mono[r], er, li, first, epoch, got_h + (size_t)r * n,
                                     got_r + (size_t)r * n, M3_OK, "", 0};
            }
            run_ranks(args, tp->tp);
            for (int r = 0; r < tp->tp; r++) {
                m3_engine *er = tp->front->ranks[r];
                CHECK(args[r].st == M3_OK);
                check_fault_clear(tp->mono[r], "mono tp rank");
                /* the stock TP 1 entries of this rank's heads */
                int nh = er->cfg.num_kv_heads, kv0 = rank_kv0(c, r, tp->tp);
                size_t rrow = (size_t)nh * D * 2 + (size_t)Di;
                uint16_t *want = xalloc((size_t)T * rrow * 2);
                for (int row = 0; row < T; row++) {
                    const uint16_t *src = ref_cache + (size_t)row * per_row;
                    uint16_t *dst = want + (size_t)row * rrow;
                    memcpy(dst, src + (size_t)kv0 * D, (size_t)nh * D * 2);
                    memcpy(dst + (size_t)nh * D, src + (size_t)(c->num_kv_heads + kv0) * D,
                           (size_t)nh * D * 2);
                    memcpy(dst + (size_t)nh * D * 2, src + (size_t)c->num_kv_heads * D * 2,
                           (size_t)Di * 2);
                }
                slot_entries(er, li, 0, nh, got_cache);
                bool ok_h = same_rows(st, got_h + (size_t)r * n, ref_h, (size_t)H);
                bool ok_r = same_rows(st, got_r + (size_t)r * n, ref_r, (size_t)H);
                bool ok_c = same_rows(&er->step, got_cache, want, rrow);
                free(want);
                CHECK(ok_h && ok_r && ok_c);
                if (!(ok_h && ok_r && ok_c))
                    fprintf(stderr, "  %s: %d rows, layer %d, TP %d rank %d: hidden %s, "
                            "residual %s, cache %s\n", f->mc->name, T, li, tp->tp, r,
                            ok_h ? "ok" : "DIFFER", ok_r ? "ok" : "DIFFER",
                            ok_c ? "ok" : "DIFFER");
            }
        }
        if (first)
            break; /* one layer as a first layer is enough */
    }
    free(in_h);
    free(in_r);
    free(ref_h);
    free(ref_r);
    free(got_h);
    free(got_r);
    free(ref_cache);
    free(got_cache);
}

/* lengths: topk * 128 plus these: sequence 0 is prefilled for real on
 * tiny; 1 ends on a block's last position, 2 on a page boundary (its
 * decode row opens a page); 7 is long (random pages: more blocks to choose
 * from); the rest are clones of 0 (or random) */
#define LONG_SEQ 7
static const int g_len_off[N_SEQS] = {5,  127, 128, 90,  1,  99,  21, 700,
                                      27, 86,  110, 103, 48, 120, 62, 64};

static bool setup_fixture(fixture *f, model_case *mc, bool with_tp4) {
    memset(f, 0, sizeof *f);
    f->mc = mc;
    f->e1 = make_engine(mc->model, 1, 2);
    CHECK(f->e1 != NULL);
    if (!f->e1)
        return false;
    m3_engine *e1 = f->e1;
    int threshold = mc->cfg.topk_blocks * PAGE;
    for (int i = 0; i < N_SEQS; i++) {
        CHECK_OK(m3_seq_create(e1, &f->seqs[i]));
        f->lens[i] = threshold + g_len_off[i];
    }
    /* the first n_prefill sequences for real, the rest cloned (or all random) */
    float *logits = xalloc((size_t)mc->cfg.vocab_size * 4);
    for (int i = 0; i < N_SEQS; i++) {
        if (i == LONG_SEQ) {
            random_seq(e1, f->seqs[i], f->lens[i]);
        } else if (i < mc->n_prefill) {
            int len = (int)f->lens[i];
            int32_t *tok = xalloc((size_t)len * 4);
            for (int k = 0; k < len; k++)
                tok[k] = (int32_t)(rng_u64() % (uint64_t)mc->cfg.vocab_size);
            m3_request r = {f->seqs[i], tok, len};
            CHECK_OK(m3_engine_step(e1, &r, 1, logits, NULL));
            free(tok);
        } else if (mc->n_prefill) {
            clone_seq(e1, f->seqs[i], f->seqs[i % mc->n_prefill], f->lens[i]);
        } else {
            random_seq(e1, f->seqs[i], f->lens[i]);
        }
    }
    free(logits);
    for (int x = 0; x < 2; x++) {
        CHECK_OK(m3_cpu_backend_create(g_threads[x], &f->be[x]));
        CHECK_OK(m3_cpu_mono_create(f->be[x], &e1->cfg, MONO_ROWS, e1->max_blocks, 0, NULL,
                                    NULL, &f->mono[x]));
        if (!f->mono[x])
            return false;
    }
    /* TP 2 with 3 threads per rank, TP 4 with 1 */
    const int tps[2] = {2, 4}, threads[2] = {6, 4};
    for (int t = 0; t < (with_tp4 ? 2 : 1); t++) {
        tp_setup *tp = &f->tps[t];
        tp->tp = tps[t];
        tp->front = make_engine(mc->model, tps[t], threads[t]);
        CHECK(tp->front != NULL);
        if (!tp->front)
            return false;
        for (int i = 0; i < N_SEQS; i++) {
            m3_seq s;
            CHECK_OK(m3_seq_create(tp->front, &s));
            CHECK(s == f->seqs[i]);
            for (int r = 0; r < tp->tp; r++)
                copy_to_rank(e1, tp->front->ranks[r], r, tp->tp, s);
        }
        CHECK_OK(m3_cpu_mono_group_create(tp->tp, MONO_ROWS, &tp->front->ranks[0]->cfg, 20000,
                                          &tp->group));
        for (int r = 0; r < tp->tp; r++) {
            m3_engine *er = tp->front->ranks[r];
            CHECK_OK(m3_cpu_mono_create(er->be, &er->cfg, MONO_ROWS, er->max_blocks, r,
                                        tp->group, NULL, &tp->mono[r]));
            if (!tp->mono[r])
                return false;
        }
    }
    return true;
}

static void free_fixture(fixture *f) {
    for (int t = 0; t < 2; t++) {
        tp_setup *tp = &f->tps[t];
        for (int r = 0; r < M3_MAX_TP; r++)
            m3_cpu_mono_free(tp->mono[r]);
        m3_cpu_mono_group_free(tp->group);
        m3_engine_free(tp->front);
    }
    for (int x = 0; x < 2; x++) {
        m3_cpu_mono_free(f->mono[x]);
        if (f->be[x])
            f->be[x]->ops->destroy(f->be[x]);
    }
    m3_engine_free(f->e1);
}

/* decode steps of 1, 2, 3, 5, 8 and 16 rows over rotating sequences */
static void test_model(model_case *mc, bool with_tp4, const int *rows, int n_rows) {
    double t0 = now_s();
    fixture f;
    bool ok = setup_fixture(&f, mc, with_tp4);
    double setup = now_s() - t0;
    if (ok) {
        for (int i = 0; i < n_rows; i++) {
            int R = rows[i];
            m3_request reqs[N_SEQS];
            int32_t tok[N_SEQS];
            for (int q = 0; q < R; q++) {
                tok[q] = (int32_t)(rng_u64() % (uint64_t)mc->cfg.vocab_size);
                reqs[q] = (m3_request){f.seqs[(R * 3 + q) % N_SEQS], &tok[q], 1};
            }
            compare_step(&f, reqs, R, false);
            if (i == (n_rows > 1))
                compare_step(&f, reqs, R, true);
        }
    }
    free_fixture(&f);
    printf("  %s: %.2f s (setup %.2f s)\n", mc->name, now_s() - t0, setup);
}

/* ------------------------------------------------------------ faults */

static bool cache_equal(m3_engine *e, int l, const uint16_t *snap) {
    const m3_config *c = &e->cfg;
    size_t kv = kv_page_elems(c) * (size_t)e->cache.n_pages;
    size_t ix = index_page_elems(c) * (size_t)e->cache.n_pages;
    m3_cache_layer *cl = &e->cache.layers[l];
    return !memcmp(snap, cl->k, kv * 2) && !memcmp(snap + kv, cl->v, kv * 2) &&
           !memcmp(snap + 2 * kv, cl->index, ix * 2);
}

static uint16_t *cache_snapshot(m3_engine *e, int l) {
    const m3_config *c = &e->cfg;
    size_t kv = kv_page_elems(c) * (size_t)e->cache.n_pages;
    size_t ix = index_page_elems(c) * (size_t)e->cache.n_pages;
    uint16_t *snap = xalloc((2 * kv + ix) * 2);
    m3_cache_layer *cl = &e->cache.layers[l];
    memcpy(snap, cl->k, kv * 2);
    memcpy(snap + kv, cl->v, kv * 2);
    memcpy(snap + 2 * kv, cl->index, ix * 2);
    return snap;
}

static int32_t fault_code(m3_cpu_mono *m, int32_t out[4]) {
    const int32_t *w = m3_cpu_mono_fault_word(m);
    for (int i = 0; i < 4; i++)
        out[i] = __atomic_load_n(&w[i], __ATOMIC_ACQUIRE);
    return out[0];
}

/* A layer that must do nothing: M3_OK, outputs (poisoned) and the whole
 * layer cache unchanged, the fault word as wanted (want_row -2: code only). */
static void expect_nothing(m3_cpu_mono *m, m3_engine *e, int l, uint32_t epoch, int want_code,
                           int want_row, int want_value) {
    const m3_step *st = &e->step;
    size_t n = (size_t)st->rows * e->cfg.hidden_size;
    uint16_t *hid = xalloc(n * 2), *res = xalloc(n * 2);
    fill16(hid, (int64_t)n, BF16_NAN);
    fill16(res, (int64_t)n, BF16_NAN);
    uint16_t *snap = cache_snapshot(e, l);
    CHECK_OK(m3_cpu_mono_layer(m, st, l, &e->w.layers[l], &e->cache.layers[l], false, epoch, hid,
                               res));
    bool untouched = true;
    for (size_t i = 0; i < n; i++)
        untouched = untouched && hid[i] == BF16_NAN && res[i] == BF16_NAN;
    CHECK(untouched);
    CHECK(cache_equal(e, l, snap));
    int32_t w[4];
    CHECK(fault_code(m, w) == want_code);
    if (want_row != -2)
        CHECK(w[1] == l && w[2] == want_row && w[3] == want_value);
    free(snap);
    free(hid);
    free(res);
}

typedef struct abort_arg {
    m3_cpu_mono *by;
    int delay_ms;
} abort_arg;

static void *abort_main(void *p) {
    abort_arg *a = p;
    struct timespec ts = {a->delay_ms / 1000, (long)(a->delay_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    m3_cpu_mono_abort_all(a->by);
    return NULL;
}

/* world 1: a slot or a page past the pool, a planted fault (sticky, the
 * first fault wins), abort_all */
static void faults_world1(m3_cpu_mono *m, m3_engine *e, int l, const m3_request *reqs) {
    /* a slot past the pool: SLOT, nothing written */
    CHECK_OK(m3_engine_build(e, reqs, 3, true));
    int64_t good = e->step.host.slots[1];
    int64_t bad_slot = e->step.n_pages * PAGE + 5;
    e->step.host.slots[1] = bad_slot;
    expect_nothing(m, e, l, 1, M3_MONO_FAULT_SLOT, 1, (int)bad_slot);
    /* sticky: a second call also does nothing, the first fault stays */
    e->step.host.slots[1] = good;
    expect_nothing(m, e, l, 2, M3_MONO_FAULT_SLOT, 1, (int)bad_slot);
    m3_cpu_mono_clear_fault(m);

    /* a block table page past the pool: PAGE, nothing written */
    int32_t *table = e->step.host.block_table + (int64_t)e->step.host.row_req[2] *
                                                    e->step.max_blocks;
    int32_t keep = table[1];
    table[1] = (int32_t)e->step.n_pages + 3;
    expect_nothing(m, e, l, 3, M3_MONO_FAULT_PAGE, 2, (int)e->step.n_pages + 3);
    table[1] = keep;
    m3_cpu_mono_clear_fault(m);

    /* a planted fault: the layer does nothing */
    m3_cpu_mono_set_fault(m, M3_MONO_FAULT_PLANTED, 7, 8, 9);
    m3_cpu_mono_set_fault(m, M3_MONO_FAULT_SLOT, 1, 1, 1); /* the first fault wins */
    int32_t w[4];
    CHECK(fault_code(m, w) == M3_MONO_FAULT_PLANTED && w[1] == 7 && w[2] == 8 && w[3] == 9);
    expect_nothing(m, e, l, 4, M3_MONO_FAULT_PLANTED, -2, 0);
    m3_cpu_mono_clear_fault(m);
    CHECK(fault_code(m, w) == 0);
    /* abort_all at world 1 marks this executor */
    m3_cpu_mono_abort_all(m);
    CHECK(fault_code(m, w) == M3_MONO_FAULT_ABORTED);
    m3_cpu_mono_clear_fault(m);
}

/* bad arguments are errors, not faults */
static void faults_bad_args(m3_cpu_mono *m, m3_engine *e, int l, m3_seq seq0) {
    int32_t w[4];
    size_t n = (size_t)MONO_ROWS * e->cfg.hidden_size;
    uint16_t *hid = xalloc(n * 2), *res = xalloc(n * 2);
    fill_rand(hid, (int64_t)n);
    fill_rand(res, (int64_t)n);
    CHECK_FAILS(m3_cpu_mono_layer(m, &e->step, 0, &e->w.layers[0], &e->cache.layers[0], false,
                                  5, hid, res),
                M3_ERR_INVALID_ARG, "the mono path takes sparse MoE layers; layer 0 is dense");
    CHECK_FAILS(m3_cpu_mono_layer(NULL, &e->step, l, &e->w.layers[l], &e->cache.layers[l],
                                  false, 5, hid, res),
                M3_ERR_INVALID_ARG, "required");
    CHECK_FAILS(m3_cpu_mono_layer(m, &e->step, l, &e->w.layers[l], &e->cache.layers[l], false,
                                  5, NULL, res),
                M3_ERR_INVALID_ARG, "required");
    m3_cpu_mono *small = NULL;
    CHECK_OK(m3_cpu_mono_create(e->be, &e->cfg, 2, e->max_blocks, 0, NULL, NULL, &small));
    CHECK_FAILS(m3_cpu_mono_layer(small, &e->step, l, &e->w.layers[l], &e->cache.layers[l],
                                  false, 5, hid, res),
                M3_ERR_INVALID_ARG, "max_rows = 2");
    m3_cpu_mono_free(small);
    int32_t two[2] = {4, 5};
    m3_request pre = {seq0, two, 2};
    CHECK_OK(m3_engine_build(e, &pre, 1, true));
    CHECK_FAILS(m3_cpu_mono_layer(m, &e->step, l, &e->w.layers[l], &e->cache.layers[l],
                                  false, 5, hid, res),
                M3_ERR_INVALID_ARG, "not decode-only");
    CHECK_FAILS(m3_cpu_mono_create(e->be, &e->cfg, 65, e->max_blocks, 0, NULL, NULL, &small),
                M3_ERR_INVALID_ARG, "max_rows 65");
    m3_cpu_mono_group *g = NULL;
    CHECK_FAILS(m3_cpu_mono_group_create(9, 16, &e->cfg, 0, &g), M3_ERR_INVALID_ARG,
                "world 9");
    CHECK_OK(m3_cpu_mono_group_create(2, 16, &e->cfg, 0, &g));
    CHECK_FAILS(m3_cpu_mono_create(e->be, &e->cfg, 16, e->max_blocks, 2, g, NULL, &small),
                M3_ERR_INVALID_ARG, "TP rank 2 of a group of 2");
    m3_cpu_mono_group_free(g);
    CHECK(fault_code(m, w) == 0); /* errors are not faults */
    free(hid);
    free(res);
}

/* TP 2: a peer that never arrives; an abort; then exact steps again */
static void faults_tp2(m3_engine *e, m3_engine *f2, int l, const m3_request *reqs) {
    int32_t w[4];
    m3_cpu_mono_group *g = NULL;
    m3_cpu_mono *rm[2] = {NULL, NULL};
    CHECK_OK(m3_cpu_mono_group_create(2, MONO_ROWS, &f2->ranks[0]->cfg, 200, &g));
    for (int r = 0; r < 2 && g; r++)
        CHECK_OK(m3_cpu_mono_create(f2->ranks[r]->be, &f2->ranks[r]->cfg, MONO_ROWS,
                                    f2->ranks[r]->max_blocks, r, g, NULL, &rm[r]));
    if (!rm[0] || !rm[1]) {
        for (int r = 0; r < 2; r++)
            m3_cpu_mono_free(rm[r]);
        m3_cpu_mono_group_free(g);
        return;
    }
    CHECK_OK(m3_engine_build(e, reqs, 3, true));
    for (int r = 0; r < 2; r++)
        CHECK_OK(m3_engine_build(f2->ranks[r], reqs, 3, true));
    const m3_step *st = &e->step;
    size_t n = (size_t)st->rows * e->cfg.hidden_size;
    uint16_t *in_h = xalloc(n * 2), *in_r = xalloc(n * 2), *h0 = xalloc(n * 2),
             *r0 = xalloc(n * 2), *h1 = xalloc(n * 2), *r1 = xalloc(n * 2);
    fill_rand(in_h, (int64_t)n);
    fill_rand(in_r, (int64_t)n);

    /* only rank 0 runs: its wait expires (200 ms) */
    memcpy(h0, in_h, n * 2);
    memcpy(r0, in_r, n * 2);
    rank_arg a0 = {rm[0], f2->ranks[0], l, false, 1, h0, r0, M3_OK, "", 0};
    rank_main(&a0);
    CHECK(a0.st == M3_OK);
    CHECK(fault_code(rm[0], w) == M3_MONO_FAULT_PEER_WAIT && w[1] == l && w[3] == 1);
    CHECK(a0.seconds >= 0.15 && a0.seconds < 5.0);
    CHECK(fault_code(rm[1], w) == 0); /* a peer's word is its own */
    m3_cpu_mono_clear_fault(rm[0]);

    /* rank 0 waits (the timeout now long); rank 1 aborts from another
     * thread: rank 0's wait ends, both words say ABORTED */
    m3_cpu_mono_group_free(g); /* a group with a long timeout, same executors' shapes */
    g = NULL;
    m3_cpu_mono_free(rm[0]);
    m3_cpu_mono_free(rm[1]);
    rm[0] = rm[1] = NULL;
    CHECK_OK(m3_cpu_mono_group_create(2, MONO_ROWS, &f2->ranks[0]->cfg, 30000, &g));
    for (int r = 0; r < 2 && g; r++)
        CHECK_OK(m3_cpu_mono_create(f2->ranks[r]->be, &f2->ranks[r]->cfg, MONO_ROWS,
                                    f2->ranks[r]->max_blocks, r, g, NULL, &rm[r]));
    if (rm[0] && rm[1]) {
        memcpy(h0, in_h, n * 2);
        memcpy(r0, in_r, n * 2);
        a0 = (rank_arg){rm[0], f2->ranks[0], l, false, 2, h0, r0, M3_OK, "", 0};
        abort_arg ab = {rm[1], 100};
        pthread_t th;
        bool started = pthread_create(&th, NULL, abort_main, &ab) == 0;
        CHECK(started);
        rank_main(&a0);
        if (started)
            pthread_join(th, NULL);
        CHECK(a0.st == M3_OK);
        CHECK(fault_code(rm[0], w) == M3_MONO_FAULT_ABORTED && w[3] == 1);
        CHECK(fault_code(rm[1], w) == M3_MONO_FAULT_ABORTED);
        CHECK(a0.seconds >= 0.05 && a0.seconds < 10.0);
        m3_cpu_mono_clear_fault(rm[0]);
        m3_cpu_mono_clear_fault(rm[1]);

        /* both ranks, later epochs: exact again (stale tags and data in
         * the peer buffers need no clearing) */
        memcpy(e->s.hidden, in_h, n * 2);
        memcpy(e->s.residual, in_r, n * 2);
        CHECK_OK(m3_stock_layer(e, st, l, false));
        for (uint32_t ep = 3; ep < 5; ep++) {
            memcpy(h0, in_h, n * 2);
            memcpy(r0, in_r, n * 2);
            memcpy(h1, in_h, n * 2);
            memcpy(r1, in_r, n * 2);
            rank_arg args[2] = {{rm[0], f2->ranks[0], l, false, ep, h0, r0, M3_OK, "", 0},
                                {rm[1], f2->ranks[1], l, false, ep, h1, r1, M3_OK, "", 0}};
            run_ranks(args, 2);
            CHECK(args[0].st == M3_OK && args[1].st == M3_OK);
            CHECK(fault_code(rm[0], w) == 0 && fault_code(rm[1], w) == 0);
            CHECK(same_rows(st, h0, e->s.hidden, (size_t)e->cfg.hidden_size));
            CHECK(same_rows(st, h1, e->s.hidden, (size_t)e->cfg.hidden_size));
            CHECK(same_rows(st, r0, e->s.residual, (size_t)e->cfg.hidden_size));
            CHECK(same_rows(st, r1, e->s.residual, (size_t)e->cfg.hidden_size));
        }
    }
    for (int r = 0; r < 2; r++)
        m3_cpu_mono_free(rm[r]);
    m3_cpu_mono_group_free(g);
    free(in_h);
    free(in_r);
    free(h0);
    free(r0);
    free(h1);
    free(r1);
}

static void test_faults(model_case *mc) {
    m3_engine *e = make_engine(mc->model, 1, 2);
    m3_engine *f2 = make_engine(mc->model, 2, 2);
    CHECK(e && f2);
    if (!e || !f2) {
        m3_engine_free(e);
        m3_engine_free(f2);
        return;
    }
    int l = 1; /* tiny: layer 1 is sparse MoE */
    m3_seq seqs[3];
    for (int i = 0; i < 3; i++) {
        CHECK_OK(m3_seq_create(e, &seqs[i]));
        random_seq(e, seqs[i], 400 + 37 * i);
        m3_seq s;
        CHECK_OK(m3_seq_create(f2, &s));
        for (int r = 0; r < 2; r++)
            copy_to_rank(e, f2->ranks[r], r, 2, s);
    }
    int32_t tok[3] = {1, 2, 3};
    m3_request reqs[3] = {{seqs[0], &tok[0], 1}, {seqs[1], &tok[1], 1}, {seqs[2], &tok[2], 1}};
    m3_cpu_mono *m = NULL;
    CHECK_OK(m3_cpu_mono_create(e->be, &e->cfg, MONO_ROWS, e->max_blocks, 0, NULL, NULL, &m));
    if (!m)
        goto done;

    faults_world1(m, e, l, reqs);
    faults_bad_args(m, e, l, seqs[0]);
    faults_tp2(e, f2, l, reqs);
done:
    m3_cpu_mono_free(m);
    m3_engine_free(e);
    m3_engine_free(f2);
}

/* ------------------------------------------------------------ main */

int main(void) {
    const char *env = getenv("M3_TEST_SEED");
    g_rng = env ? strtoull(env, NULL, 0) : 0x5eed0005ull;
    printf("test_cpu_mono: seed %llu (set M3_TEST_SEED to vary)\n", (unsigned long long)g_rng);
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    double t0 = now_s();
    test_pool();
    printf("  pool: %.2f s\n", now_s() - t0);
    t0 = now_s();
    model_case tiny = {0}, tiny8 = {0}, small = {0};
    /* prefill is the slow part under ASan: one real sequence on tiny */
    CHECK_OK(load_case(&tiny, "tiny", 0, false, "tiny", 1));
    CHECK_OK(load_case(&tiny8, "tiny", 0, true, "tiny-mxfp8", 0));
    CHECK_OK(load_case(&small, "small", 3, false, "small-3", 0));
    const int all_rows[] = {1, 2, 3, 5, 8, 16};
    const int mx_rows[] = {1, 5, 16};
    const int small_rows[] = {3};
    printf("  synth: %.2f s\n", now_s() - t0);
    if (tiny.model) {
        t0 = now_s();
        test_faults(&tiny);
        printf("  faults: %.2f s\n", now_s() - t0);
        test_model(&tiny, true, all_rows, 6);
    }
    if (tiny8.model)
        test_model(&tiny8, true, mx_rows, 3);
    if (small.model)
        test_model(&small, false, small_rows, 1); /* TP 2: TP 4 runs on tiny */
    m3_model_free(tiny.model);
    m3_model_free(tiny8.model);
    m3_model_free(small.model);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return check_summary("test_cpu_mono");
}
