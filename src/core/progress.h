/*
 * Progress lines for long work (synthesizing or loading large checkpoints):
 * a single updating line on stderr, at most a few times a second, and only
 * when stderr is a terminal, so logs and pipes stay clean.
 */
#ifndef M3_CORE_PROGRESS_H
#define M3_CORE_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>

typedef struct m3_progress {
    const char *what;
    int64_t total, done;
    bool on;
    double start_s, last_s;
} m3_progress;

/* Monotonic seconds. */
double m3_now_seconds(void);

/* enabled: the caller wants progress; it shows only on a terminal. */
void m3_progress_begin(m3_progress *p, const char *what, int64_t total_bytes, bool enabled);
void m3_progress_add(m3_progress *p, int64_t bytes);
void m3_progress_end(m3_progress *p);

#endif
