/*
 * The CUDA backend's memory-bound per-row and elementwise ops: embedding
 * lookup, row gathers, the residual add + Gemma RMSNorm, the per-head Gemma
 * norm + NeoX RoPE of q/k/iq/ik, the paged cache write and SwiGLU-OAI
 * (SPEC §2.3 steps 1, 3, 4 and 7; each op's contract is in backend.h). They
 * run every layer of every decode step, so each moves its bytes once with
 * 16-byte loads where the pointers and strides allow it (checked at run
 * time; otherwise a scalar variant of the same kernel runs, so every shape
 * the config allows works), and sizes its grid by rows x work per row so one
 * decode row and thousands of prefill rows both spread over the SMs.
 *
 * The arithmetic mirrors the CPU reference (cpu_backend.c, cpu_kernels.c)
 * operation for operation: squares summed in double and the mean rounded to
 * fp32 once, r = 1 / sqrtf(ms + eps) (IEEE division and square root, as
 * nvcc emits without fast-math), y = (x r)(1 + w), and explicit _rn
 * intrinsics where nvcc would otherwise fuse a multiply and an add the CPU
 * build (-ffp-contract=off) keeps apart. RoPE's inverse frequencies are
 * computed on the host with the very pow() call of the CPU backend and
 * passed by value; the angle and its cos/sin are formed in double on the
 * device (positions reach 2^20). All ops follow the capture rules of
 * cuda_internal.h: cu->stream only, no sync, no allocation, step metadata
 * (tokens, positions, slots) read on the device.
 */
#include <math.h>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_hnr.cuh"
#include "cuda/cuda_internal.h"

/* ------------------------------------------------------------ helpers */

static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

static inline int round_up32(int64_t n) { return (int)((n + 31) / 32 * 32); }

/* Sum over the block in double (blockDim.x a multiple of 32); every thread
 * gets the result. Called once per kernel, so no barrier guards scratch. */
__device__ __forceinline__ double block_sum_d(double v, double *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = m3_warp_sum_d(v);
    if (lane == 0)
        scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0;
    return m3_warp_sum_d(v);
}

/* ------------------------------------------------------------ row copies */

/* dst[t] = src[idx[t]] for rows of `units` units (U: uint4 = 8 bf16, or one
 * bf16). A row index outside [0, limit) yields a zero row instead of a wild
 * read (the ops cannot report an error from the device). Grid: x covers a
 * row's units, y strides over rows (so rows may exceed the y-limit). */
template <typename U>
__global__ void __launch_bounds__(256)
    gather_kernel(int rows, const int32_t *__restrict__ idx, int64_t base, int64_t limit,
                  const U *src, int64_t src_stride, int units, U *dst) {
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= units)
        return;
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        int64_t i = (int64_t)idx[t] - base;
        U v{};
        if (i >= 0 && i < limit)
            v = src[i * src_stride + u];
        dst[(int64_t)t * units + u] = v;
    }
}

/* Launches gather_kernel with 16-byte units when every row start is
 * 16-byte aligned, else with 2-byte units. */
static m3_status launch_gather(m3_cuda *cu, int rows, const int32_t *idx, int64_t base,
                               int64_t limit,
                               const uint16_t *src, int64_t src_stride, int dim, uint16_t *dst,
                               const char *what) {
    bool vec = dim % 8 == 0 && src_stride % 8 == 0 && aligned16(src) && aligned16(dst);
    int units = vec ? dim / 8 : dim;
    int threads = units < 256 ? round_up32(units) : 256;
    dim3 grid((unsigned)((units + threads - 1) / threads), (unsigned)(rows < 65535 ? rows : 65535));
    if (vec)
        gather_kernel<uint4><<<grid, threads, 0, cu->stream>>>(
            rows, idx, base, limit, reinterpret_cast<const uint4 *>(src), src_stride / 8, units,
            reinterpret_cast<uint4 *>(dst));
    else
        gather_kernel<uint16_t><<<grid, threads, 0, cu->stream>>>(rows, idx, base, limit, src,
                                                                   src_stride, units, dst);
    (void)what; /* M3_CUDA_LAUNCHED reports file:line, not the name */
    M3_CUDA_LAUNCHED(what);
    return M3_OK;
}

