/*
 * The CUDA stock path against the CPU reference, teacher-forced layer by
 * layer, over a long prompt (SPEC §8). test_cuda_model compares whole
 * free-running prefills, where one row that takes another block or expert
 * spreads to every later row through the cache, so at thousands of rows it
 * cannot say whether a layer is wrong or a choice was a near-tie. Here each
 * chunk of the prompt (then each decode step) runs every layer on both
 * engines from the same input: the CPU's output of the layer before, and
 * the CPU's cache entries for every earlier row. Per layer it reports the
 * rows' hidden and residual errors and every row whose block selection
 * differs, with how wrong the GPU's choice is under the CPU's scores.
 *
 * A row beyond --tol (relative L2, default 1e-2) must be explained by a
 * discrete choice near a tie: its selection differs from the CPU's by a
 * violation within --sel-tie (default 1e-2: the best block the GPU passed
 * over scores at most that much, relatively, above the worst competing
 * block it took, under the CPU's scores; one bf16 step of iq or ik is 3.9e-3
 * relative, and swapping one block of the `small` preset's choice for
 * another violates by 6e-2 to 0.4), or its routing's K-th and (K+1)-th keys
 * are within 1e-3. A differing selection beyond --sel-tie, a forced block
 * missed, or an unexplained row fails; so does NaN.
 *
 * Default (gpu-check, ctest): the `small` preset with M3's selection shape
 * (top-16 blocks, no init block, one local block) synthesized into a
 * temporary folder, a 2,500-token prompt in chunks of 512 rows, 2 decode
 * steps. Options: --preset NAME [--topk N], --model DIR (a checkpoint),
 * --prompt-len N, --chunk N, --steps K, --tol X, --sel-tie X. Prompt ids
 * 1 + (i x 7919) % 50000 (mod the vocabulary), as test_mono_walk's and
 * scripts/gpu-parting's. `--against cpu` runs the harness itself, a second
 * CPU engine in the GPU's place, which must match bit for bit. Without a
 * usable GPU: SKIP, exit 77.
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
#include "gpu_common.h"
#include "mono_check.h"

#define ROUTE_TIE 1e-3

typedef struct walk_args {
    const char *preset, *model;
    bool against_cpu; /* --against cpu: the harness itself, CPU against CPU (bit-identical) */
    int topk, prompt_len, chunk, steps;
    double tol, sel_tie;
} walk_args;

typedef struct walk {
    walk_args a;
    m3_model *model;
    m3_engine *cpu, *gpu;
    m3_seq sc, sg;
    int H, Nkv, D, Di, Ni, K; /* K: topk blocks */
    uint16_t *ch, *cr, *cx, *gh, *gr; /* [chunk, H]: CPU hidden/residual/norm2, GPU's */
    float *scores;                    /* [chunk, Ni, max_blocks]: the CPU's */
    int32_t *csel, *gsel;             /* [chunk, Ni, K] */
    uint16_t *ent;                    /* one cache entry */
    /* totals */
    long rows_checked, rows_over, sel_rows, sel_ties, route_ties, faults;
    double worst_h, worst_violation;
} walk;

static m3_status down(m3_engine *e, void *dst, const void *src, size_t bytes) {
    return e->be->ops->download(e->be, dst, src, bytes);
}

static m3_status up(m3_engine *e, void *dst, const void *src, size_t bytes) {
    return e->be->ops->upload(e->be, dst, src, bytes);
}

static int blocks_of(int64_t position) { return (int)(position / M3_PAGE_TOKENS) + 1; }

/* How wrong the GPU's block choice sel (ascending, -1 padded) is under the
 * CPU's scores of one (row, head): 0 where it is the CPU's choice or a
 * reordering of equal scores; else (best passed-over competing score -
 * worst chosen competing score) / |best passed over|; INFINITY where a
 * forced block is missing or a block is out of range. */
