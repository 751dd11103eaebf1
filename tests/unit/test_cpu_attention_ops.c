/*
 * Unit tests of the CPU backend's sparse-attention ops: index scores over
 * the paged index cache, block selection (top-k with forced init and local
 * blocks, ties to the lower block), and sparse attention over the selected
 * blocks, against references written from SPEC §3 (method: test_cpu_ops.c;
 * shared parts: cpu_ops_check.h).
 */
#include "cpu_ops_check.h"

/* ------------------------------------------------------------ step metadata */

/* A hand-built step: requests r with lens[r] tokens, the last qlens[r] of
 * them this step's rows, then `pad` padded rows (slot -1, position 0,
 * request 0). Blocks map to pages drawn from a shuffled pool, so requests
 * have different, non-contiguous block tables. host == dev (CPU backend). */
typedef struct tstep {
    m3_step st;
    void *mem[7];
} tstep;

static void tstep_build(tstep *s, int n_reqs, const int *lens, const int *qlens, int pad,
                        int max_blocks, int n_pages) {
    int rows = pad;
    for (int r = 0; r < n_reqs; r++)
        rows += qlens[r];
    m3_step_arrays *h = &s->st.host;
    memset(s, 0, sizeof *s);
    s->mem[0] = h->tokens = xalloc((size_t)rows * 4);
    s->mem[1] = h->positions = xalloc((size_t)rows * 8);
    s->mem[2] = h->slots = xalloc((size_t)rows * 8);
    s->mem[3] = h->row_req = xalloc((size_t)rows * 4);
    s->mem[4] = h->seq_lens = xalloc((size_t)n_reqs * 4);
    s->mem[5] = h->query_start = xalloc((size_t)(n_reqs + 1) * 4);
    s->mem[6] = h->block_table = xalloc((size_t)n_reqs * max_blocks * 4);
    int32_t *perm = xalloc((size_t)n_pages * 4);
    for (int p = 0; p < n_pages; p++)
        perm[p] = p;
    for (int p = n_pages - 1; p > 0; p--) {
        int q = rng_below(p + 1);
        int32_t tmp = perm[p];
        perm[p] = perm[q];
        perm[q] = tmp;
    }
    int t = 0, next_page = 0;
    for (int r = 0; r < n_reqs; r++) {
        int nb = (lens[r] + PAGE - 1) / PAGE;
        for (int b = 0; b < max_blocks; b++)
            h->block_table[r * max_blocks + b] = b < nb ? perm[next_page++] : -1;
        h->seq_lens[r] = lens[r];
        h->query_start[r] = t;
        for (int i = 0; i < qlens[r]; i++, t++) {
            int64_t p = lens[r] - qlens[r] + i;
            h->tokens[t] = 0;
            h->positions[t] = p;
            h->slots[t] = (int64_t)h->block_table[r * max_blocks + p / PAGE] * PAGE + p % PAGE;
            h->row_req[t] = r;
        }
        if (qlens[r] > s->st.max_query_len)
            s->st.max_query_len = qlens[r];
        if (qlens[r] > 1)
            s->st.n_prefill++;
        else
            s->st.n_decode++;
    }
    h->query_start[n_reqs] = t;
    for (; t < rows; t++) {
        h->tokens[t] = 0;
        h->positions[t] = 0;
        h->slots[t] = -1;
        h->row_req[t] = 0;
    }
    free(perm);
    s->st.rows = rows;
    s->st.n_reqs = n_reqs;
    s->st.max_blocks = max_blocks;
    s->st.n_pages = n_pages;
    s->st.graph_mode = M3_GRAPH_NONE;
    s->st.dev = s->st.host;
}

static void tstep_free(tstep *s) { free_all(s->mem, 7); }

/* Element offset of (token at position pos of request r, head) in a
 * [pages, heads, 128, dim] cache. */
static int64_t cache_at(const m3_step *st, int r, int64_t pos, int heads, int head, int dim) {
    int64_t page = st->host.block_table[r * st->max_blocks + pos / PAGE];
    return ((page * heads + head) * PAGE + pos % PAGE) * dim;
}

/* A cache that is NaN everywhere except the requests' tokens (random), so
 * that reading any slot a request does not own shows up as NaN. */