extern "C" m3_status m3_cuda_embed(m3_backend *be, int rows, const int32_t *tokens,
                                   const m3_tensor *table, int64_t vocab_start,
                                   uint16_t *out) {
    if (rows <= 0)
        return M3_OK;
    if (table->dtype != M3_DT_BF16 || table->ndim != 2 || !table->data || table->nb[0] % 2)
        return m3_fail(M3_ERR_INTERNAL, "embed: table %s is not a bf16 matrix",
                       table->name ? table->name : "?");
    int64_t V = table->ne[0], H = table->ne[1];
    if (H < 1 || H > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "embed: row width %lld is out of range",
                       (long long)H);
    /* a token outside this table's vocabulary slice gives a zero row */
    return launch_gather(m3_cuda_of(be), rows, tokens, vocab_start, V, (const uint16_t *)table->data,
                         table->nb[0] / 2, (int)H, out, "embed (gather_kernel)");
}

extern "C" m3_status m3_cuda_gather_rows(m3_backend *be, int n, const int32_t *idx, int dim,
                                         const uint16_t *src, uint16_t *dst) {
    if (n <= 0 || dim <= 0)
        return M3_OK;
    /* the source's row count is not known here: only negative ids are caught */
    return launch_gather(m3_cuda_of(be), n, idx, 0, INT64_MAX, src, dim, dim, dst,
                         "gather_rows (gather_kernel)");
}

/* out[t, i] = bf16(a[t, i] + b[t, i]); out's rows out_stride apart. Grid:
 * x over a row's values, y over rows. */
__global__ void __launch_bounds__(256)
    add_rows_kernel(int rows, int dim, const uint16_t *__restrict__ a,
                    const uint16_t *__restrict__ b, int64_t out_stride,
                    uint16_t *__restrict__ out) {
    for (int t = blockIdx.y; t < rows; t += gridDim.y)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < dim; i += gridDim.x * blockDim.x) {
            int64_t k = (int64_t)t * dim + i;
            out[(int64_t)t * out_stride + i] = m3_to_bf(m3_bf(a[k]) + m3_bf(b[k]));
        }
}

extern "C" m3_status m3_cuda_add_rows(m3_backend *be, int rows, int dim, const uint16_t *a,
                                      const uint16_t *b, int64_t out_stride, uint16_t *out) {
    if (rows <= 0 || dim <= 0)
        return M3_OK;
    if (out_stride < dim)
        return m3_fail(M3_ERR_INTERNAL, "add_rows: out_stride %lld is below the row width %d",
                       (long long)out_stride, dim);
    int bx = (dim + 255) / 256;
    dim3 grid((unsigned)(bx < 64 ? bx : 64), (unsigned)(rows < 65535 ? rows : 65535));
    add_rows_kernel<<<grid, 256, 0, m3_cuda_of(be)->stream>>>(rows, dim, a, b, out_stride, out);
    M3_CUDA_LAUNCHED("add_rows_kernel");
    return M3_OK;
}

/* cache [pages, heads, 128, dim] at slots[t] <- src row t's heads. Grid: x
 * covers (head, unit) of one row, y strides over rows; padded rows
 * (negative slot) write nothing. */
template <typename U>
__global__ void __launch_bounds__(256)
    cache_write_kernel(int rows, const int64_t *__restrict__ slots, int heads, int units,
                       const U *__restrict__ src, int64_t src_stride, U *__restrict__ cache) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= heads * units)
        return;
    int h = i / units, u = i - h * units;
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        int64_t slot = slots[t];
        if (slot < 0)
            continue;
        int64_t page = slot / M3_PAGE, off = slot % M3_PAGE;
        cache[((page * heads + h) * M3_PAGE + off) * units + u] =
            src[(int64_t)t * src_stride + (int64_t)h * units + u];
    }
}

