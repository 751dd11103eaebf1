/*
 * The engine's insides: a backend with its copy of the weights, the paged
 * cache, the step metadata buffers, the activation scratch and the
 * communicator. decode/engine.c builds steps from requests; decode/forward.c
 * runs one step through the layers.
 */
#ifndef M3_DECODE_ENGINE_H
#define M3_DECODE_ENGINE_H

#include "backend/backend.h"
#include "cache/cache.h"
#include "decode/step.h"
#include "dist/comm.h"
#include "model/config_json.h"
#include "model/model.h"

#define M3_GRAPH_MAX_ROWS 16
/* Most rows of a verify step replayed from a graph: a batch of 8 requests'
 * anchors and 7 drafts each (SPEC §7). */
#define M3_GRAPH_MAX_VERIFY_ROWS 64
/* Graph buckets: decode steps of 1, 2, 4, 8, 16 rows (padded up), then
 * requests extending their sequences by 2..64 rows in all with every row's
 * logits (a speculative verify step), one bucket per row count */
#define M3_GRAPH_DECODE_BUCKETS 5
#define M3_GRAPH_BUCKETS (M3_GRAPH_DECODE_BUCKETS + M3_GRAPH_MAX_VERIFY_ROWS - 1)

/* Activations of one step, in backend memory; R = max(max_rows, 16). */
typedef struct m3_scratch {
    uint16_t *hidden;    /* [R, H]: a layer's output */
    uint16_t *residual;  /* [R, H] */
    uint16_t *x;         /* [R, H]: a norm's output */
    uint16_t *o;         /* [R, H]: o_proj output */
    void *partial;       /* [R, H] partial_dtype: a TP rank's partial (o_proj, dense FFN) */
    uint16_t *q;         /* [R, Nq*D] */
    uint16_t *k, *v;     /* [R, Nkv*D] */
    uint16_t *iq;        /* [R, Ni*Di] */
    uint16_t *ik;        /* [R, Di] */
    float *scores;       /* [R, Ni, max_blocks] */
    int32_t *selected;   /* [R, Ni, topk] */
    uint16_t *attn;      /* [R, Nq*D] */
    uint16_t *gate, *up, *act; /* [R, F] dense MLP */
    uint16_t *out_hidden, *out_residual, *final; /* [R, H]: rows whose logits are wanted */
    int32_t *out_rows;   /* [R] */
    float *logits;       /* [R, V]: this rank's vocabulary slice at TP > 1 */
} m3_scratch;

/* Called after each layer with the step's hidden and residual (backend
 * memory); for tests and debugging, NULL otherwise. */
typedef void (*m3_layer_hook)(void *user, int layer, const m3_step *step, const uint16_t *hidden,
                              const uint16_t *residual);

struct m3_engine {
    m3_model *model;
    m3_config cfg;       /* this rank's shard of the model's config (TP 1: the model's) */
    /* TP: a front engine (ranks[0] set) drives one rank engine per rank,
     * each on its own thread with its own backend, weights shard, cache and
     * scratch; the front itself has no backend. */
    int tp_rank, tp_size;
    int vocab_full;      /* the model's vocabulary (cfg.vocab_size is the slice) */
    int64_t vocab_start; /* the first token of this rank's slice */
    struct m3_engine *ranks[M3_MAX_TP]; /* front only */
    m3_comm *rank_comms[M3_MAX_TP];     /* front only: the group's comms */
    m3_weights shard;    /* rank engines at TP > 1: the views this rank holds */
    struct m3_cpu_mono_group *mono_group; /* front on the CPU: the mono executors' peers */
    struct m3_gpu_group *gpu_group; /* front on GPUs: NCCL, one GPU per rank */
    bool own_comm;       /* a GPU rank: comm is its own (over the front's host comm) */
    int *cp_err;         /* GPU indexer CP: the kernels' error word, device int[4] */
    m3_dtype partial_dtype; /* F64 on the CPU (exact), F32 on the GPU */
    m3_engine_opts opts;
    m3_backend *be;
    m3_weights w;        /* the backend's weights */
    m3_comm *comm;
    m3_cache cache;
    m3_scratch s;
    m3_step step;
    int max_blocks;      /* block table width: ceil(max_context / 128) */
    struct m3_mono *mono;  /* the mono path's lifecycle (NULL: stock only) */
    char mono_refused[512];/* decode auto: why mono was refused ("" if it was not) */
    bool graph_mono[M3_GRAPH_BUCKETS]; /* the bucket's graph captured a mono step */
    int64_t mono_steps, stock_steps, graph_replays;
    int64_t cp_selects;  /* sparse layers that selected through indexer CP (eager steps) */
    bool graphs;         /* capture and replay decode steps */
    bool stable_width;   /* block tables always max_blocks wide */
    void *graph[M3_GRAPH_BUCKETS];
    int32_t *tokens_dev; /* [R] sampled tokens */
    int64_t *counter_dev;/* [R] sampling counters */
    m3_layer_hook layer_hook;
    void *layer_hook_user;
    /* Layer taps (the DSpark drafter's context, spec/): after tapped layer
     * L, row t's bf16(hidden + residual) goes to taps [t, tap_of[L], H]
     * (backend memory, written by the add_rows op, so a step with taps can
     * be captured into a graph). A step with taps runs every layer stock. */
    int n_taps;
    int tap_of[M3_MAX_LAYERS]; /* the tap index of a layer, -1: untapped */
    uint16_t *taps;            /* [R, n_taps, H] (backend memory) */
};

