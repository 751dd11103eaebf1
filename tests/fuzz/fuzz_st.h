/*
 * What every entry of a safetensors set the reader accepted must satisfy
 * (formats/safetensors.h's promises), for the targets that open files
 * (fuzz_safetensors, fuzz_st_index).
 */
#ifndef M3_TESTS_FUZZ_ST_H
#define M3_TESTS_FUZZ_ST_H

#include "formats/safetensors.h"
#include "fuzz.h"

static inline void fuzz_check_st_entry(const m3_st_set *set, const m3_st_entry *e) {
    if (!e->name) /* "" is a name the format allows (and no model asks for) */
        fuzz_fail("an entry without a name");
    if (m3_st_find(set, e->name) != e)
        fuzz_fail("'%s' is not found by its name", e->name);
    if (e->ndim < 0 || e->ndim > M3_ST_MAX_DIMS)
        fuzz_fail("'%s': ndim %d", e->name, e->ndim);
    unsigned __int128 elems = 1;
    for (int d = 0; d < e->ndim; d++) {
        if (e->shape[d] < 0)
            fuzz_fail("'%s': negative dim %lld", e->name, (long long)e->shape[d]);
        elems *= (unsigned __int128)e->shape[d];
    }
    if (e->dtype != M3_DT_NONE) {
        size_t el = m3_dtype_size(e->dtype);
        if (elems * el != e->bytes)
            fuzz_fail("'%s': %zu bytes for its shape", e->name, e->bytes);
        if (e->bytes && ((uintptr_t)e->data % el) != 0)
            fuzz_fail("'%s': data not aligned to %zu", e->name, el);
    }
    if (e->bytes) {
        const volatile uint8_t *p = e->data;
        uint8_t sink = p[0] ^ p[e->bytes - 1];
        (void)sink;
    }
}

/* Every entry of an accepted set checked, then the set closed. */
static inline void fuzz_check_st_set(m3_st_set *set) {
    for (size_t i = 0; i < m3_st_count(set); i++)
        fuzz_check_st_entry(set, m3_st_at(set, i));
    m3_st_close(set);
}

#endif /* M3_TESTS_FUZZ_ST_H */
