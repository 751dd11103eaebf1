/*
 * The mono path's lifecycle (src/mono/mono.c, SPEC §5) on the CPU:
 * refusals (every reason listed; a refusal on one TP rank makes every rank
 * refuse, without a hang), decide_step's table, cache binding by identity
 * (only a moved layer is rebound; no bind during capture), the fault word
 * (a planted fault fails the step with its message, commits nothing and
 * turns later steps stock), aborting a launched step on every rank,
 * health and an idempotent close. Mono-vs-stock numerics are in
 * test_cpu_mono.c and tests/cli/test_mono.py.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "core/status.h"
#include "cpu/cpu_mono.h"
#include "decode/engine.h"
#include "mono/mono.h"

static char g_dir[256];

/* tiny: one dense layer, then two sparse MoE layers */
static m3_model *load_tiny(void) {
    m3_config c;
    if (m3_preset("tiny", &c))
        return NULL;
    m3_synth_opts so = {31, false, 0};
    if (m3_synth(&c, g_dir, &so))
        return NULL;
    m3_model *m = NULL;
    m3_model_opts mo = {false};
    return m3_model_load(g_dir, &mo, &m) ? NULL : m;
}

static m3_engine *make_engine(m3_model *model, int tp, m3_decode_path decode) {
    m3_engine_opts o = m3_engine_defaults();
    o.threads = 2;
    o.tp = tp;
    o.decode = decode;
    o.max_tokens = 4096;
    o.max_seqs = 4;
    o.tp_timeout_ms = 5000;
    m3_engine *e = NULL;
    m3_status st = m3_engine_create(model, &o, &e);
    if (st)
        fprintf(stderr, "engine: %s\n", m3_last_error());
    return e;
}

static void test_refusals(m3_model *model) {
    m3_engine *e = make_engine(model, 1, M3_DECODE_STOCK);
    CHECK(e && !e->mono);
    if (!e)
        return;
    m3_mono_config mc;
    CHECK_OK(m3_mono_default_config(e, 0, &mc));
    CHECK(mc.first_layer == 1 && mc.last_layer == 2 && mc.max_rows == 16);
    CHECK(mc.n_widths == 5 && mc.widths[0] == 1 && mc.widths[4] == 16);
    char why[1024];
    CHECK(m3_mono_model_refusals(e, &mc, why, sizeof why) == 0 && why[0] == 0);

    /* several reasons at once, each named */
    m3_mono_config bad = mc;
    bad.first_layer = 0; /* a dense layer */
    bad.max_rows = 17;
    bad.tp_size = 2;
    int n = m3_mono_model_refusals(e, &bad, why, sizeof why);
    CHECK(n == 4);
    CHECK(strstr(why, "layer 0 is not sparse attention + MoE") != NULL);
    CHECK(strstr(why, "max_rows 17") != NULL);
    CHECK(strstr(why, "tp_size 2") != NULL);
    CHECK(strstr(why, "row widths") != NULL);
    m3_mono *m = NULL;
    CHECK_FAILS(m3_mono_create(e, &bad, NULL, &m), M3_ERR_UNSUPPORTED, "layer 0 is not");
    CHECK(m == NULL);
    bad = mc;
    bad.widths[1] = 1; /* not ascending */
    CHECK(m3_mono_model_refusals(e, &bad, why, sizeof why) == 1);
    /* indexer CP: built into the CPU executor, not into the CUDA kernels
     * (the options as the CUDA engine would hold them; refusals only read) */
    e->opts.indexer_cp = true;
    CHECK(m3_mono_model_refusals(e, &mc, why, sizeof why) == 0);
    e->opts.device = M3_DEVICE_CUDA;
    CHECK(m3_mono_model_refusals(e, &mc, why, sizeof why) == 1);
    CHECK(strstr(why, "indexer context parallelism") != NULL);
    e->opts.device = M3_DEVICE_CPU;
    e->opts.indexer_cp = false;
    m3_engine_free(e);
}

