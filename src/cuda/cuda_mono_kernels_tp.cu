/*
 * The TP variants (V_TP: world > 1, the in-kernel all-reduces) of the mono
 * kernels (cuda_mono_kernels.cuh), in a translation unit of their own so a
 * build compiles them beside the world-1 ones (cuda_mono_kernels.cu).
 */
#include "cuda/cuda_mono_kernels.cuh"

namespace m3mono {

template m3_status occupancy_variant<V_TP>(size_t, int *);
template m3_status occupancy_variant<V_TP | V_F8>(size_t, int *);
template m3_status launch_variant<V_TP>(cudaStream_t, int, size_t, const MonoArgs &);
template m3_status launch_variant<V_TP | V_F8>(cudaStream_t, int, size_t, const MonoArgs &);

} // namespace m3mono
