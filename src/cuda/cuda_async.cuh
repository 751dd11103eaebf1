/*
 * Device helpers shared by the stock kernels (cuda_index.cu,
 * cuda_attention.cu, cuda_cp.cu, the GEMVs of cuda_gemv.cuh) and the mono
 * path's fused kernels (cuda_mono*), so both compute the same bits with
 * one copy of the code: cp.async (global to shared, bypassing L1), the
 * L2 evict-first policy for bytes a step reads once (weights, cache
 * pages) and the copies and loads that carry it, counter loads and the
 * global timer, the CPU's first-maximum rule, the index dot
 * products in the CPU's accumulation order, the tensor-core fragment loads
 * and bf16 MMA of the attention kernels, one warp's attention tile, and
 * the exact top-k block selection.
 */
#ifndef M3_CUDA_CUDA_ASYNC_CUH
#define M3_CUDA_CUDA_ASYNC_CUH

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "cuda/cuda_common.cuh"

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* L2 prefetch sizes as PTX qualifiers: M3_PF_QUAL(256) is ".L2::256B"
 * (a load that misses L2 brings the aligned 256 bytes around it), 128
 * ".L2::128B", 0 none. */
#define M3_PF_QUAL_0 ""
#define M3_PF_QUAL_128 ".L2::128B"
#define M3_PF_QUAL_256 ".L2::256B"
#define M3_PF_QUAL_(n) M3_PF_QUAL_##n
#define M3_PF_QUAL(n) M3_PF_QUAL_(n)

/* M3_W_PF_BYTES (a build switch: 256 by default, 0 for none, or 128): the
 * L2 prefetch size of the weight loads below and of the weight ring's
 * copies (cp_async16_pol), as ldg16_na_pol's PF_BYTES for the MMA linear.
 * There a warp's load already asks for 512 contiguous bytes of a row, yet
 * the mono layer took 1-2% less time at 2-4 rows with it (docs/PERF.md,
 * fiftieth session). The cache pages' copies (cp_async16_pol_s: the index
 * keys, the mono attention's K and V blocks; rows of 256 contiguous bytes)
 * take none: 256 there ran level in both layers (fifty-first session). */
#ifndef M3_W_PF_BYTES
#define M3_W_PF_BYTES 256
#endif
#if M3_W_PF_BYTES != 0 && M3_W_PF_BYTES != 128 && M3_W_PF_BYTES != 256
#error "M3_W_PF_BYTES: 0, 128 or 256"
#endif
#define M3_W_PF M3_PF_QUAL(M3_W_PF_BYTES)

/* 16 bytes global -> shared, bypassing L1; with fill false the 16 bytes are
 * zeroed and nothing is read. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool fill) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(fill ? 16 : 0)
                 : "memory");
}

/* An L2 eviction policy for data read once per step (the weights): first
 * out, so the 200+ MB a step streams through the 50 MB L2 do not evict
 * what the step reads again (counters, partial sums, activations, the
 * kernels' code): -5 to -9% at 1-8 rows, 4K (docs/PERF.md, thirty-third
 * session). */
__device__ __forceinline__ uint64_t l2_evict_first() {
    uint64_t p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}

/* cp_async16 with an L2 cache policy (l2_evict_first); the zero fill (fill
 * false, nothing read) takes the plain form. Used only where the GPU tests
 * run it, and check the machine code (cuobjdump -sass: no LDGSTS with an
 * odd desc[URn]): in the index items' page copy nvcc 13.0 compiled this
 * copy to an LDGSTS whose descriptor was an odd uniform register
 * (desc[UR1], the shared address [R+UR0]), and the kernel stopped with an
 * illegal instruction (thirty-third session); cp_async16_pol_s is the
 * form that compiles there. */
__device__ __forceinline__ void cp_async16_pol(void *dst, const void *src, bool fill,
                                               uint64_t pol) {
    if (fill)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint" M3_W_PF
                     " [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)),
                     "l"(src), "l"(pol)
                     : "memory");
    else
        cp_async16(dst, src, false);
}

/* cp_async16_pol's copy (always filled) to the shared address dst_s. Where
 * the destination is a CTA-uniform base plus a thread's offset, take the
 * base through a shuffle (idx_copy_page): ptxas then keeps the address in
 * a per-thread register and the LDGSTS is well formed. */
__device__ __forceinline__ void cp_async16_pol_s(uint32_t dst_s, const void *src, uint64_t pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst_s),
                 "l"(src), "l"(pol)
                 : "memory");
}

