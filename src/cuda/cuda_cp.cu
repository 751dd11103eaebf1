/*
 * Indexer context parallelism on the GPU (cuda_cp.h has the contract): the
 * owned-block score kernel, the local top-k kernel and the merge kernel,
 * each the GPU form of its CPU counterpart in cp/indexer_cp.c, plus the
 * `m3 bench indexer` instrument.
 *
 * Scores: one CTA per (request, chunk of local slots), the chunk rule of
 * m3_cp_score_chunk_size; per owned block the page's 128 key rows are
 * copied to shared memory (two stages, cp.async) and every (row, head)
 * takes its dots in the CPU's order (idx_dots) and the first-max over the
 * row's visible positions, times scale: m3_index_block_score's bits.
 * Top-k: one CTA per (head, row), a radix select of the topk-th largest
 * packed key, the survivors compacted and ranked. Merge: one CTA per item,
 * every gathered key ranked against the others.
 */
#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <vector>

#include "cuda/cuda_async.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"

extern "C" {
#include "cp/indexer_cp.h"
#include "cuda/cuda_bench.h"
#include "cuda/cuda_cp.h"
}

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kPage = M3_CP_BLOCK, kDim = M3_CP_DIM;
constexpr int kScoreThreads = kPage; /* one thread per key position */
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kRowBytes = kDim * 2 + 16; /* padded: a quarter warp's row reads hit distinct banks */
constexpr int kStageBytes = kPage * kRowBytes;
constexpr int kMaxQH = M3_CUDA_CP_MAX_QH; /* query_len x heads per score program */
constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kMaxTopk = 1024;
constexpr int kMergeThreads = 256;
constexpr int kMaxMergeKeys = 4096;

struct ScoreArgs {
    m3_cuda_cp_inputs in;
    int64_t max_seq_len, blocks, local, chunk;
    int rank, world;
    float scale;
    float *out; /* [heads, tokens, local] */
    int *err;
};

__device__ void set_err(int *err, int code, int req, int64_t block, int64_t value) {
    if (atomicCAS(err, 0, code) == 0) {
        err[1] = req;
        err[2] = (int)block;
        err[3] = value > INT32_MAX ? INT32_MAX : (value < INT32_MIN ? INT32_MIN : (int)value);
    }
}

/* request i's length, clamped to 0 (and recorded) when outside [0, max] */
__device__ int64_t req_len(const int32_t *lens, int i, int64_t max_seq_len, int *err) {
    int64_t L = lens[i];
    if (L < 0 || L > max_seq_len) {
        if (threadIdx.x == 0)
            set_err(err, M3_CUDA_CP_ERR_LEN, i, -1, L);
        return 0;
    }
    return L;
}

/* Copy the first `count` key rows of `page` into a stage (nothing when the
 * page is outside the pool). */
__device__ void load_page(const ScoreArgs &a, int64_t page, int count, unsigned char *dst) {
    const unsigned char *src =
        reinterpret_cast<const unsigned char *>(a.in.icache + page * kPage * kDim);
    cp_async_rows_ef(dst, kRowBytes, src, kDim * 2, count, kDim / 8, kScoreThreads);
}

/* Scores of one owned block (global g, slot l) for every (row j, head h) of
 * request i from the stage (count rows landed; -1: bad page). */
template <int HB>
__device__ void score_pass(const ScoreArgs &a, const unsigned char *stage, const double *qd,
                           int i, int j, int h0, int count, int64_t l,
                           float (*s_red)[kScoreWarps]) {
    const int64_t tokens = (int64_t)a.in.batch * a.in.query_len, t = (int64_t)i * a.in.query_len + j;
    float d[HB];
    if ((int)threadIdx.x < count) {
        idx_dots<HB>(stage + threadIdx.x * kRowBytes, qd + ((int64_t)j * a.in.heads + h0) * kDim,
                     kDim, d);
    } else {
#pragma unroll
        for (int h = 0; h < HB; h++)
            d[h] = -INFINITY;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < HB; h++) {
        float v = warp_first_max(d[h]);
        if (lane == 0)
            s_red[h][warp] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < HB) {
        const int h = threadIdx.x;
        float v = s_red[h][0];
        for (int w = 1; w < kScoreWarps; w++)
            v = first_max(v, s_red[h][w]);
        a.out[((int64_t)(h0 + h) * tokens + t) * a.local + l] = v * a.scale;
    }
    __syncthreads(); /* s_red is reused */
}

