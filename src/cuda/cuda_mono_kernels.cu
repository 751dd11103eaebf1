/*
 * The mono executor's kernel unit: the world-1 variants of the two
 * persistent kernels (cuda_mono_kernels.cuh; the TP ones are in
 * cuda_mono_kernels_tp.cu), the fault word kernels, and the launch entry
 * points the host side (cuda_mono.cu, which describes the design) calls.
 */
#include "cuda/cuda_mono_kernels.cuh"

/* ---------------------------------------------------------------- fault word */

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

/* the TP variants are instantiated in cuda_mono_kernels_tp.cu, not here */
extern template m3_status occupancy_variant<V_TP>(size_t, int *);
extern template m3_status occupancy_variant<V_TP | V_F8>(size_t, int *);
extern template m3_status launch_variant<V_TP>(cudaStream_t, int, size_t, const MonoArgs &);
extern template m3_status launch_variant<V_TP | V_F8>(cudaStream_t, int, size_t,
                                                      const MonoArgs &);

template m3_status occupancy_variant<0>(size_t, int *);
template m3_status occupancy_variant<V_F8>(size_t, int *);
template m3_status launch_variant<0>(cudaStream_t, int, size_t, const MonoArgs &);
template m3_status launch_variant<V_F8>(cudaStream_t, int, size_t, const MonoArgs &);

/* Every variant's kernels: the launch takes the one the arguments need. */
m3_status occupancy(size_t smem, int *min_occ) {
    M3_TRY(occupancy_variant<0>(smem, min_occ));
    M3_TRY(occupancy_variant<V_F8>(smem, min_occ));
    M3_TRY(occupancy_variant<V_TP>(smem, min_occ));
    return occupancy_variant<V_TP | V_F8>(smem, min_occ);
}

/* any e4m3 weight in the layer: the MXFP8 variants */
static bool any_fp8(const MonoArgs &a) {
    const WMat *m[9] = {&a.wiq, &a.wik, &a.wk, &a.wv, &a.wq, &a.wo, &a.shg, &a.shu, &a.shd};
    bool f = a.eg.fp8 || a.eu.fp8 || a.ed.fp8;
    for (int i = 0; i < 9; i++)
        f = f || m[i]->fp8;
    return f;
}

m3_status launch_layer(cudaStream_t s, int P, size_t smem, const MonoArgs &a) {
    const bool f8 = any_fp8(a);
    if (a.world > 1)
        return f8 ? launch_variant<V_TP | V_F8>(s, P, smem, a)
                  : launch_variant<V_TP>(s, P, smem, a);
    return f8 ? launch_variant<V_F8>(s, P, smem, a) : launch_variant<0>(s, P, smem, a);
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
