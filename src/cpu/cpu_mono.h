/*
 * The CPU executor of the mono path (SPEC §5): one whole layer of a decode
 * step for up to max_rows rows in one threaded pass (every pool thread
 * enters once and walks the layer's phases with barriers between them),
 * computing exactly the stock path's bits: the same row kernels
 * (cpu/cpu.h), the same summation orders, the same rounding points.
 * decode/ and mono/ own the lifecycle; this file is the executor.
 *
 * TP: the ranks of a group are threads (dist/comm_threads.c); each rank's
 * executor holds its shard. The layer's all-reduces (o_proj, and the MoE's
 * per-expert and shared down outputs, all fp64 partial sums as in the stock
 * CPU path) go through the group's shared peer buffer: each rank pushes its
 * partial into its own slot and tags it with (epoch, layer, which), readers
 * wait for every rank's tag and sum the slots in rank order, so every rank
 * gets bit-identical results and nothing is cleared between steps (two
 * slots per rank alternate, so a fast rank never overwrites what a slow one
 * still reads). A wait is bounded: when it expires the fault word gets
 * M3_MONO_FAULT_PEER_WAIT; abort marks every rank's fault word, ending
 * every wait.
 */
#ifndef M3_CPU_CPU_MONO_H
#define M3_CPU_CPU_MONO_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "decode/step.h"
#include "dist/comm.h"
#include "m3.h"
#include "model/model.h"
#include "mono/fault.h"

/* Shared by the executors of one TP group: the peer buffers, their tags and
 * every rank's fault word. cfg: a rank's config (its shard). */
typedef struct m3_cpu_mono_group m3_cpu_mono_group;
m3_status m3_cpu_mono_group_create(int world, int max_rows, const m3_config *cfg,
                                   int64_t timeout_ms, m3_cpu_mono_group **out);
void m3_cpu_mono_group_free(m3_cpu_mono_group *g);

typedef struct m3_cpu_mono m3_cpu_mono;

/* be: this rank's CPU backend (its pool); cfg: the rank's config;
 * max_blocks: block table width (capacity); group: NULL at world 1; cp:
 * the TP group's communicator when the sparse layers select with indexer
 * context parallelism (NULL: off; every rank passes it or none does). */
m3_status m3_cpu_mono_create(m3_backend *be, const m3_config *cfg, int max_rows, int max_blocks,
                             int tp_rank, m3_cpu_mono_group *group, m3_comm *cp,
                             m3_cpu_mono **out);
void m3_cpu_mono_free(m3_cpu_mono *m);

/* One layer (sparse attention + MoE) for the step's rows (st->rows <=
 * max_rows, decode: one row per request; rows with a negative slot are
 * padding: they write no cache and reach no real row). first: layer 0 (the
 * residual holds the embedding). epoch: +1 per step, the same on every
 * rank. When the fault word is set (on entry or by this layer) the layer
 * does nothing more and returns M3_OK: the lifecycle's after_step reports
 * it. Errors (bad arguments) return a status. */
m3_status m3_cpu_mono_layer(m3_cpu_mono *m, const m3_step *st, int layer,
                            const m3_layer_weights *lw, const m3_cache_layer *cl, bool first,
                            uint32_t epoch, uint16_t *hidden, uint16_t *residual);

/* This rank's fault word (int32 [4], host memory, atomic access). */
const int32_t *m3_cpu_mono_fault_word(m3_cpu_mono *m);
/* Set this rank's fault word if unset (tests plant faults with it). */
void m3_cpu_mono_set_fault(m3_cpu_mono *m, int code, int layer, int row, int value);
/* Mark every rank's fault word M3_MONO_FAULT_ABORTED (if unset), so every
 * peer's wait ends. */
void m3_cpu_mono_abort_all(m3_cpu_mono *m);
void m3_cpu_mono_clear_fault(m3_cpu_mono *m);

#endif
