/*
 * safetensors reading (see safetensors.h; the writer is safetensors_write.c).
 *
 * Reading maps each file read-only and validates its whole header before
 * any tensor is handed out, because a checkpoint is untrusted input: every
 * rule in the format (offsets inside the data section, sizes matching
 * shapes, no overlaps, no duplicate names) is checked and a failure names
 * the file, the tensor and the bad value. Entries of all files are merged
 * into one array sorted by name so lookups are a binary search and
 * duplicates across shards show up as neighbours.
 *
 */
#include "formats/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"

#define ST_MAX_HEADER ((uint64_t)100 << 20)
/* Larger JSON numbers are doubles that may not be the integer written. */
#define ST_MAX_EXACT 9007199254740992.0
#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"
#define ST_COPY_ALIGN 64

typedef struct st_file {
    char *path;
    void *map;
    size_t map_bytes;
    const uint8_t *data; /* the data section, after the header */
    uint64_t data_bytes;
} st_file;

struct m3_st_set {
    st_file *files;
    int nfiles;
    m3_st_entry *entries; /* sorted by name once the set is complete */
    size_t count, cap;
    void **copies; /* aligned copies of misaligned tensors */
    size_t ncopies, copies_cap;
};

/* A tensor under validation: its entry plus its byte range. */
typedef struct st_pending {
    m3_st_entry e;
    uint64_t begin, end;
} st_pending;

typedef struct st_dtype_info {
    const char *name;
    size_t size;
    m3_dtype dt;
} st_dtype_info;

static const st_dtype_info st_dtypes[] = {
    {"BOOL", 1, M3_DT_NONE},    {"U8", 1, M3_DT_U8},        {"I8", 1, M3_DT_NONE},
    {"F8_E5M2", 1, M3_DT_NONE}, {"F8_E4M3", 1, M3_DT_F8_E4M3}, {"F8_E8M0", 1, M3_DT_NONE},
    {"I16", 2, M3_DT_NONE},     {"U16", 2, M3_DT_NONE},     {"F16", 2, M3_DT_NONE},
    {"BF16", 2, M3_DT_BF16},    {"I32", 4, M3_DT_I32},      {"U32", 4, M3_DT_NONE},
    {"F32", 4, M3_DT_F32},      {"F64", 8, M3_DT_NONE},     {"I64", 8, M3_DT_I64},
    {"U64", 8, M3_DT_NONE},
};

static const st_dtype_info *st_find_dtype(const char *name) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(st_dtypes[i].name, name) == 0)
            return &st_dtypes[i];
    return NULL;
}

static char *st_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = m3_malloc(a + b + 2, "a file path");
    if (p) {
        memcpy(p, dir, a);
        p[a] = '/';
        memcpy(p + a + 1, name, b + 1);
    }
    return p;
}

/* The JSON text of v, shortened to fit buf, for error messages. */
static const char *st_json_text(const cJSON *v, char *buf, size_t cap) {
    char *s = v ? cJSON_PrintUnformatted(v) : NULL;
    snprintf(buf, cap, "%s", s ? s : "(missing)");
    cJSON_free(s);
    return buf;
}

/* A JSON number that is exactly a non-negative integer. */
static bool st_json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v))
        return false;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > ST_MAX_EXACT || floor(d) != d)
        return false;
    *out = (uint64_t)d;
    return true;
}

/* ---------------------------------------------------------------- header */

