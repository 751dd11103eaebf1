/*
 * The DSpark drafter (SPEC §7, docs/DSPARK.md) inside the library: its
 * config and weight views (drafter.c loads and checks them against the
 * target), its paged context cache and activations in the target engine's
 * backend (bound to one engine by m3_drafter_attach), and its two passes
 * (draft_forward.c): the context, extended with the rows the target kept,
 * and the draft step of B rows with the Markov head (its attention: the
 * backend op draft_attention).
 *
 * speculate.c drives any proposer through the verify loop; the drafter is
 * the product's proposer, tests plug in others.
 */
#ifndef M3_SPEC_DRAFTER_H
#define M3_SPEC_DRAFTER_H

#include "decode/engine.h"
#include "model/config_json.h"

/* Every weight of a drafter. */
typedef struct m3_draft_weights {
    m3_linear fc;                    /* [H, k*H] */
    m3_tensor hidden_norm, final_norm; /* [H] bf16 */
    m3_tensor markov_w1, markov_w2;  /* [V, r] bf16 (r > 0) */
    m3_draft_layer *layers;          /* [cfg.attn.num_layers] */
} m3_draft_weights;

/* Most requests one draft step serves (SPEC §7: the drafter's kernels
 * cover up to 8 requests a launch). */
#define M3_MAX_DRAFT_REQS 8
_Static_assert(M3_MAX_DRAFT_REQS <= M3_MAX_MARKOV_REQS, "a draft step's Markov head is one call");

/* Activations and caches in the bound engine's backend memory; R = the
 * engine's rows per step, G = max_reqs, requests of one draft step; a
 * draft step's rows are request-major: row g*B + j is request g's row j. */
typedef struct m3_draft_run {
    m3_engine *front;                /* the engine bound (NULL: not bound) */
    m3_engine *eng;                  /* the one whose backend, cache and steps the
                                      * drafter uses: front, or its rank 0 at TP > 1 */
    m3_tensor embed, lm_head;        /* the target's, whole, where the drafter runs:
                                      * the engine's at TP 1, the model's at TP > 1
                                      * (copied to rank 0's GPU: the ranks hold
                                      * vocabulary slices) */
    int rows;                        /* R */
    int max_reqs;                    /* G: min(8, the engine's max_seqs, R / (B + 1)) */
    int64_t n_pages;                 /* the engine's page pool */
    int max_blocks;                  /* its block table width */
    uint16_t **k_cache, **v_cache;   /* [layers] x [pages, Nkv, 128, D] */
    void *graph[M3_MAX_DRAFT_REQS + 1]; /* the draft step's CUDA graph per request
                                      * count (run_draft_step) */
    void *ctx_graph[M3_GRAPH_MAX_VERIFY_ROWS + 1]; /* the context's graph per row count
                                      * (m3_drafter_extend) */
    int64_t replays;                 /* draft steps replayed from graph[] */
    int64_t ctx_replays;             /* contexts replayed from ctx_graph[] */
    bool fused_markov;               /* the Markov step is the backend's draft_markov */
    /* The fused drafter layers (SPEC §7's drafter dispatch, draft_forward.c
     * pick_kernels): tried at the first draft step, outside any capture;
     * off, with the reason, where the deployment does not fit or the
     * backend's kernels refuse the shapes. A new attach (a new cache)
     * starts untried: a runner holds the cache's addresses. */
    enum { M3_DRAFT_KERNELS_UNTRIED, M3_DRAFT_KERNELS_ON, M3_DRAFT_KERNELS_OFF } kernels;
    void *kernels_runner;            /* the backend's runner (ON) */
    char kernels_off[200];           /* why they are off (OFF) */
    int64_t kernel_steps;            /* draft steps whose layers ran them */
    int64_t *host_slots;             /* [R] host: the kept rows' slots, -1 the others */
    int64_t *ctx_slots;              /* [R]: the same in backend memory */
    uint16_t *ctx_u, *ctx_h;         /* [R, H]: fc output, its norm */
    uint16_t *ctx_k, *ctx_v;         /* [R, Nkv*D] */
    int32_t *tokens;                 /* [G*B] */
    int64_t *positions;              /* [G*B] */
    uint16_t *hidden, *residual, *x, *o, *final; /* [G*B, H] */
    uint16_t *q, *attn;              /* [G*B, Nq*D] */
    uint16_t *k, *v;                 /* [G*B, Nkv*D] */
    uint16_t *gate, *up, *act;       /* [G*B, F] */
    float *logits;                   /* [G*B, V] */
    uint16_t *w1_rows;               /* [G, r] */
    float *bias;                     /* [G, V] */
    int32_t *drafts;                 /* [B + 1, G]: row j's draft of request g at
                                      * [j + 1, g], the anchors at [0, g] (a row's
                                      * previous tokens lie together for the gather) */
    int32_t *pages;                  /* [G, max_blocks]: the requests' block tables */
} m3_draft_run;

struct m3_drafter {
    m3_draft_config cfg;  /* cfg.attn: the draft layers' shapes */
    int ffn_dim;          /* F */
    m3_st_set *files;
    char *dir;
    m3_draft_weights w;   /* views of the files */
    m3_draft_weights bw;  /* the bound backend's: w itself on a host-memory
                           * backend, else copies in its memory */
    void **owned;         /* [n_owned]: the copies' allocations */
    int n_owned;
    m3_draft_run run;
};

/* The drafter's run-time switches between a fused path and its ops
 * (M3_DRAFT_MARKOV, M3_DRAFT_LAYERS): *fused is 1 for "fused", 0 for
 * "ops", -1 where the variable is unset or empty; another value is an
 * error naming it. */
m3_status m3_draft_switch(const char *name, int *fused);

/* Bind d's runtime to engine e (allocating its cache and activations in
 * e's backend) and switch e's layer taps on; checks that e can run it. */
m3_status m3_drafter_attach(m3_drafter *d, m3_engine *e);
void m3_drafter_detach(m3_drafter *d);

/* Of the first `rows` rows of the target step just run on the bound
 * engine, those the target kept (keep[t] != 0; keep NULL: all of them):
 * their taps become context K/V at their positions (draft_forward.c). The
 * others' slots may already be another sequence's: nothing is written
 * there. */
m3_status m3_drafter_extend(m3_drafter *d, int rows, const uint8_t *keep);
/* One draft step for n requests (1..max_reqs, distinct sequences):
 * request g's anchor token anchors[g] at position p[g] (context
 * 0..p[g]-1); drafts [n, B] and, when logits is non-NULL, the rows' logits
 * with the Markov bias [n, B, V] (draft_forward.c). A request's drafts do
 * not depend on the others in the step where the backend's rows do not
 * (the CPU's). */
m3_status m3_drafter_propose(m3_drafter *d, int n, const m3_seq *seqs, const int64_t *p,
                             const int32_t *anchors, int32_t *drafts, float *logits);

/* Benchmarks (bench/bench_draft.c): a draft step's inputs uploaded as
 * m3_drafter_propose does, then one part of the step launched on its own
 * (launches only, so it can be captured): the whole step, the layers and
 * final norm, the lm_head, the Markov head. */
typedef enum m3_draft_part {
    M3_DRAFT_PART_STEP,
    M3_DRAFT_PART_LAYERS,
    M3_DRAFT_PART_HEAD,
    M3_DRAFT_PART_MARKOV,
} m3_draft_part;
m3_status m3_drafter_bench_inputs(m3_drafter *d, int n, const m3_seq *seqs, const int64_t *p,
                                  const int32_t *anchors);
m3_status m3_drafter_bench_part(m3_drafter *d, int n, m3_draft_part part);

#endif
