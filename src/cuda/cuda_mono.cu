/*
 * The mono path's CUDA executor (SPEC §5, cuda/cuda_mono.h): one sparse
 * attention + MoE layer of a decode step (<= 16 rows) in two launches of
 * persistent kernels, computing exactly decode/forward.c m3_stock_layer
 * with its rounding points (SPEC §2.3).
 *
 * Launch structure. Both kernels run P = SMs x (resident CTAs per SM)
 * CTAs of 128 threads (4 warps). Work is a list of items in a fixed order;
 * a CTA takes the next item from a queue counter (one atomic, in flight
 * while it works on the current item) until the list is exhausted. In the
 * post kernel most items' input is waited for in the item loop before the
 * next item is reserved (post_dep), so a CTA waiting there holds no second
 * item (o_proj and routed down items wait inside, after asking for their
 * weights, and do hold one).
 * Dependencies between items are counters in device memory: a producer
 * bumps a counter after its writes (fence + atomic: release), a consumer
 * spins on it (ld.acquire) before reading; the "last arriver" of a group
 * (the CTA whose atomic completes the count) does the group's follow-up
 * work (threadFenceReduction style). There is no grid-wide barrier at all:
 *   - every dependency points to an earlier item of the list, and items
 *     are handed out in list order, so the earliest unfinished item is
 *     always held by a running CTA whose inputs are complete: no deadlock,
 *     even when not every CTA is resident (no cooperative launch needed);
 *   - a CTA that runs ahead starts on the next item instead of idling at
 *     a barrier; waits happen only where data is really missing.
 * Counters start at zero: each kernel has its own and zeroes the other
 * kernel's at its start (the pre kernel the post kernel's, and the other
 * way round), when that kernel has ended and its next launch has not
 * begun. Launches on one stream never overlap, so this holds for eager
 * launches and graph replays alike (nothing depends on host values that
 * change between replays).
 *
 *   pre  (launch 1): norm1 rows | the rows' RoPE factors (one item; the
 *        projections wait for it with norm1) | projection tiles (iq, ik,
 *        k, v, q: one virtual matrix, iq/ik first so the indexer's inputs
 *        are ready first) — the last tile of each 128-wide head does that
 *        head's Gemma norm + RoPE (one rounding) for all rows and its cache
 *        write (k, v, ik) | index scores (slice of blocks, row), waiting
 *        only for the index heads (a page no row writes is asked for
 *        before that).
 *   post (launch 2): selection (row, head) | attention (row, KV head, head
 *        tile, split: one selected block per split) | merge (row, query
 *        head: the head's partials, once every split of its group has
 *        arrived) | o_proj tiles | norm2 rows | router
 *        tiles (fp32), the last one routes every row and plans the distinct
 *        experts | shared expert gate+up tiles | shared down tiles (both
 *        beside the router and the plan, where CTAs would only wait) |
 *        routed gate+up tiles (n_uniq x I/4, only the experts the rows
 *        route to) | routed down items (n_uniq x H/8/sub) — the last
 *        contribution to an 8-column tile of the output combines it | TP:
 *        final sums. Up to 8 rows (world 1), norm2 and the plan are not
 *        in the queue: CTA t runs row t's norm2 and CTA 0 the plan, each
 *        after a dry run of the same code on scratch while they would wait
 *        anyway (the code on the chain is fetched once per launch, cold;
 *        run dry first it is cached: M3_MONO_PIN); the shared down items
 *        are queued before the routed experts' (M3_MONO_SHDN_EARLY).
 *
 * GEMV tiles: 8 output rows (2 per warp) over K, the rows' activations
 * staged in shared memory 1024 columns at a time (cp.async); weights
 * streamed once with 16-byte (bf16) / 8-byte (e4m3) loads, the inner loop
 * of the stock GEMV as it was before its sums were cut into chunks that do
 * not depend on the TP world (cuda_ksum.cuh). Latency: each chunk's weight
 * loads are issued before its activations are staged. (Asking L2 for an
 * item's weights when it starts, before it waits on its inputs, was
 * measured and removed: the prefetches issued when a kernel starts delayed
 * the chain's first loads more than they saved, docs/PERF.md; the router's
 * 3 MB of fp32 rows are still asked for.) Routed down items cover five
 * 8-column tiles of one expert at one row, six at 2, eight above, shared
 * down items as many tiles of the shared expert; where the width fits one
 * chunk and the weights are bf16, these walk their tiles with the next two
 * tiles' weights in a shared-memory ring (cp.async; a second register
 * buffer spills), and the 16-row kernel's routed gate/up items (4-row
 * groups) and, in the 1- and 3-4-row kernels, the unsplit bf16
 * projections (q, k, v, o) stream their chunks through the same ring
 * (down_walk, gemv_ring; gemv_chain chooses for the projections); at 2-8
 * rows (world 1, bf16) a routed gate/up item covers three (2 rows) or
 * four (3-8 rows, the expert's members two at a time) 4-neuron tiles,
 * every chunk of each through the ring, the rows staged whole once
 * (gu_walk). A chunk's products run as a loop over its four pieces from 8
 * rows, and from 4 rows in every item but the routed experts' (chunk_fma:
 * the chain's code runs cold). Narrow matrices
 * (except the shared gate/up, off the chain) are split over K by the
 * rule the stock linear op used before its chunk groups (1024-column
 * slices; the count depends on the shape and the SM count, never on the
 * row count), and the tile's last arriver sums the partials in slice
 * order. So the dense products are the stock path's up to fp32 summation
 * order, not bit for bit: the cache entries, index scores and block
 * selections equal the stock path's almost everywhere (test_cuda_mono
 * counts them). Cutting these sums like the stock path's (branch
 * merge-mono-worlds) made the fused kernels 27-41% slower (docs/PERF.md).
 * Results are deterministic, and a row's values do not depend on the other
 * rows of the step (batch invariance): attention splits (one per top-k
 * block), index slices and the MoE member groups depend on capacities or
 * per-row data only.
 *
 * Precision: the stock kernels' arithmetic (norms: squares summed in
 * double, mean rounded once; RoPE angle in double from the host's pow();
 * index dots in fp64 with the CPU's accumulator order, so scores and the
 * selection equal the stock path's; attention on bf16 tensor cores with
 * the flash-decoding merge; router in fp32; the SPEC's rounding points).
 * Several device routines are ports of cuda_index.cu / cuda_attention.cu /
 * cuda_moe.cu / cuda_elementwise.cu (same math, item-sized instead of
 * kernel-sized; the block selection is the same code, cuda_async.cuh).
 *
 * TP (world > 1): o_proj and the FFN produce fp32 partial sums (no bf16
 * rounding of partial down outputs); every value is pushed to every rank's
 * landing buffer as an 8-byte (value, tag) pair (NCCL's LL protocol: an
 * aligned 8-byte store is seen whole, so no fences are needed); the tag is
 * derived from a device-side count of the executor's layer calls (equal on
 * every rank, new on every call, also under CUDA graph replay, where a
 * host-side epoch would be frozen into the graph). Readers spin on each
 * pair's tag (bounded: M3_MONO_FAULT_PEER_WAIT after kPeerTimeoutNs) and
 * sum ranks in rank order, so every rank gets identical bits; the result
 * is rounded once. A landing slot is reused only after every rank has
 * consumed it (the next push to it depends, through the other all-reduce,
 * on the reader having finished), so one buffer per all-reduce suffices.
 * World 1 keeps the stock rounding (o rounded; expert and shared down
 * outputs rounded before the combine).
 *
 * Faults: a real row's slot past the pool, a block table page outside the
 * pool (or a row past its block table), a peer that does not push in time
 * set the fault word (first one wins). Every item checks the word when it
 * starts and skips its work once it is set (counters still advance, so no
 * wait hangs); no access is ever made out of bounds.
 */