static m3_status st_parse_shape(const char *path, const char *name, const cJSON *shape,
                                const st_dtype_info *dt, m3_st_entry *e, uint64_t *bytes) {
    char text[96];
    if (!cJSON_IsArray(shape))
        return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': shape %s is not an array", path, name,
                       st_json_text(shape, text, sizeof text));
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > M3_ST_MAX_DIMS)
        return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': shape has %d dims, at most %d allowed",
                       path, name, ndim, M3_ST_MAX_DIMS);
    uint64_t count = 1;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape) {
        uint64_t n;
        if (!st_json_uint(d, &n))
            return m3_fail(M3_ERR_FORMAT,
                           "%s: tensor '%s': shape[%d] is %s, not a non-negative integer "
                           "below 2^53", path,
                           name, i, st_json_text(d, text, sizeof text));
        if (n != 0 && count > (uint64_t)INT64_MAX / n)
            return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': shape %s has too many elements",
                           path, name, st_json_text(shape, text, sizeof text));
        count *= n;
        e->shape[i++] = (int64_t)n;
    }
    if (count > UINT64_MAX / dt->size)
        return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': shape %s is too large in bytes", path,
                       name, st_json_text(shape, text, sizeof text));
    e->ndim = ndim;
    *bytes = count * dt->size;
    return M3_OK;
}

static m3_status st_parse_offsets(const st_file *f, const char *name, const cJSON *offs,
                                  uint64_t *begin, uint64_t *end) {
    char text[96];
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        !st_json_uint(cJSON_GetArrayItem(offs, 0), begin) ||
        !st_json_uint(cJSON_GetArrayItem(offs, 1), end))
        return m3_fail(M3_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets %s is not [begin, end] of non-negative "
                       "integers",
                       f->path, name, st_json_text(offs, text, sizeof text));
    if (*begin > *end || *end > f->data_bytes)
        return m3_fail(M3_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets [%llu, %llu] outside the data section "
                       "of %llu bytes",
                       f->path, name, (unsigned long long)*begin, (unsigned long long)*end,
                       (unsigned long long)f->data_bytes);
    return M3_OK;
}

/* Splits an entry object into its three keys; anything else is an error. */
static m3_status st_entry_keys(const char *path, const cJSON *item, const cJSON *keys[3]) {
    static const char *const names[3] = {"dtype", "shape", "data_offsets"};
    char text[96];
    if (!cJSON_IsObject(item))
        return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': entry %s is not an object", path,
                       item->string, st_json_text(item, text, sizeof text));
    keys[0] = keys[1] = keys[2] = NULL;
    const cJSON *k;
    cJSON_ArrayForEach(k, item) {
        int which = -1;
        for (int i = 0; i < 3; i++)
            if (strcmp(k->string, names[i]) == 0)
                which = i;
        if (which < 0)
            return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': unknown key '%s'", path,
                           item->string, k->string);
        if (keys[which])
            return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': key '%s' appears twice", path,
                           item->string, k->string);
        keys[which] = k;
    }
    for (int i = 0; i < 3; i++)
        if (!keys[i])
            return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': missing key '%s'", path,
                           item->string, names[i]);
    return M3_OK;
}

static m3_status st_parse_entry(const st_file *f, const cJSON *item, st_pending *p) {
    const char *name = item->string;
    const cJSON *keys[3] = {NULL, NULL, NULL};
    char text[96];
    M3_TRY(st_entry_keys(f->path, item, keys));
    const st_dtype_info *dt = cJSON_IsString(keys[0]) ? st_find_dtype(keys[0]->valuestring) : NULL;
    if (!dt)
        return m3_fail(M3_ERR_FORMAT, "%s: tensor '%s': unknown dtype %s", f->path, name,
                       st_json_text(keys[0], text, sizeof text));
    uint64_t bytes = 0;
    M3_TRY(st_parse_shape(f->path, name, keys[1], dt, &p->e, &bytes));
    M3_TRY(st_parse_offsets(f, name, keys[2], &p->begin, &p->end));
    if (p->end - p->begin != bytes)
        return m3_fail(M3_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets [%llu, %llu] span %llu bytes but shape %s "
                       "of %s needs %llu",
                       f->path, name, (unsigned long long)p->begin, (unsigned long long)p->end,
                       (unsigned long long)(p->end - p->begin),
                       st_json_text(keys[1], text, sizeof text), dt->name,
                       (unsigned long long)bytes);
    snprintf(p->e.dtype_name, sizeof p->e.dtype_name, "%s", dt->name);
    p->e.dtype = dt->dt;
    p->e.bytes = (size_t)bytes;
    p->e.data = f->data + p->begin;
    p->e.name = m3_strdup(name, "a tensor name");
    return p->e.name ? M3_OK : M3_ERR_NO_MEMORY;
}

