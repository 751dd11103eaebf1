/*
 * The mono path on real hidden states, layer by layer: a sequence is
 * prefilled with a long prompt; at each of a few decode steps the stock
 * path runs the layers in order, and each layer the mono path owns also
 * runs through it (m3_mono_run_layer) on the stock path's input to that
 * layer, its cache entries poisoned first. The two outputs are compared;
 * then the stock outputs and entries are put back, so every layer sees the
 * stock path's real input (teacher-forced), and the step is committed.
 * test_cpu_mono and test_cuda_mono feed the layers random inputs; this
 * feeds them what a model really carries, at a long context.
 *
 * The bound: on the CPU, bit-identical (same sums, same rounding points).
 * On CUDA (--device cuda) the two paths sum attention in different orders,
 * so hidden and residual within relative L2 1e-2 (--tol), or beyond it only
 * where the layer's routing is a near-tie (the K-th and (K+1)-th router
 * keys within 1e-3, tests/unit/mono_check.h). Each fused layer prints its
 * errors and how near its expert and block choices are to a tie.
 *
 * Then (unless --no-chain) the same step's whole mono chain, each fused
 * layer on the mono path's own outputs as a real step runs them, against
 * the stock chain, layer by layer: where and how fast the two part. On the
 * CPU every layer bit-identical; on CUDA printed (the parting grows with
 * depth and near-ties; NaN fails).
 *
 * Default (CI): the `tiny` preset synthesized into a temporary folder, a
 * 1,000-token prompt (8 pages, top-3 blocks), 2 decode steps, on the CPU.
 * Options: --preset NAME [--topk N] (top-N blocks, no init block, one local
 * block), --model DIR (a checkpoint instead), --prompt-len N, --steps K,
 * --device cpu|cuda, --tol X, --tokens ID,... (the decode steps' ids; by
 * default 3 + (k x 7919) % vocab). The prompt's ids are 1 + (i x 7919) %
 * 50000 (mod the vocabulary).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/bf16.h"
#include "core/status.h"
#include "decode/engine.h"
#include "mono/mono.h"
#include "mono_check.h"

#define NEAR_TIE 1e-3
#define PAGE M3_PAGE_TOKENS
#define BF16_POISON 0x7fc1u

typedef struct walk_args {
    const char *preset, *model, *device, *tokens;
    int topk, prompt_len, steps;
    double tol;
    bool chain; /* also run each step's whole mono chain against the stock chain
                   (default; --no-chain: not) */
} walk_args;

typedef struct walk {
    walk_args a;
    m3_engine *front, *e; /* e: the engine that runs (TP 1: the front) */
    m3_seq seq;
    int H, Nkv, D, Di, Ni;
    int ent_stride; /* max(D, Di): one entry's place in an entry buffer */
    bool cuda;
    uint16_t *in_h, *in_r, *st_h, *st_r, *mo_h, *mo_r, *x2, *st_ent, *mo_ent;
    float *scores;
    uint16_t *chain_h, *chain_r; /* [layers][H]: the stock chain's outputs (--chain) */
    int fused_layers, bad_layers, tie_layers, chain_parted;
    double worst_rel;
} walk;

static m3_status up(walk *w, void *dst, const void *src, size_t bytes) {
    return w->e->be->ops->upload(w->e->be, dst, src, bytes);
}

static m3_status down(walk *w, void *dst, const void *src, size_t bytes) {
    return w->e->be->ops->download(w->e->be, dst, src, bytes);
}

static int entry_len(const walk *w, int e) { return e < 2 * w->Nkv ? w->D : w->Di; }

/* get (dir 0), put (dir 1) or poison (dir 2) the slot's entries; buf
 * [2 Nkv + 1][ent_stride], an entry's tail past its length zero */
static m3_status entries(walk *w, const m3_cache_layer *cl, int64_t slot, uint16_t *buf,
                         int dir) {
    static uint16_t nan[1024];
    for (int k = 0; k < 1024; k++)
        nan[k] = BF16_POISON;
    for (int e = 0; e < 2 * w->Nkv + 1; e++) {
        size_t bytes = (size_t)entry_len(w, e) * 2;
        uint16_t *dev = mono_entry_ptr(cl, slot, e, w->Nkv, w->D, w->Di), *host = buf + (size_t)e * w->ent_stride;
        if (dir == 0)
            memset(host, 0, (size_t)w->ent_stride * 2);
        M3_TRY(dir == 0 ? down(w, host, dev, bytes) : up(w, dev, dir == 1 ? host : nan, bytes));
    }
    return M3_OK;
}

