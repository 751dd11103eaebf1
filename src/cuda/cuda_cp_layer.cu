/*
 * Indexer context parallelism inside a sparse layer on GPU TP ranks (the
 * contract is m3_cuda_cp_layer_select in cuda_cp.h): the CPU's
 * cp/cp_layer.c on device memory. The index queries and the local top-k
 * keys cross ranks through the communicator (NCCL all-gathers); the score,
 * top-k and merge kernels are cuda_cp.cu's, so the selection has the bits
 * of the single-rank one. Two small kernels reorder: the gathered queries
 * into [rows, heads, 128] with head k * heads_local + i for rank k's head
 * i, and the merged selections of this rank's heads into the layer's
 * [rows, heads_local, topk].
 */
#include "cuda/cuda_internal.h"

extern "C" {
#include "cp/indexer_cp.h"
#include "cuda/cuda_cp.h"
}

namespace {

constexpr int kDim = M3_CP_DIM;
constexpr int kChunks = kDim * 2 / 16; /* uint4 chunks per 128-dim bf16 head */

/* qt[t][k * Nl + i] = gathered[k][t][i]: one thread per 16-byte chunk */
__global__ void cp_queries_kernel(const uint4 *__restrict__ gathered, int world, int rows, int nl,
                                  uint4 *__restrict__ qt) {
    int64_t n = (int64_t)world * rows * nl * kChunks;
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < n;
         x += (int64_t)gridDim.x * blockDim.x) {
        int64_t c = x % kChunks, head = x / kChunks; /* head: ((k * rows + t) * nl + i) */
        int64_t i = head % nl, t = (head / nl) % rows, k = head / ((int64_t)nl * rows);
        qt[((t * world + k) * nl + i) * kChunks + c] = gathered[x];
    }
}

/* selected[t][i][j] = merged[(rank * Nl + i) * rows + t][j] */
__global__ void cp_pick_kernel(const int32_t *__restrict__ merged, int rank, int rows, int nl,
                               int topk, int32_t *__restrict__ selected) {
    int64_t n = (int64_t)rows * nl * topk;
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < n;
         x += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = x % topk, i = (x / topk) % nl, t = x / ((int64_t)topk * nl);
        selected[x] = merged[(((int64_t)rank * nl + i) * rows + t) * topk + j];
    }
}

unsigned grid_for(int64_t n) {
    int64_t blocks = (n + 255) / 256;
    return (unsigned)(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024);
}

} // namespace

extern "C" m3_status m3_cuda_cp_layer_select(m3_backend *be, m3_comm *comm,
                                             const m3_cuda_cp_layer *l, float scale,
                                             const m3_select_params *p, int32_t *selected) {
    m3_cuda *cu = m3_cuda_of(be);
    int W = comm->world, rank = comm->rank, T = l->rows, Nl = l->heads_local, H = W * Nl;
    if (l->n_reqs < 1 || T % l->n_reqs)
        return m3_fail(M3_ERR_INVALID_ARG, "indexer CP: %d rows over %d requests", T, l->n_reqs);
    m3_cuda_cp_inputs in = {nullptr, (int64_t)H * kDim, l->icache, l->pages, l->table,
                            l->table_row, l->lens, l->n_reqs, T / l->n_reqs, H};
    int64_t local = (m3_cp_global_blocks(l->max_seq_len) + W - 1) / W;
    int64_t items = (int64_t)H * T, topk = p->topk;
    size_t q_bytes = (size_t)T * Nl * kDim * 2; /* one rank's queries */
    size_t sizes[6] = {(size_t)W * q_bytes, (size_t)W * q_bytes, (size_t)(items * local * 4),
                       (size_t)(items * topk * 8), (size_t)(W * items * topk * 8),
                       (size_t)(items * topk * 4)};
    void *part[6];
    M3_TRY(m3_cuda_workspace_parts(cu, M3_CUDA_WS_CP, sizes, 6, part));
    in.q = (const uint16_t *)part[1];
    M3_TRY(m3_cuda_cp_check(&in, l->max_seq_len, rank, W, p));
    M3_TRY(comm->ops->all_gather(comm, l->iq, part[0], (int64_t)q_bytes));
    int64_t chunks = (int64_t)W * T * Nl * kChunks;
    cp_queries_kernel<<<grid_for(chunks), 256, 0, cu->stream>>>((const uint4 *)part[0], W, T, Nl,
                                                                 (uint4 *)part[1]);
    M3_CUDA_LAUNCHED("cp_queries_kernel");
    M3_TRY(m3_cuda_cp_scores(be, &in, l->max_seq_len, rank, W, scale, (float *)part[2], l->err));
    M3_TRY(m3_cuda_cp_local_topk(be, &in, l->max_seq_len, rank, W, p, (const float *)part[2],
                                 (uint64_t *)part[3], l->err));
    M3_TRY(comm->ops->all_gather(comm, part[3], part[4], (int64_t)sizes[3]));
    M3_TRY(m3_cuda_cp_merge(be, (const uint64_t *)part[4], W, items, (int)topk,
                            (int32_t *)part[5]));
    cp_pick_kernel<<<grid_for((int64_t)T * Nl * topk), 256, 0, cu->stream>>>(
        (const int32_t *)part[5], rank, T, Nl, (int)topk, selected);
    M3_CUDA_LAUNCHED("cp_pick_kernel");
    return M3_OK;
}
