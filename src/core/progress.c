/*
 * Progress lines (see progress.h).
 */
#include "core/progress.h"

#include <stdio.h>
#include <time.h>
#include <unistd.h>

double m3_now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void show(const m3_progress *p, double now) {
    double secs = now - p->start_s;
    double gib = (double)p->done / (1 << 30), total = (double)p->total / (1 << 30);
    double rate = secs > 0 ? gib / secs : 0;
    fprintf(stderr, "\r%s: %.2f / %.2f GiB (%.0f%%, %.2f GiB/s)", p->what, gib, total,
            p->total ? 100.0 * (double)p->done / (double)p->total : 100.0, rate);
    fflush(stderr);
}

void m3_progress_begin(m3_progress *p, const char *what, int64_t total, bool enabled) {
    p->what = what;
    p->total = total;
    p->done = 0;
    p->on = enabled && isatty(2);
    p->start_s = p->last_s = m3_now_seconds();
}

void m3_progress_add(m3_progress *p, int64_t bytes) {
    p->done += bytes;
    if (!p->on)
        return;
    double now = m3_now_seconds();
    if (now - p->last_s >= 0.25) {
        p->last_s = now;
        show(p, now);
    }
}

void m3_progress_end(m3_progress *p) {
    if (!p->on)
        return;
    show(p, m3_now_seconds());
    fputc('\n', stderr);
    p->on = false;
}