/* The nearest tie among the step's block choices (every index head). */
static double select_gap(const walk *w, const m3_step *st) {
    const m3_config *c = &w->e->cfg;
    int nb = (int)((st->host.seq_lens[0] + PAGE - 1) / PAGE);
    double gap = INFINITY;
    for (int h = 0; h < w->Ni; h++) {
        double g = mono_select_gap(w->scores + (size_t)h * st->max_blocks, nb, c->topk_blocks,
                                   c->init_blocks, c->local_blocks);
        gap = g < gap ? g : gap;
    }
    return gap;
}

/* Layer li of the built step through the mono path, as a step plans and
 * checks it (the plan must choose mono; the fault word checked after). */
static m3_status mono_layer(m3_engine *e, int li) {
    m3_mono_decision why;
    if (!m3_mono_plan(e->mono, &e->step, false, &why))
        return m3_fail(M3_ERR_INVALID_ARG, "the plan sent the step to stock: %s",
                       m3_mono_decision_name(why));
    M3_TRY(m3_mono_run_layer(e->mono, &e->step, li, e->s.hidden, e->s.residual));
    return m3_mono_after_step(e->mono, true, M3_OK);
}

/* Layer li of the built step through both paths on the same input; the
 * stock outputs stay in the engine. */
static m3_status fused_layer(walk *w, int step, int li) {
    m3_engine *e = w->e;
    const m3_step *st = &e->step;
    const m3_backend_ops *op = e->be->ops;
    const m3_cache_layer *cl = &e->cache.layers[li];
    size_t hb = (size_t)w->H * 2, nent = (size_t)(2 * w->Nkv + 1) * w->ent_stride;
    int64_t slot = st->host.slots[0];
    M3_TRY(down(w, w->in_h, e->s.hidden, hb));
    M3_TRY(down(w, w->in_r, e->s.residual, hb));
    /* stock */
    M3_TRY(m3_stock_layer(e, st, li, li == 0));
    M3_TRY(op->sync(e->be));
    M3_TRY(down(w, w->st_h, e->s.hidden, hb));
    M3_TRY(down(w, w->st_r, e->s.residual, hb));
    M3_TRY(down(w, w->x2, e->s.x, hb));
    /* (a fused layer is sparse MoE: it has block scores and a router) */
    M3_TRY(down(w, w->scores, e->s.scores, (size_t)w->Ni * st->max_blocks * 4));
    M3_TRY(entries(w, cl, slot, w->st_ent, 0));
    /* mono, on the same input, into poisoned entries */
    M3_TRY(entries(w, cl, slot, NULL, 2));
    M3_TRY(up(w, e->s.hidden, w->in_h, hb));
    M3_TRY(up(w, e->s.residual, w->in_r, hb));
    M3_TRY(mono_layer(e, li));
    M3_TRY(op->sync(e->be));
    M3_TRY(down(w, w->mo_h, e->s.hidden, hb));
    M3_TRY(down(w, w->mo_r, e->s.residual, hb));
    M3_TRY(entries(w, cl, slot, w->mo_ent, 0));
    /* compare */
    bool nan = false;
    double rh = mono_rel_l2(w->mo_h, w->st_h, w->H, &nan);
    double rr = mono_rel_l2(w->mo_r, w->st_r, w->H, &nan);
    double re = mono_rel_l2(w->mo_ent, w->st_ent, (int)nent, &nan);
    bool same = !memcmp(w->mo_h, w->st_h, hb) && !memcmp(w->mo_r, w->st_r, hb) &&
                !memcmp(w->mo_ent, w->st_ent, nent * 2);
    double rgap = mono_route_gap(w->front->model, li, w->x2), sgap = select_gap(w, st);
    const char *verdict;
    if (!w->cuda)
        verdict = same ? "bit-identical" : "DIFFERS";
    else if (!nan && rh <= w->a.tol && rr <= w->a.tol && re <= w->a.tol)
        verdict = "within bound";
    else if (!nan && rgap < NEAR_TIE)
        verdict = "near-tie (routing)";
    else
        verdict = "BEYOND BOUND";
    printf("step %d layer %2d: hidden relL2 %.2e, residual %.2e, cache %.2e%s; "
           "routing gap %.1e, selection gap %.1e (relative): %s\n",
           step, li, rh, rr, re, nan ? ", NaN" : "", rgap, sgap, verdict);
    w->fused_layers++;
    w->worst_rel = rh > w->worst_rel ? rh : w->worst_rel;
    w->tie_layers += verdict[0] == 'n';
    w->bad_layers += verdict[0] == 'D' || verdict[0] == 'B';
    /* the stock chain continues */
    M3_TRY(up(w, e->s.hidden, w->st_h, hb));
    M3_TRY(up(w, e->s.residual, w->st_r, hb));
    return entries(w, cl, slot, w->st_ent, 1);
}

