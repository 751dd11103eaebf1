/*
 * Shared by the GPU tests (tests/gpu/test_*.c): the skip rule for machines
 * without a usable CUDA device, the seeded generator, and the comparison of
 * a GPU result with the CPU reference (relative L2 error, largest absolute
 * error, element mismatches, NaN/inf that the reference does not have).
 * Header-only (static inline) so each test stays one translation unit.
 */
#ifndef M3_TESTS_GPU_COMMON_H
#define M3_TESTS_GPU_COMMON_H

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/backend.h"
#include "core/status.h"
#include "m3.h"

/* ctest's SKIP_RETURN_CODE for these tests */
#define GPU_TEST_SKIP 77

/* No usable device (none, no driver, not Hopper, a build without CUDA):
 * a skip. Any other failure to start the backend (a stream or cuBLAS that
 * will not initialise on a present GPU) is a failure, not a skip. */
static inline bool gpu_no_device(m3_status st) {
    return st == M3_ERR_UNSUPPORTED ||
           (st == M3_ERR_DEVICE && strstr(m3_last_error(), "no usable CUDA device"));
}

/* Probe GPU 0 with a throwaway backend. Returns 0 when it is usable; else
 * prints the skip line (exit code GPU_TEST_SKIP) or the failure (1) and
 * returns that exit code. */
static inline int gpu_probe(const char *test) {
    m3_backend *be = NULL;
    m3_status st = m3_cuda_backend_create(0, &be);
    if (!st) {
        be->ops->destroy(be);
        return 0;
    }
    if (gpu_no_device(st)) {
        printf("SKIP: no CUDA device: %s\n", m3_last_error());
        return GPU_TEST_SKIP;
    }
    fprintf(stderr, "%s: FAILED: creating the CUDA backend: %s: %s\n", test, m3_status_name(st),
            m3_last_error());
    return 1;
}

/* malloc that ends the test on failure (with at least one byte) */
static inline void *gpu_xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "GPU test: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* ------------------------------------------------------------ random */

/* splitmix64; seeded from M3_TEST_SEED when set */
static inline uint64_t gpu_rng_next(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t gpu_test_seed(uint64_t fallback) {
    const char *env = getenv("M3_TEST_SEED");
    return env ? strtoull(env, NULL, 0) : fallback;
}

/* ------------------------------------------------------------ comparing */

typedef struct gpu_cmp {
    int64_t n, mismatch, bad_special;
    double max_abs, rel_l2;
} gpu_cmp;

/* got against ref: mismatch counts values not equal (NaN equals NaN, +0
 * equals -0); bad_special counts NaN or inf on either side where the other
 * side differs (they never pass); max_abs and rel_l2 = |got - ref|_2 /
 * |ref|_2 over the pairs where both are finite. */
static inline gpu_cmp gpu_compare_f32(const float *got, const float *ref, int64_t n) {
    gpu_cmp c = {n, 0, 0, 0.0, 0.0};
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        float g = got[i], r = ref[i];
        bool same = g == r || (isnan(g) && isnan(r));
        c.mismatch += !same;
        if (!isfinite(g) || !isfinite(r)) {
            c.bad_special += !same;
            continue;
        }
        double e = fabs((double)g - (double)r);
        c.max_abs = e > c.max_abs ? e : c.max_abs;
        num += e * e;
        den += (double)r * (double)r;
    }
    c.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
    return c;
}

/* The lowest id of the largest non-NaN value; -1 when all are NaN (the
 * greedy sampling contract). */
static inline int32_t gpu_argmax(const float *l, int n) {
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (!isnan(l[i]) && (best < 0 || l[i] > l[best]))
            best = i;
    return best;
}

/* The gap between the largest and the second largest logit. */
static inline double gpu_top2_margin(const float *l, int V) {
    int a = gpu_argmax(l, V);
    double second = -INFINITY;
    for (int i = 0; i < V; i++)
        if (i != a && l[i] > second)
            second = l[i];
    return (double)l[a] - second;
}

/* ------------------------------------------------------------ generation */

/* Greedy tokens and, for each, the logits it was chosen from: tok [cap],
 * logits [cap, V], filled by m3_generate's on_token. */