/* Rows [0, count) of cpr 16-byte chunks each from src (rows src_row_bytes
 * apart) into a shared stage at dst (rows dst_row_bytes apart), under the
 * evict-first policy, threads [0, nthreads) each its share: the cache
 * pages a step reads once (index keys; the copies of cuda_index.cu,
 * cuda_cp.cu and the mono path's index items). Every lane of the CTA
 * calls it (the shuffle). */
__device__ __forceinline__ void cp_async_rows_ef(unsigned char *dst, int dst_row_bytes,
                                                 const unsigned char *src, int64_t src_row_bytes,
                                                 int count, int cpr, int nthreads) {
    const uint64_t pol = l2_evict_first();
    const uint32_t base = __shfl_sync(0xffffffffu, smem_u32(dst), 0);
    for (int c = threadIdx.x; c < count * cpr; c += nthreads) {
        const int r = c / cpr, k = c - r * cpr;
        cp_async16_pol_s(base + r * dst_row_bytes + k * 16, src + r * src_row_bytes + k * 16, pol);
    }
}

/* An attention block's K and V rows [0, count) of D bf16 elements (rows D
 * apart at ks, vs) into a stage's K and V tiles (rows row_bytes apart, V
 * tile_bytes after K), rows [count, keys) zero (nothing read), evict-first
 * as cp_async_rows_ef (every lane of the CTA calls it). The mono path's
 * attention; the stock attention kernel copies plainly (slower with it). */
template <int D>
__device__ __forceinline__ void cp_async_kv_ef(unsigned char *stage, int row_bytes,
                                               int tile_bytes, const uint16_t *ks,
                                               const uint16_t *vs, int count, int keys,
                                               int nthreads) {
    constexpr int kCpr = D / 8;
    const uint64_t pol = l2_evict_first();
    const uint32_t base = __shfl_sync(0xffffffffu, smem_u32(stage), 0);
    for (int x = threadIdx.x; x < keys * kCpr; x += nthreads) {
        const int r = x / kCpr, k = x % kCpr;
        if (r < count) {
            const uint32_t dst = base + r * row_bytes + k * 16;
            const int64_t off = (int64_t)r * D + k * 8;
            cp_async16_pol_s(dst, ks + off, pol);
            cp_async16_pol_s(dst + tile_bytes, vs + off, pol);
        } else {
            cp_async16(stage + r * row_bytes + k * 16, ks, false);
            cp_async16(stage + r * row_bytes + k * 16 + tile_bytes, vs, false);
        }
    }
}

