/*
 * The op tests' harness (test_cuda_ops.c, test_cuda_rows.c; one
 * translation unit with each, like gpu_common.h: static functions only,
 * each program using some): seeded inputs, device buffers
 * tracked for release, outputs poisoned with NaN patterns and GUARD bytes
 * past their ends, the comparisons and the per-op summary, and the paged
 * step metadata the index and attention cases run on (the GPU's arrays in
 * device memory, decoys in host memory).
 */
#ifndef M3_TESTS_GPU_OPS_HARNESS_H
#define M3_TESTS_GPU_OPS_HARNESS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "cache/cache.h"
#include "core/bf16.h"
#include "core/tensor.h"
#include "decode/step.h"
#include "gpu_common.h"
#include "m3.h"

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

#define PAGE M3_PAGE_TOKENS
#define POISON 0x7fc17fc1u /* NaN as two bf16s and as one f32; no valid block id or token */
#define BF16_NAN 0x7fc0u
#define GUARD 4096         /* poisoned bytes past the end of every GPU output */
#define TOL_BF16 1e-2
#define TOL_F32 1e-5
#define EXACT 0.0

static m3_backend *g_cpu, *g_gpu;

/* ------------------------------------------------------------ random inputs */

static uint64_t g_rng;

static uint64_t rng_u64(void) { return gpu_rng_next(&g_rng); }
static double rng_unit(void) { return (double)(rng_u64() >> 11) * 0x1p-53; }
static int rng_below(int n) { return (int)(rng_u64() % (uint64_t)n); }
/* magnitude in [amp/16, amp), random sign: order one and never zero */
static float rng_val(float amp) {
    double m = (0.0625 + 0.9375 * rng_unit()) * amp;
    return (float)((rng_u64() & 1) ? -m : m);
}

/* ------------------------------------------------------------ memory */

/* Every buffer of a case is tracked and released by release_all() at its
 * end, so the cases stay short. */
#define MAX_TRACK 8192
static void *g_host_mem[MAX_TRACK], *g_dev_mem[MAX_TRACK];
static int g_n_host, g_n_dev;

static void die(const char *what) {
    fprintf(stderr, "test_cuda_ops: FATAL: %s: %s\n", what, m3_last_error());
    exit(1);
}