static double violation(const walk *w, const float *sc, const int32_t *sel, int nb) {
    const m3_config *c = &w->cpu->cfg;
    int init_end = c->init_blocks < nb ? c->init_blocks : nb;
    int local_begin = nb - c->local_blocks > init_end ? nb - c->local_blocks : init_end;
    unsigned char *chosen = calloc((size_t)nb, 1);
    if (!chosen)
        return NAN;
    int n = 0;
    for (int j = 0; j < w->K; j++) {
        if (sel[j] < 0)
            continue;
        if (sel[j] >= nb) {
            free(chosen);
            return INFINITY;
        }
        chosen[sel[j]] = 1, n++;
    }
    int want = nb < w->K ? nb : w->K;
    double v = n == want ? 0 : INFINITY;
    float worst_in = INFINITY, best_out = -INFINITY;
    for (int b = 0; b < nb; b++) {
        bool forced = b < init_end || b >= local_begin;
        if (forced && !chosen[b])
            v = INFINITY;
        if (forced)
            continue;
        if (chosen[b] && sc[b] < worst_in)
            worst_in = sc[b];
        if (!chosen[b] && sc[b] > best_out)
            best_out = sc[b];
    }
    free(chosen);
    if (v == 0 && best_out > worst_in)
        v = ((double)best_out - worst_in) / fmax(fabs((double)best_out), 1e-30);
    return v;
}

/* Copy the CPU's cache entries of the step's rows in layer li to the GPU,
 * so later rows on both read the same keys. */
static m3_status force_cache(walk *w, int li) {
    const m3_step *st = &w->cpu->step, *sg = &w->gpu->step;
    const m3_cache_layer *cc = &w->cpu->cache.layers[li], *cg = &w->gpu->cache.layers[li];
    int n_ent = 2 * w->Nkv + (cc->index ? 1 : 0);
    for (int t = 0; t < st->rows; t++) {
        int64_t slot = st->host.slots[t], gslot = sg->host.slots[t]; /* each engine's pages */
        if (slot < 0)
            continue;
        for (int e = 0; e < n_ent; e++) {
            size_t bytes = (size_t)(e < 2 * w->Nkv ? w->D : w->Di) * 2;
            M3_TRY(down(w->cpu, w->ent, mono_entry_ptr(cc, slot, e, w->Nkv, w->D, w->Di), bytes));
            M3_TRY(up(w->gpu, mono_entry_ptr(cg, gslot, e, w->Nkv, w->D, w->Di), w->ent, bytes));
        }
    }
    return M3_OK;
}

/* One layer of the built step on both engines from the CPU's input (the
 * CPU's hidden and residual, uploaded to the GPU first: the embedding at
 * layer 0, else the CPU's previous layer's output); the rows compared and
 * classified; then the GPU made to hold the CPU's cache entries. */