/* 16 / 8 read-only bytes with an L2 cache policy */
__device__ __forceinline__ uint4 ldg16_pol(const void *p, uint64_t pol) {
    uint4 v;
    asm volatile("ld.global.nc.L2::cache_hint" M3_W_PF ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}
__device__ __forceinline__ float4 ldg16f_pol(const float *p, uint64_t pol) {
    const uint4 v = ldg16_pol(p, pol);
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                       __uint_as_float(v.w));
}
__device__ __forceinline__ uint2 ldg8_pol(const void *p, uint64_t pol) {
    uint2 v;
    asm volatile("ld.global.nc.L2::cache_hint" M3_W_PF ".v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p), "l"(pol));
    return v;
}
/* The same, not kept in L1 (L1::no_allocate): weights a kernel streams
 * once, so that L1 keeps the activations every tile re-reads. PF_BYTES
 * 256: a load that misses L2 fetches the aligned 256 bytes around it from
 * DRAM (.L2::256B; 128: .L2::128B; 0: no qualifier), so where a warp's
 * load asks for only 32-64 bytes of each of 8 rows (the MMA linear,
 * cuda_lmma.cuh), the next pieces of those rows are already on their way
 * to L2: the MMA linear at 1-16 rows took up to 22% less time, a stock layer
 * at one row 5% less (docs/PERF.md, fiftieth session). */
template <int PF_BYTES>
__device__ __forceinline__ uint4 ldg16_na_pol(const void *p, uint64_t pol) {
    static_assert(PF_BYTES == 0 || PF_BYTES == 128 || PF_BYTES == 256, "0, 128 or 256");
    uint4 v;
#define M3_LDG16_NA(Q)                                                                         \
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint" Q ".v4.u32 "                  \
                 "{%0, %1, %2, %3}, [%4], %5;"                                                 \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                  \
                 : "l"(p), "l"(pol))
    if constexpr (PF_BYTES == 256)
        M3_LDG16_NA(M3_PF_QUAL(256));
    else if constexpr (PF_BYTES == 128)
        M3_LDG16_NA(M3_PF_QUAL(128));
    else
        M3_LDG16_NA(M3_PF_QUAL(0));
#undef M3_LDG16_NA
    return v;
}
template <int PF_BYTES>
__device__ __forceinline__ uint2 ldg8_na_pol(const void *p, uint64_t pol) {
    static_assert(PF_BYTES == 0 || PF_BYTES == 128 || PF_BYTES == 256, "0, 128 or 256");
    uint2 v;
#define M3_LDG8_NA(Q)                                                                          \
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint" Q ".v2.u32 {%0, %1}, [%2], %3;" \
                 : "=r"(v.x), "=r"(v.y)                                                        \
                 : "l"(p), "l"(pol))
    if constexpr (PF_BYTES == 256)
        M3_LDG8_NA(M3_PF_QUAL(256));
    else if constexpr (PF_BYTES == 128)
        M3_LDG8_NA(M3_PF_QUAL(128));
    else
        M3_LDG8_NA(M3_PF_QUAL(0));
#undef M3_LDG8_NA
    return v;
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Wait until at most `behind` (0..2) cp.async groups issued after the one
 * wanted are pending (a ring two slots ahead: wait_group takes an
 * immediate). */
__device__ __forceinline__ void ring_wait(int behind) {
    if (behind >= 2)
        cp_async_wait<2>();
    else if (behind == 1)
        cp_async_wait<1>();
    else
        cp_async_wait<0>();
}

/* Counters between CTAs (the persistent kernels' dependencies): an acquire
 * load, and a relaxed one to poll with (ld.acquire invalidates the SM's L1
 * each time it runs); the global timer for traces. */
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned ld_relaxed(const unsigned *p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* The CPU's running max folded over two consecutive runs of positions:
 * `later` replaces `earlier` only if strictly greater or NaN, and a NaN
 * stays. Keeps the first maximal value (so -0 vs +0 matches the CPU too). */
__device__ __forceinline__ float first_max(float earlier, float later) {
    if (isnan(earlier))
        return earlier;
    return (isnan(later) || later > earlier) ? later : earlier;
}

/* first_max over the warp's lanes in lane (= position) order */
__device__ __forceinline__ float warp_first_max(float v) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = (lane & o) ? first_max(other, v) : first_max(v, other);
    }
    return v;
}

/* Dots of one key row (bf16, shared) with HB queries (fp64, shared) as
 * m3_dot_f32 forms them: element i goes to accumulator i % 8 in order,
 * then the tail 4, 2, 1 apart, then one rounding to fp32. Products of fp32
 * values are exact in fp64, so each fma equals the CPU's multiply-then-add
 * and the sums round identically. (Building the doubles from the bf16 bits
 * with integer ops instead of F2F measured slower: more issue slots.) */
template <int HB>
__device__ __forceinline__ void idx_dots(const unsigned char *krow, const double *q, int dim,
                                         float (&d)[HB]) {
    double acc[HB][8];
#pragma unroll
    for (int h = 0; h < HB; h++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[h][j] = 0.0;
#pragma unroll 2
    for (int c = 0; c < dim / 8; c++) {
        uint4 raw = *reinterpret_cast<const uint4 *>(krow + c * 16);
        uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        double k[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            k[2 * i] = (double)__uint_as_float(w[i] << 16);
            k[2 * i + 1] = (double)__uint_as_float(w[i] & 0xffff0000u);
        }
#pragma unroll
        for (int h = 0; h < HB; h++) {
            const double2 *qq = reinterpret_cast<const double2 *>(q + h * dim + c * 8);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                double2 qv = qq[i];
                acc[h][2 * i] = __fma_rn(qv.x, k[2 * i], acc[h][2 * i]);
                acc[h][2 * i + 1] = __fma_rn(qv.y, k[2 * i + 1], acc[h][2 * i + 1]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < HB; h++) {
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[h][j] = __dadd_rn(acc[h][j], acc[h][j + 4]);
        acc[h][0] = __dadd_rn(acc[h][0], acc[h][2]);
        acc[h][1] = __dadd_rn(acc[h][1], acc[h][3]);
        d[h] = __double2float_rn(__dadd_rn(acc[h][0], acc[h][1]));
    }
}

/* ---- tensor-core fragments (the attention kernels' bf16 mma.sync) ---- */

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

/* d += a b: m16n8k16, bf16 in, fp32 accumulate */
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ---- exact top-k block selection (m3_select_row's total order) ----
 * One CTA of THREADS threads selects the `room` best of candidate blocks
 * [c0, c1) by score: the threshold key (sel_threshold: a direct rank of up
 * to 128 candidates, else a radix select over 64-bit keys), then the
 * selected ids in ascending order (sel_compact). In a build with
 * M3_SEL_FILTER=1 (the default; 0 turns it off), from five
 * candidates a thread where the room is small against them (M3's 15 of
 * 513-1,024 at 128 threads), the keys that can reach the room are instead
 * filtered to at most 128 and ranked directly (sel_top_filtered; sel_top
 * picks the path). The stock select kernel (cuda_index.cu) and the mono
 * selection item (cuda_mono_attn.cuh, both paths) run this code with their
 * own CTA sizes; dev/cuda/select_top.cu checks both sizes and both paths
 * against a host reference and times them. */
namespace {

template <int WARPS>
struct SelSharedT {
    unsigned hist[256];
    unsigned long long prefix;
    unsigned k;
    int done;
    int wcount[WARPS];
};


/* m3_select_row's order as one unsigned key, larger = better: the score
 * (NaN below -inf, -0 equal to +0), then the block id (ties: higher id). */
__device__ __forceinline__ uint64_t sel_key(float s, int b) {
    uint32_t x = __float_as_uint(s), u;
    if (isnan(s))
        u = 0u;
    else {
        if ((x & 0x7fffffffu) == 0u)
            x = 0u;
        u = (x & 0x80000000u) ? ~x : (x | 0x80000000u);
    }
    return ((uint64_t)u << 32) | (uint32_t)b;
}

/* Warp 0: the digit whose bucket holds the k-th largest key of this pass;
 * narrows prefix and k; done when that bucket holds exactly the k keys
 * still wanted (then every key with the prefix is selected). */
template <int WARPS>
__device__ void sel_find_digit(SelSharedT<WARPS> &sh, int shift) {
    int lane = threadIdx.x;
    unsigned k = sh.k; /* read by every lane before any lane writes */
    unsigned c[8], tot = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        c[i] = sh.hist[lane * 8 + i];
        tot += c[i];
    }
    /* the shuffles below converge the warp but do not order memory: every
     * lane's read of sh.k must happen before the one lane's write of it */
    __syncwarp();
    unsigned suf = tot; /* keys in buckets of lanes >= this lane */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        unsigned y = __shfl_down_sync(0xffffffffu, suf, o);
        if (lane + o < 32)
            suf += y;
    }
    unsigned above = suf - tot;
    if (above < k && k <= suf) {
        for (int i = 7; i >= 0; i--) {
            if (k <= above + c[i]) {
                sh.prefix |= (unsigned long long)(lane * 8 + i) << shift;
                sh.k = k - above;
                sh.done = c[i] == k - above;
                break;
            }
            above += c[i];
        }
    }
}

/* Thread x < n of THREADS ranks `key`, its own keys[x], against keys[0..n)
 * and writes the one with exactly room - 1 keys above it to sh.prefix
 * (keys are distinct, so exactly one thread writes); the caller's barrier
 * makes it visible. The key comes in a register: a caller that built it
 * need not read it back. */
template <int THREADS>
__device__ __forceinline__ void sel_rank_write(const uint64_t *keys, int n, unsigned room,
                                               uint64_t key, SelSharedT<THREADS / 32> &sh) {
    if ((int)threadIdx.x < n) {
        unsigned above = 0;
        for (int j = 0; j < n; j++)
            above += keys[j] > key;
        if (above == room - 1u)
            sh.prefix = key;
    }
}

/* sel_rank_write over keys already in keys[0..n): each thread ranks its own. */
template <int THREADS>
__device__ __forceinline__ void sel_rank_keys(const uint64_t *keys, int n, unsigned room,
                                              SelSharedT<THREADS / 32> &sh) {
    sel_rank_write<THREADS>(keys, n, room, (int)threadIdx.x < n ? keys[threadIdx.x] : 0ull, sh);
}

/* Up to 128 candidates (every context up to 16K tokens): each thread ranks
 * its candidate's key against all of them (keys are distinct, so exactly
 * one has rank room - 1) and that key is the threshold. Two barriers and n
 * broadcast reads, where the radix select below takes up to eight passes
 * of three barriers each (2.5 µs of the mono selection item at 32
 * candidates, the ninth session's item marks). 1 <= room < n. */
template <int THREADS>
__device__ uint64_t sel_threshold_small(const float *sc, int c0, int n, unsigned room,
                                        SelSharedT<THREADS / 32> &sh) {
    static_assert(sizeof(sh.hist) >= 128 * sizeof(uint64_t), "the keys live in hist");
    uint64_t *keys = reinterpret_cast<uint64_t *>(sh.hist);
    uint64_t key = 0;
    for (int i = threadIdx.x; i < n; i += THREADS) /* one round: n <= 128 <= THREADS */
        keys[i] = key = sel_key(sc[c0 + i], c0 + i);
    __syncthreads();
    sel_rank_write<THREADS>(keys, n, room, key, sh);
    __syncthreads();
    const uint64_t thr = sh.prefix;
    __syncthreads(); /* hist (the keys) and prefix are the caller's again */
    return thr;
}

/* Radix select (8-bit digits, most significant first) over the keys of
 * candidates [c0, c1): returns thr such that exactly `room` of them have
 * key >= thr (keys are distinct: they end in the block id). */
template <int THREADS>
__device__ uint64_t sel_threshold(const float *sc, int c0, int c1, unsigned room,
                              SelSharedT<THREADS / 32> &sh) {
    if (c1 - c0 <= 128 && THREADS >= 128 && room >= 1u && (int)room < c1 - c0) /* CTA-uniform */
        return sel_threshold_small<THREADS>(sc, c0, c1 - c0, room, sh);
    int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.k = room;
        sh.done = 0;
    }
    uint64_t prefix = 0, mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += THREADS)
            sh.hist[i] = 0;
        __syncthreads();
        for (int base = c0; base < c1; base += THREADS) { /* uniform trip count */
            int b = base + threadIdx.x;
            bool act = false;
            unsigned digit = 0;
            if (b < c1) {
                uint64_t key = sel_key(sc[b], b);
                act = (key & mask) == prefix;
                digit = (unsigned)(key >> shift) & 255u;
            }
            /* one shared atomic per distinct digit in the warp: scores
             * cluster in a few top digits */
            unsigned am = __ballot_sync(0xffffffffu, act);
            if (act) {
                unsigned peers = __match_any_sync(am, digit);
                if (lane == __ffs(peers) - 1)
                    atomicAdd(&sh.hist[digit], (unsigned)__popc(peers));
            }
        }
        __syncthreads();
        if (threadIdx.x < 32)
            sel_find_digit(sh, shift);
        __syncthreads();
        prefix = sh.prefix;
        mask |= 0xffull << shift;
        if (sh.done)
            break;
    }
    return prefix;
}

/* out[0..room) = the candidates with key >= thr, ascending; returns how
 * many were written (room, by construction). */
template <int THREADS>
__device__ int sel_compact(const float *sc, int c0, int c1, uint64_t thr, int room, int32_t *out,
                           SelSharedT<THREADS / 32> &sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, run = 0;
    for (int base = c0; base < c1 && run < room; base += THREADS) {
        int b = base + threadIdx.x;
        bool f = b < c1 && sel_key(sc[b], b) >= thr;
        unsigned bal = __ballot_sync(0xffffffffu, f);
        if (lane == 0)
            sh.wcount[warp] = __popc(bal);
        __syncthreads();
        int off = run, total = 0;
        for (int w = 0; w < THREADS / 32; w++) {
            int c = sh.wcount[w];
            off += w < warp ? c : 0;
            total += c;
        }
        if (f) {
            int pos = off + __popc(bal & ((1u << lane) - 1u));
            if (pos < room)
                out[pos] = b;
        }
        run += total;
        __syncthreads(); /* wcount is rewritten next round */
    }
    return run < room ? run : room;
}

/* Candidates a thread holds on sel_top's filtered path: at most
 * kSelFilterPer (registers), at least kSelFilterMinPer. The filtered path
 * costs ~3.5-3.9 µs at 128 threads whatever the count (one rank of 128
 * keys is 0.8 of it), the radix select 1.7 µs over 129 candidates and 6.7
 * over 1,023: dev/cuda/select_top.cu put the crossing between 4 and 5 a
 * thread (H100, docs/PERF.md, fifty-first session). */
constexpr int kSelFilterPer = 8;
constexpr int kSelFilterMinPer = 5;

/* M3_SEL_FILTER=1 (a build switch, on by default since the fifty-third
 * session's gpu-check: docs/PERF.md) turns the filtered path on; 0 off */
#ifndef M3_SEL_FILTER
#define M3_SEL_FILTER 1
#endif

/* Can sel_top take the filtered path? Blocks go to threads in contiguous
 * runs of per = ceil(n / THREADS) and a group is THREADS / 128 threads, so
 * there are at most 128 group maxima; the room-th largest of them is a
 * lower bound of the room-th largest key (room distinct keys reach it),
 * and only the room groups at or above it hold keys that reach it: at
 * most room x per x group keys, which must fit the 128 keys of sh.hist.
 * CTA-uniform. */
template <int THREADS>
__device__ __forceinline__ bool sel_filter_fits(int n, unsigned room) {
    static_assert(THREADS % 128 == 0, "groups of THREADS / 128 threads");
    const int per = (n + THREADS - 1) / THREADS;
    return M3_SEL_FILTER && n > 128 && per >= kSelFilterMinPer && per <= kSelFilterPer &&
           room >= 1u && (int)room < n && (long)room * per * (THREADS / 128) <= 128;
}

/* sel_top's filtered path (sel_filter_fits): the bound from the group
 * maxima, the keys that reach it compacted in block order (at most 128),
 * the exact threshold ranked among them, the selected ids written
 * ascending. Six barriers and two ranks over at most 128 keys, where the
 * radix select over 1,024 candidates takes four or more passes of three
 * barriers and the compaction two barriers a round of THREADS candidates
 * (the selection item 9.4 µs at 128K, the thirty-second session). Out of
 * line: inlined, its code cost the mono layer 0.8% at one row, 4K, where
 * it never runs (registers unchanged; fifty-second session); out of line
 * the layer is level there and keeps the gain at 128K (fifty-third). */
template <int THREADS>
__device__ __noinline__ int sel_top_filtered(const float *sc, int c0, int c1, unsigned room,
                                             int32_t *out, SelSharedT<THREADS / 32> &sh) {
    constexpr int kGroup = THREADS / 128, kWarps = THREADS / 32;
    uint64_t *keys = reinterpret_cast<uint64_t *>(sh.hist);
    const int n = c1 - c0, per = (n + THREADS - 1) / THREADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = c0 + (int)threadIdx.x * per;
    const int cnt = min(max(c1 - first, 0), per); /* this thread's candidates */
    uint64_t k[kSelFilterPer], mx = 0;
#pragma unroll
    for (int j = 0; j < kSelFilterPer; j++) {
        k[j] = 0;
        if (j < cnt) {
            k[j] = sel_key(sc[first + j], first + j);
            mx = k[j] > mx ? k[j] : mx;
        }
    }
    /* the group's maximum (a group's first thread holds keys when any does) */
#pragma unroll
    for (int o = 1; o < kGroup; o <<= 1) {
        const uint64_t y = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = y > mx ? y : mx;
    }
    const int threads_used = (n + per - 1) / per;
    const int groups = (threads_used + kGroup - 1) / kGroup; /* > room: n > room x per x kGroup */
    if ((int)threadIdx.x % kGroup == 0 && (int)threadIdx.x / kGroup < groups)
        keys[threadIdx.x / kGroup] = mx;
    __syncthreads();
    sel_rank_keys<THREADS>(keys, groups, room, sh);
    __syncthreads();
    const uint64_t bound = sh.prefix;
    /* the keys >= bound, in block order: this thread's count, scanned */
    int mine = 0;
#pragma unroll
    for (int j = 0; j < kSelFilterPer; j++)
        mine += (j < cnt && k[j] >= bound) ? 1 : 0;
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
            incl += y;
    }
    if (lane == 31)
        sh.wcount[warp] = incl;
    __syncthreads(); /* the maxima are read: keys is free */
    int pos = incl - mine, cands = 0;
    for (int w = 0; w < kWarps; w++) {
        pos += w < warp ? sh.wcount[w] : 0;
        cands += sh.wcount[w];
    }
#pragma unroll
    for (int j = 0; j < kSelFilterPer; j++)
        if (j < cnt && k[j] >= bound)
            keys[pos++] = k[j];
    __syncthreads();
    sel_rank_keys<THREADS>(keys, cands, room, sh);
    __syncthreads();
    const uint64_t thr = sh.prefix;
    /* the candidates at or above thr, ascending (cands <= 128 <= THREADS) */
    const bool f = (int)threadIdx.x < cands && keys[threadIdx.x] >= thr;
    const unsigned bal = __ballot_sync(0xffffffffu, f);
    if (lane == 0)
        sh.wcount[warp] = __popc(bal);
    __syncthreads();
    if (f) {
        int at = __popc(bal & ((1u << lane) - 1u));
        for (int w = 0; w < warp; w++)
            at += sh.wcount[w];
        out[at] = (int32_t)(uint32_t)keys[threadIdx.x];
    }
    __syncthreads(); /* hist, prefix and wcount are the caller's again */
    return (int)room;
}