/*
 * Files: cuda_mono.cu (this: host side: create, knobs, splits, scratch,
 * trace, fault word) and cuda_mono_layer.cu (a layer call's arguments and
 * launch), sharing cuda_mono_host.h (the executor's state);
 * cuda_mono_args.cuh (constants, variants, MonoArgs, the kernel unit's
 * entry points), cuda_mono_kernels.cuh (the kernels' item
 * loops and launches, templates over rows and variant) with its parts
 * cuda_mono_dev.cuh (counters, GEMV core, norms), cuda_mono_pre.cuh
 * (launch 1 items), cuda_mono_attn.cuh (selection, attention),
 * cuda_mono_ffn.cuh (o_proj .. experts); cuda_mono_kernels.cu (world-1
 * variants, fault word kernels, entry points) and cuda_mono_kernels_tp.cu
 * (TP variants) instantiate them.
 *
 * Variants: a layer's kernels are compiled for what it needs: V_F8 when
 * any weight is MXFP8 (else the GEMV items have only the bf16 core), V_TP
 * when world > 1 (else no landing-buffer pushes, reads or final sums).
 */
#include "cuda/cuda_mono_host.h"

using namespace m3mono;

/* ================================================================ host */

/* An integer knob from the environment, `fallback` when unset or outside
 * [lo, hi]. */
static int env_int(const char *name, int fallback, int lo, int hi) {
    const char *v = getenv(name);
    if (!v || !*v)
        return fallback;
    char *end = NULL;
    long x = strtol(v, &end, 10);
    return *end == '\0' && x >= lo && x <= hi ? (int)x : fallback;
}

/* The K splits the stock GEMV uses for an [N, K] weight (cuda_linear.cu
 * k_splits: CTAs of cta_rows output rows, about two CTAs per SM), so a
 * dense product here sums in the stock path's order and gives its bits
 * (with M3_MONO_P_UNSPLIT_FROM=0 the projections, hence the cache entries,
 * the index scores and the selections, equal the stock path's). Depends on
 * shapes and the SM count only, never on the step's rows. */