extern "C" m3_status m3_cuda_cache_write(m3_backend *be, int rows, const int64_t *slots,
                                         int heads, int dim, const uint16_t *src,
                                         int64_t src_stride, uint16_t *cache) {
    m3_cuda *cu = m3_cuda_of(be);
    if (rows <= 0 || heads <= 0 || dim <= 0)
        return M3_OK;
    if ((int64_t)heads * dim > INT32_MAX / 2)
        return m3_fail(M3_ERR_UNSUPPORTED, "cache_write: %d heads x %d dims is too wide", heads,
                       dim);
    bool vec = dim % 8 == 0 && src_stride % 8 == 0 && aligned16(src) && aligned16(cache);
    int units = vec ? dim / 8 : dim, per_row = heads * units;
    int threads = per_row < 256 ? round_up32(per_row) : 256;
    dim3 grid((unsigned)((per_row + threads - 1) / threads),
              (unsigned)(rows < 65535 ? rows : 65535));
    if (vec)
        cache_write_kernel<uint4><<<grid, threads, 0, cu->stream>>>(
            rows, slots, heads, units, reinterpret_cast<const uint4 *>(src), src_stride / 8,
            reinterpret_cast<uint4 *>(cache));
    else
        cache_write_kernel<uint16_t><<<grid, threads, 0, cu->stream>>>(rows, slots, heads, units,
                                                                        src, src_stride, cache);
    M3_CUDA_LAUNCHED("cache_write_kernel");
    return M3_OK;
}

/* ------------------------------------------------------------ add + RMSNorm */

/* One CTA per row; thread k holds vectors k, k + blockDim, ... (ITEMS of
 * them, 8 bf16 each) in registers between the two passes, so the row is read
 * once. The residual is bf16 after its rounding, so the registers keep it
 * packed. No __restrict__: out may alias add (each element is read and
 * written by the same thread, reads first). */
template <int ITEMS>
__global__ void __launch_bounds__(1024)
    add_rmsnorm_vec_kernel(int dim, const uint16_t *add, uint16_t *residual,
                           const uint16_t *__restrict__ w, float eps, uint16_t *out) {
    __shared__ double scratch[32];
    const int64_t base = (int64_t)blockIdx.x * dim;
    const int nvec = dim >> 3;
    uint4 *res = reinterpret_cast<uint4 *>(residual + base);
    const uint4 *addv = add ? reinterpret_cast<const uint4 *>(add + base) : nullptr;
    /* with few items, the weights are loaded before the reduction so their
     * latency hides behind it; with many, registers would spill */
    constexpr bool PREFETCH_W = ITEMS <= 2;
    const uint4 *wv = reinterpret_cast<const uint4 *>(w);
    uint4 xv[ITEMS], wr[PREFETCH_W ? ITEMS : 1];
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        int v = threadIdx.x + k * blockDim.x;
        xv[k] = make_uint4(0u, 0u, 0u, 0u);
        if (v >= nvec)
            continue;
        if (PREFETCH_W)
            wr[k] = __ldg(wv + v);
        uint4 r = res[v];
        float f[8];
        unpack8(r, f);
        if (addv) { /* residual = bf16(add + residual): a rounding point */
            float a[8];
            unpack8(addv[v], a);
#pragma unroll
            for (int j = 0; j < 8; j++)
                f[j] = m3_round_bf(__fadd_rn(a[j], f[j]));
            r = pack8(f);
            res[v] = r;
        }
        xv[k] = r;
#pragma unroll
        for (int j = 0; j < 8; j++)
            ss += (double)f[j] * (double)f[j];
    }
    ss = block_sum_d(ss, scratch);
    float ms = (float)(ss / (double)dim); /* mean of squares, rounded once */
    float rs = 1.0f / sqrtf(ms + eps);
    uint4 *o = reinterpret_cast<uint4 *>(out + base);
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        int v = threadIdx.x + k * blockDim.x;
        if (v >= nvec)
            continue;
        float x[8], wf[8];
        unpack8(xv[k], x);
        unpack8(PREFETCH_W ? wr[PREFETCH_W ? k : 0] : __ldg(wv + v), wf);