/* A no-op for sel_top's hook. */
struct SelNoMark {
    __device__ void operator()() const {}
};

/* out[0..room) = the room best of candidates [c0, c1), ascending; returns
 * how many were written (room, by construction). The filtered path where
 * it fits, else the threshold and the compaction. at_threshold() runs
 * once between the two (after the filtered path: it has no such point),
 * for the mono item's trace marks. */
template <int THREADS, typename Mark = SelNoMark>
__device__ __forceinline__ int sel_top(const float *sc, int c0, int c1, unsigned room,
                                       int32_t *out, SelSharedT<THREADS / 32> &sh,
                                       Mark at_threshold = Mark()) {
    if (sel_filter_fits<THREADS>(c1 - c0, room)) {
        const int got = sel_top_filtered<THREADS>(sc, c0, c1, room, out, sh);
        at_threshold();
        return got;
    }
    const uint64_t thr = sel_threshold<THREADS>(sc, c0, c1, room, sh);
    at_threshold();
    return sel_compact<THREADS>(sc, c0, c1, thr, (int)room, out, sh);
}

} // namespace

/* ---- the attention's per-warp tile ----
 * One warp's share of a 64-key tile: 16 keys against the 16 query heads of
 * the CTA on tensor cores, with its own online softmax. The stock attention
 * kernel (cuda_attention.cu) and the mono attention item
 * (cuda_mono_attn.cuh) both run it. Q, K and V rows in shared memory are
 * D * 2 + 16 bytes apart. */