static int stock_splits(int sm_count, int64_t N, int64_t K, int cta_rows) {
    int64_t n_tiles = (N + cta_rows - 1) / cta_rows;
    int64_t chunks = (K + kKC - 1) / kKC;
    int64_t want = 2 * (int64_t)(sm_count > 0 ? sm_count : 1);
    if (n_tiles >= want || chunks < 2)
        return 1;
    int64_t s = (want + n_tiles - 1) / n_tiles;
    return (int)(s < chunks ? s : chunks);
}

static m3_status check_config(const m3_config *c, int max_blocks, int rank, int world) {
    if (world < 1 || world > 64 || rank < 0 || rank >= world)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "TP rank %d of %d is invalid", rank, world);
    if (max_blocks < 1 || max_blocks > (1 << 22))
        return MONO_FAIL(M3_ERR_INVALID_ARG, "max_blocks %d is out of range", max_blocks);
    if (c->head_dim != kHD)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "head_dim %d is not supported (only %d)", c->head_dim,
                         kHD);
    if (c->index_dim != kHD)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "index_dim %d is not supported (only %d)",
                         c->index_dim, kHD);
    if (c->block_size != M3_PAGE)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "sparse block size %d is not supported (only %d)",
                         c->block_size, M3_PAGE);
    if (c->rotary_dim < 0 || c->rotary_dim % 2 || c->rotary_dim > 2 * kMaxHalf)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "rotary_dim %d must be even and at most %d",
                         c->rotary_dim, 2 * kMaxHalf);
    if (!(c->rope_theta > 0))
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "rope_theta %g must be > 0", c->rope_theta);
    if (c->num_q_heads < 1 || c->num_kv_heads < 1 || c->num_q_heads % c->num_kv_heads)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "%d query heads over %d KV heads", c->num_q_heads,
                         c->num_kv_heads);
    if (c->index_heads != c->num_kv_heads)
        return MONO_FAIL(M3_ERR_UNSUPPORTED,
                         "%d index heads must equal the %d KV heads (one per KV group)",
                         c->index_heads, c->num_kv_heads);
    if (c->hidden_size < kTile || c->hidden_size % 32 || c->hidden_size > (1 << 20))
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "hidden size %d must be a multiple of 32",
                         c->hidden_size);
    if (c->num_experts < 1 || c->num_experts > (1 << 16))
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "%d experts is out of range", c->num_experts);
    if (c->experts_per_tok < 1 || c->experts_per_tok > kMaxTopE ||
        c->experts_per_tok > c->num_experts)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "top-%d of %d experts (at most %d per token)",
                         c->experts_per_tok, c->num_experts, kMaxTopE);
    if (c->expert_dim < 32 || c->expert_dim % 32)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "expert width %d must be a positive multiple of 32",
                         c->expert_dim);
    if (c->shared_dim < 0 || c->shared_dim % 32)
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "shared expert width %d must be a multiple of 32",
                         c->shared_dim);
    if (c->topk_blocks < 1 || c->topk_blocks > kMaxSplits || c->init_blocks < 0 ||
        c->local_blocks < 0 || c->init_blocks + c->local_blocks > c->topk_blocks)
        return MONO_FAIL(M3_ERR_UNSUPPORTED,
                         "top-%d blocks with %d init and %d local blocks (at most %d blocks; "
                         "forced blocks within the top-k)",
                         c->topk_blocks, c->init_blocks, c->local_blocks, kMaxSplits);
    return M3_OK;
}

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* Shared memory per CTA and CTAs per launch. The largest phase sets the
 * size (attention stages, index tiles, a GEMV's staged rows, the
 * selection), with the norms' rows (residual, addend, weight) and the
 * routing plan (its sort, then 2 x E staged floats per warp), which must
 * always fit: the kernels have no second path for them (norm_row,
 * route_and_plan). The head epilogue's 4 KiB and the attention merge's
 * partials (at most 33 KiB) fit too (static assert). P is every SM times
 * the smallest resident CTA count of every kernel instance. */
static m3_status size_launch(m3_cuda_mono *m) {
    const m3_config *c = &m->cfg;
    const int H = c->hidden_size, Ni = c->index_heads, E = c->num_experts;
    const size_t sel_min = (sizeof(SelShared) + 15) / 16 * 16;
    const size_t need[] = {(size_t)kAttnSmem,
                           idx_smem(Ni),
                           (size_t)kMaxT * kKC * 2,
                           sel_min,
                           6 * (size_t)H,
                           plan_key_offset() + (size_t)kWarps * E * 8};
    size_t smem = 0;
    for (size_t i = 0; i < sizeof need / sizeof *need; i++)
        smem = smem > need[i] ? smem : need[i];
    const size_t smem_max = 227 * 1024;
    if (smem > smem_max)
        return MONO_FAIL(M3_ERR_UNSUPPORTED,
                         "%d index heads, hidden size %d and %d experts need %zu bytes of "
                         "shared memory per CTA (at most %zu)",
                         Ni, H, E, smem, smem_max);
    m->smem = smem;
    m->sel_staged = sel_min + (size_t)m->max_blocks * 4 <= smem;
    int occ = INT_MAX;
    M3_TRY(occupancy(smem, &occ));
    if (occ < 1)
        return MONO_FAIL(M3_ERR_UNSUPPORTED,
                         "the fused kernels do not fit on an SM (%zu bytes of shared memory, %d "
                         "threads)",
                         smem, kThreads);
    m->P = (m->cu->sm_count > 0 ? m->cu->sm_count : 1) * occ;
    return M3_OK;
}

