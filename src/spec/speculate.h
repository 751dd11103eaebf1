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
    int block;    /* B: drafts per request and step */
    int max_reqs; /* most requests one propose call takes (>= 1) */
    void *self;
    /* Of the first `rows` rows of the target step just run (eng->step),
     * the target kept those with keep[t] != 0 (keep NULL: all). */
    m3_status (*extend)(void *self, int rows, const uint8_t *keep);
    /* B drafts for each of n requests (anchor anchors[g] at position p[g]):
     * drafts [n, B]; logits [n, B, V] when non-NULL. */
    m3_status (*propose)(void *self, int n, const m3_seq *seqs, const int64_t *p,
                         const int32_t *anchors, int32_t *drafts, float *logits);
} m3_proposer;

/* m3_generate_speculative_batch with any proposer (greedy; results and
 * stats as there): n prompts, res [n]. */
m3_status m3_speculate(m3_engine *eng, const m3_proposer *pr, int n,
                       const int32_t *const *prompts, const int *n_prompts,
                       const m3_gen_opts *opts, m3_gen_result *res, m3_spec_stats *stats);

#endif