static m3_status st_check_metadata(const char *path, const cJSON *meta) {
    char text[96];
    if (!cJSON_IsObject(meta))
        return m3_fail(M3_ERR_FORMAT, "%s: __metadata__ %s is not an object", path,
                       st_json_text(meta, text, sizeof text));
    const cJSON *v;
    cJSON_ArrayForEach(v, meta) {
        if (!cJSON_IsString(v))
            return m3_fail(M3_ERR_FORMAT, "%s: __metadata__ value '%s' is %s, not a string",
                           path, v->string, st_json_text(v, text, sizeof text));
    }
    return M3_OK;
}

/* Copies the header (NUL-terminated for cJSON's sake) and parses it. */
static m3_status st_parse_header_json(const st_file *f, uint64_t hlen, cJSON **out) {
    const char *src = (const char *)f->map + 8;
    if (memchr(src, '\0', (size_t)hlen))
        return m3_fail(M3_ERR_FORMAT, "%s: header contains a NUL byte", f->path);
    char *text = m3_malloc((size_t)hlen + 1, "a safetensors header");
    if (!text)
        return M3_ERR_NO_MEMORY;
    memcpy(text, src, (size_t)hlen);
    text[hlen] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, (size_t)hlen, &end, false);
    size_t at = end ? (size_t)(end - text) : 0;
    if (root)
        while (at < hlen && strchr(" \t\r\n", text[at]))
            at++;
    free(text);
    if (!root || at < hlen) {
        cJSON_Delete(root);
        return m3_fail(M3_ERR_FORMAT, "%s: header is not valid JSON (error near byte %zu of %llu)",
                       f->path, at, (unsigned long long)hlen);
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return m3_fail(M3_ERR_FORMAT, "%s: header is JSON but not an object", f->path);
    }
    *out = root;
    return M3_OK;
}

static void st_free_pending(st_pending *p, size_t n) {
    for (size_t i = 0; p && i < n; i++)
        free((char *)p[i].e.name);
    free(p);
}

/* Parses every tensor entry of a file's header into a fresh array. */
static m3_status st_parse_header(const st_file *f, uint64_t hlen, st_pending **out,
                                 size_t *count) {
    cJSON *root = NULL;
    M3_TRY(st_parse_header_json(f, hlen, &root));
    size_t cap = (size_t)cJSON_GetArraySize(root);
    st_pending *p = m3_calloc(cap, sizeof *p, "safetensors entries");
    m3_status s = p ? M3_OK : M3_ERR_NO_MEMORY;
    size_t n = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, root) {
        if (s != M3_OK)
            break;
        if (strcmp(item->string, "__metadata__") == 0)
            s = st_check_metadata(f->path, item);
        else if ((s = st_parse_entry(f, item, &p[n])) == M3_OK)
            n++;
        else
            free((char *)p[n].e.name);
    }
    cJSON_Delete(root);
    if (s != M3_OK) {
        st_free_pending(p, n);
        return s;
    }
    *out = p;
    *count = n;
    return M3_OK;
}

/* ---------------------------------------------------------------- checks */