/* ---- a refusal on one rank of two ---- */

typedef struct refuse_arg {
    m3_status st[2];
    char msg[2][512];
    int bad_rank;
} refuse_arg;

static m3_status create_on_rank(m3_engine *rank, void *p) {
    refuse_arg *a = p;
    m3_mono_config mc;
    M3_TRY(m3_mono_default_config(rank, 0, &mc));
    if (rank->tp_rank == a->bad_rank)
        mc.max_rows = 99;
    m3_mono *m = NULL;
    m3_status st = m3_mono_create(rank, &mc, NULL, &m); /* refused before any executor */
    a->st[rank->tp_rank] = st;
    snprintf(a->msg[rank->tp_rank], sizeof a->msg[0], "%s", st ? m3_last_error() : "");
    m3_mono_free(m);
    return M3_OK;
}

static void test_refusal_agreed(m3_model *model) {
    m3_engine *f = make_engine(model, 2, M3_DECODE_STOCK);
    CHECK(f && f->ranks[1]);
    if (!f)
        return;
    for (int bad = 0; bad < 2; bad++) {
        refuse_arg a = {{M3_OK, M3_OK}, {"", ""}, bad};
        CHECK_OK(m3_tp_run_all(f, create_on_rank, &a));
        CHECK(a.st[0] == M3_ERR_UNSUPPORTED && a.st[1] == M3_ERR_UNSUPPORTED);
        CHECK(strstr(a.msg[bad], "max_rows 99") != NULL);
        CHECK(strstr(a.msg[1 - bad], "refused on another TP rank") != NULL);
    }
    m3_engine_free(f);
}

/* ---- decide_step's table ---- */

