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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_bytes s = {data, size};
    const int heads = 1 + (int)(fuzz_take(&s) % 3);
    const int batch = 1 + (int)(fuzz_take(&s) % kMaxReqs);
    const int qlen = 1 + (int)(fuzz_take(&s) % kMaxQ);
    const int world = 1 + (int)(fuzz_take(&s) % kMaxWorld);
    const int64_t max_seq = 1 + (int64_t)((fuzz_take(&s) << 8 | fuzz_take(&s)) % 900);
    const int pages = 1 + (int)(fuzz_take(&s) % kMaxPages);
    m3_select_params p = {1 + (int)(fuzz_take(&s) % 6), (int)(fuzz_take(&s) % 3), (int)(fuzz_take(&s) % 3)};
    const bool bad_params = p.init_blocks + p.local_blocks > p.topk; /* forced beyond top-k */
    const int64_t gblocks = m3_cp_global_blocks(max_seq);
    const int64_t table_w = gblocks;
    int32_t lens[kMaxReqs];
    for (int r = 0; r < batch; r++) {
        unsigned b = fuzz_take(&s);
        lens[r] = b >= 248 ? (b % 2 ? -1 : (int32_t)max_seq + 1)
                           : (int32_t)((b * 37 + fuzz_take(&s)) % (max_seq + 1));
    }
    int32_t *table = malloc((size_t)batch * (size_t)table_w * sizeof *table);
    const int tokens = batch * qlen;
    uint16_t *q = malloc((size_t)tokens * heads * kDim * 2);
    uint16_t *cache = malloc((size_t)pages * M3_CP_BLOCK * kDim * 2);
    if (!table || !q || !cache)
        exit(2);
    for (int64_t i = 0; i < batch * table_w; i++) {
        unsigned b = fuzz_take(&s);
        table[i] = b >= 250 ? (b % 2 ? -1 : pages) : (int32_t)(b % (unsigned)pages);
    }
    for (int64_t i = 0; i < (int64_t)tokens * heads * kDim; i++)
        q[i] = draw_bf16(&s);
    for (int64_t i = 0; i < (int64_t)pages * M3_CP_BLOCK * kDim; i++)
        cache[i] = i < 4096 ? draw_bf16(&s) : cache[i % 4093]; /* the input's bytes run out */
    const float scale = (float)(1.0 / sqrt((double)kDim) * 1.4426950408889634);

    /* the reference: every visible block of every (head, row), one rank */
    bool bad_len = false;
    for (int r = 0; r < batch; r++)
        bad_len |= lens[r] < 0 || lens[r] > max_seq;
    float *ref = malloc((size_t)heads * tokens * (size_t)gblocks * sizeof *ref);
    int32_t *ref_sel = malloc((size_t)heads * tokens * (size_t)p.topk * sizeof *ref_sel);
    int32_t *cand = malloc((size_t)gblocks * sizeof *cand);
    float qf[kDim], kbuf[kDim];
    bool bad_page = false; /* a visible block's page is outside the pool */
    for (int h = 0; h < heads && !bad_len; h++)
        for (int t = 0; t < tokens; t++) {
            const int req = t / qlen, j = t % qlen;
            const int64_t vis = (int64_t)lens[req] - qlen + j + 1;
            const int64_t nb = vis > 0 ? (vis + M3_CP_BLOCK - 1) / M3_CP_BLOCK : 0;
            float *row = ref + ((size_t)h * tokens + t) * (size_t)gblocks;
            for (int d = 0; d < kDim; d++)
                qf[d] = m3_bf16_to_f32(q[((size_t)t * heads + h) * kDim + d]);
            for (int64_t b = 0; b < gblocks; b++) {
                row[b] = -INFINITY;
                if (b >= nb)
                    continue;
                int32_t page = table[req * table_w + b];
                if (page < 0 || page >= pages) {
                    bad_page = true;
                    continue;
                }
                int64_t keys = vis - b * M3_CP_BLOCK < M3_CP_BLOCK ? vis - b * M3_CP_BLOCK
                                                                   : M3_CP_BLOCK;
                row[b] = m3_index_block_score(qf, cache, page, keys, kDim, scale, kbuf);
            }
            if (!bad_params)
                m3_select_row(row, (int)nb, &p, ref_sel + ((size_t)h * tokens + t) * p.topk,
                              cand);
        }

    /* the ranks */
    const int64_t local = m3_cp_local_blocks(max_seq, world);
    const size_t items = (size_t)heads * tokens;
    uint64_t *keys = malloc((size_t)world * items * (size_t)p.topk * sizeof *keys);
    m3_cp_score_inputs in = m3_cp_host_inputs(tokens, heads, kDim, pages, batch, table_w, q,
                                              cache, table, lens);
    if (m3_cp_check_context_score_inputs(&in) != M3_OK)
        fuzz_fail("valid layouts refused: %s", m3_last_error());
    bool any_failed = false;
    for (int r = 0; r < world; r++) {
        m3_tensor out = {0};
        m3_status st = m3_cp_context_scores(&in, max_seq, r, world, qlen, scale, &out);
        fuzz_check_refusal(st, "m3_cp_context_scores");
        const bool should_fail = bad_len || bad_page;
        if (st != M3_OK && !should_fail)
            fuzz_fail("rank %d of %d refused good inputs: %s", r, world, m3_last_error());
        if (st == M3_OK && should_fail)
            fuzz_fail("rank %d of %d accepted %s", r, world,
                      bad_len ? "a bad length" : "a visible block outside the pool");
        if (st != M3_OK) {
            any_failed = true;
            continue;
        }
        for (size_t it = 0; it < items; it++)
            for (int64_t l = 0; l < local; l++) {
                const int64_t b = l * world + r;
                const float got = ((float *)out.data)[it * (size_t)local + (size_t)l];
                const float want = b < gblocks ? ref[it * (size_t)gblocks + (size_t)b] : -INFINITY;
                if (memcmp(&got, &want, 4) != 0 && !(isnan(got) && isnan(want)))
                    fuzz_fail("rank %d: score of item %zu, block %lld is %g, single rank %g", r,
                              it, (long long)b, got, want);
            }
        st = m3_cp_local_topk(&out, lens, batch, qlen, max_seq, r, world, &p,
                              keys + (size_t)r * items * (size_t)p.topk);
        free(out.data);
        fuzz_check_refusal(st, "m3_cp_local_topk");
        if ((st != M3_OK) != bad_params)
            fuzz_fail("rank %d: local top-k with topk %d, init %d, local %d: %s", r, p.topk,
                      p.init_blocks, p.local_blocks, st ? m3_last_error() : "accepted");
        any_failed |= st != M3_OK;
    }
    if (!any_failed) {
        int32_t *sel = malloc(items * (size_t)p.topk * sizeof *sel);
        m3_cp_merge_topk(keys, world, (int64_t)items, p.topk, 0, (int64_t)items, sel);
        for (size_t i = 0; i < items * (size_t)p.topk; i++)
            if (sel[i] != ref_sel[i])
                fuzz_fail("world %d: item %zu's selection [%zu] is %d, single rank %d", world,
                          i / (size_t)p.topk, i % (size_t)p.topk, sel[i], ref_sel[i]);
        free(sel);
    }
    free(keys);
    free(ref);
    free(ref_sel);
    free(cand);
    free(table);
    free(q);
    free(cache);
    return 0;
}