static m3_status walk_layer(walk *w, const char *what, int li) {
    const m3_step *st = &w->cpu->step;
    const m3_layer_weights *lw = &w->model->w.layers[li];
    int T = st->rows;
    size_t hb = (size_t)T * w->H * 2;
    M3_TRY(down(w->cpu, w->ch, w->cpu->s.hidden, hb));
    M3_TRY(down(w->cpu, w->cr, w->cpu->s.residual, hb));
    M3_TRY(up(w->gpu, w->gpu->s.hidden, w->ch, hb));
    M3_TRY(up(w->gpu, w->gpu->s.residual, w->cr, hb));
    M3_TRY(m3_stock_layer(w->cpu, st, li, li == 0));
    M3_TRY(m3_stock_layer(w->gpu, &w->gpu->step, li, li == 0));
    M3_TRY(w->cpu->be->ops->sync(w->cpu->be));
    M3_TRY(w->gpu->be->ops->sync(w->gpu->be));
    M3_TRY(down(w->cpu, w->ch, w->cpu->s.hidden, hb));
    M3_TRY(down(w->cpu, w->cr, w->cpu->s.residual, hb));
    M3_TRY(down(w->cpu, w->cx, w->cpu->s.x, hb));
    M3_TRY(down(w->gpu, w->gh, w->gpu->s.hidden, hb));
    M3_TRY(down(w->gpu, w->gr, w->gpu->s.residual, hb));
    int W = st->max_blocks, ns = w->Ni * w->K;
    if (lw->sparse) {
        M3_TRY(down(w->cpu, w->scores, w->cpu->s.scores, (size_t)T * w->Ni * W * 4));
        M3_TRY(down(w->cpu, w->csel, w->cpu->s.selected, (size_t)T * ns * 4));
        M3_TRY(down(w->gpu, w->gsel, w->gpu->s.selected, (size_t)T * ns * 4));
    }
    int over = 0, sel_rows = 0, sel_ties = 0, route_ties = 0, faults = 0;
    double max_h = 0, max_r = 0, max_v = 0;
    for (int t = 0; t < T; t++) {
        if (st->host.slots[t] < 0)
            continue;
        size_t o = (size_t)t * w->H;
        bool nan = false;
        double rh = mono_rel_l2(w->gh + o, w->ch + o, w->H, &nan);
        double rr = mono_rel_l2(w->gr + o, w->cr + o, w->H, &nan);
        max_h = fmax(max_h, rh), max_r = fmax(max_r, rr);
        double v = 0; /* the row's worst selection violation */
        bool sel_differs = false;
        if (lw->sparse)
            for (int h = 0; h < w->Ni; h++) {
                const int32_t *g = w->gsel + ((size_t)t * w->Ni + h) * w->K;
                if (!memcmp(g, w->csel + ((size_t)t * w->Ni + h) * w->K, (size_t)w->K * 4))
                    continue;
                sel_differs = true;
                v = fmax(v, violation(w, w->scores + ((size_t)t * w->Ni + h) * W, g,
                                      blocks_of(st->host.positions[t])));
            }
        if (sel_differs) {
            sel_rows++;
            max_v = fmax(max_v, v);
            if (!(v <= w->a.sel_tie)) {
                faults++;
                printf("  %s layer %d row %d (position %lld): selection differs, violation %.2e "
                       "beyond %.0e\n", what, li, t, (long long)st->host.positions[t], v,
                       w->a.sel_tie);
            } else {
                sel_ties++;
            }
        }
        if (!nan && rh <= w->a.tol && rr <= w->a.tol)
            continue;
        over++;
        if (nan) {
            faults++;
            printf("  %s layer %d row %d: NaN\n", what, li, t);
        } else if (sel_differs) {
            /* explained above (a tie) or already counted as a fault */
        } else if (lw->moe && mono_route_gap(w->model, li, w->cx + o) < ROUTE_TIE) {
            route_ties++;
        } else {
            faults++;
            printf("  %s layer %d row %d (position %lld): hidden relL2 %.2e, residual %.2e "
                   "with no near-tie (routing gap %.1e)\n", what, li, t,
                   (long long)st->host.positions[t], rh, rr,
                   lw->moe ? mono_route_gap(w->model, li, w->cx + o) : INFINITY);
        }
    }
    printf("%s layer %2d %-6s: %d rows, max hidden relL2 %.2e, residual %.2e; %d over %.0e "
           "(%d routing near-ties); selection differs in %d rows (%d near-ties, max violation "
           "%.1e); %d faults\n", what, li, lw->sparse ? "sparse" : "dense", T, max_h, max_r,
           over, w->a.tol, route_ties, sel_rows, sel_ties, max_v, faults);
    w->rows_checked += T, w->rows_over += over, w->sel_rows += sel_rows;
    w->sel_ties += sel_ties, w->route_ties += route_ties, w->faults += faults;
    w->worst_h = fmax(w->worst_h, max_h), w->worst_violation = fmax(w->worst_violation, max_v);
    /* teacher forcing: the GPU's entries become the CPU's (its next
     * layer's input is the CPU's output, uploaded at that layer's start) */
    return force_cache(w, li);
}