/* The tuning knobs, read once (docs/PERF.md, "Tuning and diagnostics").
 * None changes results beyond fp32 summation order; out-of-range values
 * keep the defaults. */
static void read_knobs(m3_cuda_mono *m) {
    /* M3_MONO_CTAS caps the CTAs per launch (any count is correct: every
     * dependency points to an earlier item) */
    m->P = env_int("M3_MONO_CTAS", m->P, 1, m->P);
    /* M3_MONO_SPIN_NS: a waiting CTA's sleep between polls of a counter;
     * M3_MONO_POLL_ACQUIRE=1: every poll an acquire load (docs/PERF.md has
     * the measurements, and those of the knobs measured and removed: the L2
     * weight prefetch and the staging loop). */
    m->spin_ns = env_int("M3_MONO_SPIN_NS", 64, 0, 1000000);
    m->poll_acquire = env_int("M3_MONO_POLL_ACQUIRE", 0, 0, 1);
    /* The shared expert runs beside the router and the routing plan, where
     * most CTAs only wait: its down items are queued before the routed
     * experts' items (they wait only for the shared gate/up), not after
     * them. M3_MONO_SHDN_EARLY=p queues p% of them there and the rest after
     * the routed gate/up items (-1, the default: 100%; 25% at up to 4 rows
     * from the fifteenth session to the twenty-seventh, 0.4-1.8% slower
     * than 100% on the kernels of the twenty-seventh: docs/PERF.md,
     * twenty-eighth session). */
    m->shdn_early = env_int("M3_MONO_SHDN_EARLY", -1, 0, 100);
    /* M3_MONO_EDN_SUB=n: 8-column tiles per routed down item (0, the
     * default: 8 above 2 rows, 6 at 2, 5 at one; fewer, larger items pay
     * from 4 rows (-1.5% at 4, -3% at 8: twenty-second session); 5 and 6
     * against 4 at 1-2 rows: -1.5% / -2%, twenty-eighth session) */
    m->edn_sub = env_int("M3_MONO_EDN_SUB", 0, 0, 8);
    /* M3_MONO_SHDN_SUB=n: 8-column tiles per shared down item, walked with
     * the routed down's weight ring (0, the default: as the routed down
     * items; 1: a tile per item, gemv_rows; only where the shared width
     * fits one staged chunk, unsplit, bf16, else 1) */
    m->shdn_sub = env_int("M3_MONO_SHDN_SUB", 0, 0, 8);
    /* M3_MONO_EGU_SUB=n: 4-neuron tiles per routed gate/up item in the
     * 1-8-row kernels, walked through one weight ring (gu_walk; 0, the
     * default: 1 at one row (2 or 3 there: +2-4%; twenty-second session),
     * 3 at 2 rows (-2.8%), 4 at 3-8 rows (-2.1% at 4 rows, -2.9% at 8;
     * thirty-first session); only for bf16 weights whose rows, staged
     * whole, leave two ring slots of shared memory, else 1) */
    m->egu_sub = env_int("M3_MONO_EGU_SUB", 0, 0, 8);
    /* M3_MONO_PIN=n: CTAs of their own for norm2 and the routing plan
     * (MonoArgs.pin); with 2 they run both once dry while they would wait
     * anyway, so the real ones find their code in the SM's instruction
     * cache. -1, the default: 2 at up to 8 rows (-3.5% at one row, -1% at
     * 8), 0 above (+0.6% at 16: its dry plan takes 28 us; docs/PERF.md,
     * fifteenth session), and 0 at world > 1 until the multi-GPU tests
     * have run with it (gpu-check's multigpu stage runs them with
     * M3_MONO_PIN=1 too). */
    m->pin = env_int("M3_MONO_PIN", -1, 0, 2);
    /* M3_MONO_IDX_CLAIM (-1 per step, the default; 0 fixed slices; 1
     * claims; 2 the items choose on the device at every step, a test
     * setting; see args_shapes): index-score items that claim runs of at
     * most M3_MONO_IDX_RUN pages (default 4) at run time, so long
     * contexts' pages balance over whichever CTAs are free */
    m->idx_claim = env_int("M3_MONO_IDX_CLAIM", -1, -1, 2);
    /* (the tests set it low to have the items choose claims on the device) */
    m->idx_min_pages = env_int("M3_MONO_IDX_MIN_PAGES", kIdxClaimMinPages, 1, 1 << 20);
    m->idx_run = env_int("M3_MONO_IDX_RUN", 4, 1, 1 << 20);
    /* M3_MONO_IDX_SLICES=n: fixed index slices per row, n x CTAs / rows
     * (0, the default: 2 in the kernels without claims, else 1; see
     * args_shapes) */
    m->idx_slices = env_int("M3_MONO_IDX_SLICES", 0, 0, 64);
}

