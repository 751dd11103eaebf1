/*
 * Tests for formats/safetensors: a writer -> reader round trip, the
 * writer's gap-free layout (what Hugging Face's library requires), sharded
 * checkpoints behind an index, the copy of misaligned tensors, how a folder
 * picks its files, and one hand-crafted bad file per validation rule (each
 * must fail with the right status and a message naming the problem).
 *
 * Hand-written JSON below uses ' for " to stay readable; the helpers that
 * write it to disk swap them back.
 */
#include <cjson/cJSON.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "core/status.h"
#include "formats/safetensors.h"

static char tmp_dir[] = "st_test_XXXXXX";
static const uint8_t zeros[4096];

/* Short-lived: the result is overwritten four calls later. */
static const char *in_tmp(const char *name) {
    static char buf[4][512];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", tmp_dir, name);
    return p;
}

static void write_bytes(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f)
        return;
    CHECK(fwrite(bytes, 1, n, f) == n);
    fclose(f);
}

static char *unquote(const char *text) {
    char *s = strdup(text);
    for (char *p = s; *p; p++)
        if (*p == '\'')
            *p = '"';
    return s;
}

static void write_text(const char *path, const char *text) {
    char *s = unquote(text);
    write_bytes(path, s, strlen(s));
    free(s);
}

/* A safetensors file with the given header length field, header and data. */
static void write_st_len(const char *path, uint64_t hlen, const char *header, const void *data,
                         size_t dlen) {
    char *h = unquote(header);
    size_t n = strlen(h);
    uint8_t *buf = malloc(8 + n + dlen);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(buf + 8, h, n);
    if (dlen)
        memcpy(buf + 8 + n, data, dlen);
    write_bytes(path, buf, 8 + n + dlen);
    free(buf);
    free(h);
}

static void write_st(const char *path, const char *header, const void *data, size_t dlen) {
    write_st_len(path, strlen(header), header, data, dlen);
}

#define EXPECT_BAD(header, dlen, status, substr)                                  \
    do {                                                                          \
        const char *bad_ = in_tmp("bad.safetensors");                             \
        write_st(bad_, header, zeros, dlen);                                      \
        m3_st_set *set_ = (m3_st_set *)1;                                         \
        CHECK_FAILS(m3_st_open_file(bad_, &set_), status, substr);                \
        CHECK(set_ == NULL);                                                      \
    } while (0)

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_tree(const char *dir) { nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* ---------------------------------------------------------------- round trip */

typedef struct spec {
    const char *name;
    m3_dtype dt;
    int ndim;
    int64_t shape[M3_ST_MAX_DIMS];
    size_t bytes;
} spec;

static const spec round_trip_specs[] = {
    {"layer.0.w", M3_DT_BF16, 2, {3, 5}, 30},
    {"layer.0.scale", M3_DT_U8, 2, {3, 1}, 3},
    {"empty", M3_DT_F32, 2, {0, 4}, 0},
    {"f8", M3_DT_F8_E4M3, 1, {7}, 7},
    {"ids", M3_DT_I64, 1, {3}, 24},
    {"scalar", M3_DT_F32, 0, {0}, 4},
    {"five_d", M3_DT_I32, 5, {1, 2, 1, 2, 1}, 16},
};
#define N_SPECS (sizeof round_trip_specs / sizeof round_trip_specs[0])

static void fill(uint8_t *buf, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)(seed * 31 + i * 7 + 1);
}