static uint16_t *make_cache(const m3_step *st, const int *lens, int heads, int dim, float amp) {
    int64_t n = st->n_pages * heads * PAGE * dim;
    uint16_t *c = poisoned16(n);
    for (int r = 0; r < st->n_reqs; r++)
        for (int64_t p = 0; p < lens[r]; p++)
            for (int h = 0; h < heads; h++) {
                uint16_t *e = c + cache_at(st, r, p, heads, h, dim);
                for (int i = 0; i < dim; i++)
                    e[i] = f2bf(rng_sym(amp));
            }
    return c;
}

/* ------------------------------------------------------------ index_scores */

/* scores [rows, heads, max_blocks] of the real rows (padded rows' outputs
 * are ignored by the caller, so they are left as the library wrote them). */
static void ref_index_scores(const m3_step *st, int heads, int dim, const uint16_t *iq,
                             const uint16_t *ic, float scale, const float *got, float *ref) {
    double *q = xalloc((size_t)dim * 8), *k = xalloc((size_t)dim * 8);
    for (int t = 0; t < st->rows; t++) {
        int64_t kv_len = st->host.positions[t] + 1, nb = (kv_len + PAGE - 1) / PAGE;
        for (int h = 0; h < heads; h++) {
            float *out = ref + ((int64_t)t * heads + h) * st->max_blocks;
            if (st->host.slots[t] < 0) {
                memcpy(out, got + (out - ref), (size_t)st->max_blocks * 4);
                continue;
            }
            for (int i = 0; i < dim; i++)
                q[i] = bf2f(iq[((int64_t)t * heads + h) * dim + i]);
            for (int b = 0; b < st->max_blocks; b++) {
                float best = -INFINITY;
                for (int64_t p = (int64_t)b * PAGE; b < nb && p < kv_len && p < (b + 1) * PAGE;
                     p++) {
                    const uint16_t *e = ic + cache_at(st, st->host.row_req[t], p, 1, 0, dim);
                    for (int i = 0; i < dim; i++)
                        k[i] = bf2f(e[i]);
                    float d = ref_dot(q, k, dim);
                    if (isnan(d) || isnan(best))
                        best = NAN; /* NaN propagates through the max */
                    else if (d > best)
                        best = d;
                }
                out[b] = best * scale; /* -inf past the visible blocks */
            }
        }
    }
    free(q);
    free(k);
}

static void run_index_scores(const char *what, const m3_step *st, int heads, int dim,
                             const uint16_t *iq, const uint16_t *ic, float scale, float **out) {
    int64_t n = (int64_t)st->rows * heads * st->max_blocks;
    for (int i = 0; i < N_BE; i++) {
        out[i] = xalloc((size_t)n * 4);
        fill32(out[i], n, F32_NAN_BITS);
        CHECK_OK(g_be[i]->ops->index_scores(g_be[i], st, heads, dim, iq, ic, scale, out[i]));
    }
    float *ref = xalloc((size_t)n * 4);
    ref_index_scores(st, heads, dim, iq, ic, scale, out[0], ref);
    EXPECT_F32(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 4);
    free(ref);
}

/* dim 2, one row at position 2: keys {1,0},{0,1},{-1,-1} (position 3, not
 * yet visible, is {10,10}); iq {1,2}: dots 1, 2, -3 -> max 2, times scale
 * 0.5 = 1; block 1 is not visible: -inf. */
static void index_tiny(void) {
    int lens[1] = {3}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, 2, 2);
    uint16_t ic[2 * PAGE * 2];
    fill16(ic, 2 * PAGE * 2, BF16_NAN);
    const float keys[4][2] = {{1, 0}, {0, 1}, {-1, -1}, {10, 10}};
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 2; i++)
            ic[cache_at(&s.st, 0, p, 1, 0, 2) + i] = f2bf(keys[p][i]);
    uint16_t iq[2] = {f2bf(1), f2bf(2)};
    float sc[2];
    fill32(sc, 2, F32_NAN_BITS);
    CHECK_OK(g_be[1]->ops->index_scores(g_be[1], &s.st, 1, 2, iq, ic, 0.5f, sc));
    CHECK(sc[0] == 1.0f);
    CHECK(sc[1] == -INFINITY);
    tstep_free(&s);
}