#pragma unroll
        for (int j = 0; j < 8; j++)
            x[j] = __fmul_rn(__fmul_rn(x[j], rs), __fadd_rn(1.0f, wf[j]));
        o[v] = pack8(x);
    }
}

/* Any dim, any alignment: two passes over the row in global memory (the
 * second rereads what the same thread wrote in the first). */
__global__ void __launch_bounds__(256)
    add_rmsnorm_scalar_kernel(int dim, const uint16_t *add, uint16_t *residual,
                              const uint16_t *__restrict__ w, float eps, uint16_t *out) {
    __shared__ double scratch[32];
    const int64_t base = (int64_t)blockIdx.x * dim;
    uint16_t *res = residual + base;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = m3_bf(res[i]);
        if (add) {
            v = m3_round_bf(__fadd_rn(m3_bf(add[base + i]), v));
            res[i] = m3_to_bf(v);
        }
        ss += (double)v * (double)v;
    }
    ss = block_sum_d(ss, scratch);
    float ms = (float)(ss / (double)dim);
    float rs = 1.0f / sqrtf(ms + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[base + i] =
            m3_to_bf(__fmul_rn(__fmul_rn(m3_bf(res[i]), rs), __fadd_rn(1.0f, m3_bf(w[i]))));
}

template <int ITEMS>
static void launch_rmsnorm_vec(m3_cuda *cu, int rows, int dim, const uint16_t *add,
                               uint16_t *residual, const uint16_t *w, float eps, uint16_t *out) {
    int nvec = dim / 8;
    int threads = round_up32((nvec + ITEMS - 1) / ITEMS);
    add_rmsnorm_vec_kernel<ITEMS>
        <<<(unsigned)rows, threads, 0, cu->stream>>>(dim, add, residual, w, eps, out);
}

extern "C" m3_status m3_cuda_add_rmsnorm(m3_backend *be, int rows, int dim, const uint16_t *add,
                                         uint16_t *residual, const m3_tensor *w, float eps,
                                         uint16_t *out) {
    m3_cuda *cu = m3_cuda_of(be);
    if (rows <= 0)
        return M3_OK;
    if (dim < 1 || dim > M3_CUDA_NORM_DIM_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "add_rmsnorm: dim %d is outside [1, %d]", dim,
                       M3_CUDA_NORM_DIM_MAX);
    if (w->dtype != M3_DT_BF16 || !w->data || m3_tensor_nelem(w) != dim)
        return m3_fail(M3_ERR_INTERNAL, "add_rmsnorm: weight %s is not bf16 [%d]",
                       w->name ? w->name : "?", dim);
    const uint16_t *wd = (const uint16_t *)w->data;
    bool vec = dim % 8 == 0 && aligned16(residual) && aligned16(out) && aligned16(wd) &&
               (!add || aligned16(add));
    int nvec = dim / 8;
    /* the fewest items per thread that keep the CTA within 1024 threads
     * (more threads: more loads in flight for a lone decode row) */
    if (!vec) {
        add_rmsnorm_scalar_kernel<<<(unsigned)rows, 256, 0, cu->stream>>>(dim, add, residual, wd,
                                                                          eps, out);
        M3_CUDA_LAUNCHED("add_rmsnorm_scalar_kernel");
    } else if (nvec <= 1024) {
        launch_rmsnorm_vec<1>(cu, rows, dim, add, residual, wd, eps, out);
    } else if (nvec <= 2048) {
        launch_rmsnorm_vec<2>(cu, rows, dim, add, residual, wd, eps, out);
    } else if (nvec <= 4096) {
        launch_rmsnorm_vec<4>(cu, rows, dim, add, residual, wd, eps, out);
    } else {
        launch_rmsnorm_vec<8>(cu, rows, dim, add, residual, wd, eps, out);
    }
    M3_CUDA_LAUNCHED("add_rmsnorm_vec_kernel");
    return M3_OK;
}

