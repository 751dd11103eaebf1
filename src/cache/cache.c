/*
 * Page allocator and per-sequence block tables (see cache.h).
 */
#include "cache/cache.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"

/* The free stack in its first order: low page ids handed out first. A pool
 * that drains goes back to it, so the pages a sequence gets depend only on
 * what is live, not on the order earlier sequences came and went (a bench
 * point's pages are the same whichever points ran before it). */
static void restore_first_order(m3_cache *c) {
    for (int32_t i = 0; i < c->n_pages; i++)
        c->free_pages[i] = c->n_pages - 1 - i;
    c->n_free = c->n_pages;
}

m3_status m3_cache_init(m3_cache *c, int num_layers, int32_t n_pages, int64_t max_context,
                        int max_seqs) {
    memset(c, 0, sizeof *c);
    if (num_layers < 1 || num_layers > M3_MAX_LAYERS)
        return m3_fail(M3_ERR_INVALID_ARG, "cache layers = %d: must be in [1, %d]", num_layers,
                       M3_MAX_LAYERS);
    if (n_pages < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "cache pages = %d: need at least 1", (int)n_pages);
    if (max_seqs < 1 || max_seqs > 1 << 20)
        return m3_fail(M3_ERR_INVALID_ARG, "max_seqs = %d: must be in [1, 2^20]", max_seqs);
    if (max_context < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "max_context = %lld: must be >= 1",
                       (long long)max_context);
    c->n_pages = n_pages;
    c->max_context = max_context;
    c->max_blocks = (int)((max_context + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
    c->max_seqs = max_seqs;
    c->num_layers = num_layers;
    c->free_pages = m3_malloc((size_t)n_pages * sizeof *c->free_pages, "page free list");
    c->seqs = m3_calloc((size_t)max_seqs, sizeof *c->seqs, "sequence table");
    c->layers = m3_calloc((size_t)num_layers, sizeof *c->layers, "cache layers");
    if (!c->free_pages || !c->seqs || !c->layers) {
        m3_cache_destroy(c);
        return M3_ERR_NO_MEMORY;
    }
    restore_first_order(c);
    return M3_OK;
}

void m3_cache_destroy(m3_cache *c) {
    for (int i = 0; c->seqs && i < c->max_seqs; i++)
        free(c->seqs[i].pages);
    free(c->seqs);
    free(c->free_pages);
    free(c->layers);
    memset(c, 0, sizeof *c);
}

m3_status m3_cache_seq_check(const m3_cache *c, int seq) {
    if (seq < 0 || seq >= c->max_seqs || !c->seqs[seq].live)
        return m3_fail(M3_ERR_INVALID_ARG, "sequence %d does not exist", seq);
    return M3_OK;
}

m3_status m3_cache_seq_create(m3_cache *c, int *seq) {
    for (int i = 0; i < c->max_seqs; i++) {
        m3_seq_state *s = &c->seqs[i];
        if (s->live)
            continue;
        if (!s->pages) {
            s->pages = m3_malloc((size_t)c->max_blocks * sizeof *s->pages, "block table");
            if (!s->pages)
                return M3_ERR_NO_MEMORY;
        }
        s->live = true;
        s->len = 0;
        s->n_blocks = 0;
        *seq = i;
        return M3_OK;
    }
    return m3_fail(M3_ERR_INVALID_ARG, "all %d sequences are in use", c->max_seqs);
}

m3_status m3_cache_seq_free(m3_cache *c, int seq) {
    M3_TRY(m3_cache_seq_check(c, seq));
    m3_cache_trim(c, seq, 0);
    c->seqs[seq].live = false;
    c->seqs[seq].len = 0;
    return M3_OK;
}

m3_status m3_cache_reserve(m3_cache *c, int seq, int64_t new_len) {
    M3_TRY(m3_cache_seq_check(c, seq));
    m3_seq_state *s = &c->seqs[seq];
    if (new_len < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "sequence %d: length %lld is negative", seq,
                       (long long)new_len);
    if (new_len > c->max_context)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "sequence %d would hold %lld tokens; the context limit is %lld", seq,
                       (long long)new_len, (long long)c->max_context);
    int need = (int)((new_len + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS) - s->n_blocks;
    if (need <= 0)
        return M3_OK;
    if (need > c->n_free)
        return m3_fail(M3_ERR_OUT_OF_PAGES,
                       "out of KV cache pages: sequence %d needs %d more, %d of %d are free", seq,
                       need, (int)c->n_free, (int)c->n_pages);
    for (int i = 0; i < need; i++)
        s->pages[s->n_blocks++] = c->free_pages[--c->n_free];
    return M3_OK;
}

void m3_cache_trim(m3_cache *c, int seq, int64_t len) {
    m3_seq_state *s = &c->seqs[seq];
    int keep = (int)((len + M3_PAGE_TOKENS - 1) / M3_PAGE_TOKENS);
    if (s->n_blocks <= keep)
        return;
    while (s->n_blocks > keep)
        c->free_pages[c->n_free++] = s->pages[--s->n_blocks];
    if (c->n_free == c->n_pages) /* this trim drained the pool */
        restore_first_order(c);
}

int64_t m3_cache_slot(const m3_cache *c, int seq, int64_t pos) {
    const m3_seq_state *s = &c->seqs[seq];
    return (int64_t)s->pages[pos / M3_PAGE_TOKENS] * M3_PAGE_TOKENS + pos % M3_PAGE_TOKENS;
}