/* K splits by the stock linear op's rule before its chunk groups (16-row
 * CTAs; the router's fp32 kernel 8-row CTAs), and the first item of each
 * projection in the pre kernel's virtual matrix (iq, ik, k, v, q) */
static void plan_splits(m3_cuda_mono *m) {
    const m3_config *c = &m->cfg;
    const int H = c->hidden_size, Nq = c->num_q_heads, Nkv = c->num_kv_heads;
    const int Ni = c->index_heads, E = c->num_experts, Is = c->shared_dim;
    const int sm = m->cu->sm_count;
    const int64_t p_rows[5] = {(int64_t)Ni * kHD, kHD, (int64_t)Nkv * kHD, (int64_t)Nkv * kHD,
                               (int64_t)Nq * kHD};
    /* Two sets of projection splits (iq, ik, k, v, q), chosen per step:
     * set 0 the stock rule's; set 1, for steps of at least p_unsplit_from
     * rows (0: none), q, k and v unsplit, one item per 8-row tile over all
     * of K (no partial sums), and iq and ik in M3_MONO_SPLITS_PI slices.
     * Set 1 by default at every step: on m3-tp4-rank that is 384 items,
     * one wave on 396 CTAs (the stock rule's 1,152 ran three), iq and ik in
     * items of two chunks so the index heads, and the index items after
     * them, finish while q, k and v still stream (docs/PERF.md,
     * twenty-fourth session). Unsplit, the projections' fp32 sums run in
     * another order than the stock GEMV's, so the cache entries and index
     * scores equal the stock path's up to rounding, not bit for bit. */
    const char *split_p = getenv("M3_MONO_SPLITS_P"); /* (then set 0 by default) */
    m->p_unsplit_from = env_int("M3_MONO_P_UNSPLIT_FROM", split_p && *split_p ? 0 : 1, 0, kMaxT);
    const int s_pi = env_int("M3_MONO_SPLITS_PI", 3, 1, 64);
    m->s_pmax = 1;
    for (int set = 0; set < 2; set++) {
        m->p_item0[set][0] = 0;
        for (int i = 0; i < 5; i++) {
            int sp = set == 1 ? (i < 2 ? s_pi : 1) : stock_splits(sm, p_rows[i], H, 16);
            if (set == 0)
                sp = env_int("M3_MONO_SPLITS_P", sp, 1, 64); /* experiments */
            m->s_p[set][i] = sp;
            m->s_pmax = sp > m->s_pmax ? sp : m->s_pmax;
            m->p_item0[set][i + 1] = m->p_item0[set][i] + (int)(p_rows[i] / kTile) * sp;
        }
    }
    m->s_o = stock_splits(sm, H, (int64_t)Nq * kHD, 16);
    m->s_o = env_int("M3_MONO_SPLITS_O", m->s_o, 1, 64); /* experiments */
    m->s_rt = stock_splits(sm, E, H, 8);
    m->s_rt = env_int("M3_MONO_SPLITS_RT", m->s_rt, 1, 64); /* experiments */
    /* the shared gate/up unsplit: off the chain, so fewer and larger items
     * (all of K, no partial sums) finish sooner, before the routing plan;
     * the stock rule's 6 splits made 1,152 items of 16 KB */
    m->s_shgu = 1;
    m->s_shdn = Is ? stock_splits(sm, H, Is, 16) : 1;
    /* experiments: M3_MONO_SPLITS_SHGU / _SHDN override the shared expert's
     * K splits (any count is correct; fp32 sums in another order) */
    m->s_shgu = env_int("M3_MONO_SPLITS_SHGU", m->s_shgu, 1, 64);
    m->s_shdn = env_int("M3_MONO_SPLITS_SHDN", m->s_shdn, 1, 64);
}

/* the dependency counters' offsets in one array (MonoArgs o_*) */
static void lay_counters(m3_cuda_mono *m) {
    const m3_config *c = &m->cfg;
    const int H = c->hidden_size, Ni = c->index_heads, Nkv = c->num_kv_heads;
    const int Is = c->shared_dim, R = kMaxT;
    int at = C_FIXED;
    /* the pre kernel's */
    m->o_head = at, at += m->nheads;
    m->o_idxq = at, at += R + 1; /* and the rows whose runs are all taken */
    /* the post kernel's */
    m->o_post = at;
    m->o_sel = at, at += R * Ni;
    m->o_att = at, at += R * Nkv * m->mtiles;
    m->o_otile = at, at += H / kTile;
    m->o_rtile = at, at += m->rt_tiles;
    m->o_shgu = at, at += Is ? Is / 4 : 1;
    m->o_shdn = at, at += H / kTile;
    m->o_egu = at, at += R * c->experts_per_tok;
    m->o_comb = at, at += H / kTile;
    m->n_ctr = at;
}