static int st_cmp_begin(const void *a, const void *b) {
    const st_pending *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

static int st_cmp_pending_name(const void *a, const void *b) {
    return strcmp(((const st_pending *)a)->e.name, ((const st_pending *)b)->e.name);
}

static int st_cmp_entry_name(const void *a, const void *b) {
    return strcmp(((const m3_st_entry *)a)->name, ((const m3_st_entry *)b)->name);
}

/* Sorted by begin, a tensor overlaps an earlier one exactly when it starts
 * before the furthest end seen so far; empty tensors cover no bytes. */
static m3_status st_check_overlap(const char *path, st_pending *p, size_t n) {
    if (n > 1)
        qsort(p, n, sizeof *p, st_cmp_begin);
    const st_pending *furthest = NULL;
    for (size_t i = 0; i < n; i++) {
        if (p[i].begin == p[i].end)
            continue;
        if (furthest && p[i].begin < furthest->end)
            return m3_fail(M3_ERR_FORMAT,
                           "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", path,
                           furthest->e.name, (unsigned long long)furthest->begin,
                           (unsigned long long)furthest->end, p[i].e.name,
                           (unsigned long long)p[i].begin, (unsigned long long)p[i].end);
        if (!furthest || p[i].end > furthest->end)
            furthest = &p[i];
    }
    return M3_OK;
}

static m3_status st_check_names(const char *path, st_pending *p, size_t n) {
    if (n > 1)
        qsort(p, n, sizeof *p, st_cmp_pending_name);
    for (size_t i = 1; i < n; i++)
        if (strcmp(p[i - 1].e.name, p[i].e.name) == 0)
            return m3_fail(M3_ERR_FORMAT, "%s: duplicate tensor name '%s'", path, p[i].e.name);
    return M3_OK;
}

/* ---------------------------------------------------------------- the set */

static m3_status st_keep_copy(m3_st_set *set, void *copy) {
    if (set->ncopies == set->copies_cap) {
        size_t cap = set->copies_cap ? 2 * set->copies_cap : 16;
        void **grown = realloc(set->copies, cap * sizeof *grown);
        if (!grown)
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory growing the tensor copy list");
        set->copies = grown;
        set->copies_cap = cap;
    }
    set->copies[set->ncopies++] = copy;
    return M3_OK;
}

/* Gives e aligned data: the format lets a tensor start at any byte, but
 * kernels load whole elements. */
static m3_status st_align_entry(m3_st_set *set, m3_st_entry *e, size_t elem) {
    static const uint64_t empty_data;
    if ((uintptr_t)e->data % elem == 0)
        return M3_OK;
    if (e->bytes == 0) {
        e->data = &empty_data;
        return M3_OK;
    }
    size_t rounded = (e->bytes + ST_COPY_ALIGN - 1) / ST_COPY_ALIGN * ST_COPY_ALIGN;
    void *copy = aligned_alloc(ST_COPY_ALIGN, rounded);
    if (!copy)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory copying misaligned tensor '%s' (%zu bytes)",
                       e->name, e->bytes);
    memcpy(copy, e->data, e->bytes);
    if (st_keep_copy(set, copy) != M3_OK) {
        free(copy);
        return M3_ERR_NO_MEMORY;
    }
    e->data = copy;
    return M3_OK;
}

/* Moves validated entries into the set (taking their names). */
static m3_status st_take_pending(m3_st_set *set, int file, st_pending *p, size_t n) {
    if (set->count + n > set->cap) {
        size_t cap = set->cap ? set->cap : 64;
        while (cap < set->count + n)
            cap *= 2;
        m3_st_entry *grown = realloc(set->entries, cap * sizeof *grown);
        if (!grown)
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory growing the tensor list");
        set->entries = grown;
        set->cap = cap;
    }
    size_t i = 0;
    m3_status s = M3_OK;
    for (; i < n && s == M3_OK; i++) {
        p[i].e.file = file;
        s = st_align_entry(set, &p[i].e, st_find_dtype(p[i].e.dtype_name)->size);
        set->entries[set->count++] = p[i].e;
        p[i].e.name = NULL;
    }
    return s;
}

