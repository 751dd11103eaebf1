/*
 * model.safetensors.index.json beside two fixed, valid shards
 * (model-00001-of-00002.safetensors holds a.weight, -00002- b.bias). The
 * reader promises that an index it accepts names only files in the folder
 * (plain names, no paths), maps every tensor to the file that holds it, and
 * that no name appears twice across shards. Properties: a refusal has a
 * message; an accepted set's entries keep fuzz_st.h's promises.
 */
#include "fuzz_st.h"

static void write_shard(const char *dir, const char *file, const char *name, const char *dtype,
                        const void *data, size_t bytes, const char *shape) {
    char header[256], path[700];
    int n = snprintf(header, sizeof header,
                     "{\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[0,%zu]}}", name,
                     dtype, shape, bytes);
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)((uint64_t)n >> (8 * i));
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(len, 1, 8, f) != 8 || fwrite(header, 1, (size_t)n, f) != (size_t)n ||
        fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
        perror(path);
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
    write_shard(dir, "model-00001-of-00002.safetensors", "a.weight", "BF16", w, sizeof w,
                "[2,4]");
    write_shard(dir, "model-00002-of-00002.safetensors", "b.bias", "F32", b, sizeof b, "[4]");
    return dir;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *dir = shard_dir();
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    fuzz_write(path, data, size, NULL, 0);
    m3_st_set *set = NULL;
    m3_status st = m3_st_open_dir(dir, false, &set);
    fuzz_check_refusal(st, "m3_st_open_dir");
    if (st != M3_OK)
        return 0;
    fuzz_check_st_set(set);
    return 0;
}