/* Every layer of the built step, stock, from the embedding; with save, each
 * layer's outputs into chain_h / chain_r. */
static m3_status stock_chain(walk *w, bool save) {
    m3_engine *e = w->e;
    const m3_step *st = &e->step;
    size_t hb = (size_t)w->H * 2;
    M3_TRY(e->be->ops->embed(e->be, st->rows, st->dev.tokens, &e->w.embed, e->vocab_start,
                             e->s.residual));
    for (int li = 0; li < e->cfg.num_layers; li++) {
        M3_TRY(m3_stock_layer(e, st, li, li == 0));
        if (!save)
            continue;
        M3_TRY(e->be->ops->sync(e->be));
        M3_TRY(down(w, w->chain_h + (size_t)li * w->H, e->s.hidden, hb));
        M3_TRY(down(w, w->chain_r + (size_t)li * w->H, e->s.residual, hb));
    }
    return e->be->ops->sync(e->be);
}

/* --chain: the built step's whole mono chain (the fused layers on the mono
 * path's own outputs, as a real step runs them) against the stock chain,
 * layer by layer, so the printout shows where and how fast the two part;
 * then the stock chain again, so the step's cache entries are the stock
 * path's. On the CPU every layer must be bit-identical. */
static m3_status chain_step(walk *w, int step) {
    m3_engine *e = w->e;
    const m3_step *st = &e->step;
    size_t hb = (size_t)w->H * 2;
    M3_TRY(stock_chain(w, true));
    M3_TRY(e->be->ops->embed(e->be, st->rows, st->dev.tokens, &e->w.embed, e->vocab_start,
                             e->s.residual));
    int first = m3_mono_first_layer(e->mono), last = m3_mono_last_layer(e->mono);
    for (int li = 0; li < e->cfg.num_layers; li++) {
        bool fused = li >= first && li <= last;
        M3_TRY(fused ? mono_layer(e, li) : m3_stock_layer(e, st, li, li == 0));
        M3_TRY(e->be->ops->sync(e->be));
        M3_TRY(down(w, w->mo_h, e->s.hidden, hb));
        M3_TRY(down(w, w->mo_r, e->s.residual, hb));
        const uint16_t *sh = w->chain_h + (size_t)li * w->H, *sr = w->chain_r + (size_t)li * w->H;
        bool nan = false, same = !memcmp(w->mo_h, sh, hb) && !memcmp(w->mo_r, sr, hb);
        double rh = mono_rel_l2(w->mo_h, sh, w->H, &nan);
        double rr = mono_rel_l2(w->mo_r, sr, w->H, &nan);
        printf("chain step %d layer %2d (%s): hidden relL2 %.2e, residual %.2e%s\n", step, li,
               fused ? "mono" : "stock", rh, rr, nan ? ", NaN" : "");
        w->chain_parted += nan || (!w->cuda && !same);
    }
    return stock_chain(w, false);
}