/* One step (a prompt chunk or a decode token) through every layer. */
static m3_status walk_step(walk *w, const int32_t *tokens, int n, const char *what) {
    m3_request qc = {w->sc, tokens, n}, qg = {w->sg, tokens, n};
    M3_TRY(m3_engine_build(w->cpu, &qc, 1, false));
    M3_TRY(m3_engine_build(w->gpu, &qg, 1, false));
    const m3_step *sc = &w->cpu->step, *sg = &w->gpu->step;
    /* the same rows and positions; the pages (slots) and block table
     * widths are each engine's own (a CUDA engine keeps its tables at full
     * width for graphs) */
    bool same = sc->rows == sg->rows;
    for (int t = 0; same && t < sc->rows; t++)
        same = sc->host.positions[t] == sg->host.positions[t] &&
               (sc->host.slots[t] < 0) == (sg->host.slots[t] < 0);
    if (!same)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: the two engines built steps of other rows", what);
    M3_TRY(w->cpu->be->ops->embed(w->cpu->be, sc->rows, sc->dev.tokens, &w->cpu->w.embed, 0,
                                  w->cpu->s.residual));
    for (int li = 0; li < w->cpu->cfg.num_layers; li++) {
        m3_status s = walk_layer(w, what, li);
        if (s)
            return m3_fail_context(s, "%s, layer %d", what, li);
    }
    M3_TRY(m3_engine_set_len(w->cpu, w->sc, sc->host.seq_lens[0]));
    return m3_engine_set_len(w->gpu, w->sg, sc->host.seq_lens[0]);
}

static m3_status walk_run(walk *w) {
    int V = w->cpu->cfg.vocab_size, n = w->a.prompt_len;
    int32_t *prompt = malloc((size_t)n * sizeof *prompt);
    if (!prompt)
        return m3_fail(M3_ERR_NO_MEMORY, "prompt of %d tokens", n);
    for (int i = 0; i < n; i++)
        prompt[i] = (int32_t)((1 + (int64_t)i * 7919) % 50000 % V);
    m3_status s = M3_OK;
    char what[48];
    for (int at = 0, chunk; !s && at < n; at += chunk) {
        /* no chunk of one row after the first (that would be a decode step) */
        chunk = n - at <= w->a.chunk ? n - at : n - at == w->a.chunk + 1 ? w->a.chunk - 1
                                                                           : w->a.chunk;
        snprintf(what, sizeof what, "prefill %d-%d", at, at + chunk - 1);
        s = walk_step(w, prompt + at, chunk, what);
    }
    for (int k = 0; !s && k < w->a.steps; k++) {
        int32_t tok = (int32_t)((3 + (int64_t)k * 7919) % V);
        snprintf(what, sizeof what, "decode %d", k);
        s = walk_step(w, &tok, 1, what);
    }
    free(prompt);
    return s;
}

static m3_status engine(walk *w, m3_device dev, m3_engine **out) {
    m3_engine_opts o = m3_engine_defaults();
    o.device = dev;
    o.decode = M3_DECODE_STOCK;
    o.graphs = false;
    o.max_seqs = 1;
    o.max_rows = w->a.chunk;
    o.max_tokens = w->a.prompt_len + w->a.steps + 1;
    return m3_engine_create(w->model, &o, out);
}

static m3_status walk_setup(walk *w, const char *dir) {
    M3_TRY(m3_model_load(dir, NULL, &w->model));
    M3_TRY(engine(w, w->a.against_cpu ? M3_DEVICE_CPU : M3_DEVICE_CUDA, &w->gpu));
    M3_TRY(engine(w, M3_DEVICE_CPU, &w->cpu));
    const m3_config *c = &w->cpu->cfg;
    w->H = c->hidden_size, w->Nkv = c->num_kv_heads, w->D = c->head_dim;
    w->Di = c->index_dim, w->Ni = c->index_heads, w->K = c->topk_blocks;
    size_t hb = (size_t)w->a.chunk * w->H * 2;
    uint16_t **bufs[] = {&w->ch, &w->cr, &w->cx, &w->gh, &w->gr};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        if (!(*bufs[i] = malloc(hb)))
            return m3_fail(M3_ERR_NO_MEMORY, "activations");
    w->scores = malloc((size_t)w->a.chunk * w->Ni * w->cpu->max_blocks * 4 + 4);
    w->csel = malloc((size_t)w->a.chunk * w->Ni * w->K * 4 + 4);
    w->gsel = malloc((size_t)w->a.chunk * w->Ni * w->K * 4 + 4);
    w->ent = malloc((size_t)(w->D > w->Di ? w->D : w->Di) * 2);
    if (!w->scores || !w->csel || !w->gsel || !w->ent)
        return m3_fail(M3_ERR_NO_MEMORY, "scores and selections");
    M3_TRY(m3_seq_create(w->cpu, &w->sc));
    return m3_seq_create(w->gpu, &w->sg);
}

