/*
 * Token selection on the GPU, so a decode step (or a whole CUDA graph of
 * one) ends with int32 token ids on the device instead of copying
 * [rows, vocab] fp32 logits to the host. Temperature 0 is the argmax
 * (lowest id on ties, NaN never chosen, -1 when a row is all NaN), exactly
 * as the host sampler's greedy path. Temperature T > 0 draws from
 * softmax(logits / T) by the Gumbel-max trick: token = argmax_i(l_i / T +
 * g_i) with g_i = -log(-log(u_i)) standard Gumbel noise, which selects i
 * with probability exactly softmax(l / T)_i and needs no normalisation, so
 * it is one arg-max pass like the greedy path.
 *
 * The noise is counter based, so a draw depends only on (seed, counter[r],
 * i), never on launch shape or timing:
 *   row_key = splitmix64(seed ^ splitmix64((uint64_t)counter[r]))
 *   bits_i  = mix64(row_key + (i + 1) * 0x9e3779b97f4a7c15)
 *   u_i     = ((bits_i >> 12) + 0.5) * 2^-52          in (0, 1), never 0 or 1
 *   g_i     = -logf((float)(-log(u_i)))              inner log double, outer fp32
 * where mix64 is SplitMix64's output function and splitmix64(x) =
 * mix64(x + 0x9e3779b97f4a7c15); bits_i is the (i+1)-th output of a
 * SplitMix64 generator seeded with row_key. -log(u_i) and the key l_i / T +
 * g_i are computed in double: with 52-bit uniforms the Gumbel tail reaches
 * 36.7 (fp32 uniforms would cut it at 17 and bias rare tokens), and l / T
 * cannot overflow for any fp32 l and T. The outer log is fp32 (error below
 * 4e-6 in g, a relative change of that order in any token's probability),
 * which saves half the double-precision work of the pass. Infinite logits follow the host
 * sampler's convention (+inf logits share all the mass uniformly, -inf
 * logits get mass only when every logit is -inf): their keys are
 * +-1e300 + 1e296 g, above (below) every finite key and ordered by g.
 *
 * Two deterministic stages: CTAs of SAMPLE_THREADS each reduce a chunk of
 * SAMPLE_CHUNK logits of one row to a (key, id) candidate in the
 * M3_CUDA_WS_SAMPLE workspace; a final kernel reduces each row's candidates.
 * Candidates are compared by key, then lower id, a total order, so every
 * reduction tree gives the same token (no atomics).
 */
#include <math.h>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"

#define SAMPLE_THREADS 128
#define SAMPLE_VEC_PER_THREAD 2 /* float4 loads per thread per chunk */
#define SAMPLE_CHUNK (SAMPLE_THREADS * 4 * SAMPLE_VEC_PER_THREAD) /* 1024 logits per CTA */
#define SAMPLE_FINAL_THREADS 256
#define SAMPLE_MAX_VOCAB M3_CUDA_SAMPLE_MAX_VOCAB /* int ids and offsets never overflow */

#define GOLDEN 0x9e3779b97f4a7c15ull

/* A candidate token; id < 0: none (the chunk held only NaN). */
struct cand {
    double key;
    int id;
};

/* The better of two candidates: higher key, then lower id. */
__device__ __forceinline__ cand cand_best(cand a, cand b) {
    if (b.id < 0)
        return a;
    if (a.id < 0)
        return b;
    if (a.key != b.key)
        return a.key > b.key ? a : b;
    return a.id < b.id ? a : b;
}

__device__ __forceinline__ cand warp_best(cand c) {
    for (int o = 16; o > 0; o >>= 1) {
        cand other;
        other.key = __shfl_xor_sync(0xffffffffu, c.key, o);
        other.id = __shfl_xor_sync(0xffffffffu, c.id, o);
        c = cand_best(c, other);
    }
    return c;
}

/* Best over the block (blockDim.x a multiple of 32); every thread gets it.
 * The leading barrier lets a loop call it again with the same scratch. */
__device__ __forceinline__ cand block_best(cand c, cand *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    c = warp_best(c);
    __syncthreads();
    if (lane == 0)
        scratch[warp] = c;
    __syncthreads();
    cand none = {0.0, -1};
    return warp_best(lane < nwarps ? scratch[lane] : none);
}

/* SplitMix64's output function (Steele, Lea, Flood 2014). */
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ uint64_t row_key(uint64_t seed, int64_t counter) {
    return mix64((seed ^ mix64((uint64_t)counter + GOLDEN)) + GOLDEN);
}

/* Standard Gumbel noise for logit i of the row keyed by base. */
__device__ __forceinline__ double gumbel(uint64_t base, int i) {
    uint64_t bits = mix64(base + (uint64_t)(i + 1) * GOLDEN);
    double u = ((double)(bits >> 12) + 0.5) * 0x1p-52; /* exact; in [2^-53, 1 - 2^-53] */
    /* e = -log(u) ~ Exp(1) needs double (u near 1 gives e down to 1e-16);
     * the outer log of e is well conditioned, fp32 is enough there */
    double e = -log(u);
    return -(double)logf((float)e);
}

/* Offer logit l of id i to this thread's running best. A thread offers its
 * ids in ascending order, so a strict > keeps the lowest id among ties. */
template <bool SAMPLE>
__device__ __forceinline__ void offer(cand &best, float l, int i, double inv_t, uint64_t base) {
    if (isnan(l))
        return;
    double key = (double)l;
    if (SAMPLE) {
        double g = gumbel(base, i);
        key = isinf(l) ? copysign(1e300, key) + 1e296 * g : key * inv_t + g;
    }
    if (best.id < 0 || key > best.key) {
        best.key = key;
        best.id = i;
    }
}

