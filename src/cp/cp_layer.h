/*
 * Indexer context parallelism inside a sparse layer of the stock path (CPU,
 * ranks as threads): the TP group's index queries are all-gathered, every
 * rank scores every index head over the blocks it owns, the ranks' local
 * top-k keys are all-gathered and merged, and each rank keeps the selection
 * of the heads it owns. The selection equals the single-rank one bit for
 * bit (src/cp/indexer_cp.h), so the layer's output does too.
 */
#ifndef M3_CP_CP_LAYER_H
#define M3_CP_CP_LAYER_H

#include <stdbool.h>

#include "backend/backend.h"
#include "decode/step.h"
#include "m3.h"

struct m3_engine;

/* Whether the step has the shape indexer CP takes: every request has the
 * same number of rows (decode: 1, verify: 8, or a single prefill chunk).
 * Other steps select the usual way. */
bool m3_cp_step_ok(const m3_step *st);

/* Scores and selection of one sparse layer: reads eng->s.iq [T, Ni, Di]
 * (this rank's heads), writes eng->s.selected [T, Ni, topk]. */
m3_status m3_cp_layer_select(struct m3_engine *eng, const m3_step *st, const void *icache,
                             float scale, const m3_select_params *p);

#endif