static void write_specs(const char *path, const spec *specs, size_t n) {
    m3_st_writer *w = NULL;
    CHECK_OK(m3_st_writer_create(path, &w));
    for (size_t i = 0; i < n; i++)
        CHECK_OK(m3_st_writer_add(w, specs[i].name, specs[i].dt, specs[i].ndim, specs[i].shape));
    CHECK(m3_st_writer_order(w, 0) == -1); /* not before begin */
    CHECK_OK(m3_st_writer_begin(w));
    CHECK(m3_st_writer_count(w) == n && m3_st_writer_order(w, n) == -1);
    /* The writer picks the file order; each declaration index comes once. */
    bool seen[16] = {false};
    CHECK(n <= 16);
    for (size_t k = 0; k < n; k++) {
        int i = m3_st_writer_order(w, k);
        CHECK(i >= 0 && (size_t)i < n && !seen[i]);
        if (i < 0 || (size_t)i >= n)
            continue;
        seen[i] = true;
        uint8_t buf[64];
        fill(buf, specs[i].bytes, (unsigned)i);
        /* Split each tensor over two calls: streaming is allowed. */
        size_t half = specs[i].bytes / 2;
        CHECK_OK(m3_st_writer_write(w, buf, half));
        CHECK_OK(m3_st_writer_write(w, buf + half, specs[i].bytes - half));
    }
    CHECK_OK(m3_st_writer_finish(w));
}

/* The header's text and the data section's size, read back by hand. */
static char *read_header(const char *path, uint64_t *data_bytes) {
    FILE *f = fopen(path, "rb");
    uint8_t len8[8];
    CHECK(f && fread(len8, 1, 8, f) == 8);
    if (!f)
        return NULL;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len8[i];
    CHECK((8 + hlen) % 64 == 0 && hlen < 4096);
    char *header = calloc(1, 4096 + 1);
    CHECK(hlen < 4096 && fread(header, 1, (size_t)hlen, f) == hlen);
    fseek(f, 0, SEEK_END);
    *data_bytes = (uint64_t)ftell(f) - 8 - hlen;
    fclose(f);
    return header;
}

static void check_header_layout(const char *path) {
    uint64_t data_bytes = 0;
    char *header = read_header(path, &data_bytes);
    if (!header)
        return;
    /* Declaration order is kept in the header. */
    const char *prev = header;
    for (size_t i = 0; i < N_SPECS; i++) {
        char key[64];
        snprintf(key, sizeof key, "\"%s\"", round_trip_specs[i].name);
        const char *at = strstr(header, key);
        CHECK(at != NULL && at > prev);
        prev = at ? at : prev;
    }
    free(header);
}

static void test_round_trip(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", in_tmp("rt.safetensors"));
    write_specs(path, round_trip_specs, N_SPECS);
    CHECK(access(in_tmp("rt.safetensors.tmp"), F_OK) != 0);
    check_header_layout(path);
    m3_st_set *set = NULL;
    CHECK_OK(m3_st_open_file(path, &set));
    if (!set)
        return;
    CHECK(m3_st_count(set) == N_SPECS);
    for (size_t i = 1; i < m3_st_count(set); i++)
        CHECK(strcmp(m3_st_at(set, i - 1)->name, m3_st_at(set, i)->name) < 0);
    for (size_t i = 0; i < N_SPECS; i++) {
        const spec *sp = &round_trip_specs[i];
        const m3_st_entry *e = m3_st_find(set, sp->name);
        CHECK(e != NULL);
        if (!e)
            continue;
        CHECK(strcmp(e->name, sp->name) == 0 && e->dtype == sp->dt && e->ndim == sp->ndim);
        CHECK(strcmp(e->dtype_name, m3_dtype_name(sp->dt)) == 0);
        for (int d = 0; d < sp->ndim; d++)
            CHECK(e->shape[d] == sp->shape[d]);
        uint8_t want[64];
        fill(want, sp->bytes, (unsigned)i);
        CHECK(e->bytes == sp->bytes && memcmp(e->data, want, sp->bytes) == 0);
        CHECK(sp->bytes == 0 || (uintptr_t)e->data % m3_dtype_size(sp->dt) == 0);
        CHECK(strcmp(m3_st_file_path(set, e->file), path) == 0);
    }
    m3_tensor t = m3_st_tensor(m3_st_find(set, "layer.0.w"));
    CHECK(t.dtype == M3_DT_BF16 && t.ndim == 2 && t.ne[0] == 3 && t.ne[1] == 5);
    CHECK(t.nb[1] == 2 && t.nb[0] == 10 && strcmp(t.name, "layer.0.w") == 0);
    m3_tensor five = m3_st_tensor(m3_st_find(set, "five_d"));
    CHECK(five.dtype == M3_DT_NONE);
    CHECK(m3_st_find(set, "absent") == NULL && m3_st_find(set, "") == NULL);
    m3_st_close(set);
}