static m3_status walk_step(walk *w, int step) {
    m3_engine *e = w->e;
    int32_t token = (int32_t)((3 + (int64_t)step * 7919) % e->cfg.vocab_size);
    if (w->a.tokens) { /* the step-th of the given ids */
        const char *p = w->a.tokens;
        for (int k = 0; k < step && p; k++)
            p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
        if (!p || atol(p) < 0 || atol(p) >= e->cfg.vocab_size)
            return m3_fail(M3_ERR_INVALID_ARG, "--tokens %s: no id in [0, %d) for step %d",
                           w->a.tokens, e->cfg.vocab_size, step);
        token = (int32_t)atol(p);
    }
    m3_request q = {w->seq, &token, 1};
    M3_TRY(m3_engine_build(w->front, &q, 1, false));
    const m3_step *st = &e->step;
    M3_TRY(e->be->ops->embed(e->be, st->rows, st->dev.tokens, &e->w.embed, e->vocab_start,
                             e->s.residual));
    M3_TRY(m3_mono_bind_cache(e->mono, &e->cache, st->n_pages, false));
    int first = m3_mono_first_layer(e->mono), last = m3_mono_last_layer(e->mono);
    for (int li = 0; li < e->cfg.num_layers; li++) {
        m3_status s = li >= first && li <= last ? fused_layer(w, step, li)
                                                : m3_stock_layer(e, st, li, li == 0);
        if (s)
            return m3_fail_context(s, "step %d, layer %d", step, li);
    }
    M3_TRY(e->be->ops->sync(e->be));
    if (w->a.chain)
        M3_TRY(chain_step(w, step));
    return m3_engine_set_len(w->front, w->seq, st->host.seq_lens[0]);
}

static m3_status prefill(walk *w) {
    int V = w->e->cfg.vocab_size, n = w->a.prompt_len;
    int32_t *prompt = malloc((size_t)n * sizeof *prompt);
    float *logits = malloc((size_t)V * sizeof *logits);
    m3_status s = prompt && logits ? M3_OK : m3_fail(M3_ERR_NO_MEMORY, "prompt of %d tokens", n);
    for (int i = 0; !s && i < n; i++)
        prompt[i] = (int32_t)((1 + (int64_t)i * 7919) % 50000 % V);
    for (int at = 0, chunk; !s && at < n; at += chunk) {
        /* chunks of up to 512 rows, none of one token (a decode step) */
        chunk = n - at <= 512 ? n - at : n - at == 513 ? 511 : 512;
        m3_request q = {w->seq, prompt + at, chunk};
        s = m3_engine_step(w->front, &q, 1, logits, NULL);
    }
    free(prompt), free(logits);
    return s;
}

static m3_status walk_setup(walk *w, const char *model_dir, m3_model **model) {
    M3_TRY(m3_model_load(model_dir, NULL, model));
    m3_engine_opts o = m3_engine_defaults();
    o.device = w->cuda ? M3_DEVICE_CUDA : M3_DEVICE_CPU;
    o.decode = M3_DECODE_MONO;
    o.graphs = false;
    o.max_seqs = 1;
    o.max_rows = 512;
    o.max_tokens = w->a.prompt_len + w->a.steps + 1;
    M3_TRY(m3_engine_create(*model, &o, &w->front));
    w->e = w->front->ranks[0] ? w->front->ranks[0] : w->front;
    const m3_config *c = &w->e->cfg;
    w->H = c->hidden_size, w->Nkv = c->num_kv_heads, w->D = c->head_dim;
    w->Di = c->index_dim, w->Ni = c->index_heads;
    w->ent_stride = w->D > w->Di ? w->D : w->Di;
    size_t hb = (size_t)w->H * 2, eb = (size_t)(2 * w->Nkv + 1) * w->ent_stride * 2;
    uint16_t **bufs[] = {&w->in_h, &w->in_r, &w->st_h, &w->st_r, &w->mo_h, &w->mo_r, &w->x2};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        if (!(*bufs[i] = malloc(hb)))
            return m3_fail(M3_ERR_NO_MEMORY, "activations");
    w->st_ent = malloc(eb), w->mo_ent = malloc(eb);
    w->scores = malloc((size_t)w->Ni * w->e->max_blocks * 4 + 4);
    if (!w->st_ent || !w->mo_ent || !w->scores)
        return m3_fail(M3_ERR_NO_MEMORY, "cache entries");
    if (w->a.chain) {
        w->chain_h = malloc(hb * c->num_layers), w->chain_r = malloc(hb * c->num_layers);
        if (!w->chain_h || !w->chain_r)
            return m3_fail(M3_ERR_NO_MEMORY, "the stock chain's outputs");
    }
    M3_TRY(m3_seq_create(w->front, &w->seq));
    return prefill(w);
}

