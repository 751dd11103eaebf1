/*
 * The CUDA executor of the mono path (SPEC §5): one whole sparse MoE layer
 * of a decode step in at most two launches of persistent fused kernels,
 * for up to 16 rows. decode/mono.c owns the lifecycle (refusals, cache
 * binding, plans, the fault word's check after a step); this file is the
 * kernels and the little state they need (scratch sized once at create, so
 * nothing allocates during capture; the fault word; the all-reduce landing
 * buffers).
 *
 * A call computes exactly the stock layer (decode/forward.c m3_stock_layer)
 * with the same rounding points: hidden/residual in, hidden/residual out,
 * the layer's K/V/index cache written at the rows' slots. Rows with a
 * negative slot are padding: they write nothing to the cache and nothing
 * they compute reaches a real row. The kernels check what they can (slot or
 * page out of range, a peer wait that expires) and set the fault word
 * instead of faulting; the rest of the layer then does nothing.
 *
 * TP: the config is the rank's shard (its heads, its slice of every
 * expert); the two all-reduces of the layer (after o_proj, after the FFN)
 * happen inside the kernels. World 1 needs no peers; for world > 1 every
 * rank's landing buffer is mapped on every rank (peer access) and pushes
 * are tagged with the step's epoch, so nothing is cleared between steps;
 * sums run in rank order so every rank gets bit-identical results.
 */
#ifndef M3_CUDA_CUDA_MONO_H
#define M3_CUDA_CUDA_MONO_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "decode/step.h"
#include "m3.h"
#include "model/model.h"
#include "mono/fault.h"

#ifdef __cplusplus
extern "C" {
#endif

#define M3_CUDA_MONO_MAX_ROWS 16

/* The fault word (mono/fault.h): [0] code (0 = none), [1] layer, [2] row,
 * [3] value. Sticky: the first fault wins (atomicCAS on [0]); cleared only
 * by m3_cuda_mono_clear_fault. m3_mono_fault_name is defined in
 * src/mono/fault.c (plain C, every build). */

typedef struct m3_cuda_mono m3_cuda_mono;

/* cfg: the rank's config (heads and FFN widths already divided by
 * tp_size). max_blocks: block table width of every step (capacity). */
m3_status m3_cuda_mono_create(m3_backend *be, const m3_config *cfg, int max_blocks, int tp_rank,
                              int tp_size, m3_cuda_mono **out);
void m3_cuda_mono_free(m3_cuda_mono *m);

/* world > 1: this rank's landing area (device memory other ranks write
 * into) and, once every rank has created its executor and peer access is
 * enabled, every rank's landing area and fault word
 * (m3_cuda_mono_fault_word) in rank order. */
void *m3_cuda_mono_landing(m3_cuda_mono *m);
m3_status m3_cuda_mono_set_peers(m3_cuda_mono *m, void *const *landings,
                                 int32_t *const *faults, int world);
/* Abort a launched step on every rank: mark every rank's fault word
 * ABORTED (where still clear), through a stream of its own, so it lands
 * while peers' kernels are still waiting on this rank's pushes. */
m3_status m3_cuda_mono_abort_all(m3_cuda_mono *m);

/* One layer for the step's rows (st->rows <= 16, decode: one row per
 * request; metadata read from st->dev only). lw: the backend's device
 * weight views; cl: the layer's device cache. first: layer 0 (the residual
 * holds the embedding; hidden is not added). epoch: increases by one per
 * step and is the same on every rank. Launches only: capturable. */
m3_status m3_cuda_mono_layer(m3_cuda_mono *m, const m3_step *st, int layer,
                             const m3_layer_weights *lw, const m3_cache_layer *cl, bool first,
                             uint32_t epoch, uint16_t *hidden, uint16_t *residual);

/* Item trace for performance work: after trace_start, the launches record
 * every work item (kernel, kind, CTA, index, start and end on the global
 * timer, and when its last wait for inputs ended: 0 if it did not wait);
 * trace_write synchronizes, writes them as text and stops tracing. Never
 * inside a graph capture. */
m3_status m3_cuda_mono_trace_start(m3_cuda_mono *m);
m3_status m3_cuda_mono_trace_write(m3_cuda_mono *m, const char *path);

/* Device pointer of the fault word (int32 [4]). */
int32_t *m3_cuda_mono_fault_word(m3_cuda_mono *m);
/* Launch a check of the fault word: when it is set, the kernel prints the
 * fault (code name, layer, row, value) and traps (a device-side assert), so
 * no later work of the step runs and the context is lost. Capturable. */
m3_status m3_cuda_mono_check_fault(m3_cuda_mono *m);
/* Set the fault word (if unset) from the stream: tests plant faults with it,
 * and an aborted step marks every rank with M3_MONO_FAULT_ABORTED. */
m3_status m3_cuda_mono_set_fault(m3_cuda_mono *m, int code, int layer);
/* Read the fault word to the host (synchronizes). */
m3_status m3_cuda_mono_read_fault(m3_cuda_mono *m, int32_t out[4]);
m3_status m3_cuda_mono_clear_fault(m3_cuda_mono *m);

#ifdef __cplusplus
}
#endif

#endif
