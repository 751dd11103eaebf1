/*
 * Indexer context parallelism (SPEC §6) against the single-rank selection
 * (SPEC §3), on inputs the input's bytes choose: index heads, requests and
 * their lengths (also past max_seq_len or negative), query rows per
 * request, the world and max_seq_len, pages and block tables (also entries
 * outside the pool), the top-k and forced blocks, and the query and cache
 * values (NaN and infinities among them). Every rank of the world scores
 * its blocks (m3_cp_context_scores), keeps its local top-k
 * (m3_cp_local_topk); their keys, concatenated rank-major as the
 * all-gather writes them, are merged (m3_cp_merge_topk). The reference is
 * the single-rank path: every visible block scored (m3_index_block_score,
 * the CPU stock path's) and m3_select_row. Properties: a refusal has a
 * message and happens exactly where the inputs are bad (a length outside
 * [0, max_seq_len], a visible block's page outside the pool: every rank
 * refuses, not only the one that owns the block, so no rank goes on to an
 * all-gather the others never reach; forced blocks beyond the top-k: the
 * local top-k); each rank's scores are the reference's bits for the
 * blocks it owns and -inf past what a row sees; the merged selection is
 * the reference's, bit for bit.
 */
#include <math.h>

#include "cp/indexer_cp.h"
#include "cpu/cpu.h"
#include "core/bf16.h"
#include "fuzz.h"

enum { kDim = M3_CP_DIM, kMaxReqs = 3, kMaxQ = 3, kMaxPages = 8, kMaxWorld = 5 };

/* A bf16 value: mostly small normal numbers, sometimes a special one. */
static uint16_t draw_bf16(fuzz_bytes *s) {
    unsigned b = fuzz_take(s);
    if (b >= 250) {
        static const uint16_t special[] = {0x7fc0, 0x7f80, 0xff80, 0x0000, 0x8000, 0x7f7f};
        return special[b % 6];
    }
    return m3_f32_to_bf16(((float)b - 125.0f) / 64.0f);
}

/* One drawn case: shapes, lengths, table, values, and what the reference
 * found (scores [heads, tokens, global blocks], selections, bad inputs). */
typedef struct {
    int heads, batch, qlen, world, pages, tokens;
    int64_t max_seq, gblocks, table_w;
    m3_select_params p;
    int32_t lens[kMaxReqs];
    int32_t *table;
    uint16_t *q, *cache;
    float scale;
    bool bad_params, bad_len, bad_page;
    float *ref;
    int32_t *ref_sel;
} cp_case;

static void draw(fuzz_bytes *s, cp_case *c) {
    c->heads = 1 + (int)(fuzz_take(s) % 3);
    c->batch = 1 + (int)(fuzz_take(s) % kMaxReqs);
    c->qlen = 1 + (int)(fuzz_take(s) % kMaxQ);
    c->world = 1 + (int)(fuzz_take(s) % kMaxWorld);
    c->max_seq = 1 + (int64_t)((fuzz_take(s) << 8 | fuzz_take(s)) % 900);
    c->pages = 1 + (int)(fuzz_take(s) % kMaxPages);
    c->p.topk = 1 + (int)(fuzz_take(s) % 6);
    c->p.init_blocks = (int)(fuzz_take(s) % 3);
    c->p.local_blocks = (int)(fuzz_take(s) % 3);
    c->bad_params = c->p.init_blocks + c->p.local_blocks > c->p.topk; /* forced beyond top-k */
    c->gblocks = c->table_w = m3_cp_global_blocks(c->max_seq);
    c->bad_len = false;
    for (int r = 0; r < c->batch; r++) {
        unsigned b = fuzz_take(s);
        c->lens[r] = b >= 248 ? (b % 2 ? -1 : (int32_t)c->max_seq + 1)
                              : (int32_t)((b * 37 + fuzz_take(s)) % (c->max_seq + 1));
        c->bad_len |= c->lens[r] < 0 || c->lens[r] > c->max_seq;
    }
    c->tokens = c->batch * c->qlen;
    c->table = malloc((size_t)c->batch * (size_t)c->table_w * sizeof *c->table);
    c->q = malloc((size_t)c->tokens * c->heads * kDim * 2);
    c->cache = malloc((size_t)c->pages * M3_CP_BLOCK * kDim * 2);
    c->ref = malloc((size_t)c->heads * c->tokens * (size_t)c->gblocks * sizeof *c->ref);
    c->ref_sel = malloc((size_t)c->heads * c->tokens * (size_t)c->p.topk * sizeof *c->ref_sel);
    if (!c->table || !c->q || !c->cache || !c->ref || !c->ref_sel)
        exit(2);
    for (int64_t i = 0; i < c->batch * c->table_w; i++) {
        unsigned b = fuzz_take(s);
        c->table[i] = b >= 250 ? (b % 2 ? -1 : c->pages) : (int32_t)(b % (unsigned)c->pages);
    }
    for (int64_t i = 0; i < (int64_t)c->tokens * c->heads * kDim; i++)
        c->q[i] = draw_bf16(s);
    for (int64_t i = 0; i < (int64_t)c->pages * M3_CP_BLOCK * kDim; i++)
        c->cache[i] = i < 4096 ? draw_bf16(s) : c->cache[i % 4093]; /* the bytes run out */
    c->scale = (float)(1.0 / sqrt((double)kDim) * 1.4426950408889634);
}

/* The single-rank path: every visible block of every (head, row) scored,
 * then SPEC §3's selection; notes a visible block whose page is bad. */