namespace {

/* one online softmax per warp, for the 16 query heads of the tile: lane
 * holds rows g = lane / 4 and g + 8 of the m16n8 accumulator layout */
template <int D>
struct WarpAttn {
    float o[D / 8][4];
    float m[2]; /* running max in log2 units, -inf before any key */
    float l[2]; /* this lane's share of the sum of p (bf16-rounded p) */
};

/* the state before any key: o and l zero, m -inf */
template <int D>
__device__ __forceinline__ void attn_reset(WarpAttn<D> &w) {
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            w.o[n][e] = 0.0f;
    w.m[0] = w.m[1] = -INFINITY;
    w.l[0] = w.l[1] = 0.0f;
}

/* New running max from the tile's scores (NT n-tiles of 8 keys: 2 for the
 * attention tile's 16 keys, 4 for the drafter's 32); rescales o and l.
 * ref: the subtrahend for this tile's p (the max, or 0 while every key is
 * masked, so exp2 never sees -inf - -inf). */
template <int D, int NT = 2>
__device__ __forceinline__ void attn_rescale(WarpAttn<D> &w, const float (&s)[NT][4],
                                             float (&ref)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
#pragma unroll
        for (int nt = 2; nt < NT; nt++)
            mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(w.m[r], mx);
        ref[r] = m_new == -INFINITY ? 0.0f : m_new;
        float alpha = exp2f(w.m[r] - ref[r]); /* 0 while nothing was seen */
        w.m[r] = m_new;
        w.l[r] *= alpha;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            w.o[n][2 * r] *= alpha;
            w.o[n][2 * r + 1] *= alpha;
        }
    }
}

