/*
 * Tensor-parallel shards of a model (see shard.c for the split): the
 * config one rank sees and zero-copy views of the weights it holds.
 */
#ifndef M3_MODEL_SHARD_H
#define M3_MODEL_SHARD_H

#include "model/model.h"

/* Whether the model can be split over tp ranks (a message naming the
 * dimension that does not divide when not). */
m3_status m3_tp_check(const m3_config *cfg, int tp);
/* The config of one rank: its heads, FFN widths and vocabulary slice. */
m3_config m3_tp_config(const m3_config *cfg, int tp);
/* Rank rank's views of full; free the result with m3_tp_shard_free. */
m3_status m3_tp_shard(const m3_config *cfg, const m3_weights *full, int rank, int tp,
                      m3_weights *out);
void m3_tp_shard_free(const m3_config *cfg, m3_weights *w);

#endif
