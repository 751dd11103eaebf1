/*
 * Removing a test's scratch folder (a synthesized model, a fuzz target's
 * files): shared by the unit tests' harness (check.h) and the fuzz targets
 * (tests/fuzz/fuzz.h), which do not use check.h's counters.
 */
#ifndef M3_TESTS_SCRATCH_DIR_H
#define M3_TESTS_SCRATCH_DIR_H

#include <stdio.h>
#include <stdlib.h>

/* Remove dir and everything in it; a failure is only reported. */
static inline void check_remove_dir(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

#endif
