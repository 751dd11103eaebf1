/*
 * Binding checkpoint tensors to weight views, shared by the target model's
 * loader (model/model.c) and the DSpark drafter's (spec/drafter_load.c): a
 * name prefix over a safetensors set, and views whose dtype and shape are
 * checked, with a message naming the tensor when they are wrong.
 */
#ifndef M3_MODEL_BIND_H
#define M3_MODEL_BIND_H

#include "core/tensor.h"
#include "formats/safetensors.h"

typedef struct m3_binder {
    const m3_st_set *files;
    const char *prefix; /* e.g. "language_model.model." */
} m3_binder;

/* The entry named prefix + suffix, or NULL. */
const m3_st_entry *m3_bind_find(const m3_binder *b, const char *suffix);
/* A [n] (k = 0) or [n, k] tensor of the given dtype named prefix + suffix. */
m3_status m3_bind_plain(const m3_binder *b, const char *suffix, m3_dtype dtype, int64_t n,
                        int64_t k, m3_tensor *out);
/* A linear weight base + ".weight" [n, k]: bf16, or MXFP8 (e4m3 plus u8
 * base + ".weight_scale_inv" [n, k / 32]). */
m3_status m3_bind_linear(const m3_binder *b, const char *base, int64_t n, int64_t k,
                         m3_linear *out);
/* gate and up [n, k]: separate (gate_base, up_base) or one fused tensor
 * fused_base [2n, k] with the gate rows first. */
m3_status m3_bind_gate_up(const m3_binder *b, const char *gate_base, const char *up_base,
                          const char *fused_base, int64_t n, int64_t k, m3_linear *gate,
                          m3_linear *up);

#endif
