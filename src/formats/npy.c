/*
 * The .npy writer behind `m3 generate --dump-logits` (see npy.h).
 *
 * The row count is unknown until generation stops, so the header is written
 * first with room for the widest row count an int64 can hold and rewritten
 * in place on close. Because the header's length is fixed at open, the rows
 * already streamed after it never move. Version 1.0 files carry the header
 * length in a u16 and numpy wants magic + header to be a multiple of 64.
 */
#include "formats/npy.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "npy.c writes host floats as '<f4' and assumes a little-endian host"
#endif

#define NPY_PREAMBLE 10 /* magic (6), version (2), header length (2) */
#define NPY_ALIGN 64
#define NPY_WIDEST_ROWS INT64_MAX

struct m3_npy_writer {
    char *path;
    FILE *fp;
    int64_t cols;
    int64_t rows;
    size_t header_total; /* preamble + dict + padding + '\n' */
    m3_status error;     /* the first failure; later calls repeat it */
    char error_msg[512]; /* ... with its message */
};

static int npy_dict(char *buf, size_t cap, int64_t rows, int64_t cols) {
    return snprintf(buf, cap,
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (%" PRId64 ", %" PRId64
                    "), }",
                    rows, cols);
}

/* Writes the header for rows at the file's current position. */
static m3_status npy_write_header(m3_npy_writer *w, int64_t rows) {
    char header[256];
    size_t dict = (size_t)npy_dict(header + NPY_PREAMBLE, sizeof header - NPY_PREAMBLE, rows,
                                   w->cols);
    size_t body = w->header_total - NPY_PREAMBLE;
    memcpy(header, "\x93NUMPY\x01\x00", 8);
    header[8] = (char)(body & 0xff);
    header[9] = (char)(body >> 8);
    memset(header + NPY_PREAMBLE + dict, ' ', body - dict - 1);
    header[w->header_total - 1] = '\n';
    if (fwrite(header, 1, w->header_total, w->fp) != w->header_total)
        return m3_fail(M3_ERR_IO, "%s: writing the header failed: %s", w->path, strerror(errno));
    return M3_OK;
}

m3_status m3_npy_open(const char *path, int64_t cols, m3_npy_writer **out) {
    if (!path || !out || cols <= 0)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_npy_open: bad arguments (cols %" PRId64 ")", cols);
    *out = NULL;
    m3_npy_writer *w = m3_calloc(1, sizeof *w, "an npy writer");
    size_t len = strlen(path) + 1;
    char *copy = m3_malloc(len, "a file path");
    if (!w || !copy) {
        free(w);
        free(copy);
        return M3_ERR_NO_MEMORY;
    }
    memcpy(copy, path, len);
    w->path = copy;
    w->cols = cols;
    /* Sized for the widest row count, so the final rewrite fits exactly. */
    size_t widest = (size_t)npy_dict(NULL, 0, NPY_WIDEST_ROWS, cols);
    w->header_total = (NPY_PREAMBLE + widest + 1 + NPY_ALIGN - 1) / NPY_ALIGN * NPY_ALIGN;
    w->fp = fopen(path, "wb");
    m3_status s = w->fp ? npy_write_header(w, 0)
                        : m3_fail(M3_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    if (s != M3_OK) {
        if (w->fp)
            fclose(w->fp);
        free(w->path);
        free(w);
        return s;
    }
    *out = w;
    return M3_OK;
}

m3_status m3_npy_append_row(m3_npy_writer *w, const float *row) {
    if (!w || !row)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_npy_append_row: NULL argument");
    if (w->error != M3_OK)
        return m3_fail(w->error, "%s", w->error_msg);
    if (fwrite(row, sizeof *row, (size_t)w->cols, w->fp) != (size_t)w->cols) {
        w->error = m3_fail(M3_ERR_IO, "%s: writing row %" PRId64 " failed: %s", w->path, w->rows,
                           strerror(errno));
        snprintf(w->error_msg, sizeof w->error_msg, "%s", m3_last_error());
        return w->error;
    }
    w->rows++;
    return M3_OK;
}

m3_status m3_npy_close(m3_npy_writer *w) {
    if (!w)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_npy_close: NULL writer");
    m3_status s = w->error;
    if (s != M3_OK)
        m3_fail(s, "%s", w->error_msg); /* the first failure's own message */
    else if (fflush(w->fp) != 0 || fseek(w->fp, 0, SEEK_SET) != 0)
        s = m3_fail(M3_ERR_IO, "%s: cannot rewind to rewrite the header: %s", w->path,
                    strerror(errno));
    else
        s = npy_write_header(w, w->rows);
    if (fclose(w->fp) != 0 && s == M3_OK)
        s = m3_fail(M3_ERR_IO, "%s: closing failed: %s", w->path, strerror(errno));
    free(w->path);
    free(w);
    return s;
}
