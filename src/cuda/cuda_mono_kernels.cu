/*
 * The mono executor's kernel unit: the two persistent kernels (their item
 * loops), the fault word kernels, and the launch entry points the host side
 * (cuda_mono.cu, which describes the design) calls.
 */
#include "cuda/cuda_mono_args.cuh"
#include "cuda/cuda_mono_dev.cuh"
#include "cuda/cuda_mono_pre.cuh"
#include "cuda/cuda_mono_attn.cuh"
#include "cuda/cuda_mono_ffn.cuh"

namespace m3mono {

/* ================================================================ kernels */

/* The last CTA out zeroes the counters for the next launch (and, after a
 * post launch, counts the call: the next call's landing tags). */
__device__ void finish(const MonoArgs &a, Ctl &ctl, bool post) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        ctl.flag = atomicAdd(&a.ctr[C_EXIT], 1u) == gridDim.x - 1;
        __threadfence();
    }
    __syncthreads();
    if (ctl.flag) {
        for (int i = threadIdx.x; i < a.n_ctr; i += kThreads)
            a.ctr[i] = 0u;
        if (post && threadIdx.x == 0)
            *a.calls += 1u;
    }
}

/* The item cursor: read the prefetched index and the fault word; false
 * when the item is past `total`. */
__device__ __forceinline__ int next_item(const MonoArgs &a, Ctl &ctl, bool *faulted) {
    if (threadIdx.x == 0) {
        ctl.faulted = ld_vol(a.fault) != 0;
        s_t_ready = 0;
    }
    __syncthreads();
    int cur = ctl.cur;
    *faulted = ctl.faulted != 0;
    __syncthreads(); /* ctl.cur is rewritten at the end of this item */
    return cur;
}

/* One traced item: kernel (0 pre, 1 post), item kind, CTA, item index and
 * its start and end on the global timer. Thread 0 only; off unless the
 * executor was created with M3_MONO_TRACE set. */
__device__ __forceinline__ void trace_item(const MonoArgs &a, int kernel, int kind, int item,
                                           unsigned long long t0) {
    if (!a.trace || threadIdx.x != 0)
        return;
    unsigned i = atomicAdd(a.trace_n, 1u);
    if (i >= a.trace_cap)
        return;
    unsigned long long meta = ((unsigned long long)kernel << 56) |
                              ((unsigned long long)kind << 48) |
                              ((unsigned long long)blockIdx.x << 32) | (unsigned)item;
    a.trace[4 * (size_t)i] = meta;
    a.trace[4 * (size_t)i + 1] = t0;
    a.trace[4 * (size_t)i + 2] = gtimer();
    a.trace[4 * (size_t)i + 3] = s_t_ready; /* 0: the item did not wait */
}

template <int NR>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mono_pre_kernel(const __grid_constant__ MonoArgs a) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ Ctl ctl;
    knobs_init(a);
    const int n_norm = a.T, n_proj = a.p_item0[5], n_idx = a.T * a.G;
    const int total = n_norm + n_proj + n_idx;
    if (threadIdx.x == 0)
        ctl.cur = (int)atomicAdd(&a.ctr[C_QUEUE], 1u);
    for (;;) {
        bool faulted;
        int cur = next_item(a, ctl, &faulted);
        if (cur >= total)
            break;
        unsigned nxt = 0;
        if (threadIdx.x == 0)
            nxt = atomicAdd(&a.ctr[C_QUEUE], 1u); /* in flight during the item */
        unsigned long long t0 = a.trace ? gtimer() : 0;
        int item = cur, kind;
        if (cur < n_norm)
            kind = 0, norm1_item(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_norm) < n_proj)
            kind = 1, proj_item<NR>(a, ctl, dsm, cur, faulted);
        else
            kind = 2, idx_item(a, ctl, dsm, cur - n_proj, faulted);
        trace_item(a, 0, kind, item, t0);
        if (threadIdx.x == 0)
            ctl.cur = (int)nxt;
    }
    finish(a, ctl, false);
}

template <int NR>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mono_post_kernel(const __grid_constant__ MonoArgs a) {
    constexpr int ENR = NR <= 1 ? 1 : (NR <= 2 ? 2 : 4);
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ Ctl ctl;
    knobs_init(a);
    const int n_sel = a.T * a.Ni, n_att = a.T * a.Nkv * a.mtiles * a.S;
    const int n_o = (a.H / kTile) * a.s_o, n_n2 = a.T, n_rt = a.rt_tiles * a.s_rt;
    const int n_shgu = a.Is ? (a.Is / 4) * a.s_shgu : 0;
    const int n_shdn = a.Is ? (a.H / kTile) * a.s_shdn : 0;
    const int n_fin = a.world > 1 ? a.T * ((a.H + 1023) / 1024) : 0;
    const int base_dyn = n_sel + n_att + n_o + n_n2 + n_rt + n_shgu;
    if (threadIdx.x == 0) {
        ctl.cur = (int)atomicAdd(&a.ctr[C_QUEUE], 1u);
        /* Landing tags (world > 1) from the count of earlier post launches,
         * which only the previous launch's last CTA changed: the same in
         * every CTA, the same on every rank (ranks run the same layer calls),
         * and new for every call, CUDA graph replays included (a kernel
         * parameter would be frozen in the graph). Odd / even, never the
         * buffers' initial 0 on the o side. */
        uint32_t calls = *(const volatile uint32_t *)a.calls;
        ctl.tag_o = 2u * calls + 1u;
        ctl.tag_f = 2u * calls + 2u;
    }
    for (;;) {
        bool faulted;
        int cur = next_item(a, ctl, &faulted);
        int n_egu = 0, n_edn = 0;
        if (cur >= base_dyn) { /* the routed experts' items exist once the plan does */
            wait_count(&a.ctr[C_PLAN], 1u);
            const int nu = __ldcg(a.n_uniq);
            n_egu = nu * (a.I / 4);
            n_edn = nu * edn_groups(a.H);
            if (cur - base_dyn >= n_egu + n_shdn + n_edn + n_fin)
                break;
        }
        unsigned nxt = 0;
        if (threadIdx.x == 0)
            nxt = atomicAdd(&a.ctr[C_QUEUE], 1u);
        unsigned long long t0 = a.trace ? gtimer() : 0;
        int item = cur, kind;
        if (cur < n_sel)
            kind = 0, sel_item(a, dsm, cur, faulted);
        else if ((cur -= n_sel) < n_att)
            kind = 1, att_item(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_att) < n_o)
            kind = 2, oproj_item<NR>(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_o) < n_n2)
            kind = 3, norm2_item(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_n2) < n_rt)
            kind = 4, router_item<NR>(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_rt) < n_shgu)
            kind = 5, shgu_item<NR>(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_shgu) < n_egu)
            kind = 6, egu_item<ENR>(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_egu) < n_shdn)
            kind = 7, shdn_item<NR>(a, ctl, dsm, cur, faulted);
        else if ((cur -= n_shdn) < n_edn)
            kind = 8, edn_item<ENR>(a, ctl, dsm, cur, faulted);
        else
            kind = 9, final_item(a, ctl, cur - n_edn, faulted);
        trace_item(a, 1, kind, item, t0);
        if (threadIdx.x == 0)
            ctl.cur = (int)nxt;
    }
    finish(a, ctl, true);
}