/* every scratch buffer in one device allocation, zeroed (counters must
 * start at zero); at world 1 the only peer is this rank */
static m3_status alloc_scratch(m3_cuda_mono *m) {
    const m3_config *c = &m->cfg;
    const int H = c->hidden_size, Nq = c->num_q_heads, Ni = c->index_heads;
    const int E = c->num_experts, K = c->experts_per_tok, I = c->expert_dim;
    const int Is = c->shared_dim, R = kMaxT, world = m->world;
    const size_t part_tile = (size_t)kTile * kMaxT * 4;
    struct {
        void **ptr;
        size_t bytes;
    } want[] = {
        {(void **)&m->x1, (size_t)R * H * 2},
        {(void **)&m->proj, (size_t)R * m->Ntot * 2},
        {(void **)&m->attn, (size_t)R * Nq * kHD * 2},
        {(void **)&m->o, (size_t)R * H * 2},
        {(void **)&m->x2, (size_t)R * H * 2},
        {(void **)&m->act, (size_t)R * K * I * 2},
        {(void **)&m->sh_act, (size_t)R * (Is ? Is : 1) * 2},
        {(void **)&m->scores, (size_t)R * Ni * m->max_blocks * 4},
        {(void **)&m->rope, (size_t)R * kMaxHalf * 2 * 4},
        {(void **)&m->sel, (size_t)R * Ni * c->topk_blocks * 4},
        {(void **)&m->att_ml, (size_t)R * Nq * m->S * 8},
        {(void **)&m->att_acc, (size_t)R * Nq * m->S * kHD * 4},
        {(void **)&m->logits, (size_t)R * E * 4},
        {(void **)&m->rw, (size_t)R * K * 4},
        {(void **)&m->rids, (size_t)R * K * 4},
        {(void **)&m->uniq, (size_t)R * K * 4},
        {(void **)&m->ufirst, (size_t)(R * K + 1) * 4},
        {(void **)&m->members, (size_t)R * K * 4},
        {(void **)&m->n_uniq, 4},
        {(void **)&m->dry_rows, (size_t)kMaxT * 3 * H * 2},
        {(void **)&m->dry_logits, (size_t)kMaxT * E * 4},
        {(void **)&m->dry_plan, (size_t)6 * (kMaxAssign + 1) * 4},
        {(void **)&m->eout, (size_t)R * K * H * 4},
        {(void **)&m->sh_out, (size_t)R * H * 4},
        {(void **)&m->part_proj,
         m->s_pmax > 1 ? (size_t)(m->Ntot / kTile) * m->s_pmax * part_tile : 4},
        {(void **)&m->part_o, m->s_o > 1 ? (size_t)(H / kTile) * m->s_o * part_tile : 4},
        {(void **)&m->part_rt, m->s_rt > 1 ? (size_t)m->rt_tiles * m->s_rt * part_tile : 4},
        {(void **)&m->part_shgu, m->s_shgu > 1 ? (size_t)(Is / 4) * m->s_shgu * part_tile : 4},
        {(void **)&m->part_shdn, m->s_shdn > 1 ? (size_t)(H / kTile) * m->s_shdn * part_tile : 4},
        {(void **)&m->ctr, (size_t)m->n_ctr * 4},
        {(void **)&m->calls, 4},
        {(void **)&m->fault, 16},
        {(void **)&m->peers_dev, (size_t)world * sizeof(void *)},
        {(void **)&m->landing, world > 1 ? (size_t)2 * world * R * H * 8 : 8},
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        total += align256(want[i].bytes);
    M3_CUDA_TRY(cudaMalloc(&m->block, total));
    m->block_bytes = total;
    char *p = (char *)m->block;
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        *want[i].ptr = p;
        p += align256(want[i].bytes);
    }
    m->landing_bytes = world > 1 ? (size_t)2 * world * R * H * 8 : 0;
    M3_CUDA_TRY(cudaMemsetAsync(m->block, 0, total, m->cu->stream));
    M3_CUDA_TRY(cudaStreamSynchronize(m->cu->stream));
    if (world == 1) {
        void *self = m->landing;
        M3_CUDA_TRY(cudaMemcpy(m->peers_dev, &self, sizeof self, cudaMemcpyHostToDevice));
        m->peers_set = true;
    }
    return M3_OK;
}

