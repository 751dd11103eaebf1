/*
 * `m3 synth`: write a checkpoint in the released layout with deterministic
 * random weights, from a preset or a config.json, optionally cut to fewer
 * layers (dense layers stay first, as released); or, with --draft-for, a
 * DSpark drafter for an existing target checkpoint (docs/DSPARK.md).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

static void synth_usage(FILE *f) {
    fprintf(f, "usage: m3 synth (--preset NAME | --config FILE) --out DIR [--seed S] [--layers N]\n"
               "                [--mxfp8]\n"
               "       m3 synth --draft-for TARGET --out DIR [--seed S] [--layers N]\n"
               "                [--draft-block B] [--draft-window W] [--mxfp8]\n"
               "\n"
               "  --preset NAME   tiny, small, m3 or m3-tp4-rank\n"
               "  --config FILE   a config.json (flat or nested under text_config)\n"
               "  --out DIR       the checkpoint folder to write (created)\n"
               "  --seed S        weight seed (default 0)\n"
               "  --layers N      keep only the first N layers\n"
               "  --mxfp8         store linear weights as MXFP8 (e4m3 + 1x32 scales)\n"
               "  --draft-for T   a DSpark drafter for the checkpoint T (--layers: its draft\n"
               "                  layers, default 5)\n"
               "  --draft-block B draft rows a step (default 7)\n"
               "  --draft-window W  the drafter's sliding key window (default: none)\n");
}

static int synth_drafter(const char *target, const char *out, int64_t seed, int64_t layers,
                         int64_t block, int64_t window, bool mxfp8) {
    if (!out) {
        fprintf(stderr, "m3 synth: --draft-for needs --out\n");
        return CLI_USAGE;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", target);
    m3_config cfg;
    m3_status st = m3_config_load(path, &cfg);
    m3_synth_draft_opts d = {(int)layers, (int)block, window, mxfp8};
    m3_synth_opts so = {(uint64_t)seed, true, 0};
    if (!st)
        st = m3_synth_drafter(&cfg, out, &d, &so);
    if (st)
        return cli_report("synth", st);
    fprintf(stderr, "m3 synth: wrote the drafter %s for %s\n", out, target);
    return CLI_OK;
}

int cmd_synth(int argc, char **argv) {
    const char *preset = NULL, *config = NULL, *out = NULL, *target = NULL;
    int64_t seed = 0, layers = 0, block = 0, window = 0;
    bool mxfp8 = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            synth_usage(stdout);
            return CLI_OK;
        } else if (!strcmp(a, "--mxfp8")) {
            mxfp8 = true;
            continue;
        }
        if (!(v = cli_value(argc, argv, &i)))
            return CLI_USAGE;
        if (!strcmp(a, "--preset"))
            preset = v;
        else if (!strcmp(a, "--config"))
            config = v;
        else if (!strcmp(a, "--out"))
            out = v;
        else if (!strcmp(a, "--draft-for"))
            target = v;
        else if (!strcmp(a, "--draft-block")) {
            if (!cli_int(a, v, 1, 15, &block))
                return CLI_USAGE;
        } else if (!strcmp(a, "--draft-window")) {
            if (!cli_int(a, v, 1, (int64_t)1 << 32, &window))
                return CLI_USAGE;
        }
        else if (!strcmp(a, "--seed")) {
            if (!cli_int(a, v, 0, INT64_MAX, &seed))
                return CLI_USAGE;
        } else if (!strcmp(a, "--layers")) {
            if (!cli_int(a, v, 1, M3_MAX_LAYERS, &layers))
                return CLI_USAGE;
        } else {
            fprintf(stderr, "m3 synth: unknown option '%s'\n", a);
            synth_usage(stderr);
            return CLI_USAGE;
        }
    }
    if (target)
        return synth_drafter(target, out, seed, layers, block, window, mxfp8);
    if (block || window) {
        fprintf(stderr, "m3 synth: --draft-block and --draft-window need --draft-for\n");
        return CLI_USAGE;
    }
    if (!!preset == !!config || !out) {
        fprintf(stderr, "m3 synth: give exactly one of --preset or --config, and --out\n");
        synth_usage(stderr);
        return CLI_USAGE;
    }
    m3_config cfg;
    m3_status st = preset ? m3_preset(preset, &cfg) : m3_config_load(config, &cfg);
    if (!st && layers)
        st = m3_config_cut_layers(&cfg, (int)layers);
    if (st)
        return cli_report("synth", st);
    if (mxfp8)
        cfg.mxfp8 = true;
    m3_synth_opts so = {(uint64_t)seed, true, 0};
    st = m3_synth(&cfg, out, &so);
    if (st)
        return cli_report("synth", st);
    fprintf(stderr, "m3 synth: wrote %s (%d layers, hidden %d, vocab %d)\n", out, cfg.num_layers,
            cfg.hidden_size, cfg.vocab_size);
    return CLI_OK;
}