static m3_status st_map_file(st_file *f) {
    /* non-blocking, so a FIFO in the folder is refused below instead of
     * waiting forever for a writer */
    int fd = open(f->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return m3_fail(M3_ERR_IO, "cannot open %s: %s", f->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return m3_fail(M3_ERR_IO, "cannot stat %s: %s", f->path, strerror(err));
    }
    if (!S_ISREG(st.st_mode) || st.st_size < 8) {
        close(fd);
        return S_ISREG(st.st_mode)
                   ? m3_fail(M3_ERR_FORMAT, "%s: file is truncated (%lld bytes, need at least 8)",
                             f->path, (long long)st.st_size)
                   : m3_fail(M3_ERR_IO, "%s is not a regular file", f->path);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (map == MAP_FAILED)
        return m3_fail(M3_ERR_IO, "cannot mmap %s: %s", f->path, strerror(err));
    f->map = map;
    f->map_bytes = (size_t)st.st_size;
    return M3_OK;
}

static m3_status st_validate_and_take(m3_st_set *set, int index) {
    st_file *f = &set->files[index];
    const uint8_t *b = f->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | b[i];
    if (hlen > ST_MAX_HEADER)
        return m3_fail(M3_ERR_FORMAT, "%s: header length %llu is over the 100 MiB limit", f->path,
                       (unsigned long long)hlen);
    if (hlen > f->map_bytes - 8)
        return m3_fail(M3_ERR_FORMAT, "%s: header length %llu runs past the end of the file "
                       "(%zu bytes)", f->path, (unsigned long long)hlen, f->map_bytes);
    f->data = b + 8 + hlen;
    f->data_bytes = f->map_bytes - 8 - hlen;
    st_pending *p = NULL;
    size_t n = 0;
    M3_TRY(st_parse_header(f, hlen, &p, &n));
    m3_status s = st_check_overlap(f->path, p, n);
    if (s == M3_OK)
        s = st_check_names(f->path, p, n);
    if (s == M3_OK)
        s = st_take_pending(set, index, p, n);
    st_free_pending(p, n);
    return s;
}

/* Maps and validates one file, appending its tensors; takes path. */
static m3_status st_add_file(m3_st_set *set, char *path) {
    st_file *grown = realloc(set->files, (size_t)(set->nfiles + 1) * sizeof *grown);
    if (!grown) {
        free(path);
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory growing the file list");
    }
    set->files = grown;
    int index = set->nfiles++;
    st_file *f = &set->files[index];
    memset(f, 0, sizeof *f);
    f->path = path;
    M3_TRY(st_map_file(f));
    return st_validate_and_take(set, index);
}

/* Sorts all entries by name; a duplicate now can only span two files. */
static m3_status st_finish_set(m3_st_set *set) {
    if (set->count > 1) /* an empty set has no array to sort */
        qsort(set->entries, set->count, sizeof *set->entries, st_cmp_entry_name);
    for (size_t i = 1; i < set->count; i++) {
        const m3_st_entry *a = &set->entries[i - 1], *b = &set->entries[i];
        if (strcmp(a->name, b->name) == 0)
            return m3_fail(M3_ERR_FORMAT, "tensor '%s' appears in two shards: %s and %s", a->name,
                           set->files[a->file].path, set->files[b->file].path);
    }
    return M3_OK;
}

static m3_st_set *st_new_set(void) { return m3_calloc(1, sizeof(m3_st_set), "a safetensors set"); }

void m3_st_close(m3_st_set *set) {
    if (!set)
        return;
    for (int i = 0; i < set->nfiles; i++) {
        if (set->files[i].map)
            munmap(set->files[i].map, set->files[i].map_bytes);
        free(set->files[i].path);
    }
    for (size_t i = 0; i < set->count; i++)
        free((char *)set->entries[i].name);
    for (size_t i = 0; i < set->ncopies; i++)
        free(set->copies[i]);
    free(set->files);
    free(set->entries);
    free(set->copies);
    free(set);
}

m3_status m3_st_open_file(const char *path, m3_st_set **out) {
    if (!path || !out)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_open_file: NULL argument");
    *out = NULL;
    m3_st_set *set = st_new_set();
    char *copy = set ? m3_strdup(path, "a file path") : NULL;
    if (!copy) {
        free(set);
        return M3_ERR_NO_MEMORY;
    }
    m3_status s = st_add_file(set, copy);
    if (s == M3_OK)
        s = st_finish_set(set);
    if (s != M3_OK) {
        m3_st_close(set);
        return s;
    }
    *out = set;
    return M3_OK;
}

/* ---------------------------------------------------------------- index */

static m3_status st_read_text(const char *path, char **out, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return m3_fail(M3_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(fp), &st) != 0) {
        int err = errno;
        fclose(fp);
        return m3_fail(M3_ERR_IO, "cannot stat %s: %s", path, strerror(err));
    }
    if ((uint64_t)st.st_size > ST_MAX_HEADER) {
        fclose(fp);
        return m3_fail(M3_ERR_FORMAT, "%s is %lld bytes, over the 100 MiB limit", path,
                       (long long)st.st_size);
    }
    char *text = m3_malloc((size_t)st.st_size + 1, "an index file");
    size_t got = text ? fread(text, 1, (size_t)st.st_size, fp) : 0;
    bool bad = ferror(fp) || got != (size_t)st.st_size;
    fclose(fp);
    if (!text)
        return M3_ERR_NO_MEMORY;
    if (bad) {
        free(text);
        return m3_fail(M3_ERR_IO, "cannot read %s", path);
    }
    text[got] = '\0';
    *out = text;
    *len = got;
    return M3_OK;
}

/* A weight_map file name must stay inside the checkpoint folder. */
static bool st_plain_name(const char *name) {
    return name[0] && !strchr(name, '/') && strcmp(name, ".") != 0 && strcmp(name, "..") != 0;
}

static int st_cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Validates weight_map and lists its distinct file names, sorted. */
static m3_status st_index_files(const char *ipath, const cJSON *map, const char ***out,
                                int *count) {
    char text[96];
    if (!cJSON_IsObject(map) || !map->child)
        return m3_fail(M3_ERR_FORMAT, "%s: weight_map %s is not a non-empty object", ipath,
                       st_json_text(map, text, sizeof text));
    int n = cJSON_GetArraySize(map);
    const char **names = m3_calloc((size_t)n, sizeof *names, "index file names");
    if (!names)
        return M3_ERR_NO_MEMORY;
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, map) {
        if (!cJSON_IsString(v) || !st_plain_name(v->valuestring)) {
            free(names);
            return m3_fail(M3_ERR_FORMAT,
                           "%s: weight_map['%s'] = %s is not a plain file name in the folder",
                           ipath, v->string, st_json_text(v, text, sizeof text));
        }
        names[i++] = v->valuestring;
    }
    if (n > 1)
        qsort(names, (size_t)n, sizeof *names, st_cmp_str);
    int distinct = 0;
    for (i = 0; i < n; i++)
        if (distinct == 0 || strcmp(names[distinct - 1], names[i]) != 0)
            names[distinct++] = names[i];
    *out = names;
    *count = distinct;
    return M3_OK;
}