/* An odd-sized U8 tensor between BF16 and F32 ones: written in declaration
 * order without gaps, the F32 after it would sit at an odd offset. */
static const spec gap_specs[] = {
    {"a.bf16", M3_DT_BF16, 1, {3}, 6},     {"odd.u8", M3_DT_U8, 1, {5}, 5},
    {"b.f32", M3_DT_F32, 1, {3}, 12},      {"c.bf16", M3_DT_BF16, 1, {1}, 2},
    {"d.u8", M3_DT_U8, 1, {1}, 1},         {"e.f32", M3_DT_F32, 2, {2, 1}, 8},
    {"empty.bf16", M3_DT_BF16, 1, {0}, 0}, {"f.i64", M3_DT_I64, 1, {1}, 8},
};
#define N_GAP (sizeof gap_specs / sizeof gap_specs[0])

typedef struct span {
    size_t spec;
    uint64_t begin, end;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static void test_no_gaps(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", in_tmp("gaps.safetensors"));
    write_specs(path, gap_specs, N_GAP);
    uint64_t data_bytes = 0;
    char *header = read_header(path, &data_bytes);
    cJSON *root = header ? cJSON_Parse(header) : NULL;
    CHECK(root != NULL);
    free(header);
    if (!root)
        return;

    /* What Hugging Face's library checks: sorted by offset, the tensors are
     * contiguous from 0 and the last ends at the end of the file. */
    span spans[N_GAP];
    for (size_t i = 0; i < N_GAP; i++) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, gap_specs[i].name);
        const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
        CHECK(cJSON_GetArraySize(offs) == 2);
        spans[i].spec = i;
        spans[i].begin = (uint64_t)cJSON_GetNumberValue(cJSON_GetArrayItem(offs, 0));
        spans[i].end = (uint64_t)cJSON_GetNumberValue(cJSON_GetArrayItem(offs, 1));
        CHECK(spans[i].end - spans[i].begin == gap_specs[i].bytes);
    }
    cJSON_Delete(root);
    qsort(spans, N_GAP, sizeof spans[0], cmp_span);
    uint64_t at = 0;
    for (size_t k = 0; k < N_GAP; k++) {
        const spec *sp = &gap_specs[spans[k].spec];
        CHECK(spans[k].begin == at);
        CHECK(spans[k].begin % m3_dtype_size(sp->dt) == 0);
        at = spans[k].end;
    }
    CHECK(at == data_bytes && data_bytes == 42);

    /* Largest element size first, declaration order among equal sizes. */
    const char *const file_order[N_GAP] = {"f.i64",  "b.f32",      "e.f32",  "a.bf16",
                                           "c.bf16", "empty.bf16", "odd.u8", "d.u8"};
    /* (The empty tensor shares its offset with the next; sorting by end
     * puts it first.) */
    for (size_t k = 0; k < N_GAP; k++)
        CHECK(strcmp(gap_specs[spans[k].spec].name, file_order[k]) == 0);

    /* Read back: every tensor is a view into the mapping (no aligned copy
     * was needed) at an address aligned to its element size. */
    m3_st_set *set = NULL;
    CHECK_OK(m3_st_open_file(path, &set));
    if (!set)
        return;
    const m3_st_entry *first = m3_st_find(set, gap_specs[spans[0].spec].name);
    CHECK(first && (uintptr_t)first->data % 64 == 0);
    for (size_t k = 0; first && k < N_GAP; k++) {
        size_t i = spans[k].spec;
        const m3_st_entry *e = m3_st_find(set, gap_specs[i].name);
        CHECK(e != NULL);
        if (!e || e->bytes == 0)
            continue;
        CHECK((uintptr_t)e->data % m3_dtype_size(gap_specs[i].dt) == 0);
        CHECK((const uint8_t *)e->data == (const uint8_t *)first->data + spans[k].begin);
        uint8_t want[64];
        fill(want, gap_specs[i].bytes, (unsigned)i);
        CHECK(e->bytes == gap_specs[i].bytes && memcmp(e->data, want, e->bytes) == 0);
    }
    m3_st_close(set);
}

