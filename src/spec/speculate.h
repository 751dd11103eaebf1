/*
 * The verify loop over any proposer (speculate.c). The DSpark drafter is
 * the product's proposer (m3_generate_speculative); tests plug in others
 * (e.g. one that proposes known tokens) to drive every branch of the
 * acceptance rule.
 */
#ifndef M3_SPEC_SPECULATE_H
#define M3_SPEC_SPECULATE_H

#include "decode/engine.h"

typedef struct m3_proposer {
    int block; /* B: drafts per step */
    void *self;
    /* The target step just run kept its first `rows` rows (eng->step). */
    m3_status (*extend)(void *self, int rows);
    /* B drafts after anchor at position p; logits [B, V] when non-NULL. */
    m3_status (*propose)(void *self, m3_seq seq, int64_t p, int32_t anchor, int32_t *drafts,
                         float *logits);
} m3_proposer;

/* m3_generate_speculative with any proposer (greedy; stats as there). */
m3_status m3_speculate(m3_engine *eng, const m3_proposer *pr, const int32_t *prompt,
                       int n_prompt, const m3_gen_opts *opts, m3_gen_result *res,
                       m3_spec_stats *stats);

#endif
