/*
 * A minimal test harness for the unit tests: CHECK records a failure with
 * file:line and keeps going; CHECK_OK also prints m3_last_error(). Each test
 * program returns check_summary() from main.
 */
#ifndef M3_TESTS_CHECK_H
#define M3_TESTS_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m3.h"
#include "scratch_dir.h"

static int check_failures_;
static int check_count_;

#define CHECK(cond)                                                          \
    do {                                                                     \
        check_count_++;                                                      \
        if (!(cond)) {                                                       \
            check_failures_++;                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                  \
        }                                                                    \
    } while (0)

#define CHECK_OK(expr)                                                          \
    do {                                                                        \
        check_count_++;                                                         \
        m3_status s_ = (expr);                                                  \
        if (s_ != M3_OK) {                                                      \
            check_failures_++;                                                  \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr, \
                    m3_status_name(s_), m3_last_error());                       \
        }                                                                       \
    } while (0)

/* expr must fail with status st and a message containing substr. */
#define CHECK_FAILS(expr, st, substr)                                           \
    do {                                                                        \
        check_count_++;                                                         \
        m3_status s_ = (expr);                                                  \
        if (s_ != (st) || !strstr(m3_last_error(), (substr))) {                 \
            check_failures_++;                                                  \
            fprintf(stderr, "%s:%d: %s -> %s \"%s\"; wanted %s with \"%s\"\n",  \
                    __FILE__, __LINE__, #expr, m3_status_name(s_),              \
                    m3_last_error(), m3_status_name(st), (substr));             \
        }                                                                       \
    } while (0)

static inline int check_summary(const char *name) {
    if (check_failures_)
        fprintf(stderr, "%s: %d of %d checks FAILED\n", name, check_failures_, check_count_);
    else
        printf("%s: all %d checks passed\n", name, check_count_);
    return check_failures_ ? 1 : 0;
}

#endif