static void test_writer_misuse(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", in_tmp("misuse.safetensors"));
    const int64_t shape[1] = {4};
    uint8_t buf[32] = {0};
    m3_st_writer *w = NULL;

    CHECK_OK(m3_st_writer_create(path, &w));
    CHECK_OK(m3_st_writer_add(w, "a", M3_DT_U8, 1, shape));
    CHECK_OK(m3_st_writer_add(w, "b", M3_DT_F32, 1, shape));
    CHECK(m3_st_writer_data_bytes(w) == 4 + 16 && m3_st_writer_count(w) == 2);
    CHECK_FAILS(m3_st_writer_write(w, buf, 1), M3_ERR_INVALID_ARG, "before m3_st_writer_begin");
    CHECK_OK(m3_st_writer_begin(w));
    CHECK_FAILS(m3_st_writer_add(w, "c", M3_DT_U8, 1, shape), M3_ERR_INVALID_ARG,
                "after the header");
    /* F32 'b' goes first, then U8 'a'. */
    CHECK(m3_st_writer_order(w, 0) == 1 && m3_st_writer_order(w, 1) == 0);
    CHECK_OK(m3_st_writer_write(w, buf, 16 + 3));
    CHECK_FAILS(m3_st_writer_write(w, buf, 2), M3_ERR_INVALID_ARG, "only 1 of the declared");
    CHECK(access(in_tmp("misuse.safetensors.tmp"), F_OK) == 0);
    CHECK_FAILS(m3_st_writer_finish(w), M3_ERR_INVALID_ARG, "tensor 'a' got 3 of 4 bytes");
    CHECK(access(path, F_OK) != 0);
    CHECK(access(in_tmp("misuse.safetensors.tmp"), F_OK) != 0);

    CHECK_OK(m3_st_writer_create(path, &w));
    CHECK_OK(m3_st_writer_add(w, "a", M3_DT_U8, 1, shape));
    CHECK_FAILS(m3_st_writer_add(w, "bad", M3_DT_NONE, 1, shape), M3_ERR_INVALID_ARG,
                "cannot be written");
    const int64_t negative[1] = {-2};
    CHECK_FAILS(m3_st_writer_add(w, "neg", M3_DT_U8, 1, negative), M3_ERR_INVALID_ARG,
                "shape[0] = -2");
    CHECK_OK(m3_st_writer_add(w, "a", M3_DT_U8, 1, shape));
    CHECK_FAILS(m3_st_writer_begin(w), M3_ERR_INVALID_ARG, "'a' declared twice");
    m3_st_writer_abort(w);
    CHECK(access(in_tmp("misuse.safetensors.tmp"), F_OK) != 0);

    CHECK_FAILS(m3_st_writer_create(in_tmp("no/such/dir.safetensors"), &w), M3_ERR_IO,
                "cannot create");
}

/* ---------------------------------------------------------------- shards */

static const spec shard1_specs[] = {{"x", M3_DT_BF16, 1, {4}, 8}, {"y", M3_DT_U8, 1, {3}, 3}};
static const spec shard2_specs[] = {{"z", M3_DT_I32, 1, {2}, 8}, {"extra", M3_DT_U8, 1, {1}, 1}};

static void write_shards(const char *dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    write_specs(path, shard1_specs, 2);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    write_specs(path, shard2_specs, 2);
}

