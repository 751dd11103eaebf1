/*
 * Cached preset models: `m3 generate` without --model runs the `tiny`
 * preset and `m3 bench --preset NAME` a preset cut to a few layers, each
 * synthesized (seed 0) on first use into a cache folder: $M3_CACHE_DIR,
 * else $XDG_CACHE_HOME/m3, else ~/.cache/m3, else /tmp/m3-cache. A model is
 * written into a temporary folder and renamed into place, so a half-written
 * model is never picked up and concurrent first runs do not collide.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/status.h"

/* bump when a preset or the synth's values change */
#define PRESET_VERSION "v1"

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

/* Remove a (temporary) checkpoint folder: its files, then the folder. */
static void remove_tree(const char *dir) {
    char path[4400];
    DIR *d = opendir(dir);
    struct dirent *ent;
    while (d && (ent = readdir(d)))
        if (strcmp(ent->d_name, ".") && strcmp(ent->d_name, "..")) {
            snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
            remove(path);
        }
    if (d)
        closedir(d);
    rmdir(dir);
}

m3_status cli_cached_preset(const char *preset, int layers, char *dir, size_t cap) {
    char root[4096], name[256], tmp[4400], cfg_path[4300];
    cache_root(root, sizeof root);
    if (layers > 0)
        snprintf(name, sizeof name, "%s-L%d-%s-seed0", preset, layers, PRESET_VERSION);
    else
        snprintf(name, sizeof name, "%s-%s-seed0", preset, PRESET_VERSION);
    snprintf(dir, cap, "%s/%s", root, name);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    if (access(cfg_path, R_OK) == 0)
        return M3_OK;
    m3_config cfg;
    M3_TRY(m3_preset(preset, &cfg));
    if (layers > 0)
        M3_TRY(m3_config_cut_layers(&cfg, layers));
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%ld", root, name, (long)getpid());
    fprintf(stderr, "m3: synthesizing the %s model into %s\n", preset, dir);
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
        return m3_fail(M3_ERR_IO, "cannot move the %s model into %s: %s", preset, dir,
                       strerror(err));
    }
    return M3_OK;
}

m3_status cli_builtin_tiny(char *dir, size_t cap) { return cli_cached_preset("tiny", 0, dir, cap); }
