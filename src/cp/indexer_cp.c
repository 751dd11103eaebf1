/*
 * Indexer context parallelism, the CPU core (see indexer_cp.h, SPEC §6).
 *
 * Scores: the work is laid out as the GPU grid is, (request, chunk) programs
 * over the rank's local slots, each program scoring every (head, row) of
 * its request over its slots; a program whose first block lies past the
 * request's length writes −inf and returns at once. The per-block score is
 * m3_index_block_score, the single-rank CPU kernel, so bits match.
 *
 * Selection: a key's top 32 bits order scores as block_better in
 * cpu_kernels.c does (bigger score first, -0 equal to +0, NaN lowest) with
 * forced blocks above all; the low 32 bits, the block id, break ties to the
 * higher id. So "the topk largest keys" over the visible blocks is exactly
 * m3_select_row's set: forced blocks first (init + local <= topk is
 * required), then the best of the rest; with nblocks <= topk every visible
 * block has a key and all are kept. A block in the global top-k is in its
 * own rank's top-k (fewer than topk blocks beat it anywhere), so merging the
 * per-rank lists loses nothing.
 */
#include "cp/indexer_cp.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "cpu/cpu.h"

#define M3_CP_MAX_WORLD 64 /* ranks the merge takes (the comm has M3_MAX_TP) */

static inline int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t m3_cp_global_blocks(int64_t max_seq_len) {
    return max_seq_len > 0 ? cdiv64(max_seq_len, M3_CP_BLOCK) : 0;
}

int64_t m3_cp_local_blocks(int64_t max_seq_len, int world) {
    return world > 0 ? cdiv64(m3_cp_global_blocks(max_seq_len), world) : 0;
}

/* the rule's constants in use (m3_cp_set_chunk_rule: tuning runs only) */
static int g_target_grid = M3_CP_SCORE_TARGET_GRID, g_min_blocks = M3_CP_SCORE_MIN_BLOCKS;

m3_status m3_cp_set_chunk_rule(int target_grid, int min_blocks) {
    if (target_grid < 1 || min_blocks < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "CP chunk rule: target grid %d and min blocks %d must be >= 1",
                       target_grid, min_blocks);
    g_target_grid = target_grid;
    g_min_blocks = min_blocks;
    return M3_OK;
}

int m3_cp_score_chunks(int64_t batch, int64_t local_blocks) {
    if (local_blocks <= 0)
        return 1;
    int64_t target = g_target_grid / (batch > 1 ? batch : 1);
    if (target < 1)
        target = 1;
    int64_t pow2 = 1;
    while (pow2 * 2 <= target)
        pow2 *= 2;
    int64_t chunks = pow2 < local_blocks ? pow2 : local_blocks;
    int64_t cap = cdiv64(local_blocks, g_min_blocks);
    if (cap < 1)
        cap = 1;
    if (chunks > cap)
        chunks = cap;
    return (int)cdiv64(local_blocks, cdiv64(local_blocks, chunks));
}

int64_t m3_cp_score_chunk_size(int64_t batch, int64_t local_blocks) {
    if (local_blocks <= 0)
        return 1;
    int64_t chunks = m3_cp_score_chunks(batch, local_blocks);
    if (chunks > local_blocks)
        chunks = local_blocks;
    int64_t want = cdiv64(local_blocks, chunks), size = 1;
    while (size < want)
        size *= 2;
    return size;
}

/* ------------------------------------------------------------ checks */

