/*
 * safetensors writing (see safetensors.h; reading is safetensors.c).
 *
 * Writing streams: the header is fixed up front from the declared tensors,
 * whose bytes are laid out contiguously, largest element size first (so
 * each lands on a multiple of its element size without padding, which
 * Hugging Face's library would reject), then bytes arrive in that order
 * (m3_st_writer_order) through a large stdio buffer into
 * "<path>.tmp", which is renamed to <path> only once every declared byte is
 * on disk, so an interrupted conversion never leaves a plausible-looking
 * truncated checkpoint behind.
 */
#include "formats/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/status.h"

#define ST_DATA_ALIGN 64
#define ST_WRITE_BUFFER ((size_t)16 << 20)

typedef struct st_wtensor {
    char *name;
    m3_dtype dtype;
    int ndim;
    int64_t shape[M3_ST_MAX_DIMS];
    size_t elem;         /* element size in bytes */
    uint64_t bytes;
    uint64_t begin, end; /* in the data section; set by m3_st_writer_begin */
} st_wtensor;

struct m3_st_writer {
    char *path, *tmp_path;
    FILE *fp;
    char *buffer; /* stdio's buffer */
    st_wtensor *t;  /* in declaration order */
    size_t n, cap;
    size_t *order;  /* file order: declaration indices; set by begin */
    uint64_t data_bytes;   /* sum of the declared tensors' bytes */
    uint64_t payload_left; /* tensor bytes not yet written */
    bool created; /* the temporary file exists and is ours to remove */
    bool begun, failed;
    size_t cur;   /* position in order of the tensor being written */
    uint64_t pos; /* bytes of the data section written */
};

m3_status m3_st_writer_create(const char *path, m3_st_writer **out) {
    if (!path || !out)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_writer_create: NULL argument");
    *out = NULL;
    m3_st_writer *w = m3_calloc(1, sizeof *w, "a safetensors writer");
    if (!w)
        return M3_ERR_NO_MEMORY;
    size_t len = strlen(path);
    w->path = m3_strdup(path, "a file path");
    w->tmp_path = m3_malloc(len + 5, "a file path");
    w->buffer = m3_malloc(ST_WRITE_BUFFER, "a write buffer");
    if (!w->path || !w->tmp_path || !w->buffer) {
        m3_st_writer_abort(w);
        return M3_ERR_NO_MEMORY;
    }
    memcpy(w->tmp_path, path, len);
    memcpy(w->tmp_path + len, ".tmp", 5);
    w->fp = fopen(w->tmp_path, "wb");
    if (!w->fp) {
        m3_status s = m3_fail(M3_ERR_IO, "cannot create %s: %s", w->tmp_path, strerror(errno));
        m3_st_writer_abort(w);
        return s;
    }
    w->created = true;
    setvbuf(w->fp, w->buffer, _IOFBF, ST_WRITE_BUFFER);
    *out = w;
    return M3_OK;
}

static m3_status st_writer_check_shape(const m3_st_writer *w, const char *name, m3_dtype dtype,
                                       int ndim, const int64_t *shape, uint64_t *bytes) {
    size_t size = m3_dtype_size(dtype);
    if (size == 0)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: tensor '%s': dtype %d cannot be written", w->path,
                       name, (int)dtype);
    if (ndim < 0 || ndim > M3_ST_MAX_DIMS || (ndim > 0 && !shape))
        return m3_fail(M3_ERR_INVALID_ARG, "%s: tensor '%s': %d dims (0..%d allowed)", w->path,
                       name, ndim, M3_ST_MAX_DIMS);
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || (shape[i] != 0 && count > (uint64_t)INT64_MAX / (uint64_t)shape[i]))
            return m3_fail(M3_ERR_INVALID_ARG, "%s: tensor '%s': shape[%d] = %lld is negative "
                           "or makes the tensor too large", w->path, name, i,
                           (long long)shape[i]);
        count *= (uint64_t)shape[i];
    }
    if (count > UINT64_MAX / size / 2)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: tensor '%s' is too large", w->path, name);
    *bytes = count * size;
    return M3_OK;
}

m3_status m3_st_writer_add(m3_st_writer *w, const char *name, m3_dtype dtype, int ndim,
                           const int64_t *shape) {
    if (!w || !name || !name[0] || strcmp(name, "__metadata__") == 0)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_writer_add: missing writer or bad name '%s'",
                       name ? name : "(null)");
    if (w->begun)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: tensor '%s' added after the header was written",
                       w->path, name);
    if (w->n >= (size_t)INT_MAX)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: too many tensors at '%s'", w->path, name);
    uint64_t bytes = 0;
    M3_TRY(st_writer_check_shape(w, name, dtype, ndim, shape, &bytes));
    if (w->data_bytes > UINT64_MAX / 2 - bytes)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: data section too large at tensor '%s'", w->path,
                       name);
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 64;
        st_wtensor *grown = realloc(w->t, cap * sizeof *grown);
        if (!grown)
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory declaring tensor '%s'", name);
        w->t = grown;
        w->cap = cap;
    }
    st_wtensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    t->name = m3_strdup(name, "a tensor name");
    if (!t->name)
        return M3_ERR_NO_MEMORY;
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    t->elem = m3_dtype_size(dtype);
    t->bytes = bytes;
    w->data_bytes += bytes;
    w->payload_left += bytes;
    w->n++;
    return M3_OK;
}