static void *halloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || g_n_host == MAX_TRACK) {
        fprintf(stderr, "test_cuda_ops: FATAL: out of host memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return g_host_mem[g_n_host++] = p;
}

static void fill_poison(void *p, size_t bytes) {
    const uint32_t w = POISON;
    for (size_t i = 0; i < bytes; i++)
        ((unsigned char *)p)[i] = ((const unsigned char *)&w)[i % 4];
}

static void *dalloc(size_t bytes) {
    void *p = NULL;
    if (g_gpu->ops->alloc(g_gpu, bytes, &p) || g_n_dev == MAX_TRACK)
        die("GPU allocation");
    return g_dev_mem[g_n_dev++] = p;
}

/* A GPU copy of host bytes (inputs). */
static void *dev_from(const void *host, size_t bytes) {
    void *d = dalloc(bytes);
    if (g_gpu->ops->upload(g_gpu, d, host, bytes))
        die("upload");
    return d;
}

/* A GPU buffer of bytes followed by GUARD bytes: init's bytes (or poison
 * when init is NULL), then poison. */
static void *dev_buf(const void *init, size_t bytes) {
    unsigned char *h = malloc(bytes + GUARD);
    if (!h)
        die("host staging");
    fill_poison(h, bytes + GUARD);
    if (init)
        memcpy(h, init, bytes);
    void *d = dev_from(h, bytes + GUARD);
    free(h);
    return d;
}

/* Download the bytes of a dev_buf; *guard_ok: the GUARD bytes past them
 * still hold the poison (nothing was written past the op's extent). */
static void *dev_fetch(const void *d, size_t bytes, bool *guard_ok) {
    unsigned char *h = halloc(bytes + GUARD);
    if (g_gpu->ops->download(g_gpu, h, d, bytes + GUARD))
        die("download");
    /* dev_buf laid the 4-byte poison word from offset 0 */
    const uint32_t w = POISON;
    *guard_ok = true;
    for (size_t i = bytes; i < bytes + GUARD; i++)
        *guard_ok &= h[i] == ((const unsigned char *)&w)[i % 4];
    return h;
}

static void release_all(void) {
    for (int i = 0; i < g_n_host; i++)
        free(g_host_mem[i]);
    for (int i = 0; i < g_n_dev; i++)
        g_gpu->ops->release(g_gpu, g_dev_mem[i]);
    g_n_host = g_n_dev = 0;
}

static uint16_t *rand_bf16(int64_t n, float amp) {
    uint16_t *p = halloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        p[i] = m3_f32_to_bf16(rng_val(amp));
    return p;
}

static void *hdup(const void *src, size_t bytes) { return memcpy(halloc(bytes), src, bytes); }

/* A GPU op, then a sync, so a fault in the kernel is reported here. */
static m3_status gpu_done(m3_status st) { return st ? st : g_gpu->ops->sync(g_gpu); }

static void cpu_must(m3_status st, const char *op) {
    if (st)
        die(op); /* the reference itself failed: nothing to compare with */
}

/* ------------------------------------------------------------ comparing */

typedef gpu_cmp cmp;

static cmp compare_bf16(const uint16_t *got, const uint16_t *ref, int64_t n) {
    float *g = malloc((size_t)n * 4 + 4), *r = malloc((size_t)n * 4 + 4);
    if (!g || !r)
        die("host memory");
    for (int64_t i = 0; i < n; i++) {
        g[i] = m3_bf16_to_f32(got[i]);
        r[i] = m3_bf16_to_f32(ref[i]);
    }
    cmp c = gpu_compare_f32(g, r, n);
    free(g);
    free(r);
    return c;
}

static cmp compare_i32(const int32_t *got, const int32_t *ref, int64_t n) {
    cmp c = {n, 0, 0, 0.0, 0.0};
    for (int64_t i = 0; i < n; i++)
        if (got[i] != ref[i]) {
            c.mismatch++;
            double e = fabs((double)got[i] - (double)ref[i]);
            c.max_abs = e > c.max_abs ? e : c.max_abs;
        }
    c.rel_l2 = c.mismatch ? 1.0 : 0.0;
    return c;
}

/* Copy the reference's rows into got for padded rows (negative slot):
 * their outputs are ignored by the caller, so they never fail a case. */
static void mask_padded(void *got, const void *ref, const m3_step *st, size_t row_bytes) {
    for (int t = 0; t < st->rows; t++)
        if (st->host.slots[t] < 0)
            memcpy((char *)got + t * row_bytes, (const char *)ref + t * row_bytes, row_bytes);
}

/* ------------------------------------------------------------ reporting */

typedef struct op_summary {
    const char *op;
    int cases, fails;
    double worst_rel, worst_abs;
    int64_t mismatches;
} op_summary;

static op_summary g_sum[32];
static int g_n_sum, g_cases, g_fails;

static op_summary *summary_of(const char *op) {
    for (int i = 0; i < g_n_sum; i++)
        if (!strcmp(g_sum[i].op, op))
            return &g_sum[i];
    op_summary *s = &g_sum[g_n_sum++];
    memset(s, 0, sizeof *s);
    s->op = op;
    return s;
}

static void count(const char *op, bool pass, const cmp *c) {
    op_summary *s = summary_of(op);
    s->cases++;
    s->fails += !pass;
    g_cases++;
    g_fails += !pass;
    if (c) {
        s->worst_rel = c->rel_l2 > s->worst_rel ? c->rel_l2 : s->worst_rel;
        s->worst_abs = c->max_abs > s->worst_abs ? c->max_abs : s->worst_abs;
        s->mismatches += c->mismatch;
    }
}

/* The verdict of one case. tol == EXACT: every element must be equal;
 * otherwise the relative L2 error must be within tol. extra_ok carries a
 * case's own checks (guard bytes, untouched gaps), explained by note. */
static bool report(const char *op, const char *shape, const cmp *c, double tol, bool extra_ok,
                   const char *note) {
    bool pass = c->bad_special == 0 && extra_ok &&
                (tol == EXACT ? c->mismatch == 0 : c->rel_l2 <= tol);
    char bound[32];
    if (tol == EXACT)
        snprintf(bound, sizeof bound, "exact");
    else
        snprintf(bound, sizeof bound, "<= %.0e", tol);
    printf("%-15s %-52s maxabs %-9.3g relL2 %-9.3g %-8s mism %lld/%lld %s%s%s\n", op, shape,
           c->max_abs, c->rel_l2, bound, (long long)c->mismatch, (long long)c->n,
           pass ? "PASS" : "FAIL",
           c->bad_special ? " (NaN/inf where the reference differs)" : "",
           !extra_ok && note ? note : "");
    count(op, pass, c);
    return pass;
}

/* A GPU op that returned an error. */
static void report_error(const char *op, const char *shape, m3_status st) {
    printf("%-15s %-52s FAIL: %s: %s\n", op, shape, m3_status_name(st), m3_last_error());
    count(op, false, NULL);
}

/* The verdict on a bf16 output of n values in a dev_buf: the op's error,
 * or its values against ref and its guard bytes. */
static void report_bf16_out(const char *op, const char *shape, m3_status st, const void *out,
                            const uint16_t *ref, int64_t n, double tol) {
    if (st) {
        report_error(op, shape, st);
        return;
    }
    bool guard;
    uint16_t *got = dev_fetch(out, (size_t)n * 2, &guard);
    cmp c = compare_bf16(got, ref, n);
    report(op, shape, &c, tol, guard, " (wrote past the end)");
}

/* ------------------------------------------------------------ step metadata */

/* A step for both backends: requests r with lens[r] tokens, the last ql[r]
 * of them this step's rows, then pad padded rows (slot -1). Blocks map to
 * pages of a shuffled pool, so block tables are not contiguous. The CPU
 * step has dev == host; the GPU step has dev in device memory and decoy
 * host arrays. */
typedef struct pstep {
    m3_step cpu, gpu;
} pstep;

static void step_alloc(m3_step_arrays *a, int rows, int n_reqs, int max_blocks) {
    a->tokens = halloc((size_t)rows * 4);
    a->positions = halloc((size_t)rows * 8);
    a->slots = halloc((size_t)rows * 8);
    a->row_req = halloc((size_t)rows * 4);
    a->seq_lens = halloc((size_t)n_reqs * 4);
    a->query_start = halloc((size_t)(n_reqs + 1) * 4);
    a->block_table = halloc((size_t)n_reqs * max_blocks * 4);
}

static void step_fill(m3_step *s, const int *lens, const int *ql, int n_pages) {
    m3_step_arrays *h = &s->host;
    int32_t *perm = halloc((size_t)n_pages * 4);
    for (int p = 0; p < n_pages; p++)
        perm[p] = p;
    for (int p = n_pages - 1; p > 0; p--) {
        int q = rng_below(p + 1);
        int32_t tmp = perm[p];
        perm[p] = perm[q], perm[q] = tmp;
    }
    int t = 0, next = 0;
    for (int r = 0; r < s->n_reqs; r++) {
        int nb = (lens[r] + PAGE - 1) / PAGE;
        for (int b = 0; b < s->max_blocks; b++)
            h->block_table[r * s->max_blocks + b] = b < nb ? perm[next++] : -1;
        h->seq_lens[r] = lens[r];
        h->query_start[r] = t;
        for (int i = 0; i < ql[r]; i++, t++) {
            int64_t p = lens[r] - ql[r] + i;
            h->tokens[t] = rng_below(1000);
            h->positions[t] = p;
            h->slots[t] = (int64_t)h->block_table[r * s->max_blocks + p / PAGE] * PAGE + p % PAGE;
            h->row_req[t] = r;
        }
        s->max_query_len = ql[r] > s->max_query_len ? ql[r] : s->max_query_len;
        if (ql[r] > 1 || ql[r] == lens[r])
            s->n_prefill++;
        else
            s->n_decode++;
    }
    h->query_start[s->n_reqs] = t;
    for (; t < s->rows; t++) {
        h->tokens[t] = 0, h->positions[t] = 0, h->slots[t] = -1, h->row_req[t] = 0;
    }
}

static void pstep_build(pstep *s, int n_reqs, const int *lens, const int *ql, int pad,
                        int max_blocks, int n_pages) {
    int rows = pad;
    for (int r = 0; r < n_reqs; r++)
        rows += ql[r];
    memset(s, 0, sizeof *s);
    m3_step *c = &s->cpu;
    c->rows = rows, c->n_reqs = n_reqs, c->max_blocks = max_blocks, c->n_pages = n_pages;
    c->graph_mode = M3_GRAPH_NONE;
    step_alloc(&c->host, rows, n_reqs, max_blocks);
    step_fill(c, lens, ql, n_pages);
    c->dev = c->host;
    s->gpu = *c;
    const m3_step_arrays *h = &c->host;
    m3_step_arrays *d = &s->gpu.dev, *decoy = &s->gpu.host;
    d->tokens = dev_from(h->tokens, (size_t)rows * 4);
    d->positions = dev_from(h->positions, (size_t)rows * 8);
    d->slots = dev_from(h->slots, (size_t)rows * 8);
    d->row_req = dev_from(h->row_req, (size_t)rows * 4);
    d->seq_lens = dev_from(h->seq_lens, (size_t)n_reqs * 4);
    d->query_start = dev_from(h->query_start, (size_t)(n_reqs + 1) * 4);
    d->block_table = dev_from(h->block_table, (size_t)n_reqs * max_blocks * 4);
    step_alloc(decoy, rows, n_reqs, max_blocks);
    for (int t = 0; t < rows; t++)
        decoy->tokens[t] = 0, decoy->positions[t] = 0, decoy->slots[t] = -1, decoy->row_req[t] = 0;
    for (int r = 0; r < n_reqs; r++)
        decoy->seq_lens[r] = 1, decoy->query_start[r] = 0;
    decoy->query_start[n_reqs] = 0;
    for (int i = 0; i < n_reqs * max_blocks; i++)
        decoy->block_table[i] = -1;
}

static int pages_for(int n_reqs, const int *lens, int spare) {
    int pages = spare;
    for (int r = 0; r < n_reqs; r++)
        pages += (lens[r] + PAGE - 1) / PAGE;
    return pages;
}

/* Element offset of (position pos of request r, head) in a [pages, heads,
 * 128, dim] cache. */
static int64_t cache_at(const m3_step *st, int r, int64_t pos, int heads, int head, int dim) {
    int64_t page = st->host.block_table[r * st->max_blocks + pos / PAGE];
    return ((page * heads + head) * PAGE + pos % PAGE) * dim;
}

/* NaN everywhere except the requests' tokens (random), so reading a slot
 * that a request does not own shows as NaN. */
static uint16_t *make_cache(const m3_step *st, int heads, int dim, float amp) {
    int64_t n = st->n_pages * heads * PAGE * dim;
    uint16_t *c = halloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        c[i] = BF16_NAN;
    for (int r = 0; r < st->n_reqs; r++)
        for (int64_t p = 0; p < st->host.seq_lens[r]; p++)
            for (int h = 0; h < heads; h++) {
                uint16_t *e = c + cache_at(st, r, p, heads, h, dim);
                for (int i = 0; i < dim; i++)
                    e[i] = m3_f32_to_bf16(rng_val(amp));
            }
    return c;
}

/* ------------------------------------------------------------ attention */

/* Per (row, KV group) a random non-empty set of at most topk visible
 * blocks, ascending, -1 padded; padded rows all -1. */
static int32_t *make_selection(const m3_step *st, int kv_heads, int topk) {
    int32_t *sel = halloc((size_t)st->rows * kv_heads * topk * 4);
    for (int t = 0; t < st->rows; t++)
        for (int g = 0; g < kv_heads; g++) {
            int32_t *o = sel + ((int64_t)t * kv_heads + g) * topk;
            int nb = (int)((st->host.positions[t] + PAGE) / PAGE), n = 0;
            int want = 1 + rng_below(nb < topk ? nb : topk);
            for (int b = 0; b < nb && st->host.slots[t] >= 0; b++) /* want of nb */
                if (rng_below(nb - b) < want - n)
                    o[n++] = b;
            while (n < topk)
                o[n++] = -1;
        }
    return sel;
}

typedef struct attn_shape {
    int q_heads, kv_heads, dim, topk; /* topk 0: dense */
    int max_blocks;
} attn_shape;

/* ------------------------------------------------------------ linears */

static uint8_t rand_e4m3(void) {
    return (uint8_t)(rng_below(2) << 7 | (1 + rng_below(10)) << 3 | rng_below(8));
}

/* A host [N, K] linear, bf16 (values of amp) or MXFP8 (scales 2^-7..2^-5). */
static m3_linear make_linear(int64_t N, int64_t K, bool fp8, float amp) {
    int64_t ne[2] = {N, K}, nes[2] = {N, K / 32};
    m3_linear l = {{0}, {0}, 0, 0};
    if (!fp8) {
        l.w = m3_tensor_make(M3_DT_BF16, 2, ne, rand_bf16(N * K, amp));
        return l;
    }
    uint8_t *q = halloc((size_t)(N * K)), *s = halloc((size_t)(N * K / 32));
    for (int64_t i = 0; i < N * K; i++)
        q[i] = rand_e4m3();
    for (int64_t i = 0; i < N * K / 32; i++)
        s[i] = (uint8_t)(120 + rng_below(3));
    l.w = m3_tensor_make(M3_DT_F8_E4M3, 2, ne, q);
    l.scale = m3_tensor_make(M3_DT_U8, 2, nes, s);
    return l;
}

static size_t tensor_bytes(const m3_tensor *t) {
    return (size_t)m3_tensor_nelem(t) * m3_dtype_size(t->dtype);
}

/* The same linear with its bytes on the GPU. */
static m3_linear linear_to_gpu(const m3_linear *h) {
    m3_linear d = *h;
    d.w.data = dev_from(h->w.data, tensor_bytes(&h->w));
    if (h->scale.data)
        d.scale.data = dev_from(h->scale.data, tensor_bytes(&h->scale));
    return d;
}

/* ------------------------------------------------------------ a program's run */

static struct timespec g_t0;

/* Both backends (the GPU's device 0; the CPU, the reference) and the seed
 * (M3_TEST_SEED, else `seed`). Returns -1 when both are up, else the
 * program's exit status: GPU_TEST_SKIP without a usable CUDA device (the
 * message "SKIP: no CUDA device: <reason>"), 1 on another error. */
static int harness_open(const char *program, uint64_t seed) {
    m3_status st = m3_cuda_backend_create(0, &g_gpu);
    if (st && gpu_no_device(st)) {
        printf("SKIP: no CUDA device: %s\n", m3_last_error());
        return GPU_TEST_SKIP;
    }
    if (st) {
        fprintf(stderr, "%s: FAILED: creating the CUDA backend: %s: %s\n", program,
                m3_status_name(st), m3_last_error());
        return 1;
    }
    if (m3_cpu_backend_create(0, &g_cpu))
        die("creating the CPU backend");
    g_rng = gpu_test_seed(seed);
    printf("%s: seed %llu (set M3_TEST_SEED to vary)\n", program, (unsigned long long)g_rng);
    clock_gettime(CLOCK_MONOTONIC, &g_t0);
    return -1;
}

/* The per-op summary and the verdict line; both backends destroyed.
 * Returns the exit status: 1 if any case failed. */
static int harness_close(const char *program) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double seconds = (double)(t1.tv_sec - g_t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - g_t0.tv_nsec);
    printf("\n%-16s %6s %6s %12s %12s %12s\n", "op", "cases", "fails", "worst relL2",
           "worst maxabs", "mismatches");
    for (int i = 0; i < g_n_sum; i++) {
        const op_summary *s = &g_sum[i];
        printf("%-16s %6d %6d %12.3g %12.3g %12lld\n", s->op, s->cases, s->fails, s->worst_rel,
               s->worst_abs, (long long)s->mismatches);
    }
    printf("\n%s: %d of %d cases passed (%.1f s)%s\n", program, g_cases - g_fails, g_cases,
           seconds, g_fails ? " -- FAILED" : "");
    g_gpu->ops->destroy(g_gpu);
    g_cpu->ops->destroy(g_cpu);
    return g_fails ? 1 : 0;
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#endif /* M3_TESTS_GPU_OPS_HARNESS_H */