m3_status m3_cp_check_context_score_inputs(const m3_cp_score_inputs *in) {
    const m3_tensor *q = &in->q, *ic = &in->icache, *bt = &in->table, *ln = &in->lens;
    if (!q->data || !ic->data || !bt->data || !ln->data)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP score inputs: missing data (queries %p, index cache %p, block table "
                       "%p, lengths %p)",
                       q->data, ic->data, bt->data, ln->data);
    if (q->dtype != M3_DT_BF16)
        return m3_fail(M3_ERR_INVALID_ARG, "index queries must be BF16, got %s",
                       m3_dtype_name(q->dtype));
    if (q->ndim != 3 || q->ne[2] != M3_CP_DIM)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "index queries must be [tokens, heads, %d], got ndim %d, last dim %" PRId64,
                       M3_CP_DIM, q->ndim, q->ndim > 0 ? q->ne[q->ndim - 1] : 0);
    if (q->nb[2] != 2)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "index queries' last dim must be contiguous, got stride %" PRId64 " bytes",
                       q->nb[2]);
    if (q->ne[1] < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "index queries need at least one head, got %" PRId64,
                       q->ne[1]);
    if (ic->ndim != 3 || ic->ne[1] != M3_CP_BLOCK || ic->ne[2] != M3_CP_DIM)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "index cache must be [pages, %d, %d], got ndim %d, dims %" PRId64
                       " x %" PRId64,
                       M3_CP_BLOCK, M3_CP_DIM, ic->ndim, ic->ndim > 1 ? ic->ne[1] : 0,
                       ic->ndim > 2 ? ic->ne[2] : 0);
    if (ic->ne[0] < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "index cache must be non-empty, got %" PRId64 " pages",
                       ic->ne[0]);
    if (ic->dtype != M3_DT_BF16)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "index cache must be BF16 for CP scoring (no per-token scale), got %s",
                       m3_dtype_name(ic->dtype));
    if (!m3_tensor_is_contiguous(ic))
        return m3_fail(M3_ERR_INVALID_ARG,
                       "index cache must be contiguous, got strides %" PRId64 ", %" PRId64
                       ", %" PRId64 " bytes",
                       ic->nb[0], ic->nb[1], ic->nb[2]);
    if (bt->dtype != M3_DT_I32)
        return m3_fail(M3_ERR_INVALID_ARG, "block table must be I32, got %s",
                       m3_dtype_name(bt->dtype));
    if (bt->ndim != 2)
        return m3_fail(M3_ERR_INVALID_ARG, "block table must be 2-D [batch, blocks], got ndim %d",
                       bt->ndim);
    if (bt->nb[1] != 4)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "block table must have unit inner stride, got %" PRId64 " bytes",
                       bt->nb[1]);
    if (bt->nb[0] < 4 * bt->ne[1])
        return m3_fail(M3_ERR_INVALID_ARG,
                       "block table rows overlap: row stride %" PRId64 " bytes for %" PRId64
                       " entries",
                       bt->nb[0], bt->ne[1]);
    if (ln->dtype != M3_DT_I32)
        return m3_fail(M3_ERR_INVALID_ARG, "lengths must be I32, got %s",
                       m3_dtype_name(ln->dtype));
    if (ln->ndim != 1)
        return m3_fail(M3_ERR_INVALID_ARG, "lengths must be 1-D [batch], got ndim %d", ln->ndim);
    if (!m3_tensor_is_contiguous(ln))
        return m3_fail(M3_ERR_INVALID_ARG,
                       "lengths must be contiguous, got stride %" PRId64 " bytes", ln->nb[0]);
    if (in->icache_device != in->q_device || in->table_device != in->q_device ||
        in->lens_device != in->q_device)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "all score inputs must be on one device: queries %d, index cache %d, block "
                       "table %d, lengths %d",
                       in->q_device, in->icache_device, in->table_device, in->lens_device);
    return M3_OK;
}

static inline int32_t table_at(const m3_tensor *bt, int64_t req, int64_t b) {
    return *(const int32_t *)((const char *)bt->data + req * bt->nb[0] + b * 4);
}

static inline int32_t len_at(const m3_tensor *ln, int64_t req) {
    return ((const int32_t *)ln->data)[req];
}

static inline float *score_at(const m3_tensor *o, int64_t h, int64_t t, int64_t l) {
    return (float *)((char *)o->data + h * o->nb[0] + t * o->nb[1] + l * o->nb[2]);
}

/* lengths in [0, max_seq_len] */
static m3_status check_lens(const int32_t *lens, int64_t batch, int64_t max_seq_len) {
    for (int64_t i = 0; i < batch; i++)
        if (lens[i] < 0 || lens[i] > max_seq_len)
            return m3_fail(M3_ERR_INVALID_ARG,
                           "request %" PRId64 ": length %d outside [0, max_seq_len %" PRId64 "]", i,
                           lens[i], max_seq_len);
    return M3_OK;
}

static m3_status check_out(const m3_tensor *o, int64_t heads, int64_t tokens, int64_t local) {
    if (o->dtype != M3_DT_F32 || o->ndim != 3 || o->ne[0] != heads || o->ne[1] < tokens ||
        o->ne[2] < local)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "scores must be F32 [heads %" PRId64 ", >= tokens %" PRId64
                       ", >= local %" PRId64 "], got %s ndim %d [%" PRId64 ", %" PRId64
                       ", %" PRId64 "]",
                       heads, tokens, local, m3_dtype_name(o->dtype), o->ndim, o->ne[0], o->ne[1],
                       o->ne[2]);
    if (!o->data || o->nb[0] % 4 || o->nb[1] % 4 || o->nb[2] % 4 ||
        (uintptr_t)o->data % 4)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "scores must be 4-byte aligned with data, got strides %" PRId64 ", %" PRId64
                       ", %" PRId64,
                       o->nb[0], o->nb[1], o->nb[2]);
    return M3_OK;
}

