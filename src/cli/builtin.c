/*
 * The built-in model: `m3 generate` without --model runs the `tiny` preset,
 * synthesized (seed 0) on first use into a cache folder: $M3_CACHE_DIR, else
 * $XDG_CACHE_HOME/m3, else ~/.cache/m3, else /tmp/m3-cache. It is written
 * into a temporary folder and renamed into place, so a half-written model
 * is never picked up and concurrent first runs do not collide.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/status.h"

/* bump when the tiny preset or the synth's values change */
#define TINY_VERSION "tiny-v1-seed0"

static void cache_root(char *buf, size_t cap) {
    const char *env = getenv("M3_CACHE_DIR");
    if (env && *env) {
        snprintf(buf, cap, "%s", env);
        return;
    }
    env = getenv("XDG_CACHE_HOME");
    if (env && *env) {
        snprintf(buf, cap, "%s/m3", env);
        return;
    }
    env = getenv("HOME");
    if (env && *env)
        snprintf(buf, cap, "%s/.cache/m3", env);
    else
        snprintf(buf, cap, "/tmp/m3-cache");
}

static void remove_tree(const char *dir) {
    char path[4200];
    const char *files[] = {"config.json", "model.safetensors", "model.safetensors.tmp",
                           "config.json.tmp"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        remove(path);
    }
    rmdir(dir);
}

m3_status cli_builtin_tiny(char *dir, size_t cap) {
    char root[4096], tmp[4200], cfg_path[4300];
    cache_root(root, sizeof root);
    snprintf(dir, cap, "%s/%s", root, TINY_VERSION);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    if (access(cfg_path, R_OK) == 0)
        return M3_OK;
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%ld", root, TINY_VERSION, (long)getpid());
    m3_config cfg;
    M3_TRY(m3_preset("tiny", &cfg));
    fprintf(stderr, "m3: synthesizing the built-in tiny model into %s\n", dir);
    m3_synth_opts so = {0, true, 0};
    m3_status st = m3_synth(&cfg, tmp, &so);
    if (st) {
        remove_tree(tmp);
        return st;
    }
    if (rename(tmp, dir) != 0) {
        int err = errno;
        remove_tree(tmp);
        /* another process may have won the race: fine if its model is there */
        if (access(cfg_path, R_OK) == 0)
            return M3_OK;
        return m3_fail(M3_ERR_IO, "cannot move the tiny model into %s: %s", dir, strerror(err));
    }
    return M3_OK;
}
