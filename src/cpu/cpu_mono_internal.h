/*
 * The CPU mono executor's private definitions, shared by its two files:
 * cpu_mono_setup.c (the executor, its TP group and the fault word) and
 * cpu_mono.c (the per-layer pass, which describes the design).
 */
#ifndef M3_CPU_CPU_MONO_INTERNAL_H
#define M3_CPU_CPU_MONO_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/pool.h"
#include "cpu/cpu_mono.h"
#include "dist/comm.h"

#define MONO_MAX_ROWS 64
#define MONO_MAX_TOPK 64 /* experts per token: m3_route_row's limit */

enum { WHICH_O = 0, WHICH_MOE = 1 };

typedef struct {
    _Alignas(64) _Atomic uint64_t v;
} padded_tag;

typedef struct {
    _Alignas(64) _Atomic int32_t w[4];
} padded_fault;

struct m3_cpu_mono_group {
    int world, max_rows, k;
    int64_t H;
    int64_t timeout_ms;
    size_t cap;  /* doubles per slot: (k + 1) * max_rows * H */
    double *buf; /* [world][2][cap] */
    padded_tag tag[M3_MAX_TP][2];
    padded_fault fault[M3_MAX_TP];
};

/* The item lists of one call, fixed before the pass. */
typedef struct mono_call {
    const m3_step *st;
    int layer;
    const m3_layer_weights *lw;
    const m3_cache_layer *cl;
    bool first;
    uint32_t epoch;
    uint16_t *hidden, *residual;
    int n_act;       /* real rows */
    int mb;          /* the step's block table width */
    int I, Is;       /* expert and shared widths (this rank's) */
    bool has_shared;
} mono_call;

struct m3_cpu_mono {
    m3_pool *pool;
    int n_threads;
    int max_rows, max_blocks, tp_rank;
    m3_cpu_mono_group *group;
    bool tp; /* world > 1 */
    m3_comm *cp;       /* indexer CP over this group (NULL: off) */
    int32_t *cp_table; /* [max_rows, max_blocks]: the real rows' block tables */
    int32_t *cp_lens;  /* [max_rows]: their lengths */
    _Atomic int32_t own_fault[4];
    _Atomic int32_t *fault; /* this rank's word: the group's or own */
    /* dimensions (this rank's shard) */
    int H, D, Di, Nq, Nkv, Ni, E, k, half, topk, I, Is;
    m3_config cfg;
    mono_call c;
    /* per real row a (act[a] its step row) */
    int32_t *act;        /* [max_rows] */
    int32_t *nblk;       /* [max_rows]: visible blocks */
    int64_t *score_first;/* [max_rows + 1]: prefix sums of Ni * nblk */
    float *rope_cos, *rope_sin; /* [max_rows, half] */
    float *xf;           /* [max_rows, H]: a norm's output (bf16 values) */
    uint16_t *q, *kk, *v, *iq, *ik;
    float *scores;       /* [max_rows, Ni, max_blocks] */
    int32_t *sel;        /* [max_rows, Ni, topk] */
    uint16_t *attn;      /* [max_rows, Nq * D] */
    float *attnf;        /* the same widened */
    uint16_t *o;         /* [max_rows, H] */
    float *logits;       /* [max_rows, E] */
    int32_t *ids;        /* [max_rows, k] */
    float *wts;          /* [max_rows, k] */
    float *actf;         /* [max_rows * k, I]: act of each (row, slot) */
    float *shf;          /* [max_rows, Is] */
    uint16_t *eout;      /* [max_rows * k, H]: TP 1 down outputs */
    uint16_t *shout;     /* [max_rows, H] */
    float **tbuf;        /* [n_threads]: per-thread scratch */
    int32_t **tlist;     /* [n_threads]: per-thread expert lists */
};

/* ------------------------------------------------------------ faults */

static inline void fault_set(_Atomic int32_t *w, int code, int layer, int row, int value) {
    if (!code)
        return;
    int32_t none = 0;
    if (atomic_compare_exchange_strong(&w[0], &none, code)) { /* the first fault wins */
        atomic_store(&w[1], layer);
        atomic_store(&w[2], row);
        atomic_store(&w[3], value);
    }
}

static inline bool faulted(const m3_cpu_mono *m) {
    return atomic_load_explicit(&m->fault[0], memory_order_acquire) != 0;
}

#endif