static void test_index_scores(void) {
    enum { HEADS = 2, DIM = 128, MAXB = 10, NREQ = 4 };
    /* partial last blocks (300, 1000, 5), an exactly full block (128) */
    int lens[NREQ] = {300, 128, 1000, 5}, ql[NREQ] = {3, 1, 2, 1};
    tstep s;
    tstep_build(&s, NREQ, lens, ql, 2, MAXB, 16); /* 13 pages used, 3 spare (NaN) */
    const m3_step *st = &s.st;
    uint16_t *ic = make_cache(st, lens, 1, DIM, 1.0f);
    uint16_t *iq = rand_bf16((int64_t)st->rows * HEADS * DIM, 1.0f);
    /* keys a request's first row must not see yet: 4x that row's head-0
     * query, so that reading one would win its max */
    for (int r = 0, t = 0; r < NREQ; t += ql[r], r++)
        for (int64_t p = lens[r] - ql[r] + 1; p < lens[r]; p++)
            for (int i = 0; i < DIM; i++)
                ic[cache_at(st, r, p, 1, 0, DIM) + i] =
                    f2bf(4.0f * bf2f(iq[(int64_t)t * HEADS * DIM + i]));
    float scale = (float)(1.0 / sqrt(DIM) * 1.4426950408889634); /* formed in double */
    float *out[N_BE];
    run_index_scores("index_scores", st, HEADS, DIM, iq, ic, scale, out);
    for (int t = 0; t < 7; t++) /* the real rows' -inf tails */
        CHECK(out[0][((int64_t)t * HEADS + 1) * MAXB + (MAXB - 1)] == -INFINITY);
    free_all((void **)out, N_BE);

    /* NaN propagates: a NaN in row 0's head-1 query makes all its visible
     * blocks NaN; a NaN key in request 2's block 4 makes that block NaN for
     * both of its rows and both heads */
    iq[(0 * HEADS + 1) * DIM + 7] = BF16_NAN;
    ic[cache_at(st, 2, 4 * PAGE + 10, 1, 0, DIM) + 3] = BF16_NAN;
    run_index_scores("index_scores NaN", st, HEADS, DIM, iq, ic, scale, out);
    for (int b = 0; b < MAXB; b++)
        CHECK(b < 3 ? isnan(out[0][1 * MAXB + b]) : out[0][1 * MAXB + b] == -INFINITY);
    for (int t = 4; t < 6; t++)
        for (int h = 0; h < HEADS; h++)
            CHECK(isnan(out[0][((int64_t)t * HEADS + h) * MAXB + 4]));
    free_all((void **)out, N_BE);
    free(ic);
    free(iq);
    tstep_free(&s);
    index_tiny();
}

/* ------------------------------------------------------------ select_blocks */

/* a outranks b: forced blocks first, then score (NaN lowest), ties to the
 * higher block id (also between two NaNs, and between forced blocks). */
static bool ref_outranks(const float *sc, int nb, const m3_select_params *p, int a, int b) {
    bool fa = a < p->init_blocks || a >= nb - p->local_blocks;
    bool fb = b < p->init_blocks || b >= nb - p->local_blocks;
    if (fa != fb)
        return fa;
    if (!fa) {
        bool na = isnan(sc[a]), nbn = isnan(sc[b]);
        if (na != nbn)
            return nbn;
        if (!na && sc[a] != sc[b])
            return sc[a] > sc[b];
    }
    return a > b;
}

/* The best min(topk, nb) visible blocks, ascending, -1 padded. */
static void ref_select_row(const float *sc, int nb, const m3_select_params *p, int32_t *out) {
    bool taken[512] = {false};
    for (int k = 0; k < p->topk && k < nb; k++) {
        int best = -1;
        for (int b = 0; b < nb; b++)
            if (!taken[b] && (best < 0 || ref_outranks(sc, nb, p, b, best)))
                best = b;
        taken[best] = true;
    }
    int n = 0;
    for (int b = 0; b < nb; b++)
        if (taken[b])
            out[n++] = b;
    while (n < p->topk)
        out[n++] = -1;
}

/* Requests lens/ql (and 2 padded rows), heads index heads, tables maxb
 * blocks wide. */
