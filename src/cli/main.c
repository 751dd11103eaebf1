/*
 * `m3`: the command-line program. Dispatches to the subcommands and holds
 * the argument helpers they share. Library errors are printed with their
 * message and the program exits non-zero; nothing here aborts.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: m3 <command> [options]\n"
            "\n"
            "commands:\n"
            "  synth     write a checkpoint with deterministic random weights\n"
            "  generate  generate tokens from a checkpoint (default: the built-in tiny model)\n"
            "  bench     time one layer's decode step against its memory floor (CUDA)\n"
            "\n"
            "Run 'm3 <command> --help' for a command's options.\n");
}

bool cli_int(const char *flag, const char *text, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end) {
        fprintf(stderr, "m3: %s expects an integer, got '%s'\n", flag, text);
        return false;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "m3: %s = %lld is out of range [%lld, %lld]\n", flag, v, (long long)lo,
                (long long)hi);
        return false;
    }
    *out = v;
    return true;
}

bool cli_float(const char *flag, const char *text, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end || !isfinite(v)) {
        fprintf(stderr, "m3: %s expects a number, got '%s'\n", flag, text);
        return false;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "m3: %s = %g is out of range [%g, %g]\n", flag, v, lo, hi);
        return false;
    }
    *out = v;
    return true;
}

const char *cli_value(int argc, char **argv, int *i) {
    if (*i + 1 >= argc) {
        fprintf(stderr, "m3: %s needs a value\n", argv[*i]);
        return NULL;
    }
    return argv[++*i];
}

int cli_report(const char *cmd, m3_status st) {
    fprintf(stderr, "m3 %s: %s: %s\n", cmd, m3_status_name(st), m3_last_error());
    return CLI_FAILED;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return CLI_USAGE;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return CLI_OK;
    }
    if (!strcmp(argv[1], "synth"))
        return cmd_synth(argc - 1, argv + 1);
    if (!strcmp(argv[1], "generate"))
        return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(argv[1], "bench"))
        return cmd_bench(argc - 1, argv + 1);
    fprintf(stderr, "m3: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return CLI_USAGE;
}
