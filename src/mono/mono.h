/*
 * The mono path's lifecycle (SPEC §5, seed 000 "SpecializedDecode"): the
 * object that decides, step by step, whether a fused per-layer executor
 * (CPU: cpu/cpu_mono.c, GPU: cuda/cuda_mono.cu) runs a range of layers
 * instead of the stock op-by-op path, and that keeps that decision safe.
 *
 * One m3_mono per TP rank, built after the weights are loaded:
 *
 *   m3_mono_create    refusals (every reason, agreed over ranks with a MIN),
 *                     zero-copy weight views, the executor
 *   m3_mono_bind_cache   check and identify each layer's cache; rebind only
 *                     changed layers; never during a graph capture
 *   m3_mono_plan      per forward: stock or mono (decide_step), begin_step
 *   m3_mono_run       the layers [first, last] through the executor
 *   m3_mono_after_step   after the layer loop: abort a failed launched step
 *                     on every rank, else check the sticky fault word
 *   m3_mono_health / m3_mono_close
 *
 * Every predicate of plan reads only step metadata that every rank holds
 * alike, so ranks never diverge (their kernels wait on each other).
 */
#ifndef M3_MONO_MONO_H
#define M3_MONO_MONO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"
#include "decode/step.h"
#include "m3.h"
#include "mono/fault.h"

struct m3_engine;

#define M3_MONO_MAX_WIDTHS 8

typedef struct m3_mono_config {
    int first_layer, last_layer; /* inclusive */
    int max_rows;
    int widths[M3_MONO_MAX_WIDTHS]; /* compiled row widths, ascending; the last is max_rows */
    int n_widths;
    int tp_size;
} m3_mono_config;

/* Why a step runs stock (decide_step and plan), M3_MONO_STEP_MONO when not. */
typedef enum m3_mono_decision {
    M3_MONO_STEP_MONO = 0,
    M3_MONO_STEP_CLOSED,        /* after close */
    M3_MONO_STEP_NO_CONTEXT,    /* no forward context (no step metadata) */
    M3_MONO_STEP_INTERMEDIATES, /* pipeline intermediates are present */
    M3_MONO_STEP_PREFILL,       /* a request is a prefill (or more than one row) */
    M3_MONO_STEP_TOO_MANY_ROWS, /* rows > max_rows */
    M3_MONO_STEP_PIECEWISE,     /* graph mode PIECEWISE */
    M3_MONO_STEP_NO_METADATA,   /* sparse metadata (block table, lengths) missing */
    M3_MONO_STEP_FAULTED,       /* an earlier step faulted */
    M3_MONO_STEP_UNBOUND,       /* the cache is not bound */
} m3_mono_decision;
const char *m3_mono_decision_name(m3_mono_decision d);

typedef enum m3_mono_state { M3_MONO_READY = 0, M3_MONO_FAULTED, M3_MONO_CLOSED } m3_mono_state;

typedef struct m3_mono_health {
    m3_mono_state state;
    const char *executor;       /* "cpu" or "cuda" */
    int first_layer, last_layer;
    int64_t mono_steps, stock_steps;
    int64_t binds;              /* layer bindings made, first binds included */
    uint32_t epoch;
    int32_t fault[4];           /* the last fault read (code, layer, row, value) */
} m3_mono_health;

typedef struct m3_mono m3_mono;

/* The default config for an engine: the longest run of sparse MoE layers
 * (the later one on a tie; the layers before and after it run stock),
 * max_rows (0: 16), widths 1, 2, 4, ... up to max_rows, the engine's TP
 * size. M3_ERR_UNSUPPORTED when no layer qualifies. */
m3_status m3_mono_default_config(const struct m3_engine *eng, int max_rows, m3_mono_config *out);

/* Every reason this rank cannot run cfg on eng, "; "-separated into buf
 * (empty when none); returns how many. */
int m3_mono_model_refusals(const struct m3_engine *eng, const m3_mono_config *cfg, char *buf,
                           size_t buf_size);

/* Build the rank's mono object (collective: every rank of eng's group
 * calls it). If any rank refuses, every rank fails: with its own reasons,
 * or "refused on another TP rank". group: the CPU executors' shared group
 * (cpu/cpu_mono.h) at TP > 1 on the CPU, else NULL. */
m3_status m3_mono_create(struct m3_engine *eng, const m3_mono_config *cfg, void *group,
                         m3_mono **out);
/* GPUs at TP > 1, after every rank's m3_mono_create and with peer access
 * between the GPUs on: hand each rank's fused kernels every rank's landing
 * area and fault word (monos[r] is rank r's; the in-kernel all-reduce and
 * abort_all write into peers' memory). */
m3_status m3_mono_connect_gpus(m3_mono *const *monos, int world);

/* Check and identify the layers' caches; rebind only what changed.
 * Collective: a failure on any rank fails every rank. capturing: a graph
 * capture is in progress (a first bind or a rebind then is an error). */
m3_status m3_mono_bind_cache(m3_mono *m, const m3_cache *cache, int64_t n_pages, bool capturing);

/* decide_step alone (no side effects). */
m3_mono_decision m3_mono_decide_step(const m3_mono *m, const m3_step *st);
/* Per forward: stock or mono. A mono step calls begin_step (the step's
 * slot mapping, a new epoch) and counts mono_steps; otherwise stock_steps
 * is counted. *why (optional) gets the decision. */
bool m3_mono_plan(m3_mono *m, const m3_step *st, bool intermediates, m3_mono_decision *why);
/* The layers [first, last] of the planned step; hidden/residual in
 * backend memory. */
m3_status m3_mono_run(m3_mono *m, const m3_step *st, uint16_t *hidden, uint16_t *residual);
/* One layer of the range, outside a plan (benchmarks and tests): the
 * current epoch, hidden/residual in backend memory. */
m3_status m3_mono_run_layer(m3_mono *m, const m3_step *st, int layer, uint16_t *hidden,
                            uint16_t *residual);
/* After every forward's layer loop, before logits and sampling. failure:
 * the step's status so far. With a failure the launched step is aborted on
 * every rank and the failure returned; else the fault word is checked
 * (GPU: a device-side assert that stops the process with the fault's
 * message; CPU: M3_ERR_FAULT with it). */
m3_status m3_mono_after_step(m3_mono *m, bool launched, m3_status failure);

/* The backend's executor (cpu/cpu_mono.h or cuda/cuda_mono.h), for
 * benchmarks and tests; NULL after close. */
void *m3_mono_executor(m3_mono *m);

/* Tests: set this rank's fault word as a kernel would. */
m3_status m3_mono_plant_fault(m3_mono *m, int code, int layer);

m3_mono_health m3_mono_get_health(const m3_mono *m);
int m3_mono_first_layer(const m3_mono *m);
int m3_mono_last_layer(const m3_mono *m);
/* The compiled width a step of rows rows pads to (-1: none). */
int m3_mono_width(const m3_mono *m, int rows);
/* Release the executor; later plans are stock. Idempotent. */
void m3_mono_close(m3_mono *m);
void m3_mono_free(m3_mono *m);

#endif
