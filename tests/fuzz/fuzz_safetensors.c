/*
 * One safetensors file (header length, JSON header, data section). The
 * reader promises (formats/safetensors.h) that a file it accepts has every
 * tensor's bytes inside the mapping, a size equal to its shape times its
 * dtype's size, data aligned to the element size, no overlaps and no
 * repeated names. Properties: a refusal has a message; for an accepted
 * file every entry keeps those promises, is found by its name, and its
 * first and last bytes can be read (out of bounds would fault or trip the
 * sanitizer).
 */
#include "fuzz_st.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[600];
    snprintf(path, sizeof path, "%s/x.safetensors", fuzz_dir());
    fuzz_write(path, &(fuzz_part){data, size}, 1);
    m3_st_set *set = NULL;
    m3_status st = m3_st_open_file(path, &set);
    fuzz_check_refusal(st, "m3_st_open_file");
    if (st != M3_OK)
        return 0;
    fuzz_check_st_set(set);
    return 0;
}