/* ------------------------------------------------------------ head norm + RoPE */

#define HNR_MAX_DIM M3_CUDA_HNR_MAX_DIM   /* shared memory per CTA stays under 48 KiB */
#define HNR_MAX_HALF M3_CUDA_HNR_MAX_HALF /* rotary_dim <= 1024 (head_dim <= 1024 by config) */
#define HNR_THREADS 256
/* elements (whole heads) per CTA: few rows get more, smaller CTAs (more SMs
 * busy); many rows get larger ones (more loads in flight per SM, fewer
 * cos/sin tables and barriers per byte) */
#define HNR_CTA_ELEMS_FEW 2048
#define HNR_CTA_ELEMS_MANY 8192
#define HNR_MANY_ROWS 64
#define HNR_PREFETCH 4 /* units per thread loaded before the sincos */

/* inv_freq_i = theta^(-2i / rotary_dim), computed on the host exactly as the
 * CPU backend does (so the angles match it bit for bit), passed by value
 * (__grid_constant__: read in place from the parameter bank, never copied
 * to local memory). With the other arguments the parameters pass 4 KiB,
 * which CUDA >= 12.1 allows on Volta and later (up to 32 KiB). */
struct hnr_freqs {
    double inv_freq[HNR_MAX_HALF];
};

struct hnr_args {
    uint16_t *x;
    int64_t row_stride;
    const uint16_t *w;
    const int64_t *positions;
    int heads, dim, half, hg, groups; /* hg heads per CTA, groups CTAs per row */
    int xs_off;                       /* byte offset of the staged heads in smem */
    float eps;
};

/* smem: (1 + w)[dim], cos[half], sin[half], 1/rms[hg] (fp32), then the
 * CTA's heads as bf16 at a 16-byte aligned offset */
static int hnr_xs_off(int dim, int half, int hg) {
    return ((dim + 2 * half + hg) * 4 + 15) / 16 * 16;
}

template <int V> struct hnr_unit { typedef uint16_t type; };
template <> struct hnr_unit<8> { typedef uint4 type; };

/* Stage the CTA's heads (V elements per unit), 1 + w and the row's cos/sin
 * in shared memory. Each thread issues its first HNR_PREFETCH units' loads
 * and its weight before the double-precision sincos so the latencies
 * overlap (with 16-byte units that is all of them). x is written later by
 * this kernel, so plain loads, not the read-only path. */
