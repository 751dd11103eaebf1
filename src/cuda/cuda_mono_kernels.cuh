/*
 * The mono executor's two persistent kernels (their item loops) and their
 * launches, as templates over the row bucket NR and the variant V (V_F8,
 * V_TP: cuda_mono_args.cuh). cuda_mono_kernels.cu instantiates the world-1
 * variants, cuda_mono_kernels_tp.cu the TP ones (two translation units, so
 * a build compiles them in parallel); cuda_mono.cu describes the design.
 */
#ifndef M3_CUDA_CUDA_MONO_KERNELS_CUH
#define M3_CUDA_CUDA_MONO_KERNELS_CUH

#include "cuda/cuda_mono_args.cuh"
#include "cuda/cuda_mono_dev.cuh"
#include "cuda/cuda_mono_pre.cuh"
#include "cuda/cuda_mono_attn.cuh"
#include "cuda/cuda_mono_ffn.cuh"

namespace m3mono {
namespace { /* internal linkage: cuda_mono_kernels.cu and _tp.cu both compile it */

/* ================================================================ kernels */

/* The other kernel's counters to zero, spread over the grid at the
 * launch's start: the other kernel has ended (stream order) and its next
 * launch begins after this one ends, which publishes the stores. (So no
 * launch ends in a last CTA's zeroing loop.) The pre kernel also counts
 * the layer call: the post kernel's landing tags. Not inlined: inlined, its
 * loop made the 1-row post kernel spill 36 bytes (ptxas) and the layer
 * 1% slower than the call (docs/PERF.md, twenty-sixth session). */
__device__ __noinline__ void zero_other(const MonoArgs &a, bool post) {
    const int i = blockIdx.x * kThreads + threadIdx.x, n = gridDim.x * kThreads;
    if (post) { /* the pre kernel's */
        if (i == 0) {
            a.ctr[C_QPRE] = 0u;
            a.ctr[C_NORM1] = 0u;
            a.ctr[C_IDX] = 0u;
        }
        for (int j = C_FIXED + i; j < a.o_post; j += n)
            a.ctr[j] = 0u;
    } else {
        if (i == 0) {
            a.ctr[C_QPOST] = 0u;
            a.ctr[C_ATT] = 0u;
            a.ctr[C_OPROJ] = 0u;
            a.ctr[C_NORM2] = 0u;
            a.ctr[C_ROUTER] = 0u;
            a.ctr[C_PLAN] = 0u;
            a.ctr[C_SHGU] = 0u;
            *a.calls += 1u;
        }
        for (int j = a.o_post + i; j < a.n_ctr; j += n)
            a.ctr[j] = 0u;
    }
}

/* Thread 0: a reservation's item index; its fault bit joins the CTA's
 * flag (sticky: the flag is never cleared within a launch). */
__device__ __forceinline__ int reserved(Ctl &ctl, unsigned q) {
    ctl.faulted |= (q & kQueueFault) != 0;
    return (int)(q & ~kQueueFault);
}

/* Thread 0, in the prologue: the first reservation and the fault word. */
__device__ __forceinline__ void reserve_first(const MonoArgs &a, Ctl &ctl, unsigned q) {
    ctl.faulted = ld_vol(a.fault) != 0;
    ctl.cur = reserved(ctl, q);
}

/* The item cursor: the index reserved during the previous item (or by
 * the kernel's prologue) and the CTA's fault flag. The flag is the fault
 * word as the prologue read it (a fault planted before the launch), or'ed
 * with the cursor's fault bit of every reservation since (fault_set marks
 * the cursor): so a fault set during the launch stops a CTA from the item
 * after its next reservation, one item later than a load of the fault word
 * at every item's start would, and without that load's round trip and
 * barrier. Items check their own indices (pages, slots) either way. */
__device__ __forceinline__ int next_item(Ctl &ctl, bool *faulted) {
    if (threadIdx.x == 0) {
        s_t_ready = 0;
#ifdef M3_MONO_MARKS
        s_nmark = 0;
#endif
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
    unsigned long long *rec = a.trace + (size_t)kTraceWords * i;
    rec[0] = meta;
    rec[1] = t0;
    rec[2] = gtimer();
    rec[3] = s_t_ready; /* 0: the item did not wait */
#ifdef M3_MONO_MARKS
    for (int j = 0; j < kMarks; j++)
        rec[4 + j] = j < s_nmark ? s_marks[j] : 0;
#endif
}

/* The post kernel's item kinds (the trace's kind numbers, scripts/mono_trace.py) */
enum { K_SEL, K_ATT, K_OPROJ, K_NORM2, K_ROUTER, K_SHGU, K_EGU, K_SHDN, K_EDN, K_FIN, K_MRG,
       K_PLAN, K_DRY };

/* What a post item waits for before it starts: counter c at target (c
 * null: nothing, or the item waits inside, after work that does not need
 * the input: edn reads the plan first, o_proj asks for its first weights). */
struct ItemDep {
    const unsigned *c;
    unsigned target;
};

__device__ __forceinline__ ItemDep post_dep(const MonoArgs &a, int kind, int local) {
    switch (kind) {
    case K_ATT: {
        const AttPos p = att_pos(a, local);
        return {&a.ctr[a.o_sel + p.t * a.Ni + p.g], 1u};
    }
    case K_MRG: {
        const int t = local / a.Nq, h = local % a.Nq, g = h / a.group;
        const int mt = h % a.group / kHeadTile;
        return {&a.ctr[a.o_att + (t * a.Nkv + g) * a.mtiles + mt], (unsigned)a.S};
    }
    case K_NORM2: return {&a.ctr[C_OPROJ], (unsigned)(a.H / kTile)};
    case K_ROUTER:
    case K_SHGU: return {&a.ctr[C_NORM2], (unsigned)a.T};
    case K_SHDN: return {&a.ctr[C_SHGU], (unsigned)(a.Is / 4)};
    case K_PLAN: return {&a.ctr[C_ROUTER], (unsigned)a.rt_tiles};
    default: return {nullptr, 0u};
    }
}

template <int NR, int V>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mono_pre_kernel(const __grid_constant__ MonoArgs a) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ Ctl ctl;
    knobs_init(a);
    zero_other(a, false);
    const int n_norm = a.T + 1, n_proj = a.p_item0[5], n_idx = idx_items<NR>(a);
    const int total = n_norm + n_proj + n_idx;
    if (threadIdx.x == 0)
        reserve_first(a, ctl, atomicAdd(&a.ctr[C_QPRE], 1u));
    for (;;) {
        bool faulted;
        int cur = next_item(ctl, &faulted);
        if (cur >= total)
            break;
        unsigned nxt = 0;
        if (threadIdx.x == 0)
            nxt = atomicAdd(&a.ctr[C_QPRE], 1u); /* in flight during the item */
        unsigned long long t0 = a.trace ? gtimer() : 0;
        int item = cur, kind;
        if (cur < a.T)
            kind = 0, norm1_item(a, ctl, dsm, cur, faulted);
        else if (cur < n_norm)
            kind = 4, rope_item(a, ctl, faulted); /* the RoPE factors */
        else if ((cur -= n_norm) < n_proj)
            kind = 1, proj_item<NR, V>(a, ctl, dsm, cur, faulted);
        else
            kind = 2, idx_item_of<NR>(a, ctl, dsm, cur - n_proj, faulted);
        trace_item(a, 0, kind, item, t0);
        if (threadIdx.x == 0)
            ctl.cur = reserved(ctl, nxt);
    }
}

/* M3_MONO_PIN: items outside the queue, run by CTAs 0..T-1 (codes
 * below 0; kQueue: the CTA's own list is done, the queue hands out the
 * next item) */
enum { kPlanItem = -2, kDryNorm2 = -3, kDryPlan = -4, kQueue = INT_MIN };

/* Queue position q -> post item index: with pin the norm2 items are not in
 * the queue (CTA t holds row t's). */
__device__ __forceinline__ int q_item(const MonoArgs &a, int q, int base_n2) {
    return a.pin && q >= base_n2 ? q + a.T : q;
}

/* Item s of this CTA's own list, else kQueue. With pin, CTA t < T first
 * runs (pin 2) a dry norm2 and, on CTA 0, a dry routing plan, then row t's
 * norm2, then (CTA 0) the routing plan, and only then takes queue items.
 * The host asks for pin only with more CTAs than rows, so the CTAs past T
 * run the queue while these wait (they wait only for queue items). */
__device__ __forceinline__ int own_item(const MonoArgs &a, int s, int base_n2) {
    const int c = blockIdx.x;
    if (!a.pin || c >= a.T)
        return kQueue;
    if (a.pin >= 2) {
        if (s == 0)
            return kDryNorm2;
        s -= 1;
        if (c == 0) {
            if (s == 0)
                return kDryPlan;
            s -= 1;
        }
    }
    if (s == 0)
        return base_n2 + c;
    if (c == 0 && s == 1)
        return kPlanItem;
    return kQueue;
}

template <int NR, int V>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mono_post_kernel(const __grid_constant__ MonoArgs a) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ Ctl ctl;
    knobs_init(a);
    zero_other(a, true);
    const int n_sel = a.T * a.Ni, n_att = a.T * a.Nkv * a.mtiles * a.S, n_mrg = a.T * a.Nq;
    const int n_o = (a.H / kTile) * a.s_o, n_n2 = a.T, n_rt = a.rt_tiles * a.s_rt;
    const int n_shgu = a.Is ? (a.Is / 4) * a.s_shgu : 0;
    const int n_shdn = a.Is ? edn_groups(a.H, shdn_sub_of<NR, V>(a)) * a.s_shdn : 0;
    const int n_fin = (V & V_TP) ? a.T * ((a.H + 1023) / 1024) : 0;
    /* shared down items queued before the routed experts' (the rest after
     * the routed gate/up) */
    const int n_shdn0 = n_shdn * a.shdn_early / 100;
    const int base_n2 = n_sel + n_att + n_mrg + n_o;
    const int base_dyn = base_n2 + n_n2 + n_rt + n_shgu + n_shdn0;
    if (threadIdx.x == 0) {
        ctl.step = 0;
        ctl.plan_nu = -1;
        const int own = own_item(a, 0, base_n2);
        const unsigned q = own != kQueue ? 0u : atomicAdd(&a.ctr[C_QPOST], 1u);
        reserve_first(a, ctl, q);
        if (own != kQueue)
            ctl.cur = own;
        else
            ctl.cur = q_item(a, ctl.cur, base_n2);
        /* Landing tags (world > 1) from the count of layer calls, which
         * only this call's pre kernel changed (zero_other): the same in
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
        int cur = next_item(ctl, &faulted);
        int n_egu = 0, n_edn = 0;
        if (cur >= base_dyn) { /* the routed experts' items exist once the plan does */
            int nu = ctl.plan_nu; /* (read by every thread before the barriers below) */
            if (nu < 0) {
                wait_count(&a.ctr[C_PLAN], 1u);
                nu = __ldcg(a.n_uniq);
                if (threadIdx.x == 0)
                    ctl.plan_nu = nu; /* seen by the CTA after the item's barriers */
            }
            n_egu = nu * egu_groups(a.I, egu_sub_of<NR, V>(a));
            n_edn = nu * edn_groups(a.H, a.edn_sub);
            if (cur - base_dyn >= n_egu + (n_shdn - n_shdn0) + n_edn + n_fin)
                break;
        }
        const int item = cur;
        int kind;
        if (cur < 0)
            kind = cur == kDryNorm2 ? K_NORM2 : K_PLAN; /* kPlanItem, kDryPlan: the plan */
        else if (cur < n_sel)
            kind = K_SEL;
        else if ((cur -= n_sel) < n_att)
            kind = K_ATT;
        else if ((cur -= n_att) < n_mrg)
            kind = K_MRG;
        else if ((cur -= n_mrg) < n_o)
            kind = K_OPROJ;
        else if ((cur -= n_o) < n_n2)
            kind = K_NORM2;
        else if ((cur -= n_n2) < n_rt)
            kind = K_ROUTER;
        else if ((cur -= n_rt) < n_shgu)
            kind = K_SHGU;
        else if ((cur -= n_shgu) < n_shdn0)
            kind = K_SHDN;
        else if ((cur -= n_shdn0) < n_egu)
            kind = K_EGU;
        else if ((cur -= n_egu) < n_shdn - n_shdn0)
            kind = K_SHDN, cur += n_shdn0;
        else if ((cur -= n_shdn - n_shdn0) < n_edn)
            kind = K_EDN;
        else
            kind = K_FIN, cur -= n_edn;
        const bool dry = item == kDryNorm2 || item == kDryPlan;
        unsigned long long t0 = a.trace ? gtimer() : 0;
        /* The item's input first, then the next item's reservation: a CTA
         * that waits holds no second item, so the items behind it go to
         * CTAs that are free (reserved at the start, a waiting router item
         * held the next one, and half the router phase ran a second wave
         * after norm2). The reservation's atomic is in flight during the
         * item, as before. (Kinds without a post_dep wait inside and hold
         * their next item meanwhile; the queue's order keeps that safe:
         * every wait is for an earlier item.) */
        if (kind == K_ROUTER && !faulted)
            router_prefetch(a, cur);
        const ItemDep dep = dry ? ItemDep{nullptr, 0u} : post_dep(a, kind, cur);
        if (dep.c)
            wait_count(dep.c, dep.target);
        unsigned nxt = 0;
        int own = kQueue;
        if (threadIdx.x == 0) {
            own = own_item(a, ctl.step + 1, base_n2);
            if (own == kQueue)
                nxt = atomicAdd(&a.ctr[C_QPOST], 1u);
        }
        bool plan = false;
        switch (kind) {
        case K_SEL: sel_item(a, dsm, cur, faulted); break;
        case K_ATT: att_item(a, ctl, dsm, cur, faulted); break;
        case K_MRG: merge_item(a, dsm, cur, faulted); break;
        case K_OPROJ: oproj_item<NR, V>(a, ctl, dsm, cur, faulted); break;
        case K_NORM2: norm2_item<V>(a, ctl, dsm, dry ? -1 : cur, faulted); break;
        case K_ROUTER: plan = router_item<NR, V>(a, ctl, dsm, cur, faulted) && !a.pin; break;
        case K_PLAN: plan = true; break;
        case K_SHGU: shgu_item<NR, V>(a, ctl, dsm, cur, faulted); break;
        case K_EGU: egu_item<NR, V>(a, ctl, dsm, cur, faulted); break;
        case K_SHDN: shdn_item<NR, V>(a, ctl, dsm, cur, faulted); break;
        case K_EDN: edn_item<NR, V>(a, ctl, dsm, cur, faulted); break;
        default: final_item<V>(a, ctl, cur, faulted); break;
        }
        if (plan) /* one call site: the plan's code is inlined once */
            route_and_plan<V>(a, ctl, dsm, dry);
        trace_item(a, 1, dry ? K_DRY : kind, item, t0);
        if (threadIdx.x == 0) {
            ctl.step++;
            const int q = reserved(ctl, nxt); /* (nxt is 0 for an own item) */
            ctl.cur = own != kQueue ? own : q_item(a, q, base_n2);
        }
    }
}