/* ------------------------------------------------------------ scores */

m3_status m3_cp_context_scores(const m3_cp_score_inputs *in, int64_t max_seq_len, int rank,
                               int world, int query_len, float scale, m3_tensor *out) {
    const m3_tensor *q = &in->q, *ic = &in->icache, *bt = &in->table, *ln = &in->lens;
    if (!out)
        return m3_fail(M3_ERR_INVALID_ARG, "CP scores: no output view");
    if (in->q_device != M3_CP_HOST)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "CP scores on the CPU need host inputs, got device %d", in->q_device);
    if (world < 1 || rank < 0 || rank >= world)
        return m3_fail(M3_ERR_INVALID_ARG, "CP scores: rank %d outside world %d", rank, world);
    if (query_len < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "CP scores: query_len %d < 1", query_len);
    if (max_seq_len < 1 || max_seq_len > INT32_MAX)
        return m3_fail(M3_ERR_INVALID_ARG, "CP scores: max_seq_len %" PRId64 " outside [1, 2^31)",
                       max_seq_len);
    /* the full input check is m3_cp_check_context_score_inputs, once, off
     * the hot path; the widths the loops below index by are checked here */
    if (q->ndim != 3 || q->ne[2] != M3_CP_DIM || ic->ndim != 3 || ic->ne[1] != M3_CP_BLOCK ||
        ic->ne[2] != M3_CP_DIM || ln->ndim != 1 || bt->ndim != 2)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP scores: queries [tokens, heads, %d], index cache [pages, %d, %d], "
                       "lengths 1-D and a 2-D block table are required (got query dim %" PRId64
                       ", cache [%" PRId64 ", %" PRId64 "])",
                       M3_CP_DIM, M3_CP_BLOCK, M3_CP_DIM, q->ndim == 3 ? q->ne[2] : -1,
                       ic->ndim == 3 ? ic->ne[1] : -1, ic->ndim == 3 ? ic->ne[2] : -1);
    int64_t batch = ln->ne[0], tokens = q->ne[0], heads = q->ne[1];
    int64_t blocks = m3_cp_global_blocks(max_seq_len), local = cdiv64(blocks, world);
    if (tokens != batch * query_len)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP scores: rows %" PRId64 " != batch %" PRId64 " x query_len %d", tokens,
                       batch, query_len);
    if (bt->ne[0] < batch)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP scores: block table has %" PRId64 " rows for batch %" PRId64,
                       bt->ne[0], batch);
    if (bt->ne[1] < blocks)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP scores: block table narrower than max_seq_len: %" PRId64
                       " < %" PRId64 " blocks",
                       bt->ne[1], blocks);
    M3_TRY(check_lens((const int32_t *)ln->data, batch, max_seq_len));
    int64_t pages = ic->ne[0];
    for (int64_t i = 0; i < batch; i++) {
        int64_t nb = cdiv64(len_at(ln, i), M3_CP_BLOCK);
        for (int64_t b = 0; b < nb; b++) {
            int32_t page = table_at(bt, i, b);
            if (page < 0 || page >= pages)
                return m3_fail(M3_ERR_INVALID_ARG,
                               "CP scores: request %" PRId64 " block %" PRId64
                               ": page %d outside the pool [0, %" PRId64 ")",
                               i, b, page, pages);
        }
    }
    bool allocated = false;
    if (!out->data) {
        int64_t ne[3] = {heads, tokens, local};
        size_t bytes = (size_t)(heads * tokens * local) * sizeof(float);
        float *buf = m3_malloc(bytes ? bytes : sizeof(float), "CP scores");
        if (!buf)
            return M3_ERR_NO_MEMORY;
        *out = m3_tensor_make(M3_DT_F32, 3, ne, buf);
        out->name = "cp_scores";
        allocated = true;
    }
    if (!allocated)
        M3_TRY(check_out(out, heads, tokens, local));
    if (!tokens || !local)
        return M3_OK;

    const uint16_t *icache = ic->data;
    int64_t chunk = m3_cp_score_chunk_size(batch, local), programs = cdiv64(local, chunk);
    float qf[M3_CP_DIM], kbuf[M3_CP_DIM];
    for (int64_t i = 0; i < batch; i++) {
        int64_t L = len_at(ln, i);
        for (int64_t c = 0; c < programs; c++) {
            int64_t l0 = c * chunk, l1 = l0 + chunk < local ? l0 + chunk : local;
            int64_t first = l0 * world + rank; /* global block of the first slot */
            bool past = first * M3_CP_BLOCK >= L;
            for (int64_t h = 0; h < heads; h++)
                for (int64_t j = 0; j < query_len; j++) {
                    int64_t t = i * query_len + j;
                    if (past) { /* nothing visible here: write -inf and return */
                        for (int64_t l = l0; l < l1; l++)
                            *score_at(out, h, t, l) = -INFINITY;
                        continue;
                    }
                    int64_t kv_len = L - query_len + j + 1;
                    m3_bf16_row_to_f32(
                        (const uint16_t *)((const char *)q->data + t * q->nb[0] + h * q->nb[1]),
                        qf, M3_CP_DIM);
                    for (int64_t l = l0; l < l1; l++) {
                        int64_t g = l * world + rank;
                        int64_t count = g < blocks ? m3_block_keys(kv_len, (int)g) : 0;
                        *score_at(out, h, t, l) =
                            count > 0 ? m3_index_block_score(qf, icache, table_at(bt, i, g), count,
                                                             M3_CP_DIM, scale, kbuf)
                                      : -INFINITY;
                    }
                }
        }
    }
    return M3_OK;
}

