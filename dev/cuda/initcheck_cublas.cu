/*
 * Does compute-sanitizer's initcheck see what cuBLAS writes? The op tests'
 * initcheck reports (docs/PERF.md, tenth and eleventh sessions) are all
 * reads of outputs that m3_cuda_linear wrote through cuBLAS (prefill rows,
 * bf16 weights), and those outputs match the CPU. This program repeats that
 * pattern in isolation: a bf16 GEMM (cublasGemmStridedBatchedEx, the call
 * and layout m3_cuda_linear uses) into a fresh cudaMalloc buffer, then a
 * kernel of ours that reads every element; and, as a control, the same read
 * of a buffer our own kernel wrote. Every output is checked against a CPU
 * reference, so a run that prints PASS wrote every element; run under
 * `compute-sanitizer --tool initcheck`, a report on the cuBLAS buffer then
 * means the tool does not track cuBLAS's stores (scripts/gpu-check stage
 * `cublasinit`).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>

#include "dev_util.h"

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* out[i] = float of src[i], every element read once */
__global__ void read_kernel(const __nv_bfloat16 *src, float *out, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __bfloat162float(src[i]);
}

/* the control: our own kernel writes the buffer the read kernel reads */
__global__ void copy_kernel(const __nv_bfloat16 *src, __nv_bfloat16 *dst, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

static bool run_shape(cublasHandle_t h, int m, int n, int k) {
    DevRng rng(1234 + m + n + k);
    std::vector<uint16_t> w((size_t)n * k), x((size_t)m * k);
    for (auto &v : w)
        v = to_bf16(rng.uniform() * 0.1f);
    for (auto &v : x)
        v = to_bf16(rng.uniform());
    void *dw, *dx, *dout, *dcopy;
    float *dread;
    size_t out_n = (size_t)m * n;
    DEV_CK(cudaMalloc(&dw, w.size() * 2));
    DEV_CK(cudaMalloc(&dx, x.size() * 2));
    DEV_CK(cudaMalloc(&dout, out_n * 2)); /* fresh: nothing of ours writes it */
    DEV_CK(cudaMalloc(&dcopy, out_n * 2));
    DEV_CK(cudaMalloc(&dread, out_n * 4));
    DEV_CK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    DEV_CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    float alpha = 1.0f, beta = 0.0f;
    /* row-major out[m, n] = x[m, k] w[n, k]^T, as column-major out^T = w x^T */
    cublasStatus_t s = cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, dw, CUDA_R_16BF, k, 0, dx, CUDA_R_16BF, k,
        0, &beta, dout, CUDA_R_16BF, n, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasGemmStridedBatchedEx [%d x %d x %d] failed: %d\n", m, n, k, (int)s);
        return false;
    }
    printf("shape m %d n %d k %d: reading the cuBLAS output\n", m, n, k);
    fflush(stdout);
    read_kernel<<<132, 256>>>((const __nv_bfloat16 *)dout, dread, (int64_t)out_n);
    DEV_CK(cudaGetLastError());
    DEV_CK(cudaDeviceSynchronize());
    std::vector<float> got(out_n);
    DEV_CK(cudaMemcpy(got.data(), dread, out_n * 4, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double ref = 0;
            for (int c = 0; c < k; c++)
                ref += (double)from_bf16(x[(size_t)i * k + c]) * from_bf16(w[(size_t)j * k + c]);
            double d = got[(size_t)i * n + j] - ref;
            err += d * d, norm += ref * ref;
        }
    double rel = std::sqrt(err / (norm > 0 ? norm : 1));
    printf("shape m %d n %d k %d: relative L2 error %.2e against the CPU\n", m, n, k, rel);
    printf("shape m %d n %d k %d: reading a buffer our kernel wrote (control)\n", m, n, k);
    fflush(stdout);
    copy_kernel<<<132, 256>>>((const __nv_bfloat16 *)dout, (__nv_bfloat16 *)dcopy,
                              (int64_t)out_n);
    read_kernel<<<132, 256>>>((const __nv_bfloat16 *)dcopy, dread, (int64_t)out_n);
    DEV_CK(cudaGetLastError());
    DEV_CK(cudaDeviceSynchronize());
    DEV_CK(cudaFree(dw));
    DEV_CK(cudaFree(dx));
    DEV_CK(cudaFree(dout));
    DEV_CK(cudaFree(dcopy));
    DEV_CK(cudaFree(dread));
    bool ok = rel < 1e-2; /* bf16 output rounding: ~4e-3 */
    printf("shape m %d n %d k %d: %s\n", m, n, k, ok ? "PASS" : "FAIL");
    return ok;
}

int main() {
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasCreate failed\n");
        return 1;
    }
    bool ok = run_shape(h, 64, 256, 512) && run_shape(h, 64, 1536, 6144);
    cublasDestroy(h);
    return ok ? 0 : 1;
}
