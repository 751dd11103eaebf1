/*
 * The CUDA side of the benchmark instruments (see cuda_bench.h).
 */
#include <algorithm>
#include <string.h>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"

extern "C" {
#include "cuda/cuda_bench.h"
}

/* Each thread reads 16-byte words strided over the grid; the xor keeps the
 * loads live, and one word per CTA is written so nothing is optimised out. */
__global__ void read_bw_kernel(const uint4 *__restrict__ src, size_t n, uint32_t *__restrict__ sink) {
    uint32_t acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(src + i); /* streaming: do not keep in L2 */
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    acc = __reduce_xor_sync(0xffffffffu, acc);
    if ((threadIdx.x & 31) == 0 && acc == 0x12345678u)
        sink[blockIdx.x] = acc;
}

/* The median time of one read-only kernel over `bytes`: a graph of
 * `launches` kernels, the i-th over window i of a pool of `pool` bytes
 * (windows of `bytes` rounded up to 256, wrapping), replayed iters times
 * after two warm-ups; *us = median replay / launches. With windows a pool
 * several times the L2 apart, no launch reads what the one before left in
 * L2. */
static m3_status time_reads(m3_cuda *cu, size_t pool, size_t bytes, int launches, int iters,
                            double *us) {
    const size_t window = (bytes + 255) & ~(size_t)255;
    void *buf = NULL, *sink = NULL;
    M3_CUDA_TRY(cudaMalloc(&buf, pool));
    cudaError_t err = cudaMalloc(&sink, 1 << 20);
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t a = NULL, b = NULL;
    if (err == cudaSuccess)
        err = cudaMemsetAsync(buf, 0x5a, pool, cu->stream);
    if (err == cudaSuccess)
        err = cudaStreamBeginCapture(cu->stream, cudaStreamCaptureModeThreadLocal);
    if (err == cudaSuccess) {
        const unsigned grid = (unsigned)cu->sm_count * 8;
        size_t off = 0;
        for (int i = 0; i < launches; i++) {
            if (off + window > pool)
                off = 0;
            read_bw_kernel<<<grid, 512, 0, cu->stream>>>(
                (const uint4 *)((const char *)buf + off), bytes / 16, (uint32_t *)sink);
            off += window;
        }
        cudaError_t end = cudaStreamEndCapture(cu->stream, &g);
        err = err == cudaSuccess ? end : err;
    }
    if (err == cudaSuccess)
        err = cudaGraphInstantiate(&ge, g, 0);
    if (err == cudaSuccess)
        err = cudaEventCreate(&a);
    if (err == cudaSuccess)
        err = cudaEventCreate(&b);
    std::vector<float> ms;
    for (int i = 0; err == cudaSuccess && i < iters + 2; i++) {
        cudaEventRecord(a, cu->stream);
        err = cudaGraphLaunch(ge, cu->stream);
        cudaEventRecord(b, cu->stream);
        if (err == cudaSuccess)
            err = cudaEventSynchronize(b);
        float t = 0;
        if (err == cudaSuccess)
            err = cudaEventElapsedTime(&t, a, b);
        if (i >= 2) /* two warm-ups */
            ms.push_back(t);
    }
    if (a)
        cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    if (ge)
        cudaGraphExecDestroy(ge);
    if (g)
        cudaGraphDestroy(g);
    cudaFree(buf);
    if (sink)
        cudaFree(sink);
    if (err != cudaSuccess)
        return m3_cuda_error(err, "read timing", __FILE__, __LINE__);
    std::sort(ms.begin(), ms.end());
    *us = ms[ms.size() / 2] * 1e3 / launches;
    return M3_OK;
}

extern "C" m3_status m3_cuda_read_bandwidth(m3_backend *be, size_t bytes, int iters,
                                            double *gb_per_s) {
    if (bytes < 16 || iters < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "read bandwidth: %zu bytes, %d iterations", bytes,
                       iters);
    double us = 0;
    M3_TRY(time_reads(m3_cuda_of(be), bytes, bytes, 1, iters, &us));
    *gb_per_s = (double)bytes / (us * 1e-6) / 1e9;
    return M3_OK;
}

/* The time one read-only kernel takes over `bytes`, the same kernel as
 * m3_cuda_read_bandwidth at the size of one step: its ramp, tail and the
 * gap between two kernels of a graph are in it, as they are in a layer's
 * graph replay. Eight launches over a pool of at least 1 GiB. */
extern "C" m3_status m3_cuda_read_time(m3_backend *be, size_t bytes, int iters, double *us) {
    if (bytes < 16 || iters < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "read time: %zu bytes, %d iterations", bytes, iters);
    const size_t window = (bytes + 255) & ~(size_t)255;
    return time_reads(m3_cuda_of(be), std::max((size_t)1 << 30, window * 3), bytes, 8, iters,
                      us);
}

extern "C" m3_status m3_cuda_timed_launch(m3_backend *be, void *graph, double *us) {
    m3_cuda *cu = m3_cuda_of(be);
    cudaEvent_t a, b;
    M3_CUDA_TRY(cudaEventCreate(&a));
    cudaError_t err = cudaEventCreate(&b);
    float ms = 0;
    if (err == cudaSuccess)
        err = cudaEventRecord(a, cu->stream);
    if (err == cudaSuccess)
        err = cudaGraphLaunch((cudaGraphExec_t)graph, cu->stream);
    if (err == cudaSuccess)
        err = cudaEventRecord(b, cu->stream);
    if (err == cudaSuccess)
        err = cudaEventSynchronize(b);
    if (err == cudaSuccess)
        err = cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    if (err != cudaSuccess)
        return m3_cuda_error(err, "timed graph launch", __FILE__, __LINE__);
    *us = ms * 1e3;
    return M3_OK;
}