static void select_case(const char *what, const m3_select_params *p, int n_reqs, const int *lens,
                        const int *ql, int heads, int maxb) {
    tstep s;
    int pages = 0;
    for (int r = 0; r < n_reqs; r++)
        pages += (lens[r] + PAGE - 1) / PAGE;
    tstep_build(&s, n_reqs, lens, ql, 2, maxb, pages);
    const m3_step *st = &s.st;
    int64_t n = (int64_t)st->rows * heads * maxb, nsel = (int64_t)st->rows * heads * p->topk;
    float *sc = xalloc((size_t)n * 4);
    for (int t = 0; t < st->rows; t++) {
        int nb = (int)((st->host.positions[t] + PAGE) / PAGE);
        for (int64_t k = (int64_t)t * heads * maxb; k < (int64_t)(t + 1) * heads * maxb; k++) {
            int b = (int)(k % maxb);
            /* few distinct values (many ties), some NaN; past the visible
             * blocks a large score the op must ignore */
            sc[k] = b >= nb ? 1e30f : rng_below(8) == 0 ? NAN : (float)(rng_below(6) - 2);
        }
    }
    int32_t *out[N_BE], *ref = xalloc((size_t)nsel * 4);
    for (int i = 0; i < N_BE; i++) {
        out[i] = xalloc((size_t)nsel * 4);
        fill32(out[i], nsel, SEL_POISON);
        CHECK_OK(g_be[i]->ops->select_blocks(g_be[i], st, heads, sc, p, out[i]));
    }
    for (int t = 0; t < st->rows; t++)
        for (int h = 0; h < heads; h++) {
            int32_t *r = ref + ((int64_t)t * heads + h) * p->topk;
            int nb = (int)((st->host.positions[t] + PAGE) / PAGE);
            if (st->host.slots[t] < 0) /* padded rows select nothing */
                for (int k = 0; k < p->topk; k++)
                    r[k] = -1;
            else
                ref_select_row(sc + ((int64_t)t * heads + h) * maxb, nb, p, r);
        }
    bool same = memcmp(out[0], ref, (size_t)nsel * 4) == 0;
    for (int64_t k = 0; !same && k < nsel; k++)
        if (out[0][k] != ref[k]) {
            fprintf(stderr, "  %s: selected[%lld] = %d, want %d\n", what, (long long)k,
                    out[0][k], ref[k]);
            break;
        }
    CHECK(same);
    EXPECT_SAME(what, out[0], out[1], (size_t)nsel * 4);
    free(sc);
    free(ref);
    free_all((void **)out, N_BE);
    tstep_free(&s);
}

/* One row with nb visible blocks and the given scores. */
static void select_hand(int nb, const float *scores, int topk, int init, int local,
                        const int32_t *want) {
    int lens[1] = {nb * PAGE}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, nb, nb);
    m3_select_params p = {topk, init, local};
    int32_t got[8];
    fill32(got, 8, SEL_POISON);
    CHECK_OK(g_be[1]->ops->select_blocks(g_be[1], &s.st, 1, scores, &p, got));
    bool ok = memcmp(got, want, (size_t)topk * 4) == 0;
    if (!ok)
        fprintf(stderr, "  select_blocks hand case (nb %d, topk %d): got %d %d %d ...\n", nb,
                topk, got[0], got[1], got[2]);
    CHECK(ok);
    tstep_free(&s);
}

static void test_select_blocks(void) {
    m3_select_params a = {4, 1, 2}, m3 = {3, 0, 1}, wide = {8, 1, 1}, m3full = {16, 0, 1};
    /* 1 block (fewer than topk), exactly topk, ... 20 blocks */
    int lens[5] = {100, 4 * PAGE, 5 * PAGE - 3, 11 * PAGE, 20 * PAGE}, ql[5] = {1, 1, 2, 1, 3};
    select_case("select_blocks topk 4 init 1 local 2", &a, 5, lens, ql, 2, 24);
    select_case("select_blocks topk 3 init 0 local 1", &m3, 5, lens, ql, 2, 24);
    select_case("select_blocks topk 8", &wide, 5, lens, ql, 2, 24);
    /* M3's selection (top 16, local 1) over 64 rows of up to 200 blocks:
     * enough work that every thread takes some */
    int big_lens[16], big_ql[16];
    for (int r = 0; r < 16; r++) {
        big_lens[r] = 1 + rng_below(200 * PAGE);
        big_ql[r] = big_lens[r] < 4 ? big_lens[r] : 4;
    }
    select_case("select_blocks M3, 64 rows", &m3full, 16, big_lens, big_ql, 4, 200);
    /* forced 0 and 5; then 3 beats 2 on the tie at 3 */
    const float s1[6] = {5, 1, 3, 3, 0, 2};
    select_hand(6, s1, 3, 1, 1, (const int32_t[]){0, 3, 5});
    /* NaN lowest: forced 6, then 2 (block 4), 1 (block 1) */
    const float s2[7] = {NAN, 1, NAN, 0.5f, 2, -1, 7};
    select_hand(7, s2, 3, 0, 1, (const int32_t[]){1, 4, 6});
    /* all tied: the higher id */
    const float s3[5] = {1, 1, 1, 1, 1};
    select_hand(5, s3, 2, 0, 1, (const int32_t[]){3, 4});
    /* a forced block with the lowest score still counts inside the top-k */
    const float s4[5] = {-100, 5, 6, 7, 1};
    select_hand(5, s4, 3, 1, 1, (const int32_t[]){0, 3, 4});
    /* fewer visible blocks than topk: all of them, -1 padded */
    const float s5[2] = {NAN, -3};
    select_hand(2, s5, 3, 0, 1, (const int32_t[]){0, 1, -1});
}