/* p = exp2(s - ref) rounded to bf16, packed as the A operand of P V (the
 * accumulator layout of two n-tiles is the m16k16 A layout) */
template <int D>
__device__ __forceinline__ void attn_probs(WarpAttn<D> &w, const float (&s)[2][4],
                                           const float (&ref)[2], uint32_t (&pa)[4]) {
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            __nv_bfloat162 p = __floats2bfloat162_rn(exp2f(s[nt][2 * r] - ref[r]),
                                                     exp2f(s[nt][2 * r + 1] - ref[r]));
            w.l[r] += __low2float(p) + __high2float(p);
            pa[nt * 2 + r] = (uint32_t)__bfloat16_as_ushort(p.x) |
                             ((uint32_t)__bfloat16_as_ushort(p.y) << 16);
        }
}

/* One warp, 16 keys (rows of sk / sv; the first `valid` visible): S = Q K^T
 * for 16 heads, online softmax, O += P V. */
template <int D>
__device__ __forceinline__ void attn_warp_tile(WarpAttn<D> &w, const unsigned char *sq,
                                               const unsigned char *sk, const unsigned char *sv,
                                               int valid, float scale_log2) {
    constexpr int kRowBytes = D * 2 + 16; /* AttnCfg<D>::kRowBytes: +16, conflict-free ldmatrix */
    const int lane = threadIdx.x & 31, tq = lane & 3, mi = lane >> 3, r8 = lane & 7;
    float s[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        uint32_t qa[4], kb[4];
        /* A: heads 0-7 / 8-15 x dims +0 / +8; B: keys 0-7 / 8-15 x dims +0 / +8 */
        ldsm_x4(qa, sq + (r8 + (mi & 1) * 8) * kRowBytes + (ks * 16 + (mi >> 1) * 8) * 2);
        ldsm_x4(kb, sk + (r8 + (mi >> 1) * 8) * kRowBytes + (ks * 16 + (mi & 1) * 8) * 2);
        mma_bf16(s[0], qa, kb[0], kb[1]);
        mma_bf16(s[1], qa, kb[2], kb[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            s[nt][e] = nt * 8 + 2 * tq + (e & 1) < valid ? s[nt][e] * scale_log2 : -INFINITY;
    float ref[2];
    uint32_t pa[4];
    attn_rescale<D>(w, s, ref);
    attn_probs<D>(w, s, ref, pa);
#pragma unroll
    for (int dp = 0; dp < D / 16; dp++) {
        uint32_t vb[4]; /* transposed: keys 0-7 / 8-15 x dims +0 / +8 */
        ldsm_x4_t(vb, sv + (r8 + (mi & 1) * 8) * kRowBytes + (dp * 16 + (mi >> 1) * 8) * 2);
        mma_bf16(w.o[2 * dp], pa, vb[0], vb[1]);
        mma_bf16(w.o[2 * dp + 1], pa, vb[2], vb[3]);
    }
}

/* The CTA's warps' softmax states merged per head (a state takes part iff
 * its sum is not 0: NaN takes part), after each warp wrote its o rows
 * (s_o: [WARPS][HT heads][ostride] fp32), maxima and sums (s_m, s_l:
 * [WARPS][HT]). Per head, once: the max over the warps taking part, each
 * one's factor exp2(m - max) and the sum L in warp order; then each of the
 * nh x D outputs sums factor x o over those warps in warp order and calls
 * out(r, d, acc, M, L, any) (M = -inf, L = 0, any = false when no warp saw
 * a key; poisoned, when the CTA read a page outside the pool: acc = L =
 * NaN, M = -inf, any = true for every output). The same operations in the
 * same order as every output redoing its head's max and factors, which
 * took 5.4 µs of the mono attention item (docs/PERF.md, ninth session).
 * The stock attention kernel and the mono attention item both call it.
 * scratch: WARPS x HT + 3 x HT words. */
template <int D, int WARPS, int THREADS, int HT, typename Out>
__device__ void attn_merge_warps(const float *s_o, int ostride, const float *s_m,
                                 const float *s_l, float *scratch, int nh, bool poisoned,
                                 Out out) {
    float *s_f = scratch;           /* [HT][WARPS] */
    float *s_hm = s_f + HT * WARPS; /* [HT]: M */
    float *s_hl = s_hm + HT;        /* [HT]: L */
    int *s_hv = reinterpret_cast<int *>(s_hl + HT); /* [HT]: warps taking part */
    for (int r = threadIdx.x; r < nh; r += THREADS) {
        float M = -INFINITY, L = 0.0f;
        int valid = 0;
        for (int v = 0; v < WARPS; v++)
            if (s_l[v * HT + r] != 0.0f) {
                valid |= 1 << v;
                M = fmaxf(M, s_m[v * HT + r]);
            }
        const float ref = M == -INFINITY ? 0.0f : M;
        for (int v = 0; v < WARPS; v++) {
            const float lv = s_l[v * HT + r];
            if (lv != 0.0f) {
                const float f = exp2f(s_m[v * HT + r] - ref);
                L += f * lv;
                s_f[r * WARPS + v] = f;
            }
        }
        s_hm[r] = M;
        s_hl[r] = L;
        s_hv[r] = valid;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < nh * D; x += THREADS) {
        const int r = x / D, d = x % D, valid = s_hv[r];
        float acc = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; v++)
            if (valid & (1 << v))
                acc += s_f[r * WARPS + v] * s_o[(v * HT + r) * ostride + d];
        if (poisoned) /* a poisoned page: NaN that takes part in the merge */
            out(r, d, m3_qnan(), -INFINITY, m3_qnan(), true);
        else
            out(r, d, acc, s_hm[r], s_hl[r], valid != 0);
    }
}

} // namespace

#endif