extern "C" m3_status m3_cuda_mono_create(m3_backend *be, const m3_config *cfg, int max_blocks,
                                         int tp_rank, int tp_size, m3_cuda_mono **out) {
    *out = NULL;
    if (!be || !cfg)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "backend and config are required");
    if (!be->ops || !be->ops->name || strcmp(be->ops->name, "cuda"))
        return MONO_FAIL(M3_ERR_UNSUPPORTED, "the CUDA executor needs the CUDA backend, not %s",
                         be->ops && be->ops->name ? be->ops->name : "?");
    M3_TRY(check_config(cfg, max_blocks, tp_rank, tp_size));
    m3_cuda *cu = m3_cuda_of(be);
    /* allocations below land on the backend's GPU */
    M3_CUDA_TRY(cudaSetDevice(cu->device));
    m3_cuda_mono *m = (m3_cuda_mono *)calloc(1, sizeof *m);
    if (!m)
        return MONO_FAIL(M3_ERR_NO_MEMORY, "out of memory");
    m->be = be;
    m->cu = cu;
    m->cfg = *cfg;
    m->max_blocks = max_blocks;
    m->rank = tp_rank;
    m->world = tp_size;
    const int Nq = cfg->num_q_heads, Nkv = cfg->num_kv_heads;
    m->Ntot = (cfg->index_heads + 1 + 2 * Nkv + Nq) * kHD;
    m->nheads = m->Ntot / kHD;
    m->mtiles = (Nq / Nkv + kHeadTile - 1) / kHeadTile;
    m->S = cfg->topk_blocks; /* one selected block per split */
    m->rt_tiles = (cfg->num_experts + kTile - 1) / kTile;
    int half = cfg->rotary_dim / 2;
    for (int i = 0; i < kMaxHalf; i++) /* the CPU's m3_rope_table expression */
        m->inv_freq[i] =
            i < half ? pow(cfg->rope_theta, -(double)(2 * i) / (double)cfg->rotary_dim) : 0.0;
    m3_status st = size_launch(m);
    if (!st) {
        read_knobs(m);
        plan_splits(m);
        lay_counters(m);
        st = alloc_scratch(m);
    }
    if (st) {
        m3_cuda_mono_free(m);
        return st;
    }
    *out = m;
    return M3_OK;
}

extern "C" void m3_cuda_mono_free(m3_cuda_mono *m) {
    if (!m)
        return;
    if (m->block) {
        cudaStreamSynchronize(m->cu->stream);
        cudaFree(m->block);
    }
    cudaFree(m->trace);
    cudaFree(m->trace_n);
    if (m->side)
        cudaStreamDestroy(m->side);
    free(m);
}

/* ---------------------------------------------------------------- trace */

extern "C" m3_status m3_cuda_mono_trace_start(m3_cuda_mono *m) {
    if (!m->trace) {
        m->trace_cap = 1u << 16;
        M3_CUDA_TRY(cudaMalloc((void **)&m->trace, (size_t)m->trace_cap * kTraceWords * 8));
        M3_CUDA_TRY(cudaMalloc((void **)&m->trace_n, sizeof *m->trace_n));
    }
    M3_CUDA_TRY(cudaMemsetAsync(m->trace_n, 0, sizeof *m->trace_n, m->cu->stream));
    m->tracing = true;
    return M3_OK;
}

extern "C" m3_status m3_cuda_mono_trace_write(m3_cuda_mono *m, const char *path) {
    if (!m->trace)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "trace_write without trace_start");
    unsigned n = 0;
    M3_CUDA_TRY(cudaStreamSynchronize(m->cu->stream));
    M3_CUDA_TRY(cudaMemcpy(&n, m->trace_n, sizeof n, cudaMemcpyDeviceToHost));
    n = n < m->trace_cap ? n : m->trace_cap;
    unsigned long long *h = (unsigned long long *)malloc((size_t)n * kTraceWords * 8 + 8);
    if (!h)
        return MONO_FAIL(M3_ERR_NO_MEMORY, "out of memory for the trace");
    cudaError_t e = cudaMemcpy(h, m->trace, (size_t)n * kTraceWords * 8, cudaMemcpyDeviceToHost);
    FILE *f = e == cudaSuccess ? fopen(path, "w") : NULL;
    if (f) {
        fprintf(f, "kernel kind cta item start_ns end_ns ready_ns");
        for (int j = 0; j < kMarks; j++)
            fprintf(f, " mark%d_ns", j);
        fprintf(f, "\n");
        for (unsigned i = 0; i < n; i++) {
            const unsigned long long *rec = h + (size_t)kTraceWords * i, meta = rec[0];
            fprintf(f, "%u %u %u %u %llu %llu %llu", (unsigned)(meta >> 56),
                    (unsigned)(meta >> 48) & 0xff, (unsigned)(meta >> 32) & 0xffff,
                    (unsigned)meta, rec[1], rec[2], rec[3]);
            for (int j = 0; j < kMarks; j++)
                fprintf(f, " %llu", rec[4 + j]);
            fprintf(f, "\n");
        }
        fclose(f);
    }
    free(h);
    m->tracing = false; /* later launches run untraced until the next trace_start */
    M3_CUDA_TRY(e);
    if (!f)
        return MONO_FAIL(M3_ERR_IO, "cannot write the trace to %s", path);
    return M3_OK;
}

