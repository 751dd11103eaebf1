/*
 * safetensors: reading (mmap'd, zero-copy, validated) and writing.
 *
 * A checkpoint is one file (model.safetensors) or shards listed by
 * model.safetensors.index.json ("weight_map": tensor name -> file). Every
 * file is validated in full before any tensor is used: the header length
 * lies inside the file, the header is a JSON object whose entries have a
 * known dtype, a shape of non-negative integers and data_offsets
 * [begin, end] inside the data section with end - begin = prod(shape) x
 * dtype size; no two tensors overlap; no name appears twice (within a file
 * or across shards); the index names only files that exist and tensors they
 * hold. The set keeps every file mapped until m3_st_close.
 *
 * Tensor data is handed out as views into the mapping. A tensor whose bytes
 * are not aligned to its element size (allowed by the format) is copied once
 * into an aligned buffer the set owns, so readers may load elements directly.
 */
#ifndef M3_FORMATS_SAFETENSORS_H
#define M3_FORMATS_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/tensor.h"
#include "m3.h"

#define M3_ST_MAX_DIMS 8

typedef struct m3_st_entry {
    const char *name;
    char dtype_name[16];          /* as written: "BF16", "F8_E4M3", ... */
    m3_dtype dtype;               /* M3_DT_NONE for types m3 never reads (F16, I8, ...) */
    int ndim;
    int64_t shape[M3_ST_MAX_DIMS];
    const void *data;             /* aligned to the element size */
    size_t bytes;
    int file;                     /* index into the set's files */
} m3_st_entry;

typedef struct m3_st_set m3_st_set;

/* Open a checkpoint folder: model.safetensors.index.json if present, else
 * model.safetensors, else the single *.safetensors file in the folder. */
m3_status m3_st_open_dir(const char *dir, bool progress, m3_st_set **out);
/* Open one file as a set. */
m3_status m3_st_open_file(const char *path, m3_st_set **out);
void m3_st_close(m3_st_set *set);

size_t m3_st_count(const m3_st_set *set);
const m3_st_entry *m3_st_at(const m3_st_set *set, size_t i);
/* NULL when absent. */
const m3_st_entry *m3_st_find(const m3_st_set *set, const char *name);
const char *m3_st_file_path(const m3_st_set *set, int file);
/* A dense view of the entry (ne = shape; at most M3_MAX_DIMS dims). */
m3_tensor m3_st_tensor(const m3_st_entry *e);

/* ---- writing ----
 * Declare every tensor first (m3_st_writer_add), then m3_st_writer_begin
 * writes the header. The data section starts at a 64-byte file offset (the
 * header is padded with spaces) and holds the tensors contiguously, with no
 * gaps, largest element size first (declaration order among equal sizes):
 * Hugging Face's safetensors library requires the tensors, sorted by offset,
 * to be contiguous and the last to end at the end of the file, and this
 * order still puts every tensor on a multiple of its element size. The
 * header lists the tensors in declaration order.
 *
 * Because the file order differs from declaration order, after
 * m3_st_writer_begin stream the tensors' bytes with m3_st_writer_write
 * (any number of calls per tensor) in the order m3_st_writer_order gives:
 * for i = 0 .. m3_st_writer_count() - 1, the bytes of the tensor declared
 * m3_st_writer_order(w, i)-th. */
typedef struct m3_st_writer m3_st_writer;

m3_status m3_st_writer_create(const char *path, m3_st_writer **out);
m3_status m3_st_writer_add(m3_st_writer *w, const char *name, m3_dtype dtype, int ndim,
                           const int64_t *shape);
m3_status m3_st_writer_begin(m3_st_writer *w);
m3_status m3_st_writer_write(m3_st_writer *w, const void *bytes, size_t n);
/* Checks every declared byte was written, closes the file. Frees w. */
m3_status m3_st_writer_finish(m3_st_writer *w);
/* Frees w without finishing (on error paths); removes the partial file. */
void m3_st_writer_abort(m3_st_writer *w);
/* Bytes the data section will hold (valid after all adds). */
uint64_t m3_st_writer_data_bytes(const m3_st_writer *w);
/* Tensors declared so far. */
size_t m3_st_writer_count(const m3_st_writer *w);
/* After m3_st_writer_begin: the declaration index (0-based, order of the
 * m3_st_writer_add calls) of the i-th tensor to stream; -1 before begin or
 * when i >= m3_st_writer_count(w). */
int m3_st_writer_order(const m3_st_writer *w, size_t i);

#endif