/* ------------------------------------------------------------ attention */

typedef struct attn_in {
    const m3_step *st;
    int q_heads, kv_heads, dim;
    const uint16_t *q, *kc, *vc;
    float scale;
} attn_in;

/* One query head over the keys of blocks[0..nb) (positions < kv_len):
 * s = (float)dot * scale, e = exp(s - max) (fp32, correctly rounded), the
 * sum of e in double rounded once, p = e / sum, out = bf16((float)
 * sum_double(p v)), keys in block order. */
static void ref_attend(const attn_in *in, int t, int h, const int32_t *blocks, int nb,
                       uint16_t *out) {
    int dim = in->dim, g = h / (in->q_heads / in->kv_heads), r = in->st->host.row_req[t];
    int64_t kv_len = in->st->host.positions[t] + 1;
    double *q = xalloc((size_t)dim * 8), *k = xalloc((size_t)dim * 8);
    double *acc = xalloc((size_t)dim * 8);
    float *s = xalloc((size_t)(nb * PAGE + 1) * 4);
    int64_t *pos = xalloc((size_t)(nb * PAGE + 1) * 8), n = 0;
    for (int i = 0; i < dim; i++)
        q[i] = bf2f(in->q[((int64_t)t * in->q_heads + h) * dim + i]);
    float m = -INFINITY;
    for (int i = 0; i < nb; i++)
        for (int64_t p = (int64_t)blocks[i] * PAGE; p < kv_len && p < (blocks[i] + 1) * PAGE; p++) {
            const uint16_t *e = in->kc + cache_at(in->st, r, p, in->kv_heads, g, dim);
            for (int d = 0; d < dim; d++)
                k[d] = bf2f(e[d]);
            s[n] = ref_dot(q, k, dim) * in->scale;
            m = s[n] > m ? s[n] : m;
            pos[n++] = p;
        }
    double sum = 0;
    for (int64_t j = 0; j < n; j++) {
        s[j] = ref_exp(s[j] - m);
        sum += s[j];
    }
    float fsum = (float)sum;
    memset(acc, 0, (size_t)dim * 8);
    for (int64_t j = 0; j < n; j++) {
        float p = s[j] / fsum;
        const uint16_t *v = in->vc + cache_at(in->st, r, pos[j], in->kv_heads, g, dim);
        for (int d = 0; d < dim; d++)
            acc[d] += (double)p * (double)bf2f(v[d]);
    }
    for (int d = 0; d < dim; d++)
        out[d] = f2bf((float)acc[d]);
    free(q);
    free(k);
    free(acc);
    free(s);
    free(pos);
}

/* Runs attention on both backends and compares the real rows with the
 * reference (padded rows' outputs are ignored by the caller). */
