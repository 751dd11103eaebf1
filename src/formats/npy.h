/*
 * A writer for NumPy .npy files (format version 1.0, little-endian float32,
 * C order), used by `m3 generate --dump-logits`. Rows are streamed: the
 * header is rewritten with the final row count when the file is closed.
 */
#ifndef M3_FORMATS_NPY_H
#define M3_FORMATS_NPY_H

#include <stdint.h>

#include "m3.h"

typedef struct m3_npy_writer m3_npy_writer;

/* A 2-D float32 array [rows, cols]; rows grow with each append. */
m3_status m3_npy_open(const char *path, int64_t cols, m3_npy_writer **out);
m3_status m3_npy_append_row(m3_npy_writer *w, const float *row);
/* Finalise the header and close; frees w. */
m3_status m3_npy_close(m3_npy_writer *w);

#endif