__device__ void score_block(const ScoreArgs &a, const unsigned char *stage, const double *qd,
                            int i, int64_t L, int64_t g, int64_t l, int count_all,
                            float (*s_red)[kScoreWarps]) {
    const int QL = a.in.query_len, H = a.in.heads;
    const int64_t tokens = (int64_t)a.in.batch * QL;
    for (int j = 0; j < QL; j++) {
        const int64_t t = (int64_t)i * QL + j, kv_len = L - QL + j + 1;
        const int64_t c = kv_len - g * kPage;
        const int count = c <= 0 ? 0 : (int)(c < kPage ? c : (int64_t)kPage);
        if (count == 0 || count_all < 0) { /* nothing visible, or a bad page: -inf / NaN */
            for (int h = threadIdx.x; h < H; h += kScoreThreads)
                a.out[((int64_t)h * tokens + t) * a.local + l] = count == 0 ? -INFINITY : m3_qnan();
            continue;
        }
        for (int h0 = 0; h0 < H; h0 += 4) {
            const int hb = min(4, H - h0);
            if (hb == 4)
                score_pass<4>(a, stage, qd, i, j, h0, count, l, s_red);
            else if (hb == 3)
                score_pass<3>(a, stage, qd, i, j, h0, count, l, s_red);
            else if (hb == 2)
                score_pass<2>(a, stage, qd, i, j, h0, count, l, s_red);
            else
                score_pass<1>(a, stage, qd, i, j, h0, count, l, s_red);
        }
    }
}

/* Grid: batch x programs; program c of request i scores local slots
 * [c * chunk, min(local, (c + 1) * chunk)). */
__global__ void __launch_bounds__(kScoreThreads) cp_scores_kernel(ScoreArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float s_red[4][kScoreWarps];
    __shared__ int s_count[2];
    const int programs = (int)((a.local + a.chunk - 1) / a.chunk);
    const int i = blockIdx.x / programs, c = blockIdx.x % programs;
    const int QL = a.in.query_len, H = a.in.heads;
    const int64_t tokens = (int64_t)a.in.batch * QL;
    const int64_t l0 = (int64_t)c * a.chunk, l1 = min(a.local, l0 + a.chunk);
    const int64_t L = req_len(a.in.lens, i, a.max_seq_len, a.err);
    /* slots [l0, lv) hold a block the request's last row sees */
    const int64_t nb = min((L + kPage - 1) / kPage, a.blocks);
    const int64_t vis = nb > a.rank ? (nb - 1 - a.rank) / a.world + 1 : 0;
    const int64_t lv = max(l0, min(l1, vis));
    for (int64_t k = threadIdx.x; k < (l1 - lv) * H * QL; k += kScoreThreads) {
        int64_t l = lv + k % (l1 - lv), r = k / (l1 - lv), h = r / QL, j = r % QL;
        a.out[(h * tokens + (int64_t)i * QL + j) * a.local + l] = -INFINITY;
    }
    if (lv == l0)
        return; /* past the request's length: done at once */
    double *qd = reinterpret_cast<double *>(smem); /* [QL][H][128] */
    unsigned char *stages = smem + (size_t)QL * H * kDim * sizeof(double);
    for (int e = threadIdx.x; e < QL * H * kDim; e += kScoreThreads) {
        const int j = e / (H * kDim), rest = e % (H * kDim);
        qd[e] = (double)m3_bf(a.in.q[((int64_t)i * QL + j) * a.in.q_row + rest]);
    }
    const int32_t *table = a.in.table + (int64_t)i * a.in.table_row;
    auto issue = [&](int64_t l, int s) {
        const int64_t g = l * a.world + a.rank;
        const int count = (int)(L - g * kPage < kPage ? L - g * kPage : (int64_t)kPage); /* the last row's reach */
        const int64_t page = table[g];
        const bool ok = page >= 0 && page < a.in.pages;
        if (threadIdx.x == 0) {
            s_count[s] = ok ? count : -1;
            if (!ok)
                set_err(a.err, M3_CUDA_CP_ERR_PAGE, i, g, page);
        }
        if (ok)
            load_page(a, page, count, stages + s * kStageBytes);
    };
    issue(l0, 0);
    cp_async_commit();
    for (int64_t l = l0; l < lv; l++) {
        const int s = (int)((l - l0) & 1);
        if (l + 1 < lv)
            issue(l + 1, s ^ 1);
        cp_async_commit();
        cp_async_wait<1>(); /* slot l has landed (l + 1 may be in flight) */
        __syncthreads();
        score_block(a, stages + s * kStageBytes, qd, i, L, l * a.world + a.rank, l, s_count[s],
                    s_red);
        __syncthreads(); /* the stage is refilled next iteration */
    }
}

