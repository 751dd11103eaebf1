/*
 * Tensor parallelism over GPUs in one process: one rank per GPU, each
 * driven by its own thread (decode/engine_tp.c). A GPU group holds one NCCL
 * communicator per GPU (ncclCommInitAll); each rank's m3_comm (dist/comm.h)
 * runs the stock path's collectives on its backend's stream through NCCL
 * and its host decisions (agree_min, abort) through the ranks-as-threads
 * communicator, whose waits are bounded.
 *
 * Every sum is in a fixed order: NCCL gathers the ranks' values, then one
 * kernel adds them as a pairwise tree over rank ids (cuda_ksum.cuh), so
 * every rank holds identical bits (a ring all-reduce would not guarantee
 * that) and, for a power-of-two world, a row-parallel sum has TP 1's bits. NVLink multicast (NVLS) is never
 * used: the group sets NCCL_NVLS_ENABLE=0 unless it is set already.
 *
 * NCCL is loaded at run time (dlopen of $M3_NCCL_LIB, else libnccl.so.2),
 * so a build with NCCL's header runs everywhere and only --tp > 1 on
 * --device cuda needs the library. Failures: a rank that fails marks the
 * group dead; every rank that then waits on its stream, or asks the host
 * communicator for agreement, aborts its own NCCL communicator (so no
 * collective hangs) and gets the first failure's message. A dead group
 * stays dead: the engine must be created again.
 */
#ifndef M3_CUDA_CUDA_COMM_H
#define M3_CUDA_CUDA_COMM_H

#include "backend/backend.h"
#include "dist/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct m3_gpu_group m3_gpu_group;

/* NCCL communicators for GPUs devices[0..world) (rank r on devices[r]);
 * timeout_ms bounds each rank's wait on its stream (0: 60 s). */
m3_status m3_gpu_group_create(const int *devices, int world, int64_t timeout_ms,
                              m3_gpu_group **out);
void m3_gpu_group_free(m3_gpu_group *g);

/* Rank `rank`'s communicator: be is a CUDA backend on the rank's GPU, host
 * the rank's ranks-as-threads communicator (not owned). Free with
 * m3_comm_free. */
m3_status m3_cuda_comm_create(m3_gpu_group *g, int rank, m3_backend *be, m3_comm *host,
                              m3_comm **out);

/* Peer access between every pair of the group's GPUs (the fused kernels'
 * in-kernel all-reduce writes into peers' memory); an error names the
 * pair that cannot reach each other. */
m3_status m3_gpu_group_enable_peers(m3_gpu_group *g);

#ifdef __cplusplus
}
#endif

#endif