static void reference(cp_case *c) {
    int32_t *cand = malloc((size_t)c->gblocks * sizeof *cand);
    float qf[kDim], kbuf[kDim];
    c->bad_page = false;
    for (int h = 0; h < c->heads && !c->bad_len && cand; h++)
        for (int t = 0; t < c->tokens; t++) {
            const int req = t / c->qlen, j = t % c->qlen;
            const int64_t vis = (int64_t)c->lens[req] - c->qlen + j + 1;
            const int64_t nb = vis > 0 ? (vis + M3_CP_BLOCK - 1) / M3_CP_BLOCK : 0;
            float *row = c->ref + ((size_t)h * c->tokens + t) * (size_t)c->gblocks;
            for (int d = 0; d < kDim; d++)
                qf[d] = m3_bf16_to_f32(c->q[((size_t)t * c->heads + h) * kDim + d]);
            for (int64_t b = 0; b < c->gblocks; b++) {
                row[b] = -INFINITY;
                const int32_t page = c->table[req * c->table_w + b];
                if (b >= nb)
                    continue;
                if (page < 0 || page >= c->pages) {
                    c->bad_page = true;
                    continue;
                }
                const int64_t first = b * M3_CP_BLOCK;
                const int64_t keys = vis - first < M3_CP_BLOCK ? vis - first : M3_CP_BLOCK;
                row[b] = m3_index_block_score(qf, c->cache, page, keys, kDim, c->scale, kbuf);
            }
            if (!c->bad_params)
                m3_select_row(row, (int)nb, &c->p,
                              c->ref_sel + ((size_t)h * c->tokens + t) * c->p.topk, cand);
        }
    free(cand);
}

/* Rank r's scores and local top-k (into keys); false when it refused, as
 * it must exactly where the inputs are bad. */
static bool run_rank(const cp_case *c, const m3_cp_score_inputs *in, int r, uint64_t *keys) {
    const int64_t local = m3_cp_local_blocks(c->max_seq, c->world);
    const size_t items = (size_t)c->heads * c->tokens;
    m3_tensor out = {0};
    m3_status st = m3_cp_context_scores(in, c->max_seq, r, c->world, c->qlen, c->scale, &out);
    fuzz_check_refusal(st, "m3_cp_context_scores");
    const bool should_fail = c->bad_len || c->bad_page;
    if (st != M3_OK && !should_fail)
        fuzz_fail("rank %d of %d refused good inputs: %s", r, c->world, m3_last_error());
    if (st == M3_OK && should_fail)
        fuzz_fail("rank %d of %d accepted %s", r, c->world,
                  c->bad_len ? "a bad length" : "a visible block outside the pool");
    if (st != M3_OK)
        return false;
    for (size_t it = 0; it < items; it++)
        for (int64_t l = 0; l < local; l++) {
            const int64_t b = l * c->world + r;
            const float got = ((float *)out.data)[it * (size_t)local + (size_t)l];
            const float want =
                b < c->gblocks ? c->ref[it * (size_t)c->gblocks + (size_t)b] : -INFINITY;
            if (memcmp(&got, &want, 4) != 0 && !(isnan(got) && isnan(want)))
                fuzz_fail("rank %d: score of item %zu, block %lld is %g, single rank %g", r, it,
                          (long long)b, got, want);
        }
    st = m3_cp_local_topk(&out, c->lens, c->batch, c->qlen, c->max_seq, r, c->world, &c->p,
                          keys);
    free(out.data);
    fuzz_check_refusal(st, "m3_cp_local_topk");
    if ((st != M3_OK) != c->bad_params)
        fuzz_fail("rank %d: local top-k with topk %d, init %d, local %d: %s", r, c->p.topk,
                  c->p.init_blocks, c->p.local_blocks, st ? m3_last_error() : "accepted");
    return st == M3_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_bytes s = {data, size};
    cp_case c;
    draw(&s, &c);
    reference(&c);
    const size_t items = (size_t)c.heads * c.tokens, per_rank = items * (size_t)c.p.topk;
    uint64_t *keys = malloc((size_t)c.world * per_rank * sizeof *keys);
    int32_t *sel = malloc(per_rank * sizeof *sel);
    if (!keys || !sel)
        exit(2);
    m3_cp_score_inputs in = m3_cp_host_inputs(c.tokens, c.heads, kDim, c.pages, c.batch,
                                              c.table_w, c.q, c.cache, c.table, c.lens);
    if (m3_cp_check_context_score_inputs(&in) != M3_OK)
        fuzz_fail("valid layouts refused: %s", m3_last_error());
    bool all_ran = true;
    for (int r = 0; r < c.world; r++)
        all_ran &= run_rank(&c, &in, r, keys + (size_t)r * per_rank);
    if (all_ran) { /* the keys as the all-gather lays them out, merged */
        m3_cp_merge_topk(keys, c.world, (int64_t)items, c.p.topk, 0, (int64_t)items, sel);
        for (size_t i = 0; i < per_rank; i++)
            if (sel[i] != c.ref_sel[i])
                fuzz_fail("world %d: item %zu's selection [%zu] is %d, single rank %d", c.world,
                          i / (size_t)c.p.topk, i % (size_t)c.p.topk, sel[i], c.ref_sel[i]);
    }
    free(keys);
    free(sel);
    free(c.ref);
    free(c.ref_sel);
    free(c.table);
    free(c.q);
    free(c.cache);
    return 0;
}
