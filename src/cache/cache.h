/*
 * Paged caches (SPEC §4). One page pool, indexed by page id, serves every
 * layer: page p holds tokens [128·b, 128·b + 128) of whichever sequence's
 * block b maps to it, in every layer's K, V (and, on sparse layers, index)
 * cache. A token's slot is page·128 + offset. Sequences own block tables
 * (logical block -> page) that grow as tokens are appended; pages come from
 * a free stack (low ids first; a pool that drains returns to that order), and
 * running out is M3_ERR_OUT_OF_PAGES, not a crash.
 *
 * This module is host bookkeeping only; the cache memory itself lives in
 * the backend (m3_cache_layer pointers), laid out as
 *   K, V  [pages, kv_heads, 128, head_dim] bf16
 *   index [pages, 128, index_dim]          bf16 (one key head)
 */
#ifndef M3_CACHE_CACHE_H
#define M3_CACHE_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "m3.h"

#define M3_PAGE_TOKENS 128

typedef struct m3_cache_layer {
    void *k;     /* [pages, kv_heads, 128, head_dim] bf16, backend memory */
    void *v;     /* same */
    void *index; /* [pages, 128, index_dim] bf16; NULL on dense layers */
} m3_cache_layer;

typedef struct m3_seq_state {
    bool live;
    int64_t len;      /* tokens in the cache */
    int32_t *pages;   /* [max_blocks]: block -> page */
    int n_blocks;     /* pages held */
} m3_seq_state;

typedef struct m3_cache {
    int32_t n_pages;
    int max_blocks;   /* per sequence: ceil(max_context / 128) */
    int64_t max_context;
    int32_t *free_pages; /* stack */
    int32_t n_free;
    m3_seq_state *seqs;
    int max_seqs;
    m3_cache_layer *layers; /* [num_layers], filled by the engine */
    int num_layers;
} m3_cache;

m3_status m3_cache_init(m3_cache *c, int num_layers, int32_t n_pages, int64_t max_context,
                        int max_seqs);
void m3_cache_destroy(m3_cache *c);

m3_status m3_cache_seq_create(m3_cache *c, int *seq);
m3_status m3_cache_seq_free(m3_cache *c, int seq);
m3_status m3_cache_seq_check(const m3_cache *c, int seq);

/* Make seq hold pages for new_len tokens (taking pages from the pool).
 * All or nothing: on failure the sequence keeps its pages. */
m3_status m3_cache_reserve(m3_cache *c, int seq, int64_t new_len);
/* Give back pages beyond those needed for len tokens. */
void m3_cache_trim(m3_cache *c, int seq, int64_t len);
/* slot of token position pos of seq (which must hold its page). */
int64_t m3_cache_slot(const m3_cache *c, int seq, int64_t pos);

#endif