static void walk_free(walk *w) {
    free(w->in_h), free(w->in_r), free(w->st_h), free(w->st_r), free(w->mo_h), free(w->mo_r);
    free(w->x2), free(w->st_ent), free(w->mo_ent), free(w->scores);
    free(w->chain_h), free(w->chain_r);
    m3_engine_free(w->front);
}

static bool parse(int argc, char **argv, walk_args *a) {
    *a = (walk_args){"tiny", NULL, "cpu", NULL, 0, 1000, 2, 1e-2, true};
    int i = 1;
    while (i < argc) {
        if (!strcmp(argv[i], "--no-chain")) { /* the one flag */
            a->chain = false;
            i++;
            continue;
        }
        if (i + 1 >= argc)
            return false;
        const char *k = argv[i], *v = argv[i + 1];
        i += 2;
        if (!strcmp(k, "--preset"))
            a->preset = v;
        else if (!strcmp(k, "--model"))
            a->model = v;
        else if (!strcmp(k, "--device"))
            a->device = v;
        else if (!strcmp(k, "--topk"))
            a->topk = atoi(v);
        else if (!strcmp(k, "--prompt-len"))
            a->prompt_len = atoi(v);
        else if (!strcmp(k, "--steps"))
            a->steps = atoi(v);
        else if (!strcmp(k, "--tokens"))
            a->tokens = v;
        else if (!strcmp(k, "--tol"))
            a->tol = atof(v);
        else
            return false;
    }
    return i == argc && a->prompt_len > 0 && a->steps > 0 && a->topk >= 0 &&
           (!strcmp(a->device, "cpu") || !strcmp(a->device, "cuda"));
}

int main(int argc, char **argv) {
    walk w = {0};
    if (!parse(argc, argv, &w.a)) {
        fprintf(stderr, "usage: test_mono_walk [--no-chain] [--preset NAME [--topk N] | --model DIR] "
                        "[--prompt-len N] [--steps K] [--tokens ID,...] [--device cpu|cuda] "
                        "[--tol X]\n");
        return 2;
    }
    w.cuda = !strcmp(w.a.device, "cuda");
    char dir[512] = "";
    if (!w.a.model) { /* synthesize the preset */
        CHECK_OK(mono_synth_preset(w.a.preset, w.a.topk, 7, dir, sizeof dir));
        if (check_failures_)
            return check_summary("test_mono_walk");
    }
    m3_model *model = NULL;
    m3_status s = walk_setup(&w, w.a.model ? w.a.model : dir, &model);
    if (s && w.cuda && (s == M3_ERR_UNSUPPORTED || s == M3_ERR_DEVICE) &&
        strstr(m3_last_error(), "CUDA")) {
        printf("SKIP: %s\n", m3_last_error()); /* no usable GPU */
        walk_free(&w), m3_model_free(model);
        if (dir[0])
            check_remove_dir(dir);
        return 77;
    }
    CHECK_OK(s);
    if (!s)
        printf("test_mono_walk: %s, %s, prompt %d tokens, %d steps, fused layers %d..%d\n",
               w.a.model ? w.a.model : w.a.preset, w.a.device, w.a.prompt_len, w.a.steps,
               m3_mono_first_layer(w.e->mono), m3_mono_last_layer(w.e->mono));
    for (int k = 0; !s && k < w.a.steps; k++) {
        s = walk_step(&w, k);
        CHECK_OK(s);
    }
    CHECK(w.fused_layers > 0);
    CHECK(w.bad_layers == 0);
    CHECK(w.chain_parted == 0);
    printf("test_mono_walk: %d fused layer runs, %d beyond the bound, %d near-ties; worst hidden "
           "relL2 %.2e\n", w.fused_layers, w.bad_layers, w.tie_layers, w.worst_rel);
    walk_free(&w);
    m3_model_free(model);
    if (dir[0])
        check_remove_dir(dir);
    return check_summary("test_mono_walk");
}
