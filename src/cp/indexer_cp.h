/*
 * Indexer context parallelism (SPEC §6, seed 003), the CPU core: with
 * `world` ranks, rank r owns the global index blocks l·world + r (local slot
 * l). Each rank scores its own blocks for every (head, row), keeps a local
 * top-k per (row, head) as packed sortable 64-bit keys, the keys are
 * all-gathered through the communicator, and the merge yields SPEC §3's
 * selection (ascending block ids, padded with -1), bit for bit the
 * single-rank m3_select_row over the full scores.
 *
 * Scores reuse m3_index_block_score, so every owned entry has the bits the
 * single-rank CPU path (m3_cpu_index_scores) computes for that block.
 *
 * Inputs are m3_tensor views so layouts can be checked:
 *   q       bf16 [tokens, heads, 128], last dim contiguous (any outer strides)
 *   icache  bf16 [pages, 128, 128], contiguous, pages >= 1
 *   table   int32 [batch, max_blocks], unit inner stride
 *   lens    int32 [batch], contiguous (each request's length, this step's
 *           rows included)
 * Rows of a request are consecutive: row i·query_len + j is row j of
 * request i, which sees positions < L − query_len + j + 1 (none when that
 * is <= 0: such rows score −inf everywhere and select nothing).
 *
 * Bad values are errors, never faults: a length < 0 or > max_seq_len, or a
 * visible block whose table entry is outside [0, pages), fails the call with
 * M3_ERR_INVALID_ARG naming the request, block and value, before anything
 * is written. Table entries past a row's visible blocks are never read.
 */
#ifndef M3_CP_INDEXER_CP_H
#define M3_CP_INDEXER_CP_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "m3.h"

#define M3_CP_BLOCK 128 /* tokens per index block (= page) */
#define M3_CP_DIM 128   /* index head dim */
#define M3_CP_HOST (-1) /* device id of host memory */

/* Chunk rule constants: the score grid is (request, chunk); it aims for
 * about M3_CP_SCORE_TARGET_GRID programs in all, and no chunk scores fewer
 * than M3_CP_SCORE_MIN_BLOCKS local blocks unless the shard itself is
 * smaller. Tuned on the H200 (docs/PERF.md, `m3 bench indexer
 * --target-grid --min-blocks`): a score program is latency-bound per block
 * (a 32 KiB page copy, then fp64 dots in the CPU's order), so small shards
 * want many short programs (1024 / 16 took 76 us at batch 1, 32K, where
 * 4096 / 2 takes 20 us) and large ones lose nothing to them (4096 / 2 is
 * 2-8% faster at 1M tokens). */
#define M3_CP_SCORE_TARGET_GRID 4096
#define M3_CP_SCORE_MIN_BLOCKS 2

/* The score inputs and the device each lives on (M3_CP_HOST: host memory;
 * this CPU core scores host memory only). */
typedef struct m3_cp_score_inputs {
    m3_tensor q, icache, table, lens;
    int q_device, icache_device, table_device, lens_device;
} m3_cp_score_inputs;

/* Inputs in host memory: q [tokens, heads, dim] and icache [pages, 128,
 * dim] bf16, table [reqs, table_width] and lens [reqs] int32. */
m3_cp_score_inputs m3_cp_host_inputs(int64_t tokens, int64_t heads, int64_t dim, int64_t pages,
                                     int64_t reqs, int64_t table_width, const void *q,
                                     const void *icache, const int32_t *table,
                                     const int32_t *lens);

/* ceil(max_seq_len / 128): global blocks a capture-stable bound spans. */
int64_t m3_cp_global_blocks(int64_t max_seq_len);
/* ceil(global_blocks / world): local slots per rank. */
int64_t m3_cp_local_blocks(int64_t max_seq_len, int world);

/* Chunks one request's local blocks are split across (the grid's second
 * dimension): target = max(1, TARGET_GRID / max(1, batch)); chunks = the
 * largest power of two <= target, at most local_blocks and at most
 * ceil(local_blocks / MIN_BLOCKS) (at least 1); then round-tripped through
 * the size, ceil(local / ceil(local / chunks)), so no chunk is empty.
 * local_blocks <= 0 gives 1. Pure. */
