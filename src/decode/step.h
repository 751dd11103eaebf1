/*
 * Step metadata (SPEC §4): everything a forward step needs to know about
 * its rows besides their tokens' values, identical on every TP rank. Rows
 * of one request are consecutive. The host arrays drive host decisions
 * (plans, bounds); `dev` holds the same arrays in backend memory for the
 * ops (for the CPU backend the two are the same memory).
 */
#ifndef M3_DECODE_STEP_H
#define M3_DECODE_STEP_H

#include <stdbool.h>
#include <stdint.h>

typedef enum m3_graph_mode {
    M3_GRAPH_NONE = 0,
    M3_GRAPH_PIECEWISE,
    M3_GRAPH_FULL,
} m3_graph_mode;

typedef struct m3_step_arrays {
    int32_t *tokens;      /* [rows] */
    int64_t *positions;   /* [rows] */
    int64_t *slots;       /* [rows]: page*128 + offset; < 0 for a padded row */
    int32_t *row_req;     /* [rows]: the request a row belongs to */
    int32_t *seq_lens;    /* [n_reqs]: tokens after this step */
    int32_t *query_start; /* [n_reqs + 1]: first row of each request */
    int32_t *block_table; /* [n_reqs, max_blocks]: block -> page, -1 unused */
} m3_step_arrays;

typedef struct m3_step {
    int rows;             /* T, padded rows included */
    int n_reqs;           /* B */
    int n_prefill;        /* requests with more than one row or a first chunk */
    int n_decode;         /* requests with one row after a prefill */
    int max_query_len;
    int max_blocks;       /* block table width */
    int64_t n_pages;      /* pages in the pool: slots stay below n_pages*128 */
    m3_graph_mode graph_mode;
    bool capturing;
    m3_step_arrays host;
    m3_step_arrays dev;
} m3_step;

#endif