static int st_cmp_name(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static m3_status st_writer_unique(const m3_st_writer *w) {
    const char **names = m3_calloc(w->n, sizeof *names, "tensor names");
    if (!names)
        return M3_ERR_NO_MEMORY;
    for (size_t i = 0; i < w->n; i++)
        names[i] = w->t[i].name;
    if (w->n > 1)
        qsort(names, w->n, sizeof *names, st_cmp_name);
    m3_status s = M3_OK;
    for (size_t i = 1; i < w->n && s == M3_OK; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            s = m3_fail(M3_ERR_INVALID_ARG, "%s: tensor '%s' declared twice", w->path, names[i]);
    free(names);
    return s;
}

/* Fixes the file order and every tensor's offsets: contiguous, largest
 * element size first, declaration order among equal sizes. Every tensor's
 * bytes are a multiple of its element size, so each offset is the sum of
 * multiples of sizes at least as large as (and, being powers of two, so
 * multiples of) its own element size. */
static m3_status st_writer_layout(m3_st_writer *w) {
    w->order = m3_calloc(w->n ? w->n : 1, sizeof *w->order, "the tensor order");
    if (!w->order)
        return M3_ERR_NO_MEMORY;
    size_t k = 0, below = SIZE_MAX;
    uint64_t off = 0;
    while (k < w->n) {
        size_t size = 0; /* the largest element size below the last one */
        for (size_t i = 0; i < w->n; i++)
            if (w->t[i].elem < below && w->t[i].elem > size)
                size = w->t[i].elem;
        for (size_t i = 0; i < w->n; i++) {
            st_wtensor *t = &w->t[i];
            if (t->elem != size)
                continue;
            w->order[k++] = i;
            t->begin = off;
            t->end = off + t->bytes;
            off = t->end;
        }
        below = size;
    }
    return M3_OK;
}

static cJSON *st_writer_json(const m3_st_writer *w) {
    cJSON *root = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
    bool ok = meta && cJSON_AddStringToObject(meta, "format", "pt");
    char num[32];
    for (size_t i = 0; ok && i < w->n; i++) {
        const st_wtensor *t = &w->t[i];
        cJSON *e = cJSON_AddObjectToObject(root, t->name);
        ok = e && cJSON_AddStringToObject(e, "dtype", m3_dtype_name(t->dtype));
        cJSON *shape = ok ? cJSON_AddArrayToObject(e, "shape") : NULL;
        cJSON *offs = shape ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
        ok = offs != NULL;
        /* Raw numbers: cJSON formats doubles, which could turn a large
         * integer into exponent notation that strict readers reject. */
        for (int d = 0; ok && d < t->ndim; d++) {
            snprintf(num, sizeof num, "%lld", (long long)t->shape[d]);
            ok = cJSON_AddItemToArray(shape, cJSON_CreateRaw(num));
        }
        snprintf(num, sizeof num, "%llu", (unsigned long long)t->begin);
        ok = ok && cJSON_AddItemToArray(offs, cJSON_CreateRaw(num));
        snprintf(num, sizeof num, "%llu", (unsigned long long)t->end);
        ok = ok && cJSON_AddItemToArray(offs, cJSON_CreateRaw(num));
    }
    if (!ok) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

static m3_status st_writer_io_error(m3_st_writer *w, const char *what) {
    w->failed = true;
    return m3_fail(M3_ERR_IO, "%s: %s failed: %s", w->tmp_path, what, strerror(errno));
}

m3_status m3_st_writer_begin(m3_st_writer *w) {
    if (!w || w->begun)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_writer_begin: no writer, or called twice");
    M3_TRY(st_writer_unique(w));
    if (!w->order)
        M3_TRY(st_writer_layout(w));
    cJSON *root = st_writer_json(w);
    char *json = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!json)
        return m3_fail(M3_ERR_NO_MEMORY, "%s: out of memory building the header", w->path);
    size_t len = strlen(json);
    /* Spaces pad the header so the data section starts on a 64-byte file
     * offset: in a page-aligned mapping the tensors' element-aligned
     * offsets are then element-aligned addresses, not just offsets. */
    uint64_t hlen = (8 + len + ST_DATA_ALIGN - 1) / ST_DATA_ALIGN * ST_DATA_ALIGN - 8;
    uint8_t prefix[8];
    for (int i = 0; i < 8; i++)
        prefix[i] = (uint8_t)(hlen >> (8 * i));
    bool ok = fwrite(prefix, 1, 8, w->fp) == 8 && fwrite(json, 1, len, w->fp) == len;
    for (size_t i = len; ok && i < hlen; i++)
        ok = fputc(' ', w->fp) != EOF;
    cJSON_free(json);
    w->begun = true;
    return ok ? M3_OK : st_writer_io_error(w, "writing the header");
}

/* Moves to the next tensor in file order with bytes left to receive,
 * skipping finished and empty tensors. The layout has no gaps, so that
 * tensor begins at or before pos. */
static void st_writer_advance(m3_st_writer *w) {
    while (w->cur < w->n && w->pos >= w->t[w->order[w->cur]].end)
        w->cur++;
}

m3_status m3_st_writer_write(m3_st_writer *w, const void *bytes, size_t n) {
    if (!w || !w->begun || (n > 0 && !bytes))
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_writer_write: no writer, no data, or called "
                       "before m3_st_writer_begin");
    if (w->failed)
        return m3_fail(M3_ERR_IO, "%s: an earlier write failed", w->tmp_path);
    if (n > w->payload_left)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: writing %zu bytes, but only %llu of the declared "
                       "tensor bytes remain", w->path, n, (unsigned long long)w->payload_left);
    const uint8_t *p = bytes;
    while (n > 0) {
        st_writer_advance(w);
        const st_wtensor *t = &w->t[w->order[w->cur]];
        size_t chunk = t->end - w->pos < n ? (size_t)(t->end - w->pos) : n;
        if (fwrite(p, 1, chunk, w->fp) != chunk)
            return st_writer_io_error(w, "writing tensor data");
        w->pos += chunk;
        w->payload_left -= chunk;
        p += chunk;
        n -= chunk;
    }
    return M3_OK;
}

