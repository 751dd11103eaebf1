/*
 * Tests for formats/npy: the exact bytes of a small file (magic, version,
 * header text, 64-byte header, row data), that a row count with more digits
 * than the one written at open still fits the reserved header, and that a
 * bad path fails with M3_ERR_IO.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "formats/npy.h"

static uint8_t *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n + 1);
    *len = fread(buf, 1, (size_t)n, f);
    buf[*len] = 0;
    fclose(f);
    return buf;
}

/* Checks the preamble and returns the header length (magic included). */
static size_t check_preamble(const uint8_t *b, size_t len, const char *shape_text) {
    CHECK(len >= 10 && memcmp(b, "\x93NUMPY\x01\x00", 8) == 0);
    if (len < 10)
        return 0;
    size_t total = 10 + (size_t)(b[8] | b[9] << 8);
    CHECK(total % 64 == 0 && total <= len);
    if (total > len)
        return 0;
    CHECK(b[total - 1] == '\n');
    char header[256] = {0};
    memcpy(header, b + 10, total - 10 < 255 ? total - 10 : 255);
    CHECK(strstr(header, "{'descr': '<f4', 'fortran_order': False, 'shape': (") == header);
    CHECK(strstr(header, shape_text) != NULL);
    /* Everything between the dict and the final newline is padding. */
    const char *close = strchr(header, '}');
    for (const char *p = close ? close + 1 : header; close && p < header + total - 11; p++)
        CHECK(*p == ' ');
    return total;
}

static void test_three_rows(const char *path) {
    const float rows[3][5] = {
        {0.0f, 1.0f, -2.5f, 3.25f, 1e-3f},
        {4.0f, 5.0f, 6.0f, 7.0f, 8.0f},
        {-1.0f, -0.0f, 1e30f, -1e-30f, 0.5f},
    };
    m3_npy_writer *w = NULL;
    CHECK_OK(m3_npy_open(path, 5, &w));
    for (int i = 0; i < 3; i++)
        CHECK_OK(m3_npy_append_row(w, rows[i]));
    CHECK_OK(m3_npy_close(w));

    size_t len = 0;
    uint8_t *b = read_all(path, &len);
    CHECK(b != NULL);
    if (!b)
        return;
    size_t total = check_preamble(b, len, "'shape': (3, 5), }");
    CHECK(len == total + sizeof rows);
    if (len == total + sizeof rows)
        CHECK(memcmp(b + total, rows, sizeof rows) == 0);
    free(b);
}

/* 1000 rows: the count's text is longer than the "0" written at open. */
static void test_many_rows(const char *path) {
    enum { COLS = 3, ROWS = 1000 };
    m3_npy_writer *w = NULL;
    CHECK_OK(m3_npy_open(path, COLS, &w));
    for (int i = 0; i < ROWS; i++) {
        float row[COLS] = {(float)i, (float)-i, 0.5f * (float)i};
        CHECK_OK(m3_npy_append_row(w, row));
    }
    CHECK_OK(m3_npy_close(w));

    size_t len = 0;
    uint8_t *b = read_all(path, &len);
    if (!b) {
        CHECK(b != NULL);
        return;
    }
    size_t total = check_preamble(b, len, "'shape': (1000, 3), }");
    CHECK(len == total + sizeof(float) * COLS * ROWS);
    for (int i = 0; total && len == total + sizeof(float) * COLS * ROWS && i < ROWS; i += 111) {
        float row[COLS];
        memcpy(row, b + total + sizeof row * (size_t)i, sizeof row);
        CHECK(row[0] == (float)i && row[1] == (float)-i && row[2] == 0.5f * (float)i);
    }
    free(b);
}

static void test_empty_and_errors(const char *path) {
    m3_npy_writer *w = NULL;
    CHECK_OK(m3_npy_open(path, 7, &w));
    CHECK_OK(m3_npy_close(w));
    size_t len = 0;
    uint8_t *b = read_all(path, &len);
    if (b) {
        size_t total = check_preamble(b, len, "'shape': (0, 7), }");
        CHECK(len == total);
    }
    free(b);

    CHECK_FAILS(m3_npy_open("no_such_dir_npy/x.npy", 4, &w), M3_ERR_IO, "no_such_dir_npy/x.npy");
    CHECK_FAILS(m3_npy_open(path, 0, &w), M3_ERR_INVALID_ARG, "cols 0");
}

int main(void) {
    char path[64];
    snprintf(path, sizeof path, "npy_test_%ld.npy", (long)getpid());
    test_three_rows(path);
    test_many_rows(path);
    test_empty_and_errors(path);
    remove(path);
    return check_summary("test_npy");
}