static void write_index(const char *dir, const char *weight_map) {
    char path[512], text[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    snprintf(text, sizeof text, "{'metadata': {'total_size': 20}, 'weight_map': %s}", weight_map);
    write_text(path, text);
}

#define S1 "'model-00001-of-00002.safetensors'"
#define S2 "'model-00002-of-00002.safetensors'"

static void test_sharded(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s", in_tmp("sharded"));
    CHECK(mkdir(dir, 0700) == 0);
    write_shards(dir);
    write_index(dir, "{'x': " S1 ", 'y': " S1 ", 'z': " S2 "}");
    m3_st_set *set = NULL;
    CHECK_OK(m3_st_open_dir(dir, true, &set));
    if (!set)
        return;
    CHECK(m3_st_count(set) == 4);
    const m3_st_entry *x = m3_st_find(set, "x"), *z = m3_st_find(set, "z");
    const m3_st_entry *extra = m3_st_find(set, "extra");
    CHECK(x && z && extra && x->file != z->file && extra->file == z->file);
    if (x && z) {
        uint8_t want[8];
        fill(want, 8, 0);
        CHECK(memcmp(x->data, want, 8) == 0);
        CHECK(strstr(m3_st_file_path(set, z->file), "model-00002-of-00002") != NULL);
    }
    m3_st_close(set);

    write_index(dir, "{'x': " S1 ", 'y': " S1 ", 'z': 'missing.safetensors'}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_IO, "missing.safetensors");
    write_index(dir, "{'x': " S1 ", 'z': " S1 "}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT,
                "names tensor 'z' in model-00001-of-00002.safetensors, which does not hold it");
    write_index(dir, "{'nope': " S2 "}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "tensor 'nope'");
    write_index(dir, "{'x': '../sharded/model-00001-of-00002.safetensors'}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "not a plain file name");
    write_index(dir, "{'x': '..'}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "not a plain file name");
    write_index(dir, "{}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "weight_map");
    write_text(in_tmp("sharded/model.safetensors.index.json"), "[1]");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "not a JSON object");

    /* The same tensor in two shards. */
    const spec dup_specs[] = {shard1_specs[0], shard2_specs[0]};
    write_specs(in_tmp("sharded/model-00002-of-00002.safetensors"), dup_specs, 2);
    write_index(dir, "{'x': " S1 ", 'y': " S1 ", 'z': " S2 "}");
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "'x' appears in two shards");
    CHECK(set == NULL);
}

/* How a folder without an index picks its file. */
static void test_dir_choice(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s", in_tmp("choice"));
    CHECK(mkdir(dir, 0700) == 0);
    m3_st_set *set = NULL;
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_IO, "no model.safetensors.index.json");
    CHECK_FAILS(m3_st_open_dir(in_tmp("absent"), false, &set), M3_ERR_IO, "absent");

    write_specs(in_tmp("choice/only.safetensors"), shard1_specs, 2);
    CHECK_OK(m3_st_open_dir(dir, false, &set));
    CHECK(m3_st_count(set) == 2);
    m3_st_close(set);

    write_specs(in_tmp("choice/other.safetensors"), shard2_specs, 2);
    CHECK_FAILS(m3_st_open_dir(dir, false, &set), M3_ERR_FORMAT, "2 *.safetensors files");

    write_specs(in_tmp("choice/model.safetensors"), shard2_specs, 1);
    CHECK_OK(m3_st_open_dir(dir, false, &set));
    CHECK(m3_st_count(set) == 1 && m3_st_find(set, "z") != NULL);
    m3_st_close(set);
}

/* ---------------------------------------------------------------- alignment */

static void test_misaligned_copy(void) {
    /* 8 + 87 header bytes: the data section starts at an odd offset. */
    const char *header = "{'h':{'dtype':'BF16','shape':[3],'data_offsets':[0,6]},"
                         "'f':{'dtype':'F32','shape':[2],'data_offsets':[6,14]}}";
    CHECK((8 + strlen(header)) % 2 == 1);
    const uint16_t h[3] = {0x3f80, 0x4000, 0xc040};
    const float f[2] = {1.5f, -2.25f};
    uint8_t data[14];
    memcpy(data, h, 6);
    memcpy(data + 6, f, 8);
    const char *path = in_tmp("odd.safetensors");
    write_st(path, header, data, sizeof data);
    m3_st_set *set = NULL;
    CHECK_OK(m3_st_open_file(path, &set));
    if (!set)
        return;
    const m3_st_entry *eh = m3_st_find(set, "h"), *ef = m3_st_find(set, "f");
    CHECK(eh && ef);
    if (eh && ef) {
        CHECK((uintptr_t)eh->data % 2 == 0 && (uintptr_t)ef->data % 4 == 0);
        CHECK(memcmp(eh->data, h, 6) == 0 && memcmp(ef->data, f, 8) == 0);
        m3_tensor t = m3_st_tensor(ef);
        CHECK(t.dtype == M3_DT_F32 && ((const float *)t.data)[1] == -2.25f);
    }
    m3_st_close(set);
}

/* ---------------------------------------------------------------- bad files */

#define E(name, dt, shape, offs) "'" name "':{'dtype':'" dt "','shape':" shape ",'data_offsets':" offs "}"

static void test_bad_files(void) {
    m3_st_set *set = NULL;
    write_bytes(in_tmp("empty.safetensors"), "", 0);
    CHECK_FAILS(m3_st_open_file(in_tmp("empty.safetensors"), &set), M3_ERR_FORMAT, "truncated");
    write_bytes(in_tmp("short.safetensors"), "\x02\0\0\0{}", 6);
    CHECK_FAILS(m3_st_open_file(in_tmp("short.safetensors"), &set), M3_ERR_FORMAT, "truncated");
    CHECK_FAILS(m3_st_open_file(in_tmp("nonexistent.safetensors"), &set), M3_ERR_IO,
                "nonexistent.safetensors");
    write_st_len(in_tmp("long.safetensors"), 1000, "{}", NULL, 0);
    CHECK_FAILS(m3_st_open_file(in_tmp("long.safetensors"), &set), M3_ERR_FORMAT,
                "header length 1000 runs past the end");
    write_st_len(in_tmp("huge.safetensors"), (uint64_t)200 << 20, "{}", NULL, 0);
    CHECK_FAILS(m3_st_open_file(in_tmp("huge.safetensors"), &set), M3_ERR_FORMAT, "100 MiB");
    write_bytes(in_tmp("nul.safetensors"), "\x04\0\0\0\0\0\0\0{\0}\n", 12);
    CHECK_FAILS(m3_st_open_file(in_tmp("nul.safetensors"), &set), M3_ERR_FORMAT, "NUL byte");

    EXPECT_BAD("{not json", 0, M3_ERR_FORMAT, "not valid JSON");
    EXPECT_BAD("{} trailing", 0, M3_ERR_FORMAT, "not valid JSON");
    EXPECT_BAD("[1, 2]", 0, M3_ERR_FORMAT, "not an object");
    EXPECT_BAD("{'a': 5}", 0, M3_ERR_FORMAT, "tensor 'a': entry 5 is not an object");
    EXPECT_BAD("{'a':{'shape':[1],'data_offsets':[0,1]}}", 1, M3_ERR_FORMAT,
               "tensor 'a': missing key 'dtype'");
    EXPECT_BAD("{'a':{'dtype':'U8','data_offsets':[0,1]}}", 1, M3_ERR_FORMAT,
               "tensor 'a': missing key 'shape'");
    EXPECT_BAD("{'a':{'dtype':'U8','shape':[1]}}", 1, M3_ERR_FORMAT,
               "tensor 'a': missing key 'data_offsets'");
    EXPECT_BAD("{" E("a", "Q4", "[1]", "[0,1]") "}", 1, M3_ERR_FORMAT, "unknown dtype \"Q4\"");
    EXPECT_BAD("{" E("a", "U8", "[-1]", "[0,1]") "}", 1, M3_ERR_FORMAT, "shape[0] is -1");
    EXPECT_BAD("{" E("a", "U8", "[2,2.5]", "[0,5]") "}", 5, M3_ERR_FORMAT, "shape[1] is 2.5");
    EXPECT_BAD("{" E("a", "U8", "['2']", "[0,2]") "}", 2, M3_ERR_FORMAT, "shape[0] is \"2\"");
    EXPECT_BAD("{" E("a", "U8", "3", "[0,3]") "}", 3, M3_ERR_FORMAT, "shape 3 is not an array");
    EXPECT_BAD("{" E("a", "U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 1, M3_ERR_FORMAT,
               "shape has 9 dims");
    EXPECT_BAD("{" E("a", "U8", "[4294967296,4294967296]", "[0,1]") "}", 1, M3_ERR_FORMAT,
               "too many elements");
    EXPECT_BAD("{" E("a", "U8", "[4]", "[0,8]") "}", 4, M3_ERR_FORMAT,
               "data_offsets [0, 8] outside the data section of 4 bytes");
    EXPECT_BAD("{" E("a", "U8", "[0]", "[3,2]") "}", 4, M3_ERR_FORMAT, "outside the data section");
    EXPECT_BAD("{" E("a", "U8", "[4]", "[0]") "}", 4, M3_ERR_FORMAT, "not [begin, end]");
    EXPECT_BAD("{" E("a", "U8", "[4]", "[0,-4]") "}", 4, M3_ERR_FORMAT, "not [begin, end]");
    EXPECT_BAD("{" E("a", "BF16", "[3]", "[0,3]") "}", 4, M3_ERR_FORMAT,
               "span 3 bytes but shape [3] of BF16 needs 6");
    EXPECT_BAD("{" E("a", "F16", "[2]", "[0,2]") "}", 4, M3_ERR_FORMAT, "F16 needs 4");
    EXPECT_BAD("{" E("a", "U8", "[4]", "[0,4]") "," E("b", "U8", "[2]", "[3,5]") "}", 8,
               M3_ERR_FORMAT, "tensors 'a' [0, 4) and 'b' [3, 5) overlap");
    EXPECT_BAD("{" E("a", "U8", "[8]", "[0,8]") "," E("b", "U8", "[2]", "[4,6]") "}", 8,
               M3_ERR_FORMAT, "overlap");
    EXPECT_BAD("{" E("a", "U8", "[2]", "[0,2]") "," E("a", "U8", "[2]", "[2,4]") "}", 4,
               M3_ERR_FORMAT, "duplicate tensor name 'a'");
    EXPECT_BAD("{'a':{'dtype':'U8','shape':[1],'data_offsets':[0,1],'foo':1}}", 1, M3_ERR_FORMAT,
               "tensor 'a': unknown key 'foo'");
    EXPECT_BAD("{'a':{'dtype':'U8','dtype':'U8','shape':[1],'data_offsets':[0,1]}}", 1,
               M3_ERR_FORMAT, "key 'dtype' appears twice");
    EXPECT_BAD("{'__metadata__':{'format':3}}", 0, M3_ERR_FORMAT, "__metadata__ value 'format'");
    EXPECT_BAD("{'__metadata__':[]}", 0, M3_ERR_FORMAT, "__metadata__ [] is not an object");
}

/* Files that look odd but are valid. */
static void test_good_oddities(void) {
    const char *path = in_tmp("odd_ok.safetensors");
    write_st(path,
             "{'__metadata__':{'format':'pt'}," E("a", "U8", "[4]", "[0,4]") ","
             E("e", "F64", "[0,3]", "[2,2]") "," E("h", "F16", "[2,1,1,1,1]", "[4,8]") "}  \n",
             zeros, 16);
    m3_st_set *set = NULL;
    CHECK_OK(m3_st_open_file(path, &set));
    CHECK(m3_st_count(set) == 3);
    const m3_st_entry *h = m3_st_find(set, "h"), *e = m3_st_find(set, "e");
    CHECK(h && h->dtype == M3_DT_NONE && strcmp(h->dtype_name, "F16") == 0 && h->ndim == 5);
    CHECK(e && e->bytes == 0 && e->shape[0] == 0 && e->shape[1] == 3);
    CHECK(m3_st_tensor(h).dtype == M3_DT_NONE);
    m3_st_close(set);
}

int main(void) {
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_round_trip();
    test_no_gaps();
    test_writer_misuse();
    test_sharded();
    test_dir_choice();
    test_misaligned_copy();
    test_bad_files();
    test_good_oddities();
    remove_tree(tmp_dir);
    return check_summary("test_safetensors");
}