static void test_decide(m3_model *model) {
    m3_engine *e = make_engine(model, 1, M3_DECODE_MONO);
    CHECK(e && e->mono);
    if (!e || !e->mono)
        return;
    m3_mono *m = e->mono;
    m3_seq seq;
    CHECK_OK(m3_seq_create(e, &seq));
    int32_t toks[200];
    for (int i = 0; i < 200; i++)
        toks[i] = (i * 7) % 500;
    m3_request rq = {seq, toks, 200};
    float *logits = malloc((size_t)e->cfg.vocab_size * 4);
    CHECK_OK(m3_engine_step(e, &rq, 1, logits, NULL)); /* a prefill: stock */
    CHECK(m3_engine_get_stats(e).stock_steps == 1 && m3_engine_get_stats(e).mono_steps == 0);
    CHECK_OK(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, false));

    rq.n_tokens = 1;
    CHECK_OK(m3_engine_build(e, &rq, 1, true));
    m3_step st = e->step;
    CHECK(m3_mono_decide_step(m, &st) == M3_MONO_STEP_MONO);
    CHECK(m3_mono_decide_step(m, NULL) == M3_MONO_STEP_NO_CONTEXT);
    m3_step s2 = st;
    s2.graph_mode = M3_GRAPH_PIECEWISE;
    CHECK(m3_mono_decide_step(m, &s2) == M3_MONO_STEP_PIECEWISE);
    s2 = st;
    s2.graph_mode = M3_GRAPH_FULL;
    CHECK(m3_mono_decide_step(m, &s2) == M3_MONO_STEP_MONO);
    s2 = st;
    s2.n_prefill = 1;
    s2.n_decode = 0;
    CHECK(m3_mono_decide_step(m, &s2) == M3_MONO_STEP_PREFILL);
    s2 = st;
    s2.max_query_len = 8; /* a verify step */
    CHECK(m3_mono_decide_step(m, &s2) == M3_MONO_STEP_PREFILL);
    s2 = st;
    s2.rows = 17;
    CHECK(m3_mono_decide_step(m, &s2) == M3_MONO_STEP_TOO_MANY_ROWS);
    s2 = st;
    s2.dev.block_table = NULL;
    CHECK(m3_mono_decide_step(m, &s2) == M3_MONO_STEP_NO_METADATA);
    m3_mono_decision why;
    int64_t stock = m3_mono_get_health(m).stock_steps;
    CHECK(!m3_mono_plan(m, &st, true, &why) && why == M3_MONO_STEP_INTERMEDIATES);
    CHECK(m3_mono_get_health(m).stock_steps == stock + 1);
    uint32_t epoch = m3_mono_get_health(m).epoch;
    CHECK(m3_mono_plan(m, &st, false, &why) && why == M3_MONO_STEP_MONO);
    CHECK(m3_mono_get_health(m).epoch == epoch + 1);
    CHECK_OK(m3_mono_after_step(m, true, M3_OK)); /* planned, not run: no fault */

    /* a decode step through the engine runs mono */
    int64_t len = m3_seq_len(e, seq);
    CHECK_OK(m3_engine_step(e, &rq, 1, logits, NULL));
    CHECK(m3_engine_get_stats(e).mono_steps == 1);
    CHECK(m3_seq_len(e, seq) == len + 1);

    /* a planted fault: the step fails with the fault's message, commits
     * nothing, and later steps run stock */
    CHECK_OK(m3_mono_plant_fault(m, M3_MONO_FAULT_PLANTED, 2));
    CHECK_FAILS(m3_engine_step(e, &rq, 1, logits, NULL), M3_ERR_FAULT, "planted fault (layer 2");
    CHECK(m3_seq_len(e, seq) == len + 1);
    CHECK(m3_mono_get_health(m).state == M3_MONO_FAULTED);
    CHECK(m3_mono_decide_step(m, &st) == M3_MONO_STEP_FAULTED);
    int64_t mono_steps = m3_engine_get_stats(e).mono_steps;
    CHECK_OK(m3_engine_step(e, &rq, 1, logits, NULL));
    CHECK(m3_engine_get_stats(e).mono_steps == mono_steps);
    CHECK(m3_seq_len(e, seq) == len + 2);

    /* close: idempotent, later plans stock, health says so */
    m3_mono_close(m);
    m3_mono_close(m);
    CHECK(m3_mono_get_health(m).state == M3_MONO_CLOSED);
    CHECK(m3_mono_decide_step(m, &st) == M3_MONO_STEP_CLOSED);
    CHECK(!m3_mono_plan(m, &st, false, &why) && why == M3_MONO_STEP_CLOSED);
    CHECK_FAILS(m3_mono_run(m, &st, e->s.hidden, e->s.residual), M3_ERR_INVALID_ARG, "closed");
    CHECK_OK(m3_engine_step(e, &rq, 1, logits, NULL));
    free(logits);
    m3_engine_free(e);
}

/* ---- cache binding ---- */

static void test_binding(m3_model *model) {
    m3_engine *e = make_engine(model, 1, M3_DECODE_MONO);
    CHECK(e && e->mono);
    if (!e || !e->mono)
        return;
    m3_mono *m = e->mono;
    /* a first bind during capture is an error */
    CHECK_FAILS(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, true), M3_ERR_INVALID_ARG,
                "bound for the first time");
    CHECK_OK(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, false));
    int64_t binds = m3_mono_get_health(m).binds;
    CHECK(binds == 2); /* layers 1 and 2 */
    CHECK_OK(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, false));
    CHECK(m3_mono_get_health(m).binds == binds); /* nothing changed */
    CHECK_OK(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, true)); /* same: fine */

    /* move layer 2's K cache: only that layer is rebound */
    size_t kv = (size_t)e->cache.n_pages * e->cfg.num_kv_heads * M3_PAGE_TOKENS *
                e->cfg.head_dim * 2;
    void *moved = NULL, *old = e->cache.layers[2].k;
    CHECK_OK(e->be->ops->alloc(e->be, kv, &moved));
    memcpy(moved, old, kv);
    e->cache.layers[2].k = moved;
    CHECK_FAILS(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, true), M3_ERR_INVALID_ARG,
                "layer 2's cache would be rebound during a graph capture");
    CHECK_OK(m3_mono_bind_cache(m, &e->cache, e->cache.n_pages, false));
    CHECK(m3_mono_get_health(m).binds == binds + 1);
    e->be->ops->release(e->be, old);

    /* a misaligned cache is refused with the layer named */
    m3_cache bad = e->cache;
    m3_cache_layer layers[3];
    memcpy(layers, e->cache.layers, sizeof layers);
    layers[1].v = (char *)layers[1].v + 2;
    bad.layers = layers;
    CHECK_FAILS(m3_mono_bind_cache(m, &bad, e->cache.n_pages, false), M3_ERR_INVALID_ARG,
                "layer 1's V cache");
    m3_engine_free(e);
}

