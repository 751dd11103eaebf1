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
#include "model/model.h"

/* Activations of one step, in backend memory; R = max_rows. */
typedef struct m3_scratch {
    uint16_t *hidden;    /* [R, H]: a layer's output */
    uint16_t *residual;  /* [R, H] */
    uint16_t *x;         /* [R, H]: a norm's output */
    uint16_t *o;         /* [R, H]: o_proj output */
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
    float *logits;       /* [R, V] */
} m3_scratch;

/* A contiguous range of layers run by a fused executor for one step
 * (SPEC §5); NULL in the engine until the mono path plugs in. */
typedef struct m3_layer_range_executor {
    int first_layer, last_layer;
    /* true: this executor runs the step's layers [first, last] */
    bool (*plan)(void *self, const m3_step *step);
    m3_status (*run)(void *self, const m3_step *step, uint16_t *hidden, uint16_t *residual);
    m3_status (*after_step)(void *self, m3_status failure);
    void *self;
} m3_layer_range_executor;

/* Called after each layer with the step's hidden and residual (backend
 * memory); for tests and debugging, NULL otherwise. */
typedef void (*m3_layer_hook)(void *user, int layer, const m3_step *step, const uint16_t *hidden,
                              const uint16_t *residual);

struct m3_engine {
    m3_model *model;
    m3_config cfg;
    m3_engine_opts opts;
    m3_backend *be;
    m3_weights w;        /* the backend's weights */
    m3_comm *comm;
    m3_cache cache;
    m3_scratch s;
    m3_step step;
    int max_blocks;      /* block table width: ceil(max_context / 128) */
    m3_layer_range_executor *executor;
    int64_t mono_steps, stock_steps;
    m3_layer_hook layer_hook;
    void *layer_hook_user;
};

/* Run one step: layers, then the logits of out_rows[0..n_out) (host
 * indices) into logits (host memory, [n_out, V]). */
m3_status m3_forward(m3_engine *eng, const m3_step *step, int n_out, const int32_t *out_rows,
                     float *logits);

#endif