static void attn_check(const char *what, const attn_in *in, const int32_t *sel, int topk,
                       uint16_t **out) {
    const m3_step *st = in->st;
    int64_t n = (int64_t)st->rows * in->q_heads * in->dim;
    uint16_t *ref = xalloc((size_t)n * 2);
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->attention(g_be[i], st, in->q_heads, in->kv_heads, in->dim, in->q,
                                         in->kc, in->vc, sel, topk, in->scale, out[i]));
    }
    int32_t all[64];
    for (int t = 0; t < st->rows; t++)
        for (int h = 0; h < in->q_heads; h++) {
            uint16_t *r = ref + ((int64_t)t * in->q_heads + h) * in->dim;
            if (st->host.slots[t] < 0) {
                memcpy(r, out[0] + (r - ref), (size_t)in->dim * 2);
                continue;
            }
            int nb = 0, g = h / (in->q_heads / in->kv_heads);
            const int32_t *blocks = all;
            if (sel) {
                blocks = sel + ((int64_t)t * in->kv_heads + g) * topk;
                while (nb < topk && blocks[nb] >= 0)
                    nb++;
            } else {
                for (; nb * PAGE <= st->host.positions[t]; nb++)
                    all[nb] = nb;
            }
            ref_attend(in, t, h, blocks, nb, r);
        }
    EXPECT_BF16(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    free(ref);
}

/* Per (row, KV group) a random non-empty set of at most topk visible
 * blocks (ascending, -1 padded), different for each group; or, with
 * all_visible, every visible block. Padded rows: all -1. */
static int32_t *make_selection(const m3_step *st, int kv_heads, int topk, bool all_visible) {
    int32_t *sel = xalloc((size_t)st->rows * kv_heads * topk * 4);
    for (int t = 0; t < st->rows; t++)
        for (int g = 0; g < kv_heads; g++) {
            int32_t *o = sel + ((int64_t)t * kv_heads + g) * topk;
            int nb = (int)((st->host.positions[t] + PAGE) / PAGE), n = 0;
            int want = all_visible ? nb : 1 + rng_below(nb < topk ? nb : topk);
            for (int b = 0; b < nb && st->host.slots[t] >= 0; b++) /* pick want of nb */
                if (rng_below(nb - b) < want - n || all_visible)
                    o[n++] = b;
            while (n < topk)
                o[n++] = -1;
        }
    return sel;
}

/* q {1,0}; keys {0,0}, {1,0}; values {1,0}, {0,1}; scale 1: scores 0 and 1,
 * p = {1/(1+e), e/(1+e)} = {0.268941, 0.731059} -> bf16 {0.26953125,
 * 0.73046875}. The key at position 2 is not visible yet (NaN value). */
static void attn_tiny(void) {
    int lens[1] = {3}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, 1, 1);
    s.st.host.positions[0] = 1; /* the row at position 1 of a 3-token sequence */
    uint16_t kc[PAGE * 2], vc[PAGE * 2], q[2] = {f2bf(1), 0}, out[2] = {BF16_NAN, BF16_NAN};
    fill16(kc, PAGE * 2, BF16_NAN);
    fill16(vc, PAGE * 2, BF16_NAN);
    kc[0] = kc[1] = kc[3] = 0;
    kc[2] = f2bf(1);
    vc[0] = f2bf(1), vc[1] = 0, vc[2] = 0, vc[3] = f2bf(1);
    kc[4] = f2bf(100), kc[5] = 0;
    CHECK_OK(g_be[1]->ops->attention(g_be[1], &s.st, 1, 1, 2, q, kc, vc, NULL, 0, 1.0f, out));
    EXPECT_BF16_IS(out[0], 0.26953125f);
    EXPECT_BF16_IS(out[1], 0.73046875f);
    tstep_free(&s);
}

/* The bf16 output of two keys with scores 0 and x, values a and b, as
 * ref_attend computes it from e = exp(x): sum = (float)(1 + e) in double,
 * p = {1/sum, e/sum}, (float)(p0 a + p1 b) in double, rounded to bf16. */
static uint16_t two_key_mix(float e, float a, float b) {
    float sum = (float)(1.0 + (double)e);
    return f2bf((float)((double)(1.0f / sum) * a + (double)(e / sum) * b));
}

/* The exp convention, pinned: libm's expf is one ulp off on about one
 * fp32 input in 13000, which the softmax can carry into a bf16 output.
 * Two keys with scores 0 and x (q {1,0}, keys {0,0} and {1,0}, scale x)
 * where expf(x) != (float)exp((double)x), and values searched so that the
 * two exps give different bf16 outputs: the op must give the correctly
 * rounded exp's (cpu.h m3_exp_f32; the numpy reference's exp_f32). */