/* ---- abort across ranks ---- */

typedef struct abort_arg {
    m3_status st[2];
    char msg[2][512];
} abort_arg;

static m3_status abort_on_rank(m3_engine *rank, void *p) {
    abort_arg *a = p;
    int r = rank->tp_rank;
    /* rank 1 fails inside a launched step; rank 0's own work went fine,
     * and it reaches after_step once rank 1 has aborted */
    if (r == 1) {
        a->st[r] = m3_mono_after_step(rank->mono, true, m3_fail(M3_ERR_INTERNAL, "planted failure"));
    } else {
        usleep(50000);
        a->st[r] = m3_mono_after_step(rank->mono, true, M3_OK);
    }
    snprintf(a->msg[r], sizeof a->msg[r], "%s", a->st[r] ? m3_last_error() : "");
    return a->st[r];
}

static void test_abort(m3_model *model) {
    m3_engine *f = make_engine(model, 2, M3_DECODE_MONO);
    CHECK(f && f->ranks[0]->mono && f->ranks[1]->mono);
    if (!f || !f->ranks[0]->mono)
        return;
    abort_arg a = {{M3_OK, M3_OK}, {"", ""}};
    CHECK_FAILS(m3_tp_run_all(f, abort_on_rank, &a), M3_ERR_INTERNAL, "TP rank 1: planted failure");
    CHECK(a.st[1] == M3_ERR_INTERNAL && strstr(a.msg[1], "planted failure"));
    CHECK(a.st[0] == M3_ERR_FAULT && strstr(a.msg[0], "aborted"));
    CHECK(m3_mono_get_health(f->ranks[0]->mono).fault[0] == M3_MONO_FAULT_ABORTED);
    /* the abnormal end retired the mono path on both ranks: later decode
     * steps plan stock alike on every rank, and run */
    for (int r = 0; r < 2; r++)
        CHECK(m3_mono_get_health(f->ranks[r]->mono).state == M3_MONO_FAULTED);
    m3_seq seq;
    CHECK_OK(m3_seq_create(f, &seq));
    int32_t toks[200];
    for (int i = 0; i < 200; i++)
        toks[i] = (i * 13) % 500;
    m3_request rq = {seq, toks, 200};
    float *logits = malloc((size_t)f->vocab_full * 4);
    CHECK_OK(m3_engine_step(f, &rq, 1, logits, NULL));
    rq.n_tokens = 1;
    CHECK_OK(m3_engine_step(f, &rq, 1, logits, NULL));
    CHECK(m3_engine_get_stats(f).mono_steps == 0 && m3_engine_get_stats(f).stock_steps == 2);
    free(logits);
    m3_engine_free(f);
}

/* ---- a planted fault on one rank of two, through the engine ---- */

