/*
 * The loaded model: the config plus, per layer, views of every weight the
 * forward pass reads (SPEC §2.2). All views point into the mmap'd
 * safetensors files; nothing is copied. Both tensor-name spellings are bound
 * here (released: block_sparse_moe.experts.{e}.w1/w2/w3, index_q_proj, ...;
 * newer: mlp.experts.gate_up_proj [E, 2I, H] stacked, indexer.q_proj, ...),
 * so everything past this file sees one layout.
 */
#ifndef M3_MODEL_MODEL_H
#define M3_MODEL_MODEL_H

#include "core/tensor.h"
#include "formats/safetensors.h"
#include "m3.h"

/* Shapes: H hidden, D head_dim, Di index_dim, Nq/Nkv/Ni query/KV/index
 * heads, I expert width, Is shared width, F dense MLP width, E experts. */
typedef struct m3_layer_weights {
    int index;
    bool sparse; /* indexed sparse attention */
    bool moe;    /* MoE FFN (else dense MLP) */

    m3_tensor input_norm; /* [H] bf16 */
    m3_tensor post_norm;  /* [H] bf16 */
    m3_linear q_proj;     /* [Nq*D, H] */
    m3_linear k_proj;     /* [Nkv*D, H] */
    m3_linear v_proj;     /* [Nkv*D, H] */
    m3_linear o_proj;     /* [H, Nq*D] */
    m3_tensor q_norm;     /* [D] bf16, shared by all heads */
    m3_tensor k_norm;     /* [D] bf16 */

    /* sparse layers */
    m3_linear iq_proj;    /* [Ni*Di, H] */
    m3_linear ik_proj;    /* [Di, H]: one key head */
    m3_tensor iq_norm;    /* [Di] bf16 */
    m3_tensor ik_norm;    /* [Di] bf16 */

    /* dense MLP */
    m3_linear mlp_gate;   /* [F, H] */
    m3_linear mlp_up;     /* [F, H] */
    m3_linear mlp_down;   /* [H, F] */

    /* MoE */
    m3_tensor router;      /* [E, H] f32 */
    m3_tensor router_bias; /* [E] f32; absent without use_routing_bias */
    m3_linear *exp_gate;   /* [E] x [I, H] (w1) */
    m3_linear *exp_up;     /* [E] x [I, H] (w3) */
    m3_linear *exp_down;   /* [E] x [H, I] (w2) */
    m3_linear sh_gate;     /* [Is, H]; absent without a shared expert */
    m3_linear sh_up;       /* [Is, H] */
    m3_linear sh_down;     /* [H, Is] */
} m3_layer_weights;

/* Every weight of the model. The host copy views the mmap'd files; a
 * backend may hold another copy whose pointers are its own memory. */
typedef struct m3_weights {
    m3_tensor embed;   /* [V, H] bf16 */
    m3_tensor norm;    /* [H] bf16: the final norm */
    m3_tensor lm_head; /* [V, H] bf16 (the embedding when tied) */
    m3_layer_weights *layers; /* [num_layers] */
} m3_weights;

struct m3_model {
    m3_config cfg;
    m3_st_set *files;
    m3_weights w;  /* views into files */
    char *dir;
};

#endif
