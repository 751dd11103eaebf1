/*
 * The mono executor's host state (struct m3_cuda_mono), shared by its two
 * host files: cuda_mono.cu (create, knobs, splits, scratch, trace, peers,
 * fault word) and cuda_mono_layer.cu (a layer call's arguments and launch).
 */
#ifndef M3_CUDA_CUDA_MONO_HOST_H
#define M3_CUDA_CUDA_MONO_HOST_H

#include "cuda/cuda_mono_args.cuh"

struct m3_cuda_mono {
    m3_backend *be;
    m3_cuda *cu;
    m3_config cfg;
    int max_blocks, rank, world;
    int P;              /* CTAs per launch */
    size_t smem;        /* dynamic shared memory per CTA */
    int mtiles, S, s_p[2][5], p_item0[2][6], p_unsplit_from, s_pmax, s_o, s_rt, s_shgu, s_shdn, sel_staged;
    int Ntot, nheads, rt_tiles, n_ctr, o_post;
    int o_head, o_sel, o_att, o_otile, o_rtile, o_shgu, o_shdn, o_egu, o_comb, o_idxq;
    double inv_freq[m3mono::kMaxHalf];
    void *block;        /* every buffer below, one allocation */
    size_t block_bytes;
    uint16_t *x1, *proj, *attn, *o, *x2, *act, *sh_act;
    float *scores;
    float *rope;
    int32_t *sel;
    float2 *att_ml;
    float *att_acc, *logits, *rw;
    int32_t *rids, *uniq, *ufirst, *members, *n_uniq;
    float *eout, *sh_out, *part_proj, *part_o, *part_rt, *part_shgu, *part_shdn;
    unsigned *ctr, *calls;
    int *fault;
    uint2 *landing;     /* world > 1 */
    size_t landing_bytes;
    uint2 **peers_dev;  /* [world] */
    bool peers_set;
    int32_t *peer_faults[M3_MAX_TP]; /* world > 1: every rank's fault word */
    cudaStream_t side;  /* world > 1: marks peers' fault words (abort_all) */
    unsigned long long *trace; /* M3_MONO_TRACE: item trace (cudaMalloc'd) */
    unsigned *trace_n;
    unsigned trace_cap;
    bool tracing;       /* between trace_start and trace_write */
    /* tuning knobs (cuda_mono.cu read_knobs) */
    int spin_ns, poll_acquire, shdn_early, edn_sub, shdn_sub, egu_sub, pin, idx_claim, idx_run, idx_min_pages,
        idx_slices;
    uint16_t *dry_rows; /* M3_MONO_PIN=2 scratch (see MonoArgs) */
    float *dry_logits;
    int32_t *dry_plan;
};

#define MONO_FAIL(st, ...) m3_fail((st), "mono: " __VA_ARGS__)

#endif
