/*
 * m3.h — the public interface of libm3, a C runtime that decodes MiniMax-M3.
 *
 * A tour, in the order a program uses it:
 *
 *   m3_config cfg;                      // 1. the model's geometry
 *   m3_config_load("ckpt/config.json", &cfg);
 *
 *   m3_model *model;                    // 2. weights, mmap'd and validated
 *   m3_model_load("ckpt", NULL, &model);
 *
 *   m3_engine_opts eo = m3_engine_defaults();
 *   m3_engine *eng;                     // 3. a backend, caches, scratch
 *   m3_engine_create(model, &eo, &eng);
 *
 *   m3_gen_opts go = m3_gen_defaults(); // 4. generate (prefill + decode)
 *   m3_gen_result res;
 *   m3_generate(eng, prompt_ids, n_prompt, &go, &res);
 *
 * Lower down, m3_engine_step() runs one forward step over a batch of
 * sequences (m3_seq): it appends their tokens to the paged cache and returns
 * logits. m3_generate() is built on it.
 *
 * Errors: every fallible call returns an m3_status. On failure,
 * m3_last_error() returns a message (per thread) that names the bad value.
 * The library never exits or aborts on bad input.
 *
 * Threads: one m3_engine must be used by one thread at a time; distinct
 * engines and models are independent. The math every backend computes is
 * ../shared/SPEC.md §2.3 and §3 (docs/ARCHITECTURE.md maps the code).
 */
#ifndef M3_H
#define M3_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status */

typedef enum m3_status {
    M3_OK = 0,
    M3_ERR_INVALID_ARG,  /* a caller-supplied value is out of range */
    M3_ERR_IO,           /* a file could not be opened, read or written */
    M3_ERR_FORMAT,       /* a file is malformed (JSON, safetensors, npy) */
    M3_ERR_CONFIG,       /* config.json is missing a field or has a bad value */
    M3_ERR_UNSUPPORTED,  /* valid, but this engine cannot run it */
    M3_ERR_NO_MEMORY,    /* an allocation failed */
    M3_ERR_OUT_OF_PAGES, /* the KV page pool is exhausted */
    M3_ERR_DEVICE,       /* the GPU (or its runtime) failed or is missing */
    M3_ERR_FAULT,        /* a kernel reported a fault (see message) */
    M3_ERR_INTERNAL,     /* a bug: an invariant of the library broke */
} m3_status;

/* A short name for a status ("M3_ERR_CONFIG"). */
const char *m3_status_name(m3_status status);

/* The message of the last failure on the calling thread ("" if none). */
const char *m3_last_error(void);

/* ---------------------------------------------------------------- config */

#define M3_MAX_LAYERS 256

/* The text model's configuration, parsed from config.json (flat or nested
 * under text_config; released and flattened spellings, SPEC §2.1) and
 * validated. Plain data: copy it freely. */
typedef struct m3_config {
    int hidden_size;              /* H */
    int num_layers;
    int num_q_heads;              /* query heads */
    int num_kv_heads;             /* key/value heads (GQA groups) */
    int head_dim;                 /* D */
    int rotary_dim;               /* RoPE on dims [0, rotary_dim) */
    double rope_theta;
    int vocab_size;               /* V */
    int expert_dim;               /* intermediate_size: per routed expert */
    int dense_dim;                /* dense_intermediate_size: dense MLP */
    int shared_dim;               /* shared expert width (0: none) */
    int num_experts;              /* E */
    int experts_per_tok;          /* k */
    bool use_routing_bias;
    float routed_scaling_factor;
    float swiglu_alpha, swiglu_limit;
    float rms_norm_eps;
    bool tie_word_embeddings;
    int64_t max_position_embeddings;
    /* sparse attention */
    int index_heads;              /* == num_kv_heads */
    int index_dim;
    int block_size;               /* 128: page = sparse block */
    int topk_blocks;
    int init_blocks;              /* forced blocks at the start */
    int local_blocks;             /* forced blocks at the end */
    /* per layer */
    bool layer_sparse[M3_MAX_LAYERS]; /* sparse (indexed) attention */
    bool layer_moe[M3_MAX_LAYERS];    /* MoE FFN (else dense MLP) */
    /* tokens */
    int num_eos;
    int32_t eos_ids[8];
    /* weights are MXFP8 where the checkpoint says so (quant_method mxfp8) */
    bool mxfp8;
} m3_config;

