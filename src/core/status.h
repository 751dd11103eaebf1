/*
 * Error reporting inside libm3. A failing function records a message in a
 * per-thread buffer with m3_fail() and returns the status; callers pass the
 * status up (M3_TRY) and may prepend context (m3_fail_context). The public
 * m3_last_error() reads the buffer. Nothing here exits or aborts.
 */
#ifndef M3_CORE_STATUS_H
#define M3_CORE_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#include "m3.h"

#if defined(__GNUC__)
#define M3_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define M3_PRINTF(a, b)
#endif

/* Record a message for status and return status. */
m3_status m3_fail(m3_status status, const char *fmt, ...) M3_PRINTF(2, 3);
/* Prepend "context: " to the current message; return status unchanged. */
m3_status m3_fail_context(m3_status status, const char *fmt, ...) M3_PRINTF(2, 3);
/* Forget the current message. */
void m3_clear_error(void);
/* Append one reason to the "; "-separated list in buf [cap] (cut to fit),
 * for refusals that name every reason at once. */
void m3_reasons_add(char *buf, size_t cap, const char *fmt, ...) M3_PRINTF(3, 4);
void m3_reasons_vadd(char *buf, size_t cap, const char *fmt, va_list ap);

#define M3_TRY(expr)                    \
    do {                                \
        m3_status m3_try_s_ = (expr);   \
        if (m3_try_s_ != M3_OK)         \
            return m3_try_s_;           \
    } while (0)

/* Allocation that reports failure with the size asked for. */
void *m3_malloc(size_t bytes, const char *what);
void *m3_calloc(size_t n, size_t size, const char *what);
/* A copy of the string s (NULL with the error set when out of memory). */
char *m3_strdup(const char *s, const char *what);

#endif