/* Every name weight_map lists must be in the file it names. */
static m3_status st_check_weight_map(const m3_st_set *set, const char *ipath, const char *dir,
                                     const cJSON *map) {
    const cJSON *v;
    cJSON_ArrayForEach(v, map) {
        const m3_st_entry *e = m3_st_find(set, v->string);
        char *want = st_join(dir, v->valuestring);
        if (!want)
            return M3_ERR_NO_MEMORY;
        bool ok = e && strcmp(set->files[e->file].path, want) == 0;
        free(want);
        if (!ok)
            return m3_fail(M3_ERR_FORMAT, "%s: weight_map names tensor '%s' in %s, which does "
                           "not hold it%s%s", ipath, v->string, v->valuestring,
                           e ? "; it is in " : "", e ? set->files[e->file].path : "");
    }
    return M3_OK;
}

static m3_status st_load_index(m3_st_set *set, const char *dir, const char *ipath,
                               bool progress) {
    char *text = NULL;
    size_t len = 0;
    M3_TRY(st_read_text(ipath, &text, &len));
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return m3_fail(M3_ERR_FORMAT, "%s: not a JSON object", ipath);
    }
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    const char **files = NULL;
    int nfiles = 0;
    m3_status s = st_index_files(ipath, map, &files, &nfiles);
    bool show = progress && isatty(2);
    for (int i = 0; s == M3_OK && i < nfiles; i++) {
        if (show)
            fprintf(stderr, "loading shard %d/%d: %s\n", i + 1, nfiles, files[i]);
        char *path = st_join(dir, files[i]);
        s = path ? st_add_file(set, path) : M3_ERR_NO_MEMORY;
        if (s != M3_OK)
            m3_fail_context(s, "%s lists %s", ipath, files[i]);
    }
    free(files);
    if (s == M3_OK)
        s = st_finish_set(set);
    if (s == M3_OK)
        s = st_check_weight_map(set, ipath, dir, map);
    cJSON_Delete(root);
    return s;
}