template <int V>
__device__ __forceinline__ void hnr_stage(const hnr_args &a, const hnr_freqs &f,
                                          const uint16_t *head0, int n, int row, float *wp1,
                                          float *cs, float *sn, uint16_t *xs) {
    typedef typename hnr_unit<V>::type U;
    const U *src = reinterpret_cast<const U *>(head0);
    U *dst = reinterpret_cast<U *>(xs);
    const int nu = n / V, t = threadIdx.x;
    U pre[HNR_PREFETCH];
#pragma unroll
    for (int k = 0; k < HNR_PREFETCH; k++) {
        int u = t + k * blockDim.x;
        pre[k] = u < nu ? src[u] : U{};
    }
    float w0 = t < a.dim ? m3_bf(a.w[t]) : 0.0f;
    if (t < a.half) {
        int64_t pos = a.positions[row];
        for (int i = t; i < a.half; i += blockDim.x) {
            /* the angle in double: at positions near 2^20 an fp32 angle is
             * off by hundredths of a radian (SPEC §2.3) */
            double s, c;
            sincos((double)pos * f.inv_freq[i], &s, &c);
            cs[i] = (float)c;
            sn[i] = (float)s;
        }
    }
#pragma unroll
    for (int k = 0; k < HNR_PREFETCH; k++) {
        int u = t + k * blockDim.x;
        if (u < nu)
            dst[u] = pre[k];
    }
    for (int u = t + HNR_PREFETCH * blockDim.x; u < nu; u += blockDim.x)
        dst[u] = src[u];
    if (t < a.dim)
        wp1[t] = __fadd_rn(1.0f, w0);
    for (int d = t + blockDim.x; d < a.dim; d += blockDim.x)
        wp1[d] = __fadd_rn(1.0f, m3_bf(a.w[d]));
}

/* y_d of one head: the Gemma norm, then RoPE where d < 2 half, all in fp32
 * with the CPU's operation order; partner values come from the staged head. */
__device__ __forceinline__ float hnr_value(const uint16_t *hx, int d, float r, const float *wp1,
                                           const float *cs, const float *sn, int half) {
    float y = __fmul_rn(__fmul_rn(m3_bf(hx[d]), r), wp1[d]);
    if (d >= 2 * half)
        return y;
    bool lo = d < half;
    int i = lo ? d : d - half, p = lo ? d + half : d - half;
    float yp = __fmul_rn(__fmul_rn(m3_bf(hx[p]), r), wp1[p]);
    float a = __fmul_rn(y, cs[i]), b = __fmul_rn(yp, sn[i]);
    /* o_i = y_i cos - y_{i+half} sin; o_{i+half} = y_{i+half} cos + y_i sin */
    return lo ? __fsub_rn(a, b) : __fadd_rn(a, b);
}

/* One CTA per (row, group of hg heads); x updated in place. Passes: stage,
 * one warp per head for 1/rms, then every unit's outputs rounded once. */
template <int V>
__global__ void __launch_bounds__(HNR_THREADS)
    head_norm_rope_kernel(hnr_args a, const __grid_constant__ hnr_freqs f) {
    extern __shared__ __align__(16) unsigned char hnr_smem[];
    float *wp1 = reinterpret_cast<float *>(hnr_smem);
    float *cs = wp1 + a.dim, *sn = cs + a.half, *rn = sn + a.half;
    uint16_t *xs = reinterpret_cast<uint16_t *>(hnr_smem + a.xs_off);
    int row = blockIdx.x / a.groups, h0 = (blockIdx.x % a.groups) * a.hg;
    int nh = min(a.hg, a.heads - h0), n = nh * a.dim;
    uint16_t *head0 = a.x + (int64_t)row * a.row_stride + (int64_t)h0 * a.dim;
    hnr_stage<V>(a, f, head0, n, row, wp1, cs, sn, xs);
    __syncthreads();

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int h = warp; h < nh; h += nwarps) {
        double ss = 0.0;
        for (int d = lane; d < a.dim; d += 32) {
            double v = (double)m3_bf(xs[h * a.dim + d]);
            ss += v * v;
        }
        ss = m3_warp_sum_d(ss);
        if (lane == 0)
            rn[h] = 1.0f / sqrtf((float)(ss / (double)a.dim) + a.eps);
    }
    __syncthreads();

    for (int u = threadIdx.x; u < n / V; u += blockDim.x) {
        int e0 = u * V, h = e0 / a.dim, d0 = e0 - h * a.dim; /* V divides dim */
        const uint16_t *hx = xs + h * a.dim;
        if (V == 8 && a.half % 8 == 0) {
            reinterpret_cast<uint4 *>(head0)[u] = hnr_unit8(hx, d0, rn[h], wp1, cs, sn, a.half);
            continue;
        }
        float y[V];
#pragma unroll
        for (int j = 0; j < V; j++)
            y[j] = hnr_value(hx, d0 + j, rn[h], wp1, cs, sn, a.half);
        if (V == 8)
            reinterpret_cast<uint4 *>(head0)[u] = pack8(y);
        else
            head0[u] = m3_to_bf(y[0]);
    }
}