/* Stage 1: CTA (x, y) reduces logits [x * SAMPLE_CHUNK, +SAMPLE_CHUNK) of
 * rows y, y + gridDim.y, ... to one candidate each. VEC: the row starts are
 * 16-byte aligned and vocab % 4 == 0, so float4 loads never straddle the
 * chunk or row end. The loads of a chunk are issued before any compare. */
template <bool SAMPLE, bool VEC>
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_partial_kernel(const float *__restrict__ logits, int rows, int vocab, double inv_t,
                          uint64_t seed, const int64_t *__restrict__ counter,
                          cand *__restrict__ partial) {
    __shared__ cand scratch[32];
    const int c0 = blockIdx.x * SAMPLE_CHUNK;
    const int c1 = min(c0 + SAMPLE_CHUNK, vocab);
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float *row = logits + (int64_t)r * vocab;
        uint64_t base = SAMPLE ? row_key(seed, counter[r]) : 0;
        cand best = {0.0, -1};
        if (VEC) {
            float4 v[SAMPLE_VEC_PER_THREAD];
#pragma unroll
            for (int k = 0; k < SAMPLE_VEC_PER_THREAD; k++) {
                int i = c0 + (k * SAMPLE_THREADS + (int)threadIdx.x) * 4;
                v[k] = i < c1 ? __ldg(reinterpret_cast<const float4 *>(row + i))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < SAMPLE_VEC_PER_THREAD; k++) {
                int i = c0 + (k * SAMPLE_THREADS + (int)threadIdx.x) * 4;
                if (i >= c1)
                    continue;
                offer<SAMPLE>(best, v[k].x, i, inv_t, base);
                offer<SAMPLE>(best, v[k].y, i + 1, inv_t, base);
                offer<SAMPLE>(best, v[k].z, i + 2, inv_t, base);
                offer<SAMPLE>(best, v[k].w, i + 3, inv_t, base);
            }
        } else {
            for (int i = c0 + (int)threadIdx.x; i < c1; i += SAMPLE_THREADS)
                offer<SAMPLE>(best, __ldg(row + i), i, inv_t, base);
        }
        best = block_best(best, scratch);
        if (threadIdx.x == 0)
            partial[(int64_t)r * gridDim.x + blockIdx.x] = best;
    }
}

/* Stage 2: CTA x reduces the candidates of rows x, x + gridDim.x, ... in a
 * fixed order and writes the token (-1: every logit of the row was NaN). */
__global__ void __launch_bounds__(SAMPLE_FINAL_THREADS)
    sample_final_kernel(const cand *__restrict__ partial, int rows, int chunks,
                        int32_t *__restrict__ tokens) {
    __shared__ cand scratch[32];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        cand best = {0.0, -1};
        for (int c = threadIdx.x; c < chunks; c += blockDim.x)
            best = cand_best(best, partial[(int64_t)r * chunks + c]);
        best = block_best(best, scratch);
        if (threadIdx.x == 0)
            tokens[r] = best.id;
    }
}

template <bool SAMPLE>
static void launch_partial(m3_cuda *cu, bool vec, dim3 grid, const float *logits, int rows,
                           int vocab, double inv_t, uint64_t seed, const int64_t *counter,
                           cand *partial) {
    if (vec)
        sample_partial_kernel<SAMPLE, true><<<grid, SAMPLE_THREADS, 0, cu->stream>>>(
            logits, rows, vocab, inv_t, seed, counter, partial);
    else
        sample_partial_kernel<SAMPLE, false><<<grid, SAMPLE_THREADS, 0, cu->stream>>>(
            logits, rows, vocab, inv_t, seed, counter, partial);
}

extern "C" m3_status m3_cuda_sample(m3_backend *be, int rows, const float *logits, int vocab,
                                    float temperature, uint64_t seed, const int64_t *counter,
                                    int32_t *tokens) {
    m3_cuda *cu = m3_cuda_of(be);
    if (rows <= 0)
        return M3_OK;
    if (vocab < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "sample: vocab %d must be >= 1", vocab);
    if (vocab > SAMPLE_MAX_VOCAB)
        return m3_fail(M3_ERR_UNSUPPORTED, "sample: vocab %d is above the supported %d", vocab,
                       SAMPLE_MAX_VOCAB);
    if (!(temperature >= 0) || isinf(temperature))
        return m3_fail(M3_ERR_INVALID_ARG, "sample: temperature %g must be finite and >= 0",
                       (double)temperature);
    bool sample = temperature > 0;
    if (sample && !counter)
        return m3_fail(M3_ERR_INVALID_ARG, "sample: temperature %g needs per-row counters",
                       (double)temperature);
    int chunks = (vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    void *ws = NULL;
    M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_SAMPLE, (size_t)rows * chunks * sizeof(cand), &ws));
    cand *partial = static_cast<cand *>(ws);
    bool vec = ((uintptr_t)logits & 15u) == 0 && vocab % 4 == 0;
    dim3 grid((unsigned)chunks, (unsigned)(rows < 65535 ? rows : 65535));
    double inv_t = sample ? 1.0 / (double)temperature : 0.0;
    if (sample)
        launch_partial<true>(cu, vec, grid, logits, rows, vocab, inv_t, seed, counter, partial);
    else
        launch_partial<false>(cu, vec, grid, logits, rows, vocab, inv_t, seed, counter, partial);
    M3_CUDA_LAUNCHED("sample_partial_kernel");
    sample_final_kernel<<<(unsigned)rows, SAMPLE_FINAL_THREADS, 0, cu->stream>>>(partial, rows,
                                                                                chunks, tokens);
    M3_CUDA_LAUNCHED("sample_final_kernel");
    return M3_OK;
}