static void st_writer_free(m3_st_writer *w) {
    for (size_t i = 0; i < w->n; i++)
        free(w->t[i].name);
    free(w->t);
    free(w->order);
    free(w->path);
    free(w->tmp_path);
    free(w->buffer);
    free(w);
}

/* Flushes, syncs and closes the temporary file. */
static m3_status st_writer_close_tmp(m3_st_writer *w) {
    bool ok = fflush(w->fp) == 0 && fsync(fileno(w->fp)) == 0;
    int err = errno;
    ok = fclose(w->fp) == 0 && ok;
    w->fp = NULL;
    if (!ok)
        return m3_fail(M3_ERR_IO, "%s: closing failed: %s", w->tmp_path, strerror(err));
    return M3_OK;
}

m3_status m3_st_writer_finish(m3_st_writer *w) {
    if (!w)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_writer_finish: NULL writer");
    m3_status s = M3_OK;
    if (!w->begun)
        s = m3_fail(M3_ERR_INVALID_ARG, "%s: finished before m3_st_writer_begin", w->path);
    else if (w->failed)
        s = m3_fail(M3_ERR_IO, "%s: an earlier write failed", w->tmp_path);
    else if (st_writer_advance(w), w->cur < w->n) {
        const st_wtensor *t = &w->t[w->order[w->cur]];
        s = m3_fail(M3_ERR_INVALID_ARG, "%s: finished early: tensor '%s' got %llu of %llu bytes "
                    "(%llu bytes missing in all)", w->path, t->name,
                    (unsigned long long)(w->pos - t->begin),
                    (unsigned long long)(t->end - t->begin), (unsigned long long)w->payload_left);
    }
    if (s == M3_OK)
        s = st_writer_close_tmp(w);
    if (s == M3_OK && rename(w->tmp_path, w->path) != 0)
        s = m3_fail(M3_ERR_IO, "cannot rename %s to %s: %s", w->tmp_path, w->path,
                    strerror(errno));
    if (s != M3_OK) {
        m3_st_writer_abort(w);
        return s;
    }
    st_writer_free(w);
    return M3_OK;
}

void m3_st_writer_abort(m3_st_writer *w) {
    if (!w)
        return;
    if (w->fp)
        fclose(w->fp);
    if (w->created)
        remove(w->tmp_path);
    st_writer_free(w);
}

uint64_t m3_st_writer_data_bytes(const m3_st_writer *w) { return w ? w->data_bytes : 0; }

size_t m3_st_writer_count(const m3_st_writer *w) { return w ? w->n : 0; }

int m3_st_writer_order(const m3_st_writer *w, size_t i) {
    if (!w || !w->begun || !w->order || i >= w->n)
        return -1;
    return (int)w->order[i];
}
