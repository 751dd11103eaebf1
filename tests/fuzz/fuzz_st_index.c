/*
 * model.safetensors.index.json beside two fixed, valid shards
 * (model-00001-of-00002.safetensors holds a.weight, -00002- b.bias). The
 * reader promises that an index it accepts names only files in the folder
 * (plain names, no paths), maps every tensor to the file that holds it, and
 * that no name appears twice across shards. Properties: a refusal has a
 * message; an accepted set's entries keep fuzz_st.h's promises.
 */
#include "fuzz_st.h"

/* One shard holding one tensor, through the library's writer. */
static void write_shard(const char *dir, const char *file, const char *name, m3_dtype dtype,
                        const void *data, size_t bytes, int64_t rows, int64_t cols) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    const int64_t shape[2] = {rows, cols};
    m3_st_writer *w = NULL;
    if (m3_st_writer_create(path, &w) || m3_st_writer_add(w, name, dtype, rows ? 2 : 1,
                                                          rows ? shape : shape + 1) ||
        m3_st_writer_begin(w) || m3_st_writer_write(w, data, bytes) ||
        m3_st_writer_finish(w)) {
        fprintf(stderr, "fuzz_st_index setup: %s\n", m3_last_error());
        exit(2);
    }
}

static const char *shard_dir(void) {
    static char dir[600];
    if (dir[0])
        return dir;
    snprintf(dir, sizeof dir, "%s/ckpt", fuzz_dir());
    if (mkdir(dir, 0700) != 0) {
        perror(dir);
        exit(2);
    }
    const uint16_t w[8] = {0x3f80, 0x4000, 0x4040, 0x4080, 0xbf80, 0xc000, 0x3f00, 0};
    const float b[4] = {1, 2, 3, 4};
    write_shard(dir, "model-00001-of-00002.safetensors", "a.weight", M3_DT_BF16, w, sizeof w, 2,
                4);
    write_shard(dir, "model-00002-of-00002.safetensors", "b.bias", M3_DT_F32, b, sizeof b, 0, 4);
    return dir;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *dir = shard_dir();
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    fuzz_write(path, &(fuzz_part){data, size}, 1);
    m3_st_set *set = NULL;
    m3_status st = m3_st_open_dir(dir, false, &set);
    fuzz_check_refusal(st, "m3_st_open_dir");
    if (st != M3_OK)
        return 0;
    fuzz_check_st_set(set);
    return 0;
}