/* Rows of the scratch buffers: R = max(max_rows, 16). */
static inline int m3_engine_rows(const m3_engine *e) {
    return e->opts.max_rows > M3_GRAPH_MAX_ROWS ? e->opts.max_rows : M3_GRAPH_MAX_ROWS;
}

/* generate.c and sample.c, shared with the speculative loop (spec/): the
 * checks m3_generate makes before anything runs (sampler, prompt, new
 * tokens, context); whether token ends a sequence. */
m3_status m3_gen_check(const m3_engine *eng, int n_prompt, const m3_gen_opts *opts);
/* The same for a batch of n prompts decoded together: each as above, and
 * together within the engine's sequences and free pages; the callback is
 * on_request_token (on_token only for one prompt). */
m3_status m3_gen_check_batch(const m3_engine *eng, int n, const int32_t *const *prompts,
                             const int *n_prompts, const m3_gen_opts *opts);
/* A batch's start: n results (n_prompt set, room for max_new_tokens) and
 * a fresh sequence each in seqs [n]; on failure nothing is left. Its end:
 * the sequences freed, and after a failure (st) the results' tokens. */
m3_status m3_gen_begin(m3_engine *eng, int n, const int *n_prompts, const m3_gen_opts *opts,
                       m3_gen_result *res, m3_seq *seqs);
void m3_gen_end(m3_engine *eng, int n, const m3_seq *seqs, m3_gen_result *res, m3_status st);
/* Give token (chosen from row_logits [vocab]) to request `request`'s
 * result and the callbacks; false when that request's generation ends
 * here (a callback said stop, end-of-sequence, or max_new_tokens). */
bool m3_gen_emit(const m3_engine *eng, const m3_gen_opts *opts, int request, m3_gen_result *res,
                 int32_t token, const float *row_logits);
bool m3_config_is_eos(const m3_config *c, int32_t token);
/* Pages of KV cache not held by any sequence (a TP front: its ranks'). */
int32_t m3_engine_free_pages(const m3_engine *eng);

/* Tap layers[0..n) on every later step of a TP 1 engine (n = 0: none):
 * the taps go to eng->taps in backend memory; the engine's captured graphs
 * are freed, since they were captured with the old taps (or none). */
m3_status m3_engine_set_taps(m3_engine *eng, const int *layers, int n);

/* Resolve opts->decode == M3_DECODE_DEFAULT into the path it stands for
 * (m3.h's m3_decode_path): auto, with mono_max_rows 1 on one GPU, or stock
 * on CUDA at tp > 1. Other paths are left as given. */
void m3_engine_resolve_decode(m3_engine_opts *o);
/* Run one step on the backend: the layers, then the logits of the rows
 * s.out_rows[0..n_out) (backend memory) into s.logits [n_out, V]. Launches
 * only, so a CUDA graph can capture it. */
m3_status m3_forward_device(m3_engine *eng, const m3_step *step, int n_out);


/* One layer of the stock path on the step (layer 0: first = true, the
 * residual holds the embedding). Launches only. */
m3_status m3_stock_layer(m3_engine *eng, const m3_step *step, int layer, bool first);

/* Run fn(rank engine, arg) on every rank of a front at once, one thread
 * each (collectives inside fn need every rank); the first rank's own
 * failure is returned (engine_tp.c). */
/* Make the calling thread work on e's device (a GPU rank's thread before
 * its work; engines on several GPUs may share one thread). No-op on the CPU. */
m3_status m3_engine_bind_thread(m3_engine *e);

m3_status m3_tp_run_all(m3_engine *front, m3_status (*fn)(m3_engine *rank, void *arg), void *arg);

/* A step of a TP front engine (engine_tp.c): every rank on its own thread. */
m3_status m3_tp_front_step(m3_engine *front, const m3_request *reqs, int n_reqs, float *logits,
                           float *all_logits);

/* A step like m3_engine_step with every row's greedy token (argmax, lowest
 * id on ties; -1 for a row whose every logit is NaN) in tokens [rows],
 * chosen on the device: only the tokens come back (a verify step of B + 1
 * rows would otherwise download B + 1 rows of vocabulary logits). Only
 * where m3_engine_greedy_on_device (not the CPU backend, not a TP front):
 * else M3_ERR_UNSUPPORTED. */
bool m3_engine_greedy_on_device(const m3_engine *eng);
m3_status m3_engine_step_greedy(m3_engine *eng, const m3_request *reqs, int n_reqs,
                                int32_t *tokens);

/* The most rows a step can have with each row's results the bits a
 * one-row step gives it (0: any number): the backend's exact_rows (a TP
 * front's: rank 0's). Speculative decoding verifies in steps of at most
 * this many rows, so its tokens are plain greedy decoding's. */
static inline int m3_engine_exact_rows(const m3_engine *e) {
    const m3_engine *x = e->be ? e : e->ranks[0];
    return x && x->be ? x->be->exact_rows : 0;
}

/* For benchmarks: give seq len tokens of cache (pages reserved, contents
 * whatever the cache holds) without running them. */
m3_status m3_engine_set_len(m3_engine *eng, m3_seq seq, int64_t len);
/* For benchmarks: check, reserve and build (upload) the step of reqs into
 * eng->step without running it or committing lengths; decode steps are
 * padded to their graph bucket when pad. */
m3_status m3_engine_build(m3_engine *eng, const m3_request *reqs, int n_reqs, bool pad);

#endif