/* Parse and validate config.json at path. */
m3_status m3_config_load(const char *path, m3_config *out);
/* The same from JSON text (len bytes). */
m3_status m3_config_parse(const char *json, size_t len, m3_config *out);
/* Render the config as a config.json in the released layout (nested under
 * text_config, released field names). The caller frees *out with free(). */
m3_status m3_config_to_json(const m3_config *cfg, char **out);

/* ---------------------------------------------------------------- presets */

/* Named model shapes for m3_synth: "tiny", "small", "m3", "m3-tp4-rank". */
m3_status m3_preset(const char *name, m3_config *out);
/* Cut a config to its first n layers (dense layers first, as released). */
m3_status m3_config_cut_layers(m3_config *cfg, int n);

/* ---------------------------------------------------------------- synth */

typedef struct m3_synth_opts {
    uint64_t seed;
    bool progress;               /* progress on stderr (only on a terminal) */
    int64_t max_shard_bytes;     /* shard when the checkpoint is larger (0: 4 GiB) */
} m3_synth_opts;

/* Write a checkpoint folder (config.json + safetensors in the released
 * layout) with deterministic random weights scaled to keep activations O(1).
 * The folder is created; existing checkpoint files in it are replaced. */
m3_status m3_synth(const m3_config *cfg, const char *out_dir, const m3_synth_opts *opts);

/* A DSpark drafter for a target (docs/DSPARK.md) with random weights: the
 * target's attention shapes, layers draft layers (0: 5), a block of block
 * rows (0: 7), taps spread over the target's layers, the last token as the
 * mask token, a vanilla Markov head, an optional key window. */
typedef struct m3_synth_draft_opts {
    int layers, block;
    int64_t window;   /* 0: none */
    bool mxfp8;
} m3_synth_draft_opts;
m3_status m3_synth_drafter(const m3_config *target, const char *out_dir,
                           const m3_synth_draft_opts *draft, const m3_synth_opts *opts);

/* ---------------------------------------------------------------- model */

typedef struct m3_model m3_model;

typedef struct m3_model_opts {
    bool progress;               /* progress on stderr (only on a terminal) */
} m3_model_opts;

/* Open a checkpoint folder: parse config.json, map and validate every
 * safetensors file, bind and check every tensor the model needs. */
m3_status m3_model_load(const char *dir, const m3_model_opts *opts, m3_model **out);
const m3_config *m3_model_config(const m3_model *model);
void m3_model_free(m3_model *model);

/* ---------------------------------------------------------------- engine */

typedef struct m3_engine m3_engine;

typedef enum m3_device { M3_DEVICE_CPU = 0, M3_DEVICE_CUDA = 1 } m3_device;

/* How decode steps run: the stock op-by-op path; the mono path (fused
 * per-layer executors, SPEC §5) wherever its plan allows, refusing to start
 * when the model or deployment is unsupported; or auto: mono where the plan
 * allows, stock otherwise (the reason printed once when mono is refused).
 * DEFAULT is auto where the mono executor has been measured faster than the
 * stock path: on the CPU, and on one GPU for steps of up to four rows
 * (mono_max_rows 4 unless set); stock on CUDA at tp > 1 (docs/PERF.md). */
typedef enum m3_decode_path {
    M3_DECODE_DEFAULT = 0,
    M3_DECODE_AUTO,
    M3_DECODE_STOCK,
    M3_DECODE_MONO,
} m3_decode_path;

typedef struct m3_engine_opts {
    m3_device device;
    int gpu;                     /* CUDA device index */
    bool graphs;                 /* CUDA: replay decode steps from CUDA graphs */
    int threads;                 /* CPU worker threads (0: all cores) */
    int64_t max_tokens;          /* KV capacity in tokens over all sequences */
    int max_rows;                /* most rows in one step (prefill chunk) */
    int max_seqs;                /* most live sequences */
    int tp;                      /* tensor-parallel ranks (0 or 1: none); CPU: ranks are threads */
    int64_t tp_timeout_ms;       /* bound on every wait for a peer rank (0: 60 s) */
    m3_decode_path decode;       /* see m3_decode_path */
    bool indexer_cp;             /* sparse layers select blocks with indexer context
                                  * parallelism over the TP ranks (SPEC §6); CPU */
    int mono_max_rows;           /* mono: most rows of a fused step (0: 16) */
} m3_engine_opts;

m3_engine_opts m3_engine_defaults(void);
m3_status m3_engine_create(m3_model *model, const m3_engine_opts *opts, m3_engine **out);
void m3_engine_free(m3_engine *eng);
/* The context limit of one sequence (tokens). */
int64_t m3_engine_max_context(const m3_engine *eng);