/* ---------------------------------------------------------------- local top-k */

/* m3_cp_pack_key */
__device__ __forceinline__ uint64_t pack_key(float s, int32_t b, bool forced) {
    uint32_t hi;
    if (forced)
        hi = 0xffffffffu;
    else if (isnan(s))
        hi = 1u;
    else {
        uint32_t u = __float_as_uint(s == 0.0f ? 0.0f : s);
        hi = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((uint64_t)hi << 32) | (uint32_t)b;
}

struct TopkArgs {
    const float *scores;
    const int32_t *lens;
    int batch, query_len, heads, rank, world, topk, init, local_blocks;
    int64_t max_seq_len, local;
    uint64_t *keys;
    int *err;
};

struct TopkShared {
    unsigned hist[256];
    unsigned long long prefix;
    unsigned k;
    int done;
    int wcount[kTopkWarps];
    uint64_t list[kMaxTopk];
};

__device__ __forceinline__ uint64_t slot_key(const TopkArgs &a, const float *sc, int64_t l,
                                             int64_t init_end, int64_t local_begin) {
    const int64_t g = l * a.world + a.rank;
    return pack_key(sc[l], (int32_t)g, g < init_end || g >= local_begin);
}

/* Grid: heads x tokens, item = h * tokens + t. */
__global__ void __launch_bounds__(kTopkThreads) cp_topk_kernel(TopkArgs a) {
    __shared__ TopkShared sh;
    const int64_t tokens = (int64_t)a.batch * a.query_len, item = blockIdx.x;
    const int64_t t = item % tokens;
    const float *sc = a.scores + item * a.local;
    uint64_t *out = a.keys + item * a.topk;
    const int64_t L = req_len(a.lens, (int)(t / a.query_len), a.max_seq_len, a.err);
    const int64_t kv_len = L - a.query_len + t % a.query_len + 1;
    const int64_t nblocks = kv_len > 0 ? (kv_len + kPage - 1) / kPage : 0;
    const int64_t init_end = (a.init < nblocks ? (int64_t)a.init : nblocks);
    const int64_t local_begin = max(max(nblocks - (int64_t)a.local_blocks, (int64_t)0), init_end);
    const int64_t n = min(a.local, nblocks > a.rank ? (nblocks - 1 - a.rank) / a.world + 1 : 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    /* the threshold: the k-th largest key (radix select, 8-bit digits) */
    uint64_t thr = 0;
    if (n > a.topk) {
        if (threadIdx.x == 0) {
            sh.prefix = 0;
            sh.k = (unsigned)a.topk;
            sh.done = 0;
        }
        uint64_t prefix = 0, mask = 0;
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int x = threadIdx.x; x < 256; x += kTopkThreads)
                sh.hist[x] = 0;
            __syncthreads();
            for (int64_t base = 0; base < n; base += kTopkThreads) {
                const int64_t l = base + threadIdx.x;
                bool act = false;
                unsigned digit = 0;
                if (l < n) {
                    uint64_t key = slot_key(a, sc, l, init_end, local_begin);
                    act = (key & mask) == prefix;
                    digit = (unsigned)(key >> shift) & 255u;
                }
                unsigned am = __ballot_sync(kFull, act);
                if (act) {
                    unsigned peers = __match_any_sync(am, digit);
                    if (lane == __ffs(peers) - 1)
                        atomicAdd(&sh.hist[digit], (unsigned)__popc(peers));
                }
            }
            __syncthreads();
            if (warp == 0) { /* the digit holding the k-th largest key */
                unsigned k = sh.k, c[8], tot = 0;
#pragma unroll
                for (int x = 0; x < 8; x++) {
                    c[x] = sh.hist[lane * 8 + x];
                    tot += c[x];
                }
                unsigned suf = tot;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    unsigned y = __shfl_down_sync(kFull, suf, o);
                    if (lane + o < 32)
                        suf += y;
                }
                unsigned above = suf - tot;
                if (above < k && k <= suf)
                    for (int x = 7; x >= 0; x--) {
                        if (k <= above + c[x]) {
                            sh.prefix |= (unsigned long long)(lane * 8 + x) << shift;
                            sh.k = k - above;
                            sh.done = c[x] == k - above;
                            break;
                        }
                        above += c[x];
                    }
            }
            __syncthreads();
            prefix = sh.prefix;
            mask |= 0xffull << shift;
            if (sh.done)
                break;
        }
        thr = prefix;
    }
    /* compact the keys >= thr (min(n, topk) of them: keys are distinct) */
    int run = 0;
    const int want = (int)(n < a.topk ? n : (int64_t)a.topk);
    for (int64_t base = 0; base < n && run < want; base += kTopkThreads) {
        const int64_t l = base + threadIdx.x;
        uint64_t key = l < n ? slot_key(a, sc, l, init_end, local_begin) : 0;
        bool f = l < n && key >= thr;
        unsigned bal = __ballot_sync(kFull, f);
        if (lane == 0)
            sh.wcount[warp] = __popc(bal);
        __syncthreads();
        int off = run, total = 0;
        for (int w = 0; w < kTopkWarps; w++) {
            off += w < warp ? sh.wcount[w] : 0;
            total += sh.wcount[w];
        }
        if (f) {
            int pos = off + __popc(bal & ((1u << lane) - 1u));
            if (pos < want)
                sh.list[pos] = key;
        }
        run += total;
        __syncthreads();
    }
    /* best first: each key's place is the count of larger keys */
    for (int x = threadIdx.x; x < a.topk; x += kTopkThreads) {
        if (x >= want) {
            out[x] = 0;
            continue;
        }
        const uint64_t key = sh.list[x];
        int place = 0;
        for (int y = 0; y < want; y++)
            place += sh.list[y] > key;
        out[place] = key;
    }
}

