/*
 * The shapes the CUDA backend's stock-path kernels take. Each op refuses
 * what lies outside them when it is called (its own check, with these
 * numbers); m3_cuda_check_config (cuda_backend.cu) refuses a model whose
 * shapes an op would refuse before any weight is uploaded, so a
 * checkpoint the GPU cannot run fails at once with every reason instead
 * of after minutes of loading, at its first step. Plain C: the engine's
 * C side and the .cu files include it.
 */
#ifndef M3_CUDA_CUDA_LIMITS_H
#define M3_CUDA_CUDA_LIMITS_H

#define M3_CUDA_ATTN_DIM_MAX 256      /* head_dim: a multiple of 32 in [32, 256] */
#define M3_CUDA_INDEX_DIM_MAX 256     /* index_dim: a multiple of 8 in [8, 256] */
#define M3_CUDA_NORM_DIM_MAX 65536    /* add_rmsnorm: rows of at most this */
#define M3_CUDA_HNR_MAX_DIM 4096      /* head_norm_rope: shared memory under 48 KiB */
#define M3_CUDA_HNR_MAX_HALF 512      /* head_norm_rope: rotary_dim <= 1024 */
#define M3_CUDA_MOE_MAX_K 64          /* experts per token */
#define M3_CUDA_MOE_MAX_EXPERTS 8192
#define M3_CUDA_MOE_ALIGN 32          /* hidden and expert widths: multiples of this */
#define M3_CUDA_SAMPLE_MAX_VOCAB (1 << 30) /* int ids and offsets never overflow */
#define M3_CUDA_EXACT_ROWS 16        /* rows a step can have with each row's bits a one-row
                                       * step's (the linear's MMA kernel; cuBLAS beyond):
                                       * the default of M3_LINEAR_MMA_ROWS (16, 32 or 64) */
#define M3_CUDA_LINEAR_MMA_PASS 32   /* the most rows one launch of that kernel takes */
#define M3_CUDA_DRAFT_MAX_ROWS 16     /* draft_attention over a long context: block rows */
#define M3_CUDA_DRAFT_SPLIT_FROM 256  /* draft_attention: context keys from which they are
                                       * split over CTAs (M3_DRAFT_SPLIT_FROM; docs/PERF.md,
                                       * forty-sixth session) */
#define M3_CUDA_DRAFT_SPLIT_TWO_FROM 196608 /* draft_attention's split CTAs: groups (KV
                                             * heads x requests x query passes) times the
                                             * table's keys from which they run two a
                                             * multiprocessor (M3_DRAFT_SPLIT_TWO_FROM;
                                             * docs/PERF.md, forty-eighth session) */

#endif