/* A sequence: its tokens' slots in the paged cache. */
typedef int m3_seq;
m3_status m3_seq_create(m3_engine *eng, m3_seq *out);
/* Release the sequence and its pages. */
m3_status m3_seq_free(m3_engine *eng, m3_seq seq);
int64_t m3_seq_len(const m3_engine *eng, m3_seq seq);

/* One request of a step: append tokens to seq and compute their logits. */
typedef struct m3_request {
    m3_seq seq;
    const int32_t *tokens;
    int n_tokens;
} m3_request;

/* Step statistics: steps run by the fused (mono) path and by the stock
 * path, and decode steps replayed from a CUDA graph; the layers a mono step
 * runs fused, first..last (-1, -1 where the engine has no mono path). */
typedef struct m3_engine_stats {
    int64_t mono_steps, stock_steps, graph_replays;
    int mono_first_layer, mono_last_layer;
} m3_engine_stats;
m3_engine_stats m3_engine_get_stats(const m3_engine *eng);
/* With decode auto: why the mono path was refused ("" when it runs, or
 * when stock was asked for). */
const char *m3_engine_mono_refusal(const m3_engine *eng);

/* One forward step over n_reqs requests (rows = their summed n_tokens,
 * at most max_rows). On success the tokens are in the cache and logits
 * [n_reqs, vocab] holds the logits of each request's last row (or, when
 * all_logits is non-NULL, all_logits [rows, vocab] every row's). On
 * failure no sequence changes. */
m3_status m3_engine_step(m3_engine *eng, const m3_request *reqs, int n_reqs,
                         float *logits, float *all_logits);

/* ---------------------------------------------------------------- sampling */

typedef struct m3_sampler {
    float temperature;           /* 0: greedy (argmax, lowest id on ties) */
    int top_k;                   /* 0: off */
    float top_p;                 /* 1: off */
    uint64_t seed;
} m3_sampler;

typedef struct m3_rng { uint64_t state, inc; } m3_rng;
void m3_rng_seed(m3_rng *rng, uint64_t seed);

/* The sampler's settings are valid: temperature >= 0 and finite, top_p in
 * (0, 1], top_k >= 0 (what m3_sample and m3_engine_decode check before
 * anything runs). */
m3_status m3_sampler_check(const m3_sampler *s);
/* Choose a token from logits[vocab]. */
m3_status m3_sample(const m3_sampler *s, m3_rng *rng, const float *logits, int vocab,
                    int32_t *token);

/* ---------------------------------------------------------------- generate */

typedef struct m3_gen_opts {
    int max_new_tokens;
    m3_sampler sampler;
    bool stop_at_eos;
    /* called after each generated token (may be NULL); a non-zero return
     * stops; for one prompt only (a batch refuses it) */
    int (*on_token)(void *user, int32_t token, const float *logits, int vocab);
    /* the same naming the request (the prompt's index in a batch; 0 for
     * one prompt); a non-zero return stops that request only */
    int (*on_request_token)(void *user, int request, int32_t token, const float *logits,
                            int vocab);
    void *user;
} m3_gen_opts;

typedef struct m3_gen_result {
    int n_tokens;                /* generated tokens */
    int32_t *tokens;             /* [n_tokens]; free with free() */
    double prefill_seconds, decode_seconds;
    int n_prompt;
    bool stopped_at_eos;
} m3_gen_result;

m3_gen_opts m3_gen_defaults(void);
/* One decode step (one token per request) that also samples: tokens[r]
 * is request r's next token, drawn with the sampler (on the device where the
 * backend can: greedy, or temperature without top-k/top-p, keyed by
 * (seed, step)); logits [n_reqs, vocab] is filled when non-NULL. A bad
 * sampler fails before the step (no sequence changes); a step whose
 * logits are all NaN fails after it (M3_ERR_FAULT). */
m3_status m3_engine_decode(m3_engine *eng, const m3_request *reqs, int n_reqs,
                           const m3_sampler *sampler, m3_rng *rng, int64_t step,
                           int32_t *tokens, float *logits);

/* Prefill the prompt (chunked by max_rows) in a fresh sequence, then decode. */
m3_status m3_generate(m3_engine *eng, const int32_t *prompt, int n_prompt,
                      const m3_gen_opts *opts, m3_gen_result *out);

/* n prompts at once (1..max_seqs; their pages must fit the engine's free
 * cache): each prefilled in its own sequence, then decoded together, one
 * token per live request a step (up to max_rows, and 16, requests a step:
 * more take several steps a round). out [n]:
 * out[i] is prompt i's, with its own prefill time and the batch's decode
 * time. Greedy tokens are each prompt's m3_generate tokens where the
 * backend's rows do not depend on the batch (the CPU's); sampled ones are
 * drawn from one generator (seeded by the sampler) over the batch. */