static void attn_exp_convention(void) {
    float x = -0.7f;
    while (expf(x) == ref_exp(x) && x > -20.0f)
        x = nextafterf(x, -INFINITY);
    float ea = expf(x), eb = ref_exp(x);
    uint16_t va = 0, vb = 0;
    bool found = false;
    /* values b in [0.5, 8) and a near -b e, so that the mix nearly cancels
     * and its bf16 ulp is small next to the exps' difference */
    for (uint32_t b = 0x3f00; b < 0x4100 && !found; b++) {
        int near = f2bf(-bf2f((uint16_t)b) * eb);
        for (int a = near - 16; a <= near + 16 && !found; a++)
            if (two_key_mix(ea, bf2f((uint16_t)a), bf2f((uint16_t)b)) !=
                two_key_mix(eb, bf2f((uint16_t)a), bf2f((uint16_t)b)))
                va = (uint16_t)a, vb = (uint16_t)b, found = true;
    }
    if (!found) { /* libm agrees with the correctly rounded exp here */
        printf("test_cpu_attention_ops: no softmax input tells the exp conventions apart\n");
        return;
    }
    int lens[1] = {2}, ql[1] = {1};
    tstep s;
    tstep_build(&s, 1, lens, ql, 0, 1, 1);
    uint16_t kc[PAGE * 2], vc[PAGE * 2], q[2] = {f2bf(1), 0}, out[2] = {BF16_NAN, BF16_NAN};
    fill16(kc, PAGE * 2, BF16_NAN);
    fill16(vc, PAGE * 2, BF16_NAN);
    kc[0] = kc[1] = kc[3] = 0, kc[2] = f2bf(1);
    vc[0] = va, vc[2] = vb, vc[1] = vc[3] = 0;
    CHECK_OK(g_be[0]->ops->attention(g_be[0], &s.st, 1, 1, 2, q, kc, vc, NULL, 0, x, out));
    uint16_t want = two_key_mix(eb, bf2f(va), bf2f(vb));
    if (out[0] != want)
        fprintf(stderr, "  attention, scores {0, %a}, values {%g, %g}: got %g, want %g (the "
                "correctly rounded exp)\n", x, bf2f(va), bf2f(vb), bf2f(out[0]), bf2f(want));
    CHECK(out[0] == want);
    tstep_free(&s);
}

static void test_attention(void) {
    enum { QH = 8, KVH = 2, DIM = 128, NREQ = 4, TOPK = 3 };
    int lens[NREQ] = {200, 1, 700, 129}, ql[NREQ] = {3, 1, 2, 1};
    tstep s;
    tstep_build(&s, NREQ, lens, ql, 1, 8, 13); /* 11 pages used, 2 spare */
    const m3_step *st = &s.st;
    uint16_t *kc = make_cache(st, lens, KVH, DIM, 1.0f), *vc = make_cache(st, lens, KVH, DIM, 1.0f);
    uint16_t *q = rand_bf16((int64_t)st->rows * QH * DIM, 3.0f);
    attn_in in = {st, QH, KVH, DIM, q, kc, vc, (float)(1.0 / sqrt(DIM))};
    uint16_t *dense[N_BE], *sparse[N_BE];
    attn_check("attention dense", &in, NULL, 0, dense);

    /* sparse: head h reads the blocks its group h / 4 selected */
    int32_t *sel = make_selection(st, KVH, TOPK, false);
    attn_check("attention sparse", &in, sel, TOPK, sparse);
    free_all((void **)sparse, N_BE);
    free(sel);

    /* every visible block selected: bit-identical to dense */
    sel = make_selection(st, KVH, 8, true);
    attn_check("attention all blocks selected", &in, sel, 8, sparse);
    int64_t real = (int64_t)(st->rows - 1) * QH * DIM; /* the last row is padding */
    EXPECT_SAME("attention sparse(all) vs dense", sparse[0], dense[0], (size_t)real * 2);
    free_all((void **)sparse, N_BE);
    free_all((void **)dense, N_BE);
    free(sel);
    free(kc);
    free(vc);
    free(q);
    tstep_free(&s);
    attn_tiny();
    attn_exp_convention();
}

int main(void) {
    void (*const tests[])(void) = {test_index_scores, test_select_blocks, test_attention};
    return cpu_ops_main("test_cpu_attention_ops", tests, (int)(sizeof tests / sizeof *tests));
}