/* ------------------------------------------------------------ selection */

uint64_t m3_cp_pack_key(float score, int32_t block, bool forced) {
    uint32_t hi;
    if (forced) {
        hi = 0xffffffffu;
    } else if (isnan(score)) {
        hi = 1u; /* below every number (-inf maps to 0x007fffff) */
    } else {
        if (score == 0.0f)
            score = 0.0f; /* -0 ranks as +0: equal scores tie on the id */
        uint32_t u;
        memcpy(&u, &score, sizeof u);
        hi = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((uint64_t)hi << 32) | (uint32_t)block;
}

static m3_status check_select_params(const m3_select_params *p) {
    if (p->topk < 1 || p->init_blocks < 0 || p->local_blocks < 0 ||
        (int64_t)p->init_blocks + p->local_blocks > p->topk)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP selection: topk %d, init %d, local %d: need topk >= 1 and "
                       "0 <= init + local <= topk",
                       p->topk, p->init_blocks, p->local_blocks);
    return M3_OK;
}

m3_status m3_cp_local_topk(const m3_tensor *scores, const int32_t *lens, int batch, int query_len,
                           int64_t max_seq_len, int rank, int world, const m3_select_params *p,
                           uint64_t *keys) {
    M3_TRY(check_select_params(p));
    if (world < 1 || rank < 0 || rank >= world)
        return m3_fail(M3_ERR_INVALID_ARG, "CP selection: rank %d outside world %d", rank, world);
    if (query_len < 1 || batch < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "CP selection: batch %d, query_len %d", batch,
                       query_len);
    if (max_seq_len < 1 || max_seq_len > INT32_MAX)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CP selection: max_seq_len %" PRId64 " outside [1, 2^31)", max_seq_len);
    int64_t tokens = (int64_t)batch * query_len, blocks = m3_cp_global_blocks(max_seq_len);
    int64_t local = cdiv64(blocks, world);
    int64_t heads = scores->ndim == 3 ? scores->ne[0] : 0;
    M3_TRY(check_out(scores, heads, tokens, local));
    M3_TRY(check_lens(lens, batch, max_seq_len));
    int topk = p->topk;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < tokens; t++) {
            uint64_t *list = keys + (h * tokens + t) * topk;
            int64_t L = lens[t / query_len], j = t % query_len;
            int64_t kv_len = L - query_len + j + 1;
            int64_t nblocks = kv_len > 0 ? cdiv64(kv_len, M3_CP_BLOCK) : 0;
            /* forced blocks, as m3_select_row computes them */
            int64_t init_end = p->init_blocks < nblocks ? p->init_blocks : nblocks;
            int64_t local_begin = nblocks - p->local_blocks > 0 ? nblocks - p->local_blocks : 0;
            if (local_begin < init_end)
                local_begin = init_end;
            int kept = 0;
            for (int64_t l = 0; l < local; l++) {
                int64_t g = l * world + rank;
                if (g >= nblocks)
                    break; /* slots ascend in block id */
                bool forced = g < init_end || g >= local_begin;
                uint64_t key = m3_cp_pack_key(*score_at(scores, h, t, l), (int32_t)g, forced);
                if (kept == topk && key <= list[topk - 1])
                    continue;
                int pos = kept < topk ? kept++ : topk - 1;
                while (pos > 0 && key > list[pos - 1]) {
                    list[pos] = list[pos - 1];
                    pos--;
                }
                list[pos] = key;
            }
            for (int k = kept; k < topk; k++)
                list[k] = M3_CP_KEY_NONE;
        }
    return M3_OK;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void m3_cp_merge_topk(const uint64_t *gathered, int world, int64_t items, int topk,
                      int64_t item_begin, int64_t item_end, int32_t *out) {
    int at[M3_CP_MAX_WORLD];
    if (world > M3_CP_MAX_WORLD)
        world = M3_CP_MAX_WORLD; /* callers pass a communicator's world (<= M3_MAX_TP) */
    for (int64_t it = item_begin; it < item_end; it++) {
        int32_t *o = out + (it - item_begin) * topk;
        for (int r = 0; r < world; r++)
            at[r] = 0;
        int n = 0;
        /* k-way merge of the ranks' best-first lists */
        while (n < topk) {
            int best = -1;
            uint64_t bk = M3_CP_KEY_NONE;
            for (int r = 0; r < world; r++) {
                if (at[r] >= topk)
                    continue;
                uint64_t k = gathered[((int64_t)r * items + it) * topk + at[r]];
                if (k > bk) {
                    bk = k;
                    best = r;
                }
            }
            if (best < 0)
                break;
            at[best]++;
            o[n++] = m3_cp_key_block(bk);
        }
        qsort(o, (size_t)n, sizeof *o, cmp_i32);
        for (int k = n; k < topk; k++)
            o[k] = -1;
    }
}

