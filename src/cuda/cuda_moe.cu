/*
 * The MoE FFN on the GPU (SPEC §2.3 step 7), graph-capturable: the routing
 * is decided on the device and never read back. Launches:
 *   router logits (fp32 GEMV)        logits [T, E]
 *   route: top-k by sigmoid + bias   ids, weights [T, k]
 *   plan: group assignments by expert (one CTA): the distinct experts, and
 *         each one's assignments (row * k + slot), in expert order
 *   experts' gate + up + SwiGLU-OAI  act [T*k, I]    grid (I tiles, slot u)
 *   experts' down                    eout [T*k, H]   grid (H tiles, slot u)
 *   the shared expert (linear ops)   shared [T, H]
 *   combine: y = bf16(scaling * sum_s w_s eout_s + shared)
 * The expert grids have one slot per possible distinct expert (min(T*k, E));
 * slots past the step's count return at once, so only routed experts'
 * weights are read. Experts of one kind sit at a uniform stride in device
 * memory (cuda_backend.cu lays them out so), indexed by id.
 */
#include "cuda/cuda_gemv.cuh"
#include "cuda/cuda_internal.h"

#define MOE_MAX_K M3_CUDA_MOE_MAX_K

/* One CTA per row: keys s + bias in shared memory, k rounds of arg-best
 * over the experts not taken yet (highest key, ties to the lower id; a NaN
 * key ranks as -inf). The same order as the CPU's m3_route_row. */
__global__ void moe_route_kernel(const float *__restrict__ logits, const float *__restrict__ bias,
                                 int E, int k, int32_t *__restrict__ ids,
                                 float *__restrict__ weights) {
    extern __shared__ float keys[]; /* [E] keys, then [E] taken flags */
    unsigned char *taken = reinterpret_cast<unsigned char *>(keys + E);
    __shared__ float best_key[32];
    __shared__ int best_id[32];
    __shared__ float chosen_s[MOE_MAX_K];
    int t = blockIdx.x;
    const float *l = logits + (int64_t)t * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float key = m3_sigmoid(l[e]) + (bias ? bias[e] : 0.0f);
        keys[e] = isnan(key) ? -INFINITY : key;
        taken[e] = 0;
    }
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int round = 0; round < k; round++) {
        float bk = -INFINITY;
        int bi = INT32_MAX;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (!taken[e] && (keys[e] > bk || (keys[e] == bk && e < bi))) {
                bk = keys[e];
                bi = e;
            }
        for (int o = 16; o > 0; o >>= 1) {
            float ok = __shfl_xor_sync(0xffffffffu, bk, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ok > bk || (ok == bk && oi < bi)) {
                bk = ok;
                bi = oi;
            }
        }
        if (lane == 0) {
            best_key[warp] = bk;
            best_id[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float k0 = best_key[0];
            int i0 = best_id[0];
            for (int w = 1; w < nwarps; w++)
                if (best_key[w] > k0 || (best_key[w] == k0 && best_id[w] < i0)) {
                    k0 = best_key[w];
                    i0 = best_id[w];
                }
            /* k <= E, so an untaken expert always exists */
            ids[t * k + round] = i0;
            chosen_s[round] = m3_sigmoid(l[i0]);
            taken[i0] = 1;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int s = 0; s < k; s++)
            sum += chosen_s[s];
        for (int s = 0; s < k; s++)
            weights[t * k + s] = chosen_s[s] / sum;
    }
}

/* One CTA: the distinct experts among n assignments and their members,
 * grouped by expert in ascending id, members in assignment order. */