static m3_status hnr_check(int heads, int dim, int64_t row_stride, const m3_tensor *w,
                           const m3_rope *rope) {
    if (dim < 1 || dim > HNR_MAX_DIM)
        return m3_fail(M3_ERR_UNSUPPORTED, "head_norm_rope: head dim %d is outside [1, %d]", dim,
                       HNR_MAX_DIM);
    if (rope->rotary_dim < 0 || rope->rotary_dim % 2 || rope->rotary_dim > dim ||
        rope->rotary_dim / 2 > HNR_MAX_HALF)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "head_norm_rope: rotary_dim %d must be even, at most head dim %d and at "
                       "most %d",
                       rope->rotary_dim, dim, 2 * HNR_MAX_HALF);
    if (!(rope->theta > 0))
        return m3_fail(M3_ERR_INVALID_ARG, "head_norm_rope: rope theta %g must be > 0",
                       rope->theta);
    if (row_stride < (int64_t)heads * dim)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "head_norm_rope: row stride %lld is less than %d heads x %d dims",
                       (long long)row_stride, heads, dim);
    if (w->dtype != M3_DT_BF16 || !w->data || m3_tensor_nelem(w) != dim)
        return m3_fail(M3_ERR_INTERNAL, "head_norm_rope: weight %s is not bf16 [%d]",
                       w->name ? w->name : "?", dim);
    return M3_OK;
}

extern "C" m3_status m3_cuda_head_norm_rope(m3_backend *be, int rows, int heads, int dim,
                                            uint16_t *x, int64_t row_stride, const m3_tensor *w,
                                            float eps, const int64_t *positions,
                                            const m3_rope *rope) {
    m3_cuda *cu = m3_cuda_of(be);
    if (rows <= 0 || heads <= 0)
        return M3_OK;
    M3_TRY(hnr_check(heads, dim, row_stride, w, rope));
    hnr_freqs f;
    int half = rope->rotary_dim / 2;
    for (int i = 0; i < HNR_MAX_HALF; i++) /* the CPU's m3_rope_table expression */
        f.inv_freq[i] =
            i < half ? pow(rope->theta, -(double)(2 * i) / (double)rope->rotary_dim) : 0.0;
    int hg = (rows >= HNR_MANY_ROWS ? HNR_CTA_ELEMS_MANY : HNR_CTA_ELEMS_FEW) / dim;
    hg = hg < 1 ? 1 : (hg > heads ? heads : hg);
    hg = hg < 256 ? hg : 256; /* tiny heads: the 1/rms array stays small */
    int groups = (heads + hg - 1) / hg;
    if ((int64_t)rows * groups > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "head_norm_rope: %d rows x %d head groups is too many",
                       rows, groups);
    hnr_args a = {x, row_stride, (const uint16_t *)w->data, positions, heads, dim, half, hg,
                  groups, hnr_xs_off(dim, half, hg), eps};
    size_t smem = (size_t)a.xs_off + (size_t)hg * dim * sizeof(uint16_t);
    bool vec = dim % 8 == 0 && row_stride % 8 == 0 && aligned16(x);
    int units = vec ? hg * dim / 8 : hg * dim;
    int threads = units < HNR_THREADS ? round_up32(units) : HNR_THREADS;
    unsigned grid = (unsigned)((int64_t)rows * groups);
    if (vec)
        head_norm_rope_kernel<8><<<grid, threads, smem, cu->stream>>>(a, f);
    else
        head_norm_rope_kernel<1><<<grid, threads, smem, cu->stream>>>(a, f);
    M3_CUDA_LAUNCHED("head_norm_rope_kernel");
    return M3_OK;
}