/* ---------------------------------------------------------------- merge */

/* Grid: items. Key x of the world * topk gathered ones is taken when fewer
 * than topk keys beat it (equal keys, which only emulated gathers hold,
 * rank by position); the taken ids are then placed in ascending order. */
__global__ void __launch_bounds__(kMergeThreads) cp_merge_kernel(const uint64_t *gathered,
                                                                 int world, int64_t items, int topk,
                                                                 int32_t *out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint64_t *keys = reinterpret_cast<uint64_t *>(smem);
    const int n = world * topk;
    int32_t *ids = reinterpret_cast<int32_t *>(keys + n); /* [topk], -1: empty */
    __shared__ int s_taken;
    const int64_t item = blockIdx.x;
    for (int x = threadIdx.x; x < n; x += kMergeThreads) {
        const int r = x / topk, k = x % topk;
        keys[x] = gathered[((int64_t)r * items + item) * topk + k];
    }
    for (int x = threadIdx.x; x < topk; x += kMergeThreads)
        ids[x] = -1;
    if (threadIdx.x == 0)
        s_taken = 0;
    __syncthreads();
    for (int x = threadIdx.x; x < n; x += kMergeThreads) {
        const uint64_t key = keys[x];
        if (key == 0) /* no block */
            continue;
        int place = 0;
        for (int y = 0; y < n; y++)
            place += keys[y] > key || (keys[y] == key && y < x);
        if (place < topk) {
            ids[place] = (int32_t)(uint32_t)key;
            atomicAdd(&s_taken, 1);
        }
    }
    __syncthreads();
    const int taken = s_taken;
    int32_t *o = out + item * topk;
    for (int x = threadIdx.x; x < topk; x += kMergeThreads) {
        if (x >= taken) {
            o[x] = -1;
            continue;
        }
        const int32_t id = ids[x];
        int place = 0;
        for (int y = 0; y < taken; y++)
            place += ids[y] < id || (ids[y] == id && y < x);
        o[place] = id;
    }
}