/* ---------------------------------------------------------------- launches */

template <int NR, int V>
m3_status occupancy_nr(size_t smem, int *min_occ) {
    const void *fns[2] = {(const void *)mono_pre_kernel<NR, V>,
                          (const void *)mono_post_kernel<NR, V>};
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

template <int NR, int V>
m3_status launch_nr(cudaStream_t s, int P, size_t smem, const MonoArgs &a) {
    mono_pre_kernel<NR, V><<<(unsigned)P, kThreads, smem, s>>>(a);
    M3_CUDA_LAUNCHED("mono_pre_kernel");
    mono_post_kernel<NR, V><<<(unsigned)P, kThreads, smem, s>>>(a);
    M3_CUDA_LAUNCHED("mono_post_kernel");
    return M3_OK;
}

} // namespace

template <int V>
m3_status occupancy_variant(size_t smem, int *min_occ) {
    M3_TRY((occupancy_nr<1, V>(smem, min_occ)));
    M3_TRY((occupancy_nr<2, V>(smem, min_occ)));
    M3_TRY((occupancy_nr<4, V>(smem, min_occ)));
    M3_TRY((occupancy_nr<8, V>(smem, min_occ)));
    return occupancy_nr<16, V>(smem, min_occ);
}

template <int V>
m3_status launch_variant(cudaStream_t s, int P, size_t smem, const MonoArgs &a) {
    if (a.T <= 1)
        return launch_nr<1, V>(s, P, smem, a);
    if (a.T <= 2)
        return launch_nr<2, V>(s, P, smem, a);
    if (a.T <= 4)
        return launch_nr<4, V>(s, P, smem, a);
    if (a.T <= 8)
        return launch_nr<8, V>(s, P, smem, a);
    return launch_nr<16, V>(s, P, smem, a);
}

} // namespace m3mono

#endif
