/*
 * Tensor views. A tensor here is a view: it never owns memory. Shapes are
 * in the checkpoint's order (row-major, as safetensors and PyTorch write
 * them): ne[ndim-1] is the innermost dimension; nb[i] is the byte stride of
 * dimension i, so slices and transposed views need no copies. Weights are
 * views into mmap'd safetensors files (CPU) or device buffers (CUDA).
 *
 * A linear layer's weight is [N, K] (out, in) in bf16, or MXFP8: e4m3
 * elements plus a u8 exponent per 32 columns ([N, K/32]), value
 * e4m3(w) * 2^(s-127).
 */
#ifndef M3_CORE_TENSOR_H
#define M3_CORE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum m3_dtype {
    M3_DT_NONE = 0,
    M3_DT_BF16,
    M3_DT_F32,
    M3_DT_F8_E4M3,
    M3_DT_U8,
    M3_DT_I32,
    M3_DT_I64,
    M3_DT_F64, /* never in a checkpoint: the CPU backend's exact TP partial sums */
} m3_dtype;

#define M3_MAX_DIMS 4

typedef struct m3_tensor {
    m3_dtype dtype;
    int ndim;
    int64_t ne[M3_MAX_DIMS]; /* elements per dimension, outermost first */
    int64_t nb[M3_MAX_DIMS]; /* byte stride per dimension */
    void *data;              /* NULL: absent */
    const char *name;        /* for messages; not owned */
} m3_tensor;

/* GPU sums over K that do not depend on the TP world (src/cuda/
 * cuda_ksum.cuh): a dot product over the full K is taken as m3_k_chunks(K)
 * fixed chunks, each summed by the same code, combined as a pairwise tree,
 * so a row-parallel rank's partial is a subtree of TP 1's sum. */
#define M3_K_CHUNKS 8
#define M3_N_BLOCKS 16

typedef struct m3_linear {
    m3_tensor w;     /* [N, K] bf16 or f8_e4m3 */
    m3_tensor scale; /* [N, K/32] u8 when w is f8_e4m3; else absent */
    /* A row-parallel weight (o_proj, the down projections): how many of
     * the full weight's m3_k_chunks chunks this K holds (a TP rank's share
     * of them); its GPU sums are then cut so, and prefill's GEMM too. 0: a
     * weight whose K is never split over ranks. The CPU ignores it (its
     * partials are fp64). */
    int k_chunks;
    /* A column-parallel weight (q/k/v, the index query, gate/up, lm_head):
     * how many of the full weight's M3_N_BLOCKS row blocks this N holds;
     * prefill's GEMM is issued per block, the same shape on every world
     * (cuBLAS's sums depend on N, and on whether a call is batched at
     * all: 16 blocks keep TP 8's batch at 2). 0: one GEMM. */
    int n_chunks;
} m3_linear;

/* The chunks of a full K: the most (8, 4, 2) whose length is a multiple of
 * 256 (the GEMV's step: chunk bounds then fall between steps), else the
 * most whose length is a multiple of 8 (a slower GEMV path), else 1. A
 * world W gives TP 1's bits where W divides this count. */
static inline int m3_k_chunks(int64_t K) {
    for (int n = M3_K_CHUNKS; n >= 1; n /= 2)
        if (K % (256 * n) == 0)
            return n;
    for (int n = M3_K_CHUNKS; n > 1; n /= 2)
        if (K % (8 * n) == 0)
            return n;
    return 1;
}

size_t m3_dtype_size(m3_dtype dt);
const char *m3_dtype_name(m3_dtype dt);

/* Elements in the tensor. */
int64_t m3_tensor_nelem(const m3_tensor *t);
/* A dense row-major view of data with the given shape. */
m3_tensor m3_tensor_make(m3_dtype dt, int ndim, const int64_t *ne, void *data);
bool m3_tensor_is_contiguous(const m3_tensor *t);
/* Rows [first, first+count) of dimension 0 as a view. */
m3_tensor m3_tensor_rows(const m3_tensor *t, int64_t first, int64_t count);

static inline int64_t m3_linear_rows(const m3_linear *l) { return l->w.ne[0]; }
static inline int64_t m3_linear_cols(const m3_linear *l) { return l->w.ne[1]; }
/* Rows [first, first+count) of a linear (weight and scale). */
m3_linear m3_linear_rows_view(const m3_linear *l, int64_t first, int64_t count);

#endif