extern "C" void *m3_cuda_mono_landing(m3_cuda_mono *m) {
    return m && m->world > 1 ? (void *)m->landing : NULL;
}

extern "C" m3_status m3_cuda_mono_set_peers(m3_cuda_mono *m, void *const *landings,
                                            int32_t *const *faults, int world) {
    if (!m || !landings || !faults)
        return MONO_FAIL(M3_ERR_INVALID_ARG,
                         "set_peers: executor, landing areas and fault words are required");
    if (world > M3_MAX_TP)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "set_peers: TP world %d (at most %d)", world,
                         M3_MAX_TP);
    if (world != m->world)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "set_peers: %d landing areas for a TP world of %d",
                         world, m->world);
    if (m->cu->capturing)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "set_peers during graph capture");
    for (int r = 0; r < world; r++)
        if (!landings[r] || ((uintptr_t)landings[r] & 15))
            return MONO_FAIL(M3_ERR_INVALID_ARG, "set_peers: rank %d's landing area %p is invalid",
                             r, landings[r]);
    if (landings[m->rank] != (void *)m->landing || faults[m->rank] != m->fault)
        return MONO_FAIL(M3_ERR_INVALID_ARG,
                         "set_peers: entry %d is not this rank's landing area and fault word",
                         m->rank);
    for (int r = 0; r < world; r++)
        if (!faults[r])
            return MONO_FAIL(M3_ERR_INVALID_ARG, "set_peers: rank %d has no fault word", r);
    M3_CUDA_TRY(cudaMemcpy(m->peers_dev, landings, (size_t)world * sizeof(void *),
                           cudaMemcpyHostToDevice));
    if (!m->side)
        M3_CUDA_TRY(cudaStreamCreateWithFlags(&m->side, cudaStreamNonBlocking));
    for (int r = 0; r < world; r++)
        m->peer_faults[r] = faults[r];
    m->peers_set = true;
    return M3_OK;
}

/* ---------------------------------------------------------------- fault word */

extern "C" int32_t *m3_cuda_mono_fault_word(m3_cuda_mono *m) { return m ? m->fault : NULL; }

extern "C" m3_status m3_cuda_mono_check_fault(m3_cuda_mono *m) {
    if (!m)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "check_fault: no executor");
    return launch_check(m->cu->stream, m->fault);
}

extern "C" m3_status m3_cuda_mono_set_fault(m3_cuda_mono *m, int code, int layer) {
    if (!m)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "set_fault: no executor");
    if (code <= M3_MONO_FAULT_NONE)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "set_fault: code %d is not a fault", code);
    return launch_set(m->cu->stream, m->fault, code, layer);
}

extern "C" m3_status m3_cuda_mono_abort_all(m3_cuda_mono *m) {
    if (!m)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "abort_all: no executor");
    if (m->world == 1 || !m->peers_set) /* this rank is every rank */
        return m3_cuda_mono_set_fault(m, M3_MONO_FAULT_ABORTED, -1);
    /* Not through the rank's stream: it may hold a kernel that waits on a
     * push this rank will never make. A word already set keeps its fault
     * (the read and the write are not one atomic step: a fault landing in
     * between is overwritten by ABORTED, which still ends the step). */
    static const int32_t aborted[4] = {M3_MONO_FAULT_ABORTED, -1, -1, 0};
    for (int r = 0; r < m->world; r++) {
        int32_t now[4];
        M3_CUDA_TRY(cudaMemcpyAsync(now, m->peer_faults[r], sizeof now, cudaMemcpyDeviceToHost,
                                    m->side));
        M3_CUDA_TRY(cudaStreamSynchronize(m->side));
        if (now[0] == 0)
            M3_CUDA_TRY(cudaMemcpyAsync(m->peer_faults[r], aborted, sizeof aborted,
                                        cudaMemcpyHostToDevice, m->side));
    }
    M3_CUDA_TRY(cudaStreamSynchronize(m->side));
    return M3_OK;
}

extern "C" m3_status m3_cuda_mono_read_fault(m3_cuda_mono *m, int32_t out[4]) {
    if (!m || !out)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "read_fault: executor and output are required");
    if (m->cu->capturing)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "read_fault during graph capture");
    M3_CUDA_TRY(cudaMemcpyAsync(out, m->fault, 16, cudaMemcpyDeviceToHost, m->cu->stream));
    return m3_cuda_stream_wait(m->cu);
}

extern "C" m3_status m3_cuda_mono_clear_fault(m3_cuda_mono *m) {
    if (!m)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "clear_fault: no executor");
    if (m->cu->capturing)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "clear_fault during graph capture");
    M3_CUDA_TRY(cudaMemsetAsync(m->fault, 0, 16, m->cu->stream));
    return m3_cuda_stream_wait(m->cu);
}
