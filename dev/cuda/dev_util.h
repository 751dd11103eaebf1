/*
 * Host helpers the dev/cuda experiments share: a CUDA call check that ends
 * the program with the call and the error (these are standalone
 * measurements run by hand or by scripts/gpu-check, not the library, whose
 * calls return a status instead), a seeded uniform generator for the
 * inputs, a median, an L2 flush buffer (a buffer larger than L2,
 * written between timed runs so every run starts cold) and event timing.
 */
#ifndef M3_DEV_CUDA_DEV_UTIL_H
#define M3_DEV_CUDA_DEV_UTIL_H

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define DEV_CK(x)                                                                                  \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* U(-1, 1) from a 64-bit LCG: the same inputs on every run and machine */
struct DevRng {
    uint64_t s;
    explicit DevRng(uint64_t seed) : s(seed) {}
    float uniform() {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (float)((s >> 40) & 0xffffff) / (float)0x800000 - 1.0f;
    }
};

/* the median (the upper one of an even count); 0 for none; sorts v */
inline double dev_median(std::vector<double> &v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

/* writing this (4 x L2) between runs evicts the previous run's lines */
struct DevL2Flush {
    void *buf = nullptr;
    size_t bytes = 0;
    explicit DevL2Flush(const cudaDeviceProp &prop) : bytes((size_t)prop.l2CacheSize * 4) {
        DEV_CK(cudaMalloc(&buf, bytes));
    }
    void flush(int run) { DEV_CK(cudaMemset(buf, run & 0xff, bytes)); }
};

/* `prog [--runs N]`: N (> 0) into *runs, or a usage line and false */
inline bool dev_runs_arg(int argc, char **argv, const char *prog, int *runs) {
    if (argc == 3 && std::string(argv[1]) == "--runs" && atoi(argv[2]) > 0) {
        *runs = atoi(argv[2]);
        return true;
    }
    if (argc == 1)
        return true;
    fprintf(stderr, "usage: %s [--runs N]\n", prog);
    return false;
}

/* Event timing of what is enqueued between start() and stop_us(): stop_us
 * also checks the launches and waits for them. */
struct DevTimer {
    cudaEvent_t e0, e1;
    DevTimer() {
        DEV_CK(cudaEventCreate(&e0));
        DEV_CK(cudaEventCreate(&e1));
    }
    void start() { DEV_CK(cudaEventRecord(e0)); }
    double stop_us() {
        DEV_CK(cudaEventRecord(e1));
        DEV_CK(cudaGetLastError());
        DEV_CK(cudaEventSynchronize(e1));
        float ms;
        DEV_CK(cudaEventElapsedTime(&ms, e0, e1));
        return ms * 1e3;
    }
};

#endif
