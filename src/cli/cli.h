/*
 * Shared pieces of the `m3` command-line program: argument parsing helpers
 * that turn bad values into clear messages, and the subcommands.
 */
#ifndef M3_CLI_CLI_H
#define M3_CLI_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "m3.h"

/* exit codes */
enum { CLI_OK = 0, CLI_FAILED = 1, CLI_USAGE = 2 };

/* Parse a whole integer / number in [lo, hi]; false (with a message on
 * stderr naming the flag) otherwise. */
bool cli_int(const char *flag, const char *text, int64_t lo, int64_t hi, int64_t *out);
bool cli_float(const char *flag, const char *text, double lo, double hi, double *out);
/* The value after a flag, or NULL with a message. */
const char *cli_value(int argc, char **argv, int *i);
/* Report a library failure: "m3 <cmd>: <status>: <message>". */
int cli_report(const char *cmd, m3_status st);

int cmd_synth(int argc, char **argv);
int cmd_generate(int argc, char **argv);

/* The folder of the built-in tiny model, synthesized on first use. */
m3_status cli_builtin_tiny(char *dir, size_t cap);
/* The folder of preset cut to layers (0: all), synthesized on first use. */
m3_status cli_cached_preset(const char *preset, int layers, char *dir, size_t cap);
int cmd_bench(int argc, char **argv);

#endif