__global__ void moe_plan_kernel(const int32_t *__restrict__ ids, int n, int E,
                                int32_t *__restrict__ uniq, int32_t *__restrict__ first,
                                int32_t *__restrict__ members, int32_t *__restrict__ n_uniq) {
    extern __shared__ int32_t count[]; /* [E] then [E] write cursors */
    int32_t *cursor = count + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        count[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        atomicAdd(&count[ids[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) { /* E <= a few thousand: a serial scan is cheap */
        int u = 0, at = 0;
        for (int e = 0; e < E; e++) {
            cursor[e] = at;
            if (count[e]) {
                uniq[u] = e;
                first[u] = at;
                u++;
            }
            at += count[e];
        }
        first[u] = at;
        *n_uniq = u;
    }
    __syncthreads();
    /* stable placement: assignment i goes after every earlier one of its
     * expert (a serial pass keeps the order independent of scheduling) */
    if (threadIdx.x == 0)
        for (int i = 0; i < n; i++)
            members[cursor[ids[i]]++] = i;
}

struct expert_weights {
    const uint8_t *w0;  /* expert 0's weight */
    int64_t w_stride;   /* bytes between experts */
    int64_t w_row;      /* bytes per row */
    const uint8_t *s0;  /* expert 0's MXFP8 scales, or NULL */
    int64_t s_stride, s_row;
};

__device__ __forceinline__ gemv_weight expert_at(const expert_weights &x, int e) {
    gemv_weight w = {x.w0 + (int64_t)e * x.w_stride, x.w_row,
                     x.s0 ? x.s0 + (int64_t)e * x.s_stride : nullptr, x.s_row};
    return w;
}

/* act[m, n] = bf16(swiglu(bf16(x_m . gate[n]), bf16(x_m . up[n]))) for the
 * members m of slot u's expert; x_m = x[m / k]. */
template <int T, bool FP8>
__global__ void __launch_bounds__(GEMV_THREADS)
    moe_gate_up_kernel(expert_weights gate, expert_weights up, const uint16_t *__restrict__ x,
                       int k, int H, int I, const int32_t *__restrict__ uniq,
                       const int32_t *__restrict__ first, const int32_t *__restrict__ members,
                       const int32_t *__restrict__ n_uniq, float alpha, float limit,
                       uint16_t *__restrict__ act) {
    extern __shared__ uint4 smem_x[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem_x);
    int u = blockIdx.y;
    if (u >= *n_uniq)
        return; /* no expert in this slot this step: nothing is read */
    int e = uniq[u];
    gemv_weight Wg = expert_at(gate, e), Wu = expert_at(up, e);
    int64_t n0 = ((int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_R;
    int lane = threadIdx.x & 31;
    for (int g0 = first[u]; g0 < first[u + 1]; g0 += T) {
        int rows = first[u + 1] - g0 < T ? first[u + 1] - g0 : T;
        auto row_ptr = [&](int t) { return x + (int64_t)(members[g0 + t] / k) * H; };
        float g[GEMV_R][T], v[GEMV_R][T];
        gemv_rows<T, FP8>(g, Wg, n0, I, 0, H, row_ptr, rows, xs);
        gemv_rows<T, FP8>(v, Wu, n0, I, 0, H, row_ptr, rows, xs);
#pragma unroll
        for (int r = 0; r < GEMV_R; r++)
#pragma unroll
            for (int t = 0; t < T; t++) {
                if ((r * T + t) % 32 != lane || n0 + r >= I || t >= rows)
                    continue;
                float a = m3_swiglu_oai(m3_round_bf(g[r][t]), m3_round_bf(v[r][t]), alpha, limit);
                act[(int64_t)members[g0 + t] * I + n0 + r] = m3_to_bf(a);
            }
    }
}

/* A down output: rounded to bf16 (TP 1), or kept as an fp32 partial sum
 * (TP > 1: rounded after the all-reduce, in the combine). */
__device__ __forceinline__ void down_store(uint16_t *p, float v) { *p = m3_to_bf(v); }
__device__ __forceinline__ void down_store(float *p, float v) { *p = v; }
__device__ __forceinline__ float down_load(const uint16_t *p) { return m3_bf(*p); }
__device__ __forceinline__ float down_load(const float *p) { return m3_round_bf(*p); }

/* eout[m, n] = act[m] . down[n] for the members m of slot u's expert,
 * summed over I's n_chunks chunks as cuda_ksum.cuh's tree (a TP rank holds
 * its share of the full width's chunks: its fp32 partial is a subtree of
 * TP 1's sum). */
template <int T, bool FP8, typename Out>
__global__ void __launch_bounds__(GEMV_THREADS, (T) <= 2 ? 3 : 2)
    moe_down_kernel(expert_weights down, const uint16_t *__restrict__ act, int H, int I,
                    int n_chunks, const int32_t *__restrict__ uniq,
                    const int32_t *__restrict__ first, const int32_t *__restrict__ members,
                    const int32_t *__restrict__ n_uniq, Out *__restrict__ eout) {
    extern __shared__ uint4 smem_x[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem_x);
    int u = blockIdx.y;
    if (u >= *n_uniq)
        return;
    gemv_weight W = expert_at(down, uniq[u]);
    int64_t n0 = ((int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_R;
    for (int g0 = first[u]; g0 < first[u + 1]; g0 += T) {
        int rows = first[u + 1] - g0 < T ? first[u + 1] - g0 : T;
        auto row_ptr = [&](int t) { return act + (int64_t)members[g0 + t] * I; };
        float y = gemv_tree<T, FP8>(W, n0, H, I, n_chunks, 0, n_chunks, row_ptr, rows, xs);
        bool first_lane;
        int j = ksum_lane_value<GEMV_R * T>(&first_lane);
        int r = j / T, t = j % T;
        if (first_lane && n0 + r < H && t < rows)
            down_store(&eout[(int64_t)members[g0 + t] * H + n0 + r], y);
    }
}

/* y = bf16(scaling * sum_s w[t,s] eout[t*k+s] + shared[t]), the sum in
 * fp32 in routing-rank order; each expert's and the shared expert's output
 * rounded to bf16 first (at TP > 1 here, after the all-reduce). */
template <typename In>
__global__ void moe_combine_kernel(const float *__restrict__ w, const In *__restrict__ eout,
                                   const In *__restrict__ shared, int rows, int k, int H,
                                   float scaling, uint16_t *__restrict__ out) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)rows * H)
        return;
    int64_t t = i / H, h = i % H;
    float acc = 0.0f;
    for (int s = 0; s < k; s++)
        acc += w[t * k + s] * down_load(&eout[(t * k + s) * H + h]);
    float y = scaling * acc;
    if (shared)
        y += down_load(&shared[i]);
    out[i] = m3_to_bf(y);
}

/* ------------------------------------------------------------ host side */

typedef struct moe_ws {
    float *logits, *weights;
    int32_t *ids, *uniq, *first, *members, *n_uniq;
    uint16_t *act, *sh_gate, *sh_up, *sh_act;
    void *eout, *shared; /* bf16, or fp32 partials at TP > 1 (out_size 4) */
} moe_ws;

static m3_status carve(m3_cuda *cu, int T, int E, int k, int64_t H, int64_t I, int64_t Is,
                       int out_size, moe_ws *w) {
    int64_t n = (int64_t)T * k;
    size_t sizes[13] = {(size_t)T * E * 4, (size_t)n * 4, (size_t)n * 4, (size_t)E * 4,
                        (size_t)(E + 1) * 4, (size_t)n * 4, 4, (size_t)(n * I * 2),
                        (size_t)(n * H * out_size), (size_t)(T * Is * 2), (size_t)(T * Is * 2),
                        (size_t)(T * Is * 2), (size_t)(T * H * out_size)};
    void *p[13];
    M3_TRY(m3_cuda_workspace_parts(cu, M3_CUDA_WS_MOE, sizes, 13, p));
    w->logits = (float *)p[0];
    w->weights = (float *)p[1];
    w->ids = (int32_t *)p[2];
    w->uniq = (int32_t *)p[3];
    w->first = (int32_t *)p[4];
    w->members = (int32_t *)p[5];
    w->n_uniq = (int32_t *)p[6];
    w->act = (uint16_t *)p[7];
    w->eout = p[8];
    w->sh_gate = (uint16_t *)p[9];
    w->sh_up = (uint16_t *)p[10];
    w->sh_act = (uint16_t *)p[11];
    w->shared = p[12];
    return M3_OK;
}

/* The experts of one kind as base + stride; they must be uniformly spaced. */
static m3_status expert_layout(const m3_linear *l, int E, const char *kind, expert_weights *out) {
    const char *w0 = (const char *)l[0].w.data;
    int64_t stride = E > 1 ? (const char *)l[1].w.data - w0 : 0;
    int64_t sstride = E > 1 && l[0].scale.data
                          ? (const char *)l[1].scale.data - (const char *)l[0].scale.data
                          : 0;
    for (int e = 0; e < E; e++)
        if ((const char *)l[e].w.data != w0 + e * stride ||
            (l[0].scale.data &&
             (const char *)l[e].scale.data != (const char *)l[0].scale.data + e * sstride))
            return m3_fail(M3_ERR_INTERNAL, "MoE: %s experts are not uniformly laid out", kind);
    out->w0 = (const uint8_t *)w0;
    out->w_stride = stride;
    out->w_row = l[0].w.nb[0];
    out->s0 = (const uint8_t *)l[0].scale.data;
    out->s_stride = sstride;
    out->s_row = l[0].scale.data ? l[0].scale.nb[0] : 0;
    return M3_OK;
}

template <int T, bool FP8>
static m3_status launch_experts_t(m3_cuda *cu, const expert_weights &g, const expert_weights &u,
                                  const expert_weights &d, const uint16_t *x, int slots, int k,
                                  int H, int I, int n_chunks, const m3_moe_params *p,
                                  const moe_ws &w) {
    size_t smem = (size_t)T * GEMV_KC * 2;
    dim3 grid_up((unsigned)((I + GEMV_WARPS * GEMV_R - 1) / (GEMV_WARPS * GEMV_R)), (unsigned)slots);
    moe_gate_up_kernel<T, FP8><<<grid_up, GEMV_THREADS, smem, cu->stream>>>(
        g, u, x, k, H, I, w.uniq, w.first, w.members, w.n_uniq, p->act.alpha, p->act.limit,
        w.act);
    M3_CUDA_LAUNCHED("moe_gate_up_kernel");
    dim3 grid_down((unsigned)((H + GEMV_WARPS * GEMV_R - 1) / (GEMV_WARPS * GEMV_R)),
                   (unsigned)slots);
    if (p->tp && p->tp->world > 1)
        moe_down_kernel<T, FP8, float><<<grid_down, GEMV_THREADS, smem, cu->stream>>>(
            d, w.act, H, I, n_chunks, w.uniq, w.first, w.members, w.n_uniq, (float *)w.eout);
    else
        moe_down_kernel<T, FP8, uint16_t><<<grid_down, GEMV_THREADS, smem, cu->stream>>>(
            d, w.act, H, I, n_chunks, w.uniq, w.first, w.members, w.n_uniq,
            (uint16_t *)w.eout);
    M3_CUDA_LAUNCHED("moe_down_kernel");
    return M3_OK;
}

template <bool FP8>
static m3_status launch_experts(m3_cuda *cu, int rows, const expert_weights &g,
                                const expert_weights &u, const expert_weights &d,
                                const uint16_t *x, int slots, int k, int H, int I,
                                int n_chunks, const m3_moe_params *p, const moe_ws &w) {
    /* An expert's members are at most the step's rows, and in decode
     * usually one or two (k of E experts per row): the kernels take up to
     * 4 members per pass, so the FMA work stays a few per weight element
     * (a 16-row template did 16 and was arithmetic-bound), and an expert
     * with more members streams its weights once per 4. */
    if (rows <= 1)
        return launch_experts_t<1, FP8>(cu, g, u, d, x, slots, k, H, I, n_chunks, p, w);
    if (rows <= 2)
        return launch_experts_t<2, FP8>(cu, g, u, d, x, slots, k, H, I, n_chunks, p, w);
    return launch_experts_t<4, FP8>(cu, g, u, d, x, slots, k, H, I, n_chunks, p, w);
}

static m3_status check_shapes(const m3_layer_weights *lw, const m3_moe_params *p, int64_t H,
                              int64_t I) {
    if (p->top_k > MOE_MAX_K || p->top_k > p->num_experts)
        return m3_fail(M3_ERR_UNSUPPORTED, "CUDA MoE: top %d of %d experts (at most %d)",
                       p->top_k, p->num_experts, MOE_MAX_K);
    if (p->num_experts > M3_CUDA_MOE_MAX_EXPERTS)
        return m3_fail(M3_ERR_UNSUPPORTED, "CUDA MoE: %d experts (at most %d)", p->num_experts,
                       M3_CUDA_MOE_MAX_EXPERTS);
    if (H % M3_CUDA_MOE_ALIGN || I % M3_CUDA_MOE_ALIGN)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "CUDA MoE: hidden %lld and expert width %lld must be multiples of %d",
                       (long long)H, (long long)I, M3_CUDA_MOE_ALIGN);
    return M3_OK;
}

extern "C" m3_status m3_cuda_moe(m3_backend *be, int rows, const uint16_t *x,
                                 const m3_layer_weights *lw, const m3_moe_params *p,
                                 uint16_t *out) {
    m3_cuda *cu = m3_cuda_of(be);
    bool tp = p->tp && p->tp->world > 1; /* lw holds this rank's slice of every width */
    int E = p->num_experts, k = p->top_k;
    int64_t H = lw->router.ne[1], I = lw->exp_gate[0].w.ne[0];
    int64_t Is = lw->sh_gate.w.data ? lw->sh_gate.w.ne[0] : 0;
    if (rows <= 0)
        return M3_OK;
    M3_TRY(check_shapes(lw, p, H, I));
    expert_weights g, u, d;
    M3_TRY(expert_layout(lw->exp_gate, E, "gate", &g));
    M3_TRY(expert_layout(lw->exp_up, E, "up", &u));
    M3_TRY(expert_layout(lw->exp_down, E, "down", &d));
    bool fp8 = lw->exp_gate[0].w.dtype == M3_DT_F8_E4M3;
    moe_ws w;
    M3_TRY(carve(cu, rows, E, k, H, I, Is, tp ? 4 : 2, &w));
    cu->moe_n_uniq = w.n_uniq;

    M3_TRY(m3_cuda_linear_f32w(cu, rows, x, (const float *)lw->router.data, E, H, w.logits));
    moe_route_kernel<<<rows, 256, (size_t)E * 5, cu->stream>>>(
        w.logits, (const float *)lw->router_bias.data, E, k, w.ids, w.weights);
    M3_CUDA_LAUNCHED("moe_route_kernel");
    int n = rows * k;
    moe_plan_kernel<<<1, 1024, (size_t)E * 8, cu->stream>>>(w.ids, n, E, w.uniq, w.first,
                                                            w.members, w.n_uniq);
    M3_CUDA_LAUNCHED("moe_plan_kernel");
    int slots = n < E ? n : E;
    /* the down sums' chunks (cuda_ksum.cuh); bounds must be multiples of 8 */
    int nch = m3_cuda_k_chunks(&lw->exp_down[0]);
    if (I % (8 * nch))
        nch = 1;
    if (fp8)
        M3_TRY(launch_experts<true>(cu, rows, g, u, d, x, slots, k, (int)H, (int)I, nch, p, w));
    else
        M3_TRY(launch_experts<false>(cu, rows, g, u, d, x, slots, k, (int)H, (int)I, nch, p, w));
    if (Is) {
        M3_TRY(m3_cuda_linear(be, rows, x, &lw->sh_gate, M3_DT_BF16, w.sh_gate));
        M3_TRY(m3_cuda_linear(be, rows, x, &lw->sh_up, M3_DT_BF16, w.sh_up));
        M3_TRY(m3_cuda_swiglu(be, (int64_t)rows * Is, w.sh_gate, w.sh_up, &p->act, w.sh_act));
        M3_TRY(m3_cuda_linear(be, rows, w.sh_act, &lw->sh_down, tp ? M3_DT_F32 : M3_DT_BF16,
                              w.shared));
    }
    int64_t total = (int64_t)rows * H;
    unsigned grid = (unsigned)((total + 255) / 256);
    if (tp) { /* whole down outputs on every rank, summed over ranks, then rounded */
        M3_TRY(p->tp->ops->all_reduce_sum_f32(p->tp, (float *)w.eout, (int64_t)n * H));
        if (Is)
            M3_TRY(p->tp->ops->all_reduce_sum_f32(p->tp, (float *)w.shared, total));
        moe_combine_kernel<float><<<grid, 256, 0, cu->stream>>>(
            w.weights, (const float *)w.eout, Is ? (const float *)w.shared : NULL, rows, k,
            (int)H, p->routed_scaling, out);
    } else {
        moe_combine_kernel<uint16_t><<<grid, 256, 0, cu->stream>>>(
            w.weights, (const uint16_t *)w.eout, Is ? (const uint16_t *)w.shared : NULL, rows, k,
            (int)H, p->routed_scaling, out);
    }
    M3_CUDA_LAUNCHED("moe_combine_kernel");
    return M3_OK;
}
