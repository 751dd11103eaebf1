/*
 * Shared pieces of the fuzz targets (tests/fuzz/fuzz_*.c). Each target is
 * one LLVMFuzzerTestOneInput over one of the library's parsers of untrusted
 * input (config.json, a safetensors file, a shard index, a checkpoint's
 * tensors), with the properties it must keep: refuse with a message, or
 * accept something the rest of the engine can use. The same target links
 * either with libFuzzer (clang, scripts/fuzz: a fuzzing run) or with
 * replay.c (any compiler: ctest replays the checked-in corpus in both
 * builds, so every input that once broke a parser stays a test).
 *
 * A broken property is a crash here on purpose (fuzz_fail: message, then
 * abort), since that is what both drivers report with the input.
 */
#ifndef M3_TESTS_FUZZ_H
#define M3_TESTS_FUZZ_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "m3.h"
#include "model/config_json.h"
#include "scratch_dir.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static inline void fuzz_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz property broken: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

/* The input read as a stream of choices (the targets whose bytes pick
 * shapes and calls rather than being parsed): each take is the next byte,
 * 0 once the input runs out, so every input is a complete program. */
typedef struct {
    const uint8_t *p;
    size_t n;
} fuzz_bytes;

static inline unsigned fuzz_take(fuzz_bytes *s) {
    if (!s->n)
        return 0;
    s->n--;
    return *s->p++;
}

/* A refusal must say what is wrong. With M3_FUZZ_VERBOSE set, every
 * outcome is printed (to see what a corpus exercises). */
static inline void fuzz_check_refusal(m3_status st, const char *what) {
    const char *msg = m3_last_error();
    if (getenv("M3_FUZZ_VERBOSE"))
        fprintf(stderr, "  %s: %s%s%s\n", what, st == M3_OK ? "accepted" : m3_status_name(st),
                st == M3_OK ? "" : ": ", st == M3_OK ? "" : msg);
    if (st != M3_OK && (!msg || !msg[0]))
        fuzz_fail("%s failed (%s) without a message", what, m3_status_name(st));
}

/* A scratch folder for this process, made once and removed at exit. */
static char fuzz_dir_[512];
static inline void fuzz_rm_dir_(void) {
    if (fuzz_dir_[0])
        check_remove_dir(fuzz_dir_);
}
static inline const char *fuzz_dir(void) {
    if (fuzz_dir_[0])
        return fuzz_dir_;
    const char *tmp = getenv("TMPDIR");
    snprintf(fuzz_dir_, sizeof fuzz_dir_, "%s/m3_fuzz_XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(fuzz_dir_)) {
        perror("fuzz: mkdtemp");
        exit(2);
    }
    atexit(fuzz_rm_dir_);
    return fuzz_dir_;
}

/* A whole file from parts written one after the other; exits on an I/O
 * error (the harness's own failure, not a finding). */
typedef struct {
    const void *p;
    size_t n;
} fuzz_part;

static inline void fuzz_write(const char *path, const fuzz_part *parts, int n_parts) {
    FILE *f = fopen(path, "wb");
    bool ok = f != NULL;
    for (int i = 0; ok && i < n_parts; i++)
        ok = !parts[i].n || fwrite(parts[i].p, 1, parts[i].n, f) == parts[i].n;
    if (f && fclose(f) != 0)
        ok = false;
    if (!ok) {
        perror(path);
        exit(2);
    }
}

/* A whole file into memory (the library's reader); exits on an error. */
static inline uint8_t *fuzz_read(const char *path, size_t *n) {
    char *buf = NULL;
    if (m3_read_text_file(path, (size_t)1 << 32, &buf, n) != M3_OK) {
        fprintf(stderr, "fuzz: %s\n", m3_last_error());
        exit(2);
    }
    return (uint8_t *)buf;
}

#endif /* M3_TESTS_FUZZ_H */