typedef struct gpu_trace {
    int n, cap, V;
    int32_t *tok;
    float *logits;
} gpu_trace;

static inline bool gpu_trace_init(gpu_trace *t, int cap, int V) {
    *t = (gpu_trace){0, cap, V, malloc((size_t)cap * 4), malloc((size_t)cap * V * 4)};
    return t->tok && t->logits;
}

static inline void gpu_trace_free(gpu_trace *t) {
    free(t->tok);
    free(t->logits);
}

static inline int gpu_trace_token(void *user, int32_t token, const float *logits, int vocab) {
    gpu_trace *t = (gpu_trace *)user;
    if (t->n < t->cap) {
        t->tok[t->n] = token;
        memcpy(t->logits + (size_t)t->n * t->V, logits, (size_t)vocab * 4);
        t->n++;
    }
    return 0;
}

/* Greedy generation of t->cap tokens after the prompt, end-of-sequence
 * ignored, into t. */
static inline m3_status gpu_generate(m3_engine *e, const int32_t *prompt, int n_prompt,
                                     gpu_trace *t) {
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = t->cap;
    go.stop_at_eos = false;
    go.on_token = gpu_trace_token;
    go.user = t;
    m3_gen_result res;
    m3_status st = m3_generate(e, prompt, n_prompt, &go, &res);
    free(res.tokens);
    return st;
}

/* ------------------------------------------------------------ files, children */

/* Remove a folder of plain files (a synthesized checkpoint). */
static inline void gpu_remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        char path[1024];
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
                unlink(path);
            }
        closedir(d);
    }
    rmdir(dir);
}

/* Config cfg_in synthesized (seed) into a new folder dir [size] under
 * $TMPDIR (named after tag and name) and loaded: *model, its *cfg. On
 * failure the message says which step failed; dir is "" when no folder was
 * made. */
static inline m3_status gpu_synth_config(const m3_config *cfg_in, const char *name,
                                         const char *tag, uint64_t seed, char *dir, size_t size,
                                         m3_config *cfg, m3_model **model) {
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, size, "%s/m3_gpu_%s_%s_XXXXXX", tmp, tag, name);
    if (!mkdtemp(dir)) {
        dir[0] = 0;
        return m3_fail(M3_ERR_IO, "cannot create a folder under %s", tmp);
    }
    m3_synth_opts so = {seed, false, 0};
    *cfg = *cfg_in;
    m3_status st = m3_synth(cfg, dir, &so);
    if (!st)
        st = m3_model_load(dir, NULL, model);
    if (!st)
        *cfg = *m3_model_config(*model);
    return st;
}

/* Preset `preset` synthesized and loaded, as gpu_synth_config. */
static inline m3_status gpu_synth_model(const char *preset, const char *tag, uint64_t seed,
                                        char *dir, size_t size, m3_config *cfg,
                                        m3_model **model) {
    m3_config c;
    dir[0] = 0;
    M3_TRY(m3_preset(preset, &c));
    return gpu_synth_config(&c, preset, tag, seed, dir, size, cfg, model);
}

/* A child process: this test program again with argv (argv[0] its name),
 * stdout and stderr into out [size] (NUL-terminated), killed after
 * timeout_s (*hung). *status as waitpid gives it. Returns false when the
 * child could not be run at all. Used for faults that end the process. */
static inline bool gpu_run_child(char *const argv[], double timeout_s, char *out, size_t size,
                                 int *status, bool *hung) {
    char path[] = "/tmp/m3_gpu_child_XXXXXX";
    int fd = mkstemp(path);
    *status = 0;
    *hung = false;
    out[0] = 0;
    if (fd < 0)
        return false;
    fflush(stdout);
    fflush(stderr);
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    while (pid > 0 && waitpid(pid, status, WNOHANG) == 0) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec) >
            timeout_s) {
            kill(pid, SIGKILL);
            waitpid(pid, status, 0);
            *hung = true;
            break;
        }
        usleep(100000);
    }
    ssize_t got = pid > 0 ? pread(fd, out, size - 1, 0) : 0;
    out[got > 0 ? got : 0] = 0;
    close(fd);
    unlink(path);
    return pid > 0;
}

#endif
