/*
 * The per-thread error message behind m3_last_error(), and allocation
 * helpers that record what failed to allocate.
 */
#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define M3_ERROR_CAP 1024

static _Thread_local char error_msg[M3_ERROR_CAP];

const char *m3_status_name(m3_status status) {
    switch (status) {
    case M3_OK: return "M3_OK";
    case M3_ERR_INVALID_ARG: return "M3_ERR_INVALID_ARG";
    case M3_ERR_IO: return "M3_ERR_IO";
    case M3_ERR_FORMAT: return "M3_ERR_FORMAT";
    case M3_ERR_CONFIG: return "M3_ERR_CONFIG";
    case M3_ERR_UNSUPPORTED: return "M3_ERR_UNSUPPORTED";
    case M3_ERR_NO_MEMORY: return "M3_ERR_NO_MEMORY";
    case M3_ERR_OUT_OF_PAGES: return "M3_ERR_OUT_OF_PAGES";
    case M3_ERR_DEVICE: return "M3_ERR_DEVICE";
    case M3_ERR_FAULT: return "M3_ERR_FAULT";
    case M3_ERR_INTERNAL: return "M3_ERR_INTERNAL";
    }
    return "M3_ERR_UNKNOWN";
}

const char *m3_last_error(void) { return error_msg; }

void m3_clear_error(void) { error_msg[0] = '\0'; }

void m3_reasons_vadd(char *buf, size_t cap, const char *fmt, va_list ap) {
    size_t used = strnlen(buf, cap);
    if (used && used + 2 < cap) {
        memcpy(buf + used, "; ", 3);
        used += 2;
    }
    if (used + 1 < cap)
        vsnprintf(buf + used, cap - used, fmt, ap);
}

void m3_reasons_add(char *buf, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    m3_reasons_vadd(buf, cap, fmt, ap);
    va_end(ap);
}

m3_status m3_fail(m3_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_msg, sizeof error_msg, fmt, ap);
    va_end(ap);
    return status;
}

m3_status m3_fail_context(m3_status status, const char *fmt, ...) {
    char buf[M3_ERROR_CAP];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    size_t used = n < 0 ? 0 : (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
    /* "context: old message", cut to the buffer */
    const char sep[] = ": ";
    for (size_t i = 0; sep[i] && used + 1 < sizeof buf; i++)
        buf[used++] = sep[i];
    size_t old_len = strnlen(error_msg, sizeof error_msg);
    size_t room = sizeof buf - 1 - used;
    size_t take = old_len < room ? old_len : room;
    memcpy(buf + used, error_msg, take);
    buf[used + take] = '\0';
    memcpy(error_msg, buf, sizeof error_msg);
    return status;
}

void *m3_malloc(size_t bytes, const char *what) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        m3_fail(M3_ERR_NO_MEMORY, "out of memory allocating %zu bytes for %s", bytes, what);
    return p;
}

void *m3_calloc(size_t n, size_t size, const char *what) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        m3_fail(M3_ERR_NO_MEMORY, "out of memory allocating %zu x %zu bytes for %s", n, size,
                what);
    return p;
}

char *m3_strdup(const char *s, const char *what) {
    size_t n = strlen(s) + 1;
    char *p = m3_malloc(n, what);
    if (p)
        memcpy(p, s, n);
    return p;
}