m3_status m3_generate_batch(m3_engine *eng, int n, const int32_t *const *prompts,
                            const int *n_prompts, const m3_gen_opts *opts, m3_gen_result *out);


/* ---------------------------------------------------------------- speculative decoding */

/* A DSpark drafter (SPEC §7, docs/DSPARK.md): a few dense layers over the
 * target's tapped hidden states that propose B tokens a step, which the
 * target verifies in one step of B + 1 rows. Greedy output is exactly the
 * target's plain greedy output. */
typedef struct m3_drafter m3_drafter;

/* Load the drafter checkpoint folder dir for target (its config is checked
 * against the target's: hidden and vocabulary sizes, tap layers). */
m3_status m3_drafter_load(const char *dir, const m3_model *target, const m3_model_opts *opts,
                          m3_drafter **out);
int m3_drafter_block(const m3_drafter *d); /* B */
void m3_drafter_free(m3_drafter *d);

/* One draft step of a speculative run. */
typedef struct m3_spec_step {
    int request;        /* the prompt's index in a batch (0 for one prompt) */
    int64_t pos;        /* p: the anchor's position */
    int32_t anchor;     /* the token chosen for position p */
    int n_drafts;       /* B */
    int verified;       /* drafts the target checked (B, fewer near max_new_tokens) */
    int accepted;       /* drafts kept */
    int32_t drafts[16]; /* [n_drafts]: proposals for positions p + 1 .. */
} m3_spec_step;

typedef struct m3_spec_stats {
    /* in: keep each step's record (steps) and its draft logits with the
     * Markov bias (draft_logits [n_steps, B, vocab]) */
    bool keep_steps, keep_draft_logits;
    /* out */
    /* a request's draft-and-verify cycles (summed over a batch's requests),
     * drafts verified, drafts kept */
    int64_t cycles, drafted, accepted;
    int64_t batch_steps; /* cycles of a group of up to 8 requests: one draft step (none
                          * where none had room to draft), then their verify steps */
    int64_t verify_steps; /* the target's verify steps: one a cycle, or several where a
                           * step of every request's rows would round a row differently
                           * from a one-row step (CUDA: more than 16 rows) */
    /* wall seconds in the proposer (its drafts, and the kept rows taken in
     * as its context) and in the target's verify steps (the step, its
     * logits and the acceptance): per batch step, what a step's time is made of */
    double draft_seconds, verify_seconds;
    int64_t draft_replays; /* draft steps replayed from a CUDA graph */
    /* draft steps whose layers ran the backend's fused drafter kernels
     * (SPEC §7), and, where they did not run, why ("" where they did) */
    int64_t kernel_draft_steps;
    char draft_kernels_off[200];
    int n_steps;
    m3_spec_step *steps;
    float *draft_logits;
} m3_spec_stats;
void m3_spec_stats_free(m3_spec_stats *s);

/* m3_generate with the drafter proposing and the target verifying (greedy
 * only: a temperature above 0 is refused). The engine's max_rows must hold
 * B + 1 rows. At TP > 1 the drafter runs whole on rank 0 (on GPUs with a
 * copy of the model's whole embedding and lm_head on rank 0's GPU). Its
 * steps then run stock; on CUDA with graphs the drafter's steps replay
 * CUDA graphs, and at TP 1 its verify steps too. stats may be NULL. */
m3_status m3_generate_speculative(m3_engine *eng, m3_drafter *d, const int32_t *prompt,
                                  int n_prompt, const m3_gen_opts *opts, m3_gen_result *out,
                                  m3_spec_stats *stats);

/* m3_generate_speculative over n prompts at once (as m3_generate_batch):
 * each cycle, one draft step proposes for up to 8 live requests (and no
 * more than max_rows / (B + 1) or max_seqs) and one target step verifies
 * all their drafts. out[i] is prompt i's tokens: greedy, each prompt's
 * plain greedy tokens where the backend's rows do not depend on the batch
 * (the CPU's). stats sum over the requests; each step names its request. */
m3_status m3_generate_speculative_batch(m3_engine *eng, m3_drafter *d, int n,
                                        const int32_t *const *prompts, const int *n_prompts,
                                        const m3_gen_opts *opts, m3_gen_result *out,
                                        m3_spec_stats *stats);

#ifdef __cplusplus
}
#endif
#endif /* M3_H */