/* ------------------------------------------------------------ SwiGLU-OAI */

/* out = bf16(swiglu_oai(gate, up)), 8 elements per thread per step over a
 * grid-stride loop; the n % 8 tail goes to the grid's first threads. */
__global__ void __launch_bounds__(256)
    swiglu_vec_kernel(int64_t n, const uint16_t *gate, const uint16_t *up, float alpha,
                      float limit, uint16_t *out) {
    int64_t nvec = n / 8, stride = (int64_t)gridDim.x * blockDim.x;
    int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t v = tid; v < nvec; v += stride) {
        float g[8], u[8];
        unpack8(reinterpret_cast<const uint4 *>(gate)[v], g);
        unpack8(reinterpret_cast<const uint4 *>(up)[v], u);
#pragma unroll
        for (int j = 0; j < 8; j++)
            g[j] = m3_swiglu_oai(g[j], u[j], alpha, limit);
        reinterpret_cast<uint4 *>(out)[v] = pack8(g);
    }
    if (tid < n - nvec * 8) {
        int64_t i = nvec * 8 + tid;
        out[i] = m3_to_bf(m3_swiglu_oai(m3_bf(gate[i]), m3_bf(up[i]), alpha, limit));
    }
}

/* Any alignment: one element per thread per step. */
__global__ void __launch_bounds__(256)
    swiglu_scalar_kernel(int64_t n, const uint16_t *gate, const uint16_t *up, float alpha,
                         float limit, uint16_t *out) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = m3_to_bf(m3_swiglu_oai(m3_bf(gate[i]), m3_bf(up[i]), alpha, limit));
}

extern "C" m3_status m3_cuda_swiglu(m3_backend *be, int64_t n, const uint16_t *gate,
                                    const uint16_t *up, const m3_swiglu *act, uint16_t *out) {
    m3_cuda *cu = m3_cuda_of(be);
    if (n <= 0)
        return M3_OK;
    bool vec = aligned16(gate) && aligned16(up) && aligned16(out);
    int64_t work = vec ? (n / 8 > 0 ? n / 8 : 1) : n;
    /* enough CTAs to fill the GPU a few times over; the loop does the rest */
    int64_t cap = (int64_t)(cu->sm_count > 0 ? cu->sm_count : 132) * 16;
    int64_t blocks = (work + 255) / 256;
    blocks = blocks < cap ? blocks : cap;
    if (vec)
        swiglu_vec_kernel<<<(unsigned)blocks, 256, 0, cu->stream>>>(n, gate, up, act->alpha,
                                                                    act->limit, out);
    else
        swiglu_scalar_kernel<<<(unsigned)blocks, 256, 0, cu->stream>>>(n, gate, up, act->alpha,
                                                                       act->limit, out);
    M3_CUDA_LAUNCHED("swiglu_kernel");
    return M3_OK;
}

__global__ void round_bf16_kernel(int64_t n, const float *__restrict__ in,
                                  uint16_t *__restrict__ out) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = m3_to_bf(in[i]);
}

extern "C" m3_status m3_cuda_round_bf16(m3_backend *be, int64_t n, m3_dtype in_dtype,
                                        const void *in_ptr, uint16_t *out) {
    if (n <= 0)
        return M3_OK;
    if (in_dtype != M3_DT_F32)
        return m3_fail(M3_ERR_INTERNAL, "round_bf16: input dtype %s (CUDA partials are F32)",
                       m3_dtype_name(in_dtype));
    const float *in = (const float *)in_ptr;
    int64_t blocks = (n + 255) / 256;
    round_bf16_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0,
                        m3_cuda_of(be)->stream>>>(n, in, out);
    M3_CUDA_LAUNCHED("round_bf16_kernel");
    return M3_OK;
}