m3_status m3_cp_select_blocks(m3_comm *c, const m3_tensor *scores, const int32_t *lens, int batch,
                              int query_len, int64_t max_seq_len, const m3_select_params *p,
                              int32_t *selected) {
    if (c->world > M3_CP_MAX_WORLD)
        return m3_fail(M3_ERR_UNSUPPORTED, "CP selection: world %d > %d", c->world,
                       M3_CP_MAX_WORLD);
    int64_t heads = scores->ndim == 3 ? scores->ne[0] : 0;
    int64_t items = heads * batch * (int64_t)(query_len > 0 ? query_len : 0);
    int64_t n = items * (p->topk > 0 ? p->topk : 0);
    uint64_t *keys = m3_malloc((size_t)(n ? n : 1) * sizeof *keys, "CP local keys");
    uint64_t *all = m3_malloc((size_t)(n ? n : 1) * c->world * sizeof *all, "CP gathered keys");
    m3_status st = keys && all ? M3_OK : M3_ERR_NO_MEMORY;
    if (!st)
        st = m3_cp_local_topk(scores, lens, batch, query_len, max_seq_len, c->rank, c->world, p,
                              keys);
    if (st) {
        /* peers are waiting in the gather: end it for them with this error */
        c->ops->abort(c, m3_last_error());
    } else {
        st = c->ops->all_gather(c, keys, all, n * (int64_t)sizeof *keys);
        if (!st)
            m3_cp_merge_topk(all, c->world, items, p->topk, 0, items, selected);
    }
    free(keys);
    free(all);
    return st;
}

m3_cp_score_inputs m3_cp_host_inputs(int64_t tokens, int64_t heads, int64_t dim, int64_t pages,
                                     int64_t reqs, int64_t table_width, const void *q,
                                     const void *icache, const int32_t *table,
                                     const int32_t *lens) {
    m3_cp_score_inputs in;
    const int64_t ne_q[3] = {tokens, heads, dim}, ne_c[3] = {pages, M3_CP_BLOCK, dim};
    const int64_t ne_t[2] = {reqs, table_width}, ne_l[1] = {reqs};
    in.q = m3_tensor_make(M3_DT_BF16, 3, ne_q, (void *)q);
    in.icache = m3_tensor_make(M3_DT_BF16, 3, ne_c, (void *)icache);
    in.table = m3_tensor_make(M3_DT_I32, 2, ne_t, (void *)table);
    in.lens = m3_tensor_make(M3_DT_I32, 1, ne_l, (void *)lens);
    in.q_device = in.icache_device = in.table_device = in.lens_device = M3_CP_HOST;
    return in;
}