static bool st_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* The only *.safetensors file in dir, when there is no index and no
 * model.safetensors. */
static m3_status st_only_file(const char *dir, char **out) {
    DIR *d = opendir(dir);
    if (!d)
        return m3_fail(M3_ERR_IO, "cannot open checkpoint folder %s: %s", dir, strerror(errno));
    char found[2][256] = {{0}};
    int n = 0;
    const struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name), ext = strlen(".safetensors");
        if (len > ext && strcmp(de->d_name + len - ext, ".safetensors") == 0) {
            if (n < 2)
                snprintf(found[n], sizeof found[n], "%s", de->d_name);
            n++;
        }
    }
    closedir(d);
    if (n == 0)
        return m3_fail(M3_ERR_IO, "%s holds no %s, %s or other *.safetensors file", dir,
                       ST_INDEX_NAME, ST_SINGLE_NAME);
    if (n > 1)
        return m3_fail(M3_ERR_FORMAT, "%s holds %d *.safetensors files (%s, %s%s) but no %s to "
                       "say how they fit together", dir, n, found[0], found[1],
                       n > 2 ? ", ..." : "", ST_INDEX_NAME);
    *out = st_join(dir, found[0]);
    return *out ? M3_OK : M3_ERR_NO_MEMORY;
}

static m3_status st_open_dir_into(m3_st_set *set, const char *dir, bool progress) {
    char *path = st_join(dir, ST_INDEX_NAME);
    if (!path)
        return M3_ERR_NO_MEMORY;
    if (st_exists(path)) {
        m3_status s = st_load_index(set, dir, path, progress);
        free(path);
        return s;
    }
    free(path);
    path = st_join(dir, ST_SINGLE_NAME);
    if (!path)
        return M3_ERR_NO_MEMORY;
    if (!st_exists(path)) {
        free(path);
        M3_TRY(st_only_file(dir, &path));
    }
    M3_TRY(st_add_file(set, path));
    return st_finish_set(set);
}

m3_status m3_st_open_dir(const char *dir, bool progress, m3_st_set **out) {
    if (!dir || !out)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_st_open_dir: NULL argument");
    *out = NULL;
    m3_st_set *set = st_new_set();
    if (!set)
        return M3_ERR_NO_MEMORY;
    m3_status s = st_open_dir_into(set, dir, progress);
    if (s != M3_OK) {
        m3_st_close(set);
        return s;
    }
    *out = set;
    return M3_OK;
}

/* ---------------------------------------------------------------- lookup */

size_t m3_st_count(const m3_st_set *set) { return set ? set->count : 0; }

const m3_st_entry *m3_st_at(const m3_st_set *set, size_t i) {
    return set && i < set->count ? &set->entries[i] : NULL;
}

const m3_st_entry *m3_st_find(const m3_st_set *set, const char *name) {
    if (!set || !name)
        return NULL;
    size_t lo = 0, hi = set->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(set->entries[mid].name, name);
        if (c == 0)
            return &set->entries[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const char *m3_st_file_path(const m3_st_set *set, int file) {
    return set && file >= 0 && file < set->nfiles ? set->files[file].path : NULL;
}

m3_tensor m3_st_tensor(const m3_st_entry *e) {
    if (!e || e->ndim > M3_MAX_DIMS) {
        m3_tensor none = {0};
        none.name = e ? e->name : NULL;
        return none;
    }
    /* The mapping is read-only; m3_tensor has one pointer type for both. */
    m3_tensor t = m3_tensor_make(e->dtype, e->ndim, e->shape, (void *)(uintptr_t)e->data);
    t.name = e->name;
    return t;
}