static void walk_free(walk *w) {
    free(w->ch), free(w->cr), free(w->cx), free(w->gh), free(w->gr);
    free(w->scores), free(w->csel), free(w->gsel), free(w->ent);
    m3_engine_free(w->cpu), m3_engine_free(w->gpu);
    m3_model_free(w->model);
}

static bool parse(int argc, char **argv, walk_args *a) {
    *a = (walk_args){"small", NULL, false, 16, 2500, 512, 2, 1e-2, 1e-2};
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc)
            return false;
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--preset"))
            a->preset = v;
        else if (!strcmp(k, "--model"))
            a->model = v;
        else if (!strcmp(k, "--topk"))
            a->topk = atoi(v);
        else if (!strcmp(k, "--prompt-len"))
            a->prompt_len = atoi(v);
        else if (!strcmp(k, "--chunk"))
            a->chunk = atoi(v);
        else if (!strcmp(k, "--steps"))
            a->steps = atoi(v);
        else if (!strcmp(k, "--tol"))
            a->tol = atof(v);
        else if (!strcmp(k, "--sel-tie"))
            a->sel_tie = atof(v);
        else if (!strcmp(k, "--against") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
            a->against_cpu = !strcmp(v, "cpu");
        else
            return false;
    }
    return a->prompt_len > 1 && a->chunk > 1 && a->steps >= 0 && a->topk >= 0 && a->tol > 0 &&
           a->sel_tie >= 0;
}

int main(int argc, char **argv) {
    walk w = {0};
    if (!parse(argc, argv, &w.a)) {
        fprintf(stderr, "usage: test_cuda_walk [--preset NAME [--topk N] | --model DIR] "
                        "[--prompt-len N] [--chunk N] [--steps K] [--tol X] [--sel-tie X] "
                        "[--against cuda|cpu]\n");
        return 2;
    }
    int probe = w.a.against_cpu ? 0 : gpu_probe("test_cuda_walk");
    if (probe)
        return probe;
    char dir[512] = "";
    if (!w.a.model) { /* synthesize the preset */
        CHECK_OK(mono_synth_preset(w.a.preset, w.a.topk, 11, dir, sizeof dir));
        if (check_failures_)
            return check_summary("test_cuda_walk");
    }
    m3_status s = walk_setup(&w, w.a.model ? w.a.model : dir);
    CHECK_OK(s);
    if (!s) {
        printf("test_cuda_walk: %s, prompt %d tokens in chunks of %d, %d decode steps; top-%d "
               "blocks; tol %.0e, selection tie %.0e\n", w.a.model ? w.a.model : w.a.preset,
               w.a.prompt_len, w.a.chunk, w.a.steps, w.K, w.a.tol, w.a.sel_tie);
        s = walk_run(&w);
        CHECK_OK(s);
    }
    CHECK(w.rows_checked > 0);
    CHECK(w.faults == 0);
    if (w.a.against_cpu) /* the same sums on both sides */
        CHECK(w.worst_h == 0 && w.sel_rows == 0);
    printf("test_cuda_walk: %ld row-layers, %ld over the bound (%ld routing near-ties), "
           "selection differs in %ld (%ld near-ties), %ld faults; worst hidden relL2 %.2e, "
           "worst selection violation %.2e\n", w.rows_checked, w.rows_over, w.route_ties,
           w.sel_rows, w.sel_ties, w.faults, w.worst_h, w.worst_violation);
    walk_free(&w);
    if (dir[0])
        check_remove_dir(dir);
    return check_summary("test_cuda_walk");
}
