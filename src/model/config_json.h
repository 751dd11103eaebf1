/*
 * Internal helpers shared by the config parser, the presets and the
 * checkpoint writer.
 */
#ifndef M3_MODEL_CONFIG_JSON_H
#define M3_MODEL_CONFIG_JSON_H

#include <stddef.h>

#include "m3.h"

/* Read a whole (text) file of at most max_bytes; *out is NUL-free-terminated
 * only by length: use *len. Free with free(). */
m3_status m3_read_text_file(const char *path, size_t max_bytes, char **out, size_t *len);

/* A DSpark drafter's config.json (docs/DSPARK.md): its dense layers'
 * attention, norm and SwiGLU fields in attn (the target's parser for them;
 * attn.num_layers is the draft layers), and the DSpark keys in either
 * spelling. Checks against the target are the loader's (spec/drafter.c). */
#define M3_MAX_TAPS 16
#define M3_MAX_DRAFT_BLOCK 15 /* B: the verify step's B + 1 rows fit a 16-row step */
typedef struct m3_draft_config {
    m3_config attn;
    int vocab_size;
    int n_taps;
    int taps[M3_MAX_TAPS]; /* target layers whose output is tapped, in order */
    int32_t mask_token;
    int block;             /* B: draft rows per step */
    int markov_rank;       /* r (0: no Markov head; -1: not given, the loader
                            * takes markov_w1's columns) */
    int ffn_dim;           /* dspark_ffn_hidden_size, 0 if absent */
    int64_t window;        /* sliding key window, 0: none */
} m3_draft_config;
m3_status m3_draft_config_parse(const char *json, size_t len, m3_draft_config *out);
/* m3 synth --draft-for: a drafter's config for target t (preset.c), and
 * its config.json text (free with free()). */
m3_status m3_draft_config_for(const m3_config *t, const m3_synth_draft_opts *o,
                              m3_draft_config *out);
m3_status m3_draft_config_to_json(const m3_draft_config *d, char **out);

/* Number of layers of each kind. */
int m3_config_count_sparse(const m3_config *c);
int m3_config_count_moe(const m3_config *c);

#endif