static void test_tp_fault(m3_model *model) {
    m3_engine *f = make_engine(model, 2, M3_DECODE_MONO);
    CHECK(f && f->ranks[1] && f->ranks[1]->mono);
    if (!f || !f->ranks[1]->mono)
        return;
    m3_seq seq;
    CHECK_OK(m3_seq_create(f, &seq));
    int32_t toks[200];
    for (int i = 0; i < 200; i++)
        toks[i] = (i * 11) % 500;
    m3_request rq = {seq, toks, 200};
    float *logits = malloc((size_t)f->vocab_full * 4);
    CHECK_OK(m3_engine_step(f, &rq, 1, logits, NULL));
    rq.n_tokens = 1;
    CHECK_OK(m3_engine_step(f, &rq, 1, logits, NULL));
    CHECK(m3_engine_get_stats(f).mono_steps == 1);
    int64_t len = m3_seq_len(f, seq);
    /* rank 1's kernels would find the word set: it does nothing, aborts its
     * peer's wait (bounded: the group waits 5 s at most, this takes far
     * less), and every rank fails with the fault's message */
    CHECK_OK(m3_mono_plant_fault(f->ranks[1]->mono, M3_MONO_FAULT_PLANTED, 1));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK_FAILS(m3_engine_step(f, &rq, 1, logits, NULL), M3_ERR_FAULT,
                "TP rank 1: mono fault: planted fault (layer 1");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    CHECK(s < 2.0);
    CHECK(m3_seq_len(f, seq) == len); /* nothing committed on any rank */
    CHECK(m3_seq_len(f->ranks[0], seq) == len && m3_seq_len(f->ranks[1], seq) == len);
    for (int r = 0; r < 2; r++)
        CHECK(m3_mono_get_health(f->ranks[r]->mono).state == M3_MONO_FAULTED);
    CHECK(m3_mono_get_health(f->ranks[0]->mono).fault[0] == M3_MONO_FAULT_ABORTED);
    CHECK_OK(m3_engine_step(f, &rq, 1, logits, NULL)); /* stock from here */
    CHECK(m3_engine_get_stats(f).mono_steps == 2);  /* the failed step was a mono step */
    CHECK(m3_engine_get_stats(f).stock_steps == 2); /* the prefill and the last step */
    free(logits);
    m3_engine_free(f);
}

/* ---- interleaved mono and stock steps against all-stock ---- */

/* 18 sequences: prefill them (stock), then decode steps of 1, 3 and 18 rows
 * (18 > max_rows 16: stock) in turns, greedy, on a mono engine and on a
 * stock engine: the same tokens and bit-identical logits (the CPU executor
 * computes the stock path's bits). */
static void test_interleaved(m3_model *model) {
    enum { NS = 18 };
    m3_engine_opts o = m3_engine_defaults();
    o.threads = 2;
    o.max_tokens = 16384;
    o.max_seqs = NS;
    o.max_rows = 512;
    m3_engine *e[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        o.decode = k ? M3_DECODE_MONO : M3_DECODE_STOCK;
        CHECK_OK(m3_engine_create(model, &o, &e[k]));
    }
    if (!e[0] || !e[1])
        goto out;
    int V = e[0]->cfg.vocab_size;
    float *lg[2] = {malloc((size_t)NS * V * 4), malloc((size_t)NS * V * 4)};
    int32_t prompt[400], next[2][NS];
    m3_seq seqs[NS];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < NS; i++) {
            int len = 40 + (i * 37) % 160;
            for (int j = 0; j < len; j++)
                prompt[j] = (j * 31 + i * 7) % V;
            CHECK_OK(m3_seq_create(e[k], &seqs[i]));
            m3_request rq = {seqs[i], prompt, len};
            CHECK_OK(m3_engine_step(e[k], &rq, 1, lg[k], NULL));
            next[k][i] = 0;
            for (int v = 1; v < V; v++)
                next[k][i] = lg[k][v] > lg[k][next[k][i]] ? v : next[k][i];
        }
    static const int widths[] = {1, 3, NS, 1, NS, 3, 16};
    int same = 0, steps = 0;
    for (size_t w = 0; w < sizeof widths / sizeof *widths; w++) {
        for (int k = 0; k < 2; k++) {
            m3_request rq[NS];
            for (int i = 0; i < widths[w]; i++)
                rq[i] = (m3_request){seqs[i], &next[k][i], 1};
            CHECK_OK(m3_engine_step(e[k], rq, widths[w], lg[k], NULL));
            for (int i = 0; i < widths[w]; i++) {
                const float *row = lg[k] + (size_t)i * V;
                int best = 0;
                for (int v = 1; v < V; v++)
                    best = row[v] > row[best] ? v : best;
                next[k][i] = best;
            }
        }
        steps++;
        same += !memcmp(lg[0], lg[1], (size_t)widths[w] * V * 4);
        for (int i = 0; i < widths[w]; i++)
            CHECK(next[0][i] == next[1][i]);
    }
    CHECK(same == steps);
    /* 1-, 3- and 16-row decode steps ran mono, the 18-row ones stock */
    m3_engine_stats s = m3_engine_get_stats(e[1]);
    CHECK(s.mono_steps == 5);
    CHECK(s.stock_steps == NS + 2);
    CHECK(m3_engine_get_stats(e[0]).mono_steps == 0);
    free(lg[0]);
    free(lg[1]);
