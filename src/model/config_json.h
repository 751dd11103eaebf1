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

/* Number of layers of each kind. */
int m3_config_count_sparse(const m3_config *c);
int m3_config_count_moe(const m3_config *c);

#endif