size_t score_smem(const m3_cuda_cp_inputs *in) {
    return (size_t)in->query_len * in->heads * kDim * sizeof(double) + 2 * (size_t)kStageBytes;
}

} // namespace

/* ================================================================ host side */

extern "C" m3_status m3_cuda_cp_check(const m3_cuda_cp_inputs *in, int64_t max_seq_len, int rank,
                                      int world, const m3_select_params *p) {
    if (!in || !in->q || !in->icache || !in->table || !in->lens)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: a null input pointer");
    if (world < 1 || world > 64 || rank < 0 || rank >= world)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: rank %d outside world %d (1..64)", rank,
                       world);
    if (in->batch < 1 || in->query_len < 1 || in->heads < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: batch %d, query_len %d, heads %d must be >= 1",
                       in->batch, in->query_len, in->heads);
    if ((int64_t)in->query_len * in->heads > kMaxQH)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "CUDA CP: query_len %d x heads %d > %d (the score program keeps them in "
                       "shared memory)",
                       in->query_len, in->heads, kMaxQH);
    if (in->q_row < (int64_t)in->heads * kDim)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: q row stride %lld < heads %d x 128",
                       (long long)in->q_row, in->heads);
    if (max_seq_len < 1 || max_seq_len > INT32_MAX)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: max_seq_len %lld outside [1, 2^31)",
                       (long long)max_seq_len);
    if (in->pages < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: index cache has %lld pages",
                       (long long)in->pages);
    const int64_t blocks = m3_cp_global_blocks(max_seq_len);
    if (in->table_row < blocks)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CUDA CP: block table narrower than max_seq_len: %lld < %lld blocks",
                       (long long)in->table_row, (long long)blocks);
    if (p && (p->topk < 1 || p->topk > kMaxTopk || p->init_blocks < 0 || p->local_blocks < 0 ||
              (int64_t)p->init_blocks + p->local_blocks > p->topk))
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CUDA CP: topk %d (1..%d), init %d, local %d: need 0 <= init + local <= "
                       "topk",
                       p->topk, kMaxTopk, p->init_blocks, p->local_blocks);
    if (p && (int64_t)world * p->topk > kMaxMergeKeys)
        return m3_fail(M3_ERR_UNSUPPORTED, "CUDA CP: world %d x topk %d > %d gathered keys", world,
                       p->topk, kMaxMergeKeys);
    return M3_OK;
}

