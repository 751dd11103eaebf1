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

/* GPU sums over K are taken as M3_K_CHUNKS fixed chunks of the full K
 * combined as a pairwise tree, so a TP rank's partial is a subtree of TP
 * 1's sum (src/cuda/cuda_ksum.cuh). The same for cuBLAS's column blocks. */
#define M3_K_CHUNKS 8

typedef struct m3_linear {
    m3_tensor w;     /* [N, K] bf16 or f8_e4m3 */
    m3_tensor scale; /* [N, K/32] u8 when w is f8_e4m3; else absent */
    /* How many of the full weight's M3_K_CHUNKS column chunks this K spans
     * (a row-parallel TP shard: 8 / tp), and of its M3_K_CHUNKS row blocks
     * this N spans (a column-parallel shard); 0 means all of them. The
     * CPU ignores both (its partials are fp64). */
    int k_chunks, n_chunks;
} m3_linear;

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