int m3_cp_score_chunks(int64_t batch, int64_t local_blocks);
/* Replace the rule's two constants for the rest of the process (tuning
 * runs: `m3 bench indexer --target-grid N --min-blocks N`; not thread-safe
 * against concurrent scoring). Both >= 1. */
m3_status m3_cp_set_chunk_rule(int target_grid, int min_blocks);
/* Local blocks one program scores: the next power of two >= ceil(local /
 * chunks) with chunks from m3_cp_score_chunks (rounding up never drops a
 * block: ceil(local / chunk) programs still span the shard). >= 1. */
int64_t m3_cp_score_chunk_size(int64_t batch, int64_t local_blocks);

/* Validate the layout m3_cp_context_scores assumes; call once (off the hot
 * path). M3_ERR_INVALID_ARG with one message per broken rule. */
m3_status m3_cp_check_context_score_inputs(const m3_cp_score_inputs *in);

/* Scores of the owned blocks: out fp32 [heads, >=tokens, >=local] (any byte
 * strides, 4-byte aligned), tokens = batch · query_len rows; entry (h, t, l)
 * is the SPEC §3 score of global block l·world + rank for row t and index
 * head h, −inf where the block has no visible position (or lies past
 * max_seq_len). Every entry [heads, tokens, local] is written.
 * scale is the whole multiplier, index_dim^-0.5 · log2(e) rounded to fp32
 * as the single-rank path takes it.
 * max_seq_len is the capture-stable bound (max_model_len) that sizes the
 * work; programs past a request's length write −inf and return at once.
 * out: when out->data is set, written in place (shape and dtype checked);
 * when NULL, a dense [heads, tokens, local] buffer is allocated into out
 * (free out->data with free()). Per-call checks: rows = batch × query_len,
 * table wide enough for max_seq_len, 0 <= rank < world, lengths sane. */
m3_status m3_cp_context_scores(const m3_cp_score_inputs *in, int64_t max_seq_len, int rank,
                               int world, int query_len, float scale, m3_tensor *out);

/* ---- selection ---- */

/* A packed sortable key: bigger is better. Bits 63..32: the rank of the
 * score (0xffffffff: a forced block; finite and infinite scores by value
 * with -0 as +0; 1: NaN, lowest); bits 31..0: the block id, so equal scores
 * break to the higher id. 0: no block. */
uint64_t m3_cp_pack_key(float score, int32_t block, bool forced);
static inline int32_t m3_cp_key_block(uint64_t key) { return (int32_t)(uint32_t)key; }
#define M3_CP_KEY_NONE ((uint64_t)0)

/* Local top-k of rank `rank` from its scores (a view as m3_cp_context_scores
 * writes, fp32 [heads, >=tokens, >=local]): keys [heads, tokens, topk] u64,
 * each list best first and padded with M3_CP_KEY_NONE. The full topk per
 * rank; forced blocks (SPEC §3: b < init_blocks, b >= nblocks −
 * local_blocks) pinned above every score. lens: host int32 [batch]. */
m3_status m3_cp_local_topk(const m3_tensor *scores, const int32_t *lens, int batch, int query_len,
                           int64_t max_seq_len, int rank, int world, const m3_select_params *p,
                           uint64_t *keys);

/* Merge all-gathered keys [world][items][topk] (rank-major, as all_gather
 * writes) for items [item_begin, item_end) into out [item_end - item_begin,
 * topk]: the topk best keys over all ranks, as ascending block ids padded
 * with -1. world <= 64 (ranks past 64 are ignored; communicators have at
 * most M3_MAX_TP). */
void m3_cp_merge_topk(const uint64_t *gathered, int world, int64_t items, int topk,
                      int64_t item_begin, int64_t item_end, int32_t *out);

/* The whole selection on one rank: local top-k, an all-gather of the keys
 * through c (c->rank, c->world own the blocks) and the merge of every item:
 * selected int32 [heads, tokens, topk]. Every rank of c calls it. */
m3_status m3_cp_select_blocks(m3_comm *c, const m3_tensor *scores, const int32_t *lens, int batch,
                              int query_len, int64_t max_seq_len, const m3_select_params *p,
                              int32_t *selected);

#endif