extern "C" m3_status m3_cuda_cp_scores(m3_backend *be, const m3_cuda_cp_inputs *in,
                                       int64_t max_seq_len, int rank, int world, float scale,
                                       float *out, int *err) {
    M3_TRY(m3_cuda_cp_check(in, max_seq_len, rank, world, NULL));
    if (!out || !err)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP scores: no output or error word");
    m3_cuda *cu = m3_cuda_of(be);
    ScoreArgs a;
    a.in = *in;
    a.max_seq_len = max_seq_len;
    a.blocks = m3_cp_global_blocks(max_seq_len);
    a.local = m3_cp_local_blocks(max_seq_len, world);
    a.chunk = m3_cp_score_chunk_size(in->batch, a.local);
    a.rank = rank;
    a.world = world;
    a.scale = scale;
    a.out = out;
    a.err = err;
    const int64_t programs = (a.local + a.chunk - 1) / a.chunk;
    const size_t smem = score_smem(in);
    M3_CUDA_TRY(cudaFuncSetAttribute(cp_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    cp_scores_kernel<<<(unsigned)(in->batch * programs), kScoreThreads, smem, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("cp_scores_kernel");
    return M3_OK;
}

extern "C" m3_status m3_cuda_cp_local_topk(m3_backend *be, const m3_cuda_cp_inputs *in,
                                           int64_t max_seq_len, int rank, int world,
                                           const m3_select_params *p, const float *scores,
                                           uint64_t *keys, int *err) {
    if (!p)
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP top-k: no select params");
    M3_TRY(m3_cuda_cp_check(in, max_seq_len, rank, world, p));
    m3_cuda *cu = m3_cuda_of(be);
    TopkArgs a;
    a.scores = scores;
    a.lens = in->lens;
    a.batch = in->batch;
    a.query_len = in->query_len;
    a.heads = in->heads;
    a.rank = rank;
    a.world = world;
    a.topk = p->topk;
    a.init = p->init_blocks;
    a.local_blocks = p->local_blocks;
    a.max_seq_len = max_seq_len;
    a.local = m3_cp_local_blocks(max_seq_len, world);
    a.keys = keys;
    a.err = err;
    const int64_t items = (int64_t)in->heads * in->batch * in->query_len;
    cp_topk_kernel<<<(unsigned)items, kTopkThreads, 0, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("cp_topk_kernel");
    return M3_OK;
}

extern "C" m3_status m3_cuda_cp_merge(m3_backend *be, const uint64_t *gathered, int world,
                                      int64_t items, int topk, int32_t *out) {
    if (world < 1 || topk < 1 || (int64_t)world * topk > kMaxMergeKeys || items < 0)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CUDA CP merge: world %d x topk %d outside 1..%d keys (items %lld)", world,
                       topk, kMaxMergeKeys, (long long)items);
    if (items == 0)
        return M3_OK;
    m3_cuda *cu = m3_cuda_of(be);
    const size_t smem = (size_t)world * topk * 8 + (size_t)topk * 4;
    M3_CUDA_TRY(cudaFuncSetAttribute(cp_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    cp_merge_kernel<<<(unsigned)items, kMergeThreads, smem, cu->stream>>>(gathered, world, items,
                                                                         topk, out);
    M3_CUDA_LAUNCHED("cp_merge_kernel");
    return M3_OK;
}

extern "C" m3_status m3_cuda_cp_error(m3_backend *be, const int *err) {
    m3_cuda *cu = m3_cuda_of(be);
    int h[4] = {0, 0, 0, 0};
    M3_CUDA_TRY(cudaMemcpyAsync(h, err, sizeof h, cudaMemcpyDeviceToHost, cu->stream));
    M3_TRY(m3_cuda_stream_wait(cu)); /* TP: bounded, ends when a peer fails */
    if (h[0] == M3_CUDA_CP_ERR_LEN)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CUDA CP: request %d: length %d outside [0, max_seq_len] (treated as 0)",
                       h[1], h[3]);
    if (h[0] == M3_CUDA_CP_ERR_PAGE)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CUDA CP: request %d block %d: page %d outside the pool (scored NaN, not "
                       "read)",
                       h[1], h[2], h[3]);
    if (h[0])
        return m3_fail(M3_ERR_INVALID_ARG, "CUDA CP: error word %d", h[0]);
    return M3_OK;
}

/* ================================================================ bench */

namespace {
__global__ void iota_table_kernel(int32_t *table, int64_t n) {
    for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < n;
         x += (int64_t)gridDim.x * blockDim.x)
        table[x] = (int32_t)x;
}
} // namespace

extern "C" m3_status m3_cuda_bench_indexer(m3_backend *be, int batch, int64_t context, int world,
                                           int heads, const m3_select_params *p, int iters,
                                           double *us, double *bytes) {
    m3_cuda *cu = m3_cuda_of(be);
    const int64_t blocks = m3_cp_global_blocks(context), local = m3_cp_local_blocks(context, world);
    const int64_t pages = (int64_t)batch * blocks, tokens = batch, items = (int64_t)heads * tokens;
    m3_cuda_cp_inputs in = {};
    in.q_row = (int64_t)heads * kDim;
    in.pages = pages;
    in.table_row = blocks;
    in.batch = batch;
    in.query_len = 1;
    in.heads = heads;
    /* the rank's bytes: its owned blocks of every request (all visible) */
    const int64_t owned = blocks > 0 ? (blocks - 1) / world + 1 : 0; /* rank 0 */
    *bytes = (double)batch * owned * kPage * kDim * 2;
    uint16_t *q = NULL, *icache = NULL;
    int32_t *table = NULL, *lens = NULL, *sel = NULL;
    float *scores = NULL;
    uint64_t *keys = NULL;
    int *err = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    std::vector<float> ms;
    m3_status st = M3_OK;
#define BENCH_TRY(call)                                                             \
    do {                                                                            \
        cudaError_t e_ = (call);                                                    \
        if (e_ != cudaSuccess && !st)                                               \
            st = m3_cuda_error(e_, #call, __FILE__, __LINE__);                      \
    } while (0)
    BENCH_TRY(cudaMalloc((void **)&q, (size_t)tokens * heads * kDim * 2));
    BENCH_TRY(cudaMalloc((void **)&icache, (size_t)pages * kPage * kDim * 2));
    BENCH_TRY(cudaMalloc((void **)&table, (size_t)pages * 4));
    BENCH_TRY(cudaMalloc((void **)&lens, (size_t)batch * 4));
    BENCH_TRY(cudaMalloc((void **)&scores, (size_t)items * (local ? local : 1) * 4));
    BENCH_TRY(cudaMalloc((void **)&keys, (size_t)items * p->topk * 8 * (world + 1)));
    BENCH_TRY(cudaMalloc((void **)&sel, (size_t)items * p->topk * 4));
    BENCH_TRY(cudaMalloc((void **)&err, 16));
    if (!st)
        st = m3_cuda_fill_random_bf16(be, q, (size_t)tokens * heads * kDim, 1, 1.0f);
    if (!st)
        st = m3_cuda_fill_random_bf16(be, icache, (size_t)pages * kPage * kDim, 2, 1.0f);
    if (!st) {
        iota_table_kernel<<<256, 256, 0, cu->stream>>>(table, pages);
        std::vector<int32_t> hl((size_t)batch, (int32_t)context);
        BENCH_TRY(cudaMemcpyAsync(lens, hl.data(), (size_t)batch * 4, cudaMemcpyHostToDevice,
                                  cu->stream));
        BENCH_TRY(cudaMemsetAsync(err, 0, 16, cu->stream));
        BENCH_TRY(cudaStreamSynchronize(cu->stream));
    }
    in.q = q;
    in.icache = icache;
    in.table = table;
    in.lens = lens;
    uint64_t *gathered = keys + items * p->topk;
    const float scale = m3_index_scale(kDim);
    /* one eager pass: the rank's keys, copied world times as the gather */
    if (!st)
        st = m3_cuda_cp_scores(be, &in, context, 0, world, scale, scores, err);
    if (!st)
        st = m3_cuda_cp_local_topk(be, &in, context, 0, world, p, scores, keys, err);
    for (int r = 0; r < world && !st; r++)
        BENCH_TRY(cudaMemcpyAsync(gathered + (int64_t)r * items * p->topk, keys,
                                  (size_t)items * p->topk * 8, cudaMemcpyDeviceToDevice,
                                  cu->stream));
    if (!st)
        st = m3_cuda_cp_error(be, err);
    if (!st) {
        BENCH_TRY(cudaStreamBeginCapture(cu->stream, cudaStreamCaptureModeThreadLocal));
        m3_status cs = m3_cuda_cp_scores(be, &in, context, 0, world, scale, scores, err);
        if (!cs)
            cs = m3_cuda_cp_local_topk(be, &in, context, 0, world, p, scores, keys, err);
        if (!cs)
            cs = m3_cuda_cp_merge(be, gathered, world, items, p->topk, sel);
        cudaError_t ce = cudaStreamEndCapture(cu->stream, &graph);
        if (!st)
            st = cs;
        BENCH_TRY(ce);
    }
    if (!st)
        BENCH_TRY(cudaGraphInstantiate(&exec, graph, 0));
    BENCH_TRY(cudaEventCreate(&e0));
    BENCH_TRY(cudaEventCreate(&e1));
    for (int it = 0; it < iters + 3 && !st; it++) {
        BENCH_TRY(cudaEventRecord(e0, cu->stream));
        BENCH_TRY(cudaGraphLaunch(exec, cu->stream));
        BENCH_TRY(cudaEventRecord(e1, cu->stream));
        BENCH_TRY(cudaEventSynchronize(e1));
        float t = 0.0f;
        BENCH_TRY(cudaEventElapsedTime(&t, e0, e1));
        if (it >= 3)
            ms.push_back(t);
    }
#undef BENCH_TRY
    if (!st && !ms.empty()) {
        std::sort(ms.begin(), ms.end());
        *us = ms[ms.size() / 2] * 1e3;
    }
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(q);
    cudaFree(icache);
    cudaFree(table);
    cudaFree(lens);
    cudaFree(scores);
    cudaFree(keys);
    cudaFree(sel);
    cudaFree(err);
    return st;
}