/* ---------------------------------------------------------------- fault word */

} // namespace m3mono

/* The check kernel's device-side assert must survive -DNDEBUG (release
 * builds): re-include assert.h with NDEBUG lifted. Nothing after this point
 * uses assert otherwise. */
#ifdef NDEBUG
#undef NDEBUG
#include <assert.h>
#define NDEBUG 1
#else
#include <assert.h>
#endif

namespace m3mono {

/* the names of m3_mono_fault_name, from the same list (mono/fault.h), for
 * the device printf; tests/gpu/test_cuda_mono.c checks that they agree */
#define M3_FAULT_CASE_DEV(code, name) \
    case code:                        \
        return name;
__device__ const char *fault_name_dev(int code) {
    switch (code) {
        M3_MONO_FAULT_NAMES(M3_FAULT_CASE_DEV)
    default:
        return "unknown fault";
    }
}

__global__ void mono_check_kernel(const int *f) {
    int code = ld_vol(f);
    if (code == 0)
        return;
    printf("m3: mono fault: %s (layer %d, row %d, value %d)\n", fault_name_dev(code),
           ld_vol(f + 1), ld_vol(f + 2), ld_vol(f + 3));
    /* a device-side assert (enabled here even in release builds, see the
     * include above): the runtime reports it as cudaErrorAssert with its
     * message, the printf above is flushed with it, and no later work of
     * the context runs; __trap() in case assert is compiled out anyway */
    assert(code == 0 && "m3 mono fault word is set");
    __trap();
}

__global__ void mono_set_kernel(int *f, int code, int layer) {
    if (atomicCAS(f, 0, code) == 0) {
        f[1] = layer;
        f[2] = -1;
        f[3] = 0;
    }
}

/* ================================================================ entry points */

template <int NR>
static m3_status occupancy_of(size_t smem, int *min_occ) {
    const void *fns[2] = {(const void *)mono_pre_kernel<NR>, (const void *)mono_post_kernel<NR>};
    for (int i = 0; i < 2; i++) {
        M3_CUDA_TRY(cudaFuncSetAttribute(fns[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem));
        int n = 0;
        M3_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fns[i], kThreads, smem));
        if (n < *min_occ)
            *min_occ = n;
    }
    return M3_OK;
}

m3_status occupancy(size_t smem, int *min_occ) {
    M3_TRY(occupancy_of<1>(smem, min_occ));
    M3_TRY(occupancy_of<2>(smem, min_occ));
    M3_TRY(occupancy_of<4>(smem, min_occ));
    M3_TRY(occupancy_of<8>(smem, min_occ));
    return occupancy_of<16>(smem, min_occ);
}

template <int NR>
static m3_status launch_nr(cudaStream_t s, int P, size_t smem, const MonoArgs &a) {
    mono_pre_kernel<NR><<<(unsigned)P, kThreads, smem, s>>>(a);
    M3_CUDA_LAUNCHED("mono_pre_kernel");
    mono_post_kernel<NR><<<(unsigned)P, kThreads, smem, s>>>(a);
    M3_CUDA_LAUNCHED("mono_post_kernel");
    return M3_OK;
}

m3_status launch_layer(cudaStream_t s, int P, size_t smem, const MonoArgs &a) {
    if (a.T <= 1)
        return launch_nr<1>(s, P, smem, a);
    if (a.T <= 2)
        return launch_nr<2>(s, P, smem, a);
    if (a.T <= 4)
        return launch_nr<4>(s, P, smem, a);
    if (a.T <= 8)
        return launch_nr<8>(s, P, smem, a);
    return launch_nr<16>(s, P, smem, a);
}

m3_status launch_check(cudaStream_t s, const int *fault) {
    mono_check_kernel<<<1, 1, 0, s>>>(fault);
    M3_CUDA_LAUNCHED("mono_check_kernel");
    return M3_OK;
}

m3_status launch_set(cudaStream_t s, int *fault, int code, int layer) {
    mono_set_kernel<<<1, 1, 0, s>>>(fault, code, layer);
    M3_CUDA_LAUNCHED("mono_set_kernel");
    return M3_OK;
}

} // namespace m3mono