__global__ void fill_random_kernel(uint16_t *dst, size_t n, uint64_t seed, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t x = seed ^ (i * 0x9e3779b97f4a7c15ull);
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        x ^= x >> 31;
        float u = (float)(x >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
        dst[i] = m3_to_bf((2.0f * u - 1.0f) * scale);
    }
}

extern "C" m3_status m3_cuda_fill_random_bf16(m3_backend *be, void *dst, size_t n, uint64_t seed,
                                              float scale) {
    m3_cuda *cu = m3_cuda_of(be);
    fill_random_kernel<<<(unsigned)cu->sm_count * 16, 256, 0, cu->stream>>>((uint16_t *)dst, n,
                                                                            seed, scale);
    M3_CUDA_LAUNCHED("fill_random_kernel");
    return M3_OK;
}

extern "C" m3_status m3_cuda_moe_unique_experts(m3_backend *be, int *n) {
    m3_cuda *cu = m3_cuda_of(be);
    *n = 0;
    if (!cu->moe_n_uniq)
        return m3_fail(M3_ERR_INVALID_ARG, "no MoE op has run on this backend");
    int32_t v = 0;
    M3_CUDA_TRY(cudaMemcpyAsync(&v, cu->moe_n_uniq, sizeof v, cudaMemcpyDeviceToHost, cu->stream));
    M3_CUDA_TRY(cudaStreamSynchronize(cu->stream));
    *n = v;
    return M3_OK;
}

/* Median microseconds of iters runs of fn(i) between events. */
template <typename Fn>
static m3_status time_median(m3_cuda *cu, int iters, Fn fn, double *us) {
    std::vector<float> ms;
    cudaEvent_t a, b;
    M3_CUDA_TRY(cudaEventCreate(&a));
    M3_CUDA_TRY(cudaEventCreate(&b));
    m3_status st = M3_OK;
    for (int i = -3; i < iters && !st; i++) {
        cudaEventRecord(a, cu->stream);
        st = fn(i + 3);
        cudaEventRecord(b, cu->stream);
        cudaError_t err = cudaEventSynchronize(b);
        float t = 0;
        if (!st && err == cudaSuccess)
            err = cudaEventElapsedTime(&t, a, b);
        if (!st && err != cudaSuccess)
            st = m3_cuda_error(err, "timing", __FILE__, __LINE__);
        if (i >= 0)
            ms.push_back(t);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    if (st)
        return st;
    std::sort(ms.begin(), ms.end());
    *us = ms[ms.size() / 2] * 1e3;
    return M3_OK;
}

extern "C" m3_status m3_cuda_bench_linear(m3_backend *be, int rows, int64_t n, int64_t k,
                                          int iters, double *gemv_us, double *cublas_us,
                                          double *one_gemm_us) {
    m3_cuda *cu = m3_cuda_of(be);
    size_t wbytes = (size_t)(n * k * 2);
    int copies = (int)std::min<size_t>(16, std::max<size_t>(1, (4 * cu->l2_bytes) / wbytes + 1));
    uint16_t *w = NULL, *x = NULL, *out = NULL;
    M3_CUDA_TRY(cudaMalloc(&w, wbytes * copies));
    cudaError_t err = cudaMalloc(&x, (size_t)rows * k * 2);
    if (err == cudaSuccess)
        err = cudaMalloc(&out, (size_t)rows * n * 2);
    m3_status st = err == cudaSuccess ? M3_OK : m3_cuda_error(err, "cudaMalloc", __FILE__, __LINE__);
    if (!st)
        st = m3_cuda_fill_random_bf16(be, w, (size_t)n * k * copies, 7, 0.05f);
    if (!st)
        st = m3_cuda_fill_random_bf16(be, x, (size_t)rows * k, 8, 1.0f);
    auto view = [&](int i) {
        m3_linear l;
        memset(&l, 0, sizeof l);
        int64_t ne[2] = {n, k};
        l.w = m3_tensor_make(M3_DT_BF16, 2, ne, (char *)w + (size_t)(i % copies) * wbytes);
        return l;
    };
    if (!st)
        st = time_median(cu, iters, [&](int i) {
            m3_linear l = view(i); /* as a column-parallel weight */
            l.n_chunks = n % M3_N_BLOCKS == 0 ? M3_N_BLOCKS : 0;
            return m3_cuda_linear(be, rows, x, &l, M3_DT_BF16, out);
        }, gemv_us);
    if (!st) /* a row-parallel weight: K cut into its chunks, then the tree */
        st = time_median(cu, iters, [&](int i) {
            m3_linear l = view(i);
            l.k_chunks = m3_k_chunks(k);
            return m3_cuda_linear_cublas(cu, rows, x, &l, M3_DT_BF16, out);
        }, cublas_us);
    if (!st) /* one GEMM, uncut */
        st = time_median(cu, iters, [&](int i) {
            m3_linear l = view(i);
            return m3_cuda_linear_cublas(cu, rows, x, &l, M3_DT_BF16, out);
        }, one_gemm_us);
    cudaFree(w);
    if (x)
        cudaFree(x);
    if (out)
        cudaFree(out);
    return st;
}