out:
    m3_engine_free(e[0]);
    m3_engine_free(e[1]);
}

/* What M3_DECODE_DEFAULT stands for (m3.h): auto on the CPU; on one GPU
 * auto fusing steps of up to 4 rows (a mono_max_rows given is kept); stock on GPUs at
 * tp > 1; any other path as given. */
static void test_default_path(void) {
    struct {
        m3_device dev;
        int tp, max_rows_in;
        m3_decode_path given, want;
        int want_max_rows;
    } cases[] = {
        {M3_DEVICE_CPU, 1, 0, M3_DECODE_DEFAULT, M3_DECODE_AUTO, 0},
        {M3_DEVICE_CPU, 4, 0, M3_DECODE_DEFAULT, M3_DECODE_AUTO, 0},
        {M3_DEVICE_CUDA, 0, 0, M3_DECODE_DEFAULT, M3_DECODE_AUTO, 4},
        {M3_DEVICE_CUDA, 1, 0, M3_DECODE_DEFAULT, M3_DECODE_AUTO, 4},
        {M3_DEVICE_CUDA, 1, 2, M3_DECODE_DEFAULT, M3_DECODE_AUTO, 2},
        {M3_DEVICE_CUDA, 2, 0, M3_DECODE_DEFAULT, M3_DECODE_STOCK, 0},
        {M3_DEVICE_CUDA, 1, 0, M3_DECODE_AUTO, M3_DECODE_AUTO, 0},
        {M3_DEVICE_CUDA, 1, 0, M3_DECODE_MONO, M3_DECODE_MONO, 0},
        {M3_DEVICE_CUDA, 1, 0, M3_DECODE_STOCK, M3_DECODE_STOCK, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        m3_engine_opts o = m3_engine_defaults();
        o.device = cases[i].dev, o.tp = cases[i].tp, o.mono_max_rows = cases[i].max_rows_in;
        o.decode = cases[i].given;
        m3_engine_resolve_decode(&o);
        CHECK(o.decode == cases[i].want);
        CHECK(o.mono_max_rows == cases[i].want_max_rows);
    }
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/m3_test_mono_%d", (int)getpid());
    m3_model *model = load_tiny();
    CHECK(model != NULL);
    if (!model)
        return check_summary("test_mono_lifecycle");
    test_default_path();
    test_refusals(model);
    test_refusal_agreed(model);
    test_decide(model);
    test_binding(model);
    test_abort(model);
    test_interleaved(model);
    test_tp_fault(model);
    m3_model_free(model);
    check_remove_dir(g_dir);
    return check_summary("test_mono_lifecycle");
}
