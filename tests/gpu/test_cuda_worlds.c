/*
 * Sums that do not depend on the TP world, checked on one GPU
 * (src/cuda/cuda_ksum.cuh): a TP rank's share of an op, computed by the
 * same CUDA op on that rank's weight slice, must give TP 1's bits once the
 * ranks' fp32 partials are combined as the all-reduce combines them (a
 * pairwise tree over rank ids). Worlds 2, 4 and 8 (where they divide the
 * chunks) are emulated one rank
 * after another on GPU 0; test_cuda_tp checks the same on real GPUs, end
 * to end.
 *
 *   linear, row-parallel: rank r holds columns [r K/W, (r+1) K/W) of the
 *     weight with its share of the m3_k_chunks(K) chunks (as model/shard.c
 *     sets it) and the same columns of x; its fp32 outputs, tree-summed over ranks, must equal TP
 *     1's fp32 output bit for bit, and rounded, TP 1's bf16 output. Decode
 *     row counts (the GEMV), prefill (cuBLAS, 17 to 300 rows), MXFP8, and
 *     chunks that are not multiples of 256 columns (staged one by one).
 *   linear, column-parallel: rank r holds rows [r N/W, ...); its outputs
 *     must equal TP 1's columns bit for bit (cuBLAS's sums must not
 *     depend on N).
 *   MoE: each rank runs the MoE op on its slices of every expert and of the
 *     shared expert, through a communicator whose all-reduce first collects
 *     the ranks' fp32 partials and then, on a second pass, hands back their
 *     tree sum; the layer output must equal TP 1's bit for bit.
 *
 * Inputs are seeded random values (M3_TEST_SEED varies them), outputs are
 * poisoned before every run. Without a usable CUDA device: exit 77 (skip).
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/bf16.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "gpu_common.h"
#include "m3.h"

static m3_backend *g_gpu;
static uint64_t g_rng;
static int g_checks, g_fails;

static void check(bool ok, const char *what, const char *detail) {
    g_checks++;
    g_fails += !ok;
    printf("%-4s %s%s%s\n", ok ? "PASS" : "FAIL", what, detail[0] ? ": " : "", detail);
}

static void must(m3_status st, const char *what) {
    if (st) {
        fprintf(stderr, "test_cuda_worlds: FAILED: %s: %s: %s\n", what, m3_status_name(st),
                m3_last_error());
        exit(1);
    }
}

/* ------------------------------------------------------------ memory */

static float rnd_val(float amp) { /* magnitude in [amp/16, amp), random sign */
    double u = (double)(gpu_rng_next(&g_rng) >> 11) * 0x1p-53;
    float v = amp * (float)(1.0 / 16 + u * 15.0 / 16);
    return gpu_rng_next(&g_rng) & 1 ? -v : v;
}

static uint16_t *rnd_bf16(int64_t n, float amp) {
    uint16_t *p = gpu_xmalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        p[i] = m3_f32_to_bf16(rnd_val(amp));
    return p;
}

/* device buffers of the current case, released by release_dev() */
static void **g_dev;
static int g_n_dev, g_cap_dev;

static void release_dev(void) {
    for (int i = 0; i < g_n_dev; i++)
        g_gpu->ops->release(g_gpu, g_dev[i]);
    g_n_dev = 0;
}

static void *dev_put(const void *host, size_t bytes) {
    void *d = NULL;
    must(g_gpu->ops->alloc(g_gpu, bytes ? bytes : 16, &d), "alloc");
    if (g_n_dev == g_cap_dev) {
        g_cap_dev = g_cap_dev ? 2 * g_cap_dev : 256;
        g_dev = realloc(g_dev, sizeof *g_dev * (size_t)g_cap_dev);
        if (!g_dev)
            must(m3_fail(M3_ERR_NO_MEMORY, "out of memory"), "tracking device buffers");
    }
    g_dev[g_n_dev++] = d;
    if (host && bytes)
        must(g_gpu->ops->upload(g_gpu, d, host, bytes), "upload");
    return d;
}

/* A device output of bytes, poisoned (NaN as bf16 pairs and as fp32). */
static void *dev_out(size_t bytes) {
    uint32_t *p = gpu_xmalloc(bytes + 4);
    for (size_t i = 0; i < bytes / 4 + 1; i++)
        p[i] = 0x7fc17fc1u;
    void *d = dev_put(p, bytes);
    free(p);
    return d;
}

static void *dev_get(const void *d, size_t bytes) {
    void *h = gpu_xmalloc(bytes);
    must(g_gpu->ops->download(g_gpu, h, d, bytes), "download");
    return h;
}

/* The all-reduce's order: a pairwise tree over the ranks' values (W a
 * power of two), left subtree first, as cuda_ksum.cuh's ksum_tree. */
static float tree_sum(const float *v, int n, int64_t stride) {
    if (n == 1)
        return v[0];
    return tree_sum(v, n / 2, stride) + tree_sum(v + (int64_t)(n / 2) * stride, n / 2, stride);
}

/* ------------------------------------------------------------ linear */

typedef struct host_linear {
    int64_t N, K;
    bool fp8;
    uint8_t *w, *s; /* [N, K] bf16 or e4m3; [N, K / 32] scales */
} host_linear;

static host_linear make_weight(int64_t N, int64_t K, bool fp8, float amp) {
    host_linear h = {N, K, fp8, NULL, NULL};
    if (!fp8) {
        h.w = (uint8_t *)rnd_bf16(N * K, amp);
        return h;
    }
    h.w = gpu_xmalloc((size_t)(N * K));
    h.s = gpu_xmalloc((size_t)(N * K / 32));
    for (int64_t i = 0; i < N * K; i++) /* finite, non-zero e4m3: exponent 1..10 */
        h.w[i] = (uint8_t)((gpu_rng_next(&g_rng) & 1) << 7 |
                           (1 + gpu_rng_next(&g_rng) % 10) << 3 | (gpu_rng_next(&g_rng) & 7));
    for (int64_t i = 0; i < N * K / 32; i++)
        h.s[i] = (uint8_t)(120 + gpu_rng_next(&g_rng) % 3);
    return h;
}

/* Rows [n0, n0 + n) and columns [k0, k0 + k) of h, dense, as a host
 * linear with the given chunk counts (free with free_host). */
static m3_linear slice_host(const host_linear *h, int64_t n0, int64_t n, int64_t k0, int64_t k,
                            int k_chunks, int n_chunks) {
    size_t es = h->fp8 ? 1 : 2;
    uint8_t *w = gpu_xmalloc((size_t)(n * k) * es);
    for (int64_t r = 0; r < n; r++)
        memcpy(w + (size_t)(r * k) * es, h->w + (size_t)((n0 + r) * h->K + k0) * es,
               (size_t)k * es);
    int64_t ne[2] = {n, k}, nes[2] = {n, k / 32};
    m3_linear l = {{0}, {0}, k_chunks, n_chunks};
    l.w = m3_tensor_make(h->fp8 ? M3_DT_F8_E4M3 : M3_DT_BF16, 2, ne, w);
    if (h->fp8) {
        uint8_t *s = gpu_xmalloc((size_t)(n * k / 32));
        for (int64_t r = 0; r < n; r++)
            memcpy(s + r * (k / 32), h->s + (n0 + r) * (h->K / 32) + k0 / 32, (size_t)(k / 32));
        l.scale = m3_tensor_make(M3_DT_U8, 2, nes, s);
    }
    return l;
}

static void free_host(m3_linear *l) {
    free(l->w.data);
    free(l->scale.data);
}

static size_t bytes_of(const m3_tensor *t) {
    return (size_t)m3_tensor_nelem(t) * m3_dtype_size(t->dtype);
}

/* slice_host's linear on the device. */
static m3_linear slice_to_gpu(const host_linear *h, int64_t n0, int64_t n, int64_t k0, int64_t k,
                              int k_chunks, int n_chunks) {
    m3_linear l = slice_host(h, n0, n, k0, k, k_chunks, n_chunks), d = l;
    d.w.data = dev_put(l.w.data, bytes_of(&l.w));
    if (l.scale.data)
        d.scale.data = dev_put(l.scale.data, bytes_of(&l.scale));
    free_host(&l);
    return d;
}

static void *run_linear(int rows, const uint16_t *x_dev, const m3_linear *w, m3_dtype out) {
    size_t bytes = (size_t)rows * w->w.ne[0] * (out == M3_DT_F32 ? 4 : 2);
    void *d = dev_out(bytes);
    must(g_gpu->ops->linear(g_gpu, rows, x_dev, w, out, d), "linear");
    return dev_get(d, bytes);
}

/* Columns [k0, k0 + k) of x [rows, K], dense, on the device. */
static uint16_t *x_cols(const uint16_t *x, int rows, int64_t K, int64_t k0, int64_t k) {
    uint16_t *h = gpu_xmalloc((size_t)(rows * k) * 2);
    for (int t = 0; t < rows; t++)
        memcpy(h + t * k, x + t * K + k0, (size_t)k * 2);
    uint16_t *d = dev_put(h, (size_t)(rows * k) * 2);
    free(h);
    return d;
}

/* Row-parallel at world W (W divides the full weight's chunks): the
 * ranks' fp32 partials, tree-summed, against TP 1's fp32 and bf16. */
static void row_parallel(const host_linear *h, const uint16_t *x, int rows, const float *ref32,
                         const uint16_t *ref16, int W) {
    int64_t N = h->N, K = h->K, kw = K / W, n = (int64_t)rows * N;
    int kch = m3_k_chunks(K);
    float *parts = gpu_xmalloc((size_t)W * n * 4);
    for (int r = 0; r < W; r++) {
        m3_linear l = slice_to_gpu(h, 0, N, r * kw, kw, kch / W, 0);
        float *p = run_linear(rows, x_cols(x, rows, K, r * kw, kw), &l, M3_DT_F32);
        memcpy(parts + (size_t)r * n, p, (size_t)n * 4);
        free(p);
    }
    int64_t bad32 = 0, bad16 = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = tree_sum(parts + i, W, n);
        uint32_t a, b;
        memcpy(&a, &v, 4);
        memcpy(&b, &ref32[i], 4);
        bad32 += a != b;
        bad16 += m3_f32_to_bf16(v) != ref16[i];
    }
    free(parts);
    char what[160], detail[96];
    snprintf(what, sizeof what, "linear %s N %lld K %lld (%d chunks) rows %d, world %d, "
             "row-parallel = TP 1", h->fp8 ? "mxfp8" : "bf16", (long long)N, (long long)K, kch,
             rows, W);
    snprintf(detail, sizeof detail, "%lld fp32 and %lld bf16 of %lld values differ",
             (long long)bad32, (long long)bad16, (long long)n);
    check(bad32 == 0 && bad16 == 0, what, detail);
}

/* Column-parallel at world W: each rank's rows of TP 1's output. */
static void column_parallel(const host_linear *h, const uint16_t *x, int rows,
                            const uint16_t *ref16, int W) {
    int64_t N = h->N, K = h->K, nw = N / W, bad = 0;
    uint16_t *xd = dev_put(x, (size_t)(rows * K) * 2);
    for (int r = 0; r < W; r++) {
        m3_linear l = slice_to_gpu(h, r * nw, nw, 0, K, 0, M3_N_BLOCKS / W);
        uint16_t *o = run_linear(rows, xd, &l, M3_DT_BF16);
        for (int t = 0; t < rows; t++)
            for (int64_t j = 0; j < nw; j++)
                bad += o[t * nw + j] != ref16[t * N + r * nw + j];
        free(o);
    }
    char what[160], detail[96];
    snprintf(what, sizeof what, "linear %s N %lld K %lld rows %d, world %d, column-parallel = TP 1",
             h->fp8 ? "mxfp8" : "bf16", (long long)N, (long long)K, rows, W);
    snprintf(detail, sizeof detail, "%lld of %lld values differ", (long long)bad,
             (long long)rows * N);
    check(bad == 0, what, detail);
}

static void linear_case(int64_t N, int64_t K, bool fp8, int rows) {
    host_linear h = make_weight(N, K, fp8, 2.0f / sqrtf((float)K));
    uint16_t *x = rnd_bf16((int64_t)rows * K, 1.0f);
    uint16_t *xd = dev_put(x, (size_t)(rows * K) * 2);
    int kch = m3_k_chunks(K);
    /* TP 1 as a row-parallel weight (model.c marks o_proj and the downs
     * so) and as a column-parallel one (q/k/v, gate/up) */
    m3_linear row = slice_to_gpu(&h, 0, N, 0, K, kch, 0);
    m3_linear col = slice_to_gpu(&h, 0, N, 0, K, 0, N % M3_N_BLOCKS ? 0 : M3_N_BLOCKS);
    float *ref32 = run_linear(rows, xd, &row, M3_DT_F32);
    uint16_t *ref16 = run_linear(rows, xd, &row, M3_DT_BF16);
    uint16_t *col16 = run_linear(rows, xd, &col, M3_DT_BF16);
    for (int W = 2; W <= 8; W *= 2) {
        if (kch % W == 0 && (!fp8 || (K / W) % 32 == 0))
            row_parallel(&h, x, rows, ref32, ref16, W);
        if (N % M3_N_BLOCKS == 0)
            column_parallel(&h, x, rows, col16, W);
    }
    free(ref32), free(ref16), free(col16), free(x), free(h.w), free(h.s);
    release_dev();
}

static void test_linear(void) {
    static const int rows_list[] = {1, 3, 8, 16, 17, 40, 300};
    for (size_t i = 0; i < sizeof rows_list / sizeof *rows_list; i++)
        linear_case(528, 2048, false, rows_list[i]); /* 8 chunks of 256 */
    linear_case(272, 6144, false, 1);                 /* 8 of 768 */
    linear_case(272, 6144, false, 16);
    linear_case(6144, 3072, false, 5);                /* 4 of 768: M3's down widths */
    linear_case(6144, 3072, false, 64);
    linear_case(272, 1024, true, 1);                  /* MXFP8, 4 of 256 */
    linear_case(272, 1024, true, 5);
    linear_case(272, 1024, true, 40);
    linear_case(80, 240, false, 3);                   /* 2 of 120: chunks staged one by one */
    linear_case(80, 240, false, 40);
    linear_case(2048, 6144, false, 300);              /* q_proj's width at prefill */
    linear_case(128, 6144, false, 700);               /* a KV head's */
}

/* ------------------------------------------------------------ MoE */

/* A communicator whose all-reduce either keeps each call's buffer (per
 * rank) or hands back the calls' tree sums over ranks. */
typedef struct fake_comm {
    m3_comm c;
    bool inject;
    int call;
    float *got[2][8];  /* [call][rank] the rank's partial */
    float *sum[2];     /* [call] tree over ranks */
    int64_t n[2];
} fake_comm;

static m3_status fake_sum_f32(m3_comm *c, float *buf, int64_t n) {
    fake_comm *f = (fake_comm *)c;
    int k = f->call++;
    if (k >= 2)
        return m3_fail(M3_ERR_INTERNAL, "fake comm: more than two all-reduces");
    f->n[k] = n;
    if (f->inject)
        return g_gpu->ops->upload(g_gpu, buf, f->sum[k], (size_t)n * 4);
    f->got[k][c->rank] = dev_get(buf, (size_t)n * 4);
    return M3_OK;
}

static const m3_comm_ops fake_ops = {fake_sum_f32, NULL, NULL, NULL, NULL, NULL, NULL};

typedef struct moe_shape {
    int E, k, H, I, Is;
    bool fp8;
} moe_shape;

typedef struct moe_host {
    host_linear *gate, *up, *down, sh_gate, sh_up, sh_down;
    float *router, *bias;
} moe_host;

/* Rank r of W's layer (W = 1: the whole layer) on the device. */
static void moe_rank(const moe_shape *m, const moe_host *h, m3_config *cfg, int r, int W,
                     m3_weights *dev) {
    m3_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    lw.moe = true;
    int64_t ne[2] = {m->E, m->H}, neb[1] = {m->E};
    lw.router = m3_tensor_make(M3_DT_F32, 2, ne, h->router);
    lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, h->bias);
    int64_t iw = m->I / W, sw = m->Is / W;
    /* the downs are row-parallel: their share of the full widths' chunks */
    int kc = m3_k_chunks(m->I) / W, kcs = m3_k_chunks(m->Is) / W;
    m3_linear *ex = gpu_xmalloc(sizeof(m3_linear) * 3 * (size_t)m->E);
    lw.exp_gate = ex, lw.exp_up = ex + m->E, lw.exp_down = ex + 2 * m->E;
    for (int e = 0; e < m->E; e++) {
        lw.exp_gate[e] = slice_host(&h->gate[e], r * iw, iw, 0, m->H, 0, 0);
        lw.exp_up[e] = slice_host(&h->up[e], r * iw, iw, 0, m->H, 0, 0);
        lw.exp_down[e] = slice_host(&h->down[e], 0, m->H, r * iw, iw, kc, 0);
    }
    lw.sh_gate = slice_host(&h->sh_gate, r * sw, sw, 0, m->H, 0, M3_N_BLOCKS / W);
    lw.sh_up = slice_host(&h->sh_up, r * sw, sw, 0, m->H, 0, M3_N_BLOCKS / W);
    lw.sh_down = slice_host(&h->sh_down, 0, m->H, r * sw, sw, kcs, 0);
    memset(cfg, 0, sizeof *cfg);
    cfg->num_layers = 1;
    cfg->num_experts = m->E;
    cfg->experts_per_tok = m->k;
    m3_weights host = {.layers = &lw};
    must(g_gpu->ops->load_weights(g_gpu, cfg, &host, dev), "load_weights");
    for (int e = 0; e < 3 * m->E; e++)
        free_host(&ex[e]);
    free(ex);
    free_host(&lw.sh_gate);
    free_host(&lw.sh_up);
    free_host(&lw.sh_down);
}

static void moe_case(const moe_shape *m, int rows) {
    moe_host h;
    h.gate = gpu_xmalloc(sizeof(host_linear) * (size_t)m->E);
    h.up = gpu_xmalloc(sizeof(host_linear) * (size_t)m->E);
    h.down = gpu_xmalloc(sizeof(host_linear) * (size_t)m->E);
    for (int e = 0; e < m->E; e++) {
        h.gate[e] = make_weight(m->I, m->H, m->fp8, 2.0f / sqrtf((float)m->H));
        h.up[e] = make_weight(m->I, m->H, m->fp8, 2.0f / sqrtf((float)m->H));
        h.down[e] = make_weight(m->H, m->I, m->fp8, 2.0f / sqrtf((float)m->I));
    }
    h.sh_gate = make_weight(m->Is, m->H, false, 2.0f / sqrtf((float)m->H));
    h.sh_up = make_weight(m->Is, m->H, false, 2.0f / sqrtf((float)m->H));
    h.sh_down = make_weight(m->H, m->Is, false, 2.0f / sqrtf((float)m->Is));
    h.router = gpu_xmalloc((size_t)m->E * m->H * 4);
    h.bias = gpu_xmalloc((size_t)m->E * 4);
    for (int64_t i = 0; i < (int64_t)m->E * m->H; i++)
        h.router[i] = rnd_val(0.1f);
    for (int e = 0; e < m->E; e++)
        h.bias[e] = rnd_val(0.2f);
    int64_t n = (int64_t)rows * m->H;
    uint16_t *x = rnd_bf16(n, 1.0f), *xd = dev_put(x, (size_t)n * 2);

    m3_config cfg;
    m3_weights dev;
    moe_rank(m, &h, &cfg, 0, 1, &dev);
    m3_moe_params p = {m->E, m->k, 2.0f, {1.702f, 7.0f}, NULL};
    void *out = dev_out((size_t)n * 2);
    must(g_gpu->ops->moe(g_gpu, rows, xd, &dev.layers[0], &p, out), "moe, TP 1");
    uint16_t *ref = dev_get(out, (size_t)n * 2);
    g_gpu->ops->unload_weights(g_gpu, &cfg, &dev);

    for (int W = 2; W <= 4; W *= 2) {
        fake_comm f;
        memset(&f, 0, sizeof f);
        f.c.ops = &fake_ops;
        f.c.world = W;
        p.tp = &f.c;
        for (int r = 0; r < W; r++) { /* pass 1: every rank's partials */
            f.c.rank = r;
            f.call = 0;
            moe_rank(m, &h, &cfg, r, W, &dev);
            must(g_gpu->ops->moe(g_gpu, rows, xd, &dev.layers[0], &p, out), "moe, a rank");
            must(g_gpu->ops->sync(g_gpu), "sync");
            g_gpu->ops->unload_weights(g_gpu, &cfg, &dev);
        }
        for (int k = 0; k < f.call; k++) {
            f.sum[k] = gpu_xmalloc((size_t)f.n[k] * 4);
            float v[8];
            for (int64_t i = 0; i < f.n[k]; i++) {
                for (int r = 0; r < W; r++)
                    v[r] = f.got[k][r][i];
                f.sum[k][i] = tree_sum(v, W, 1);
            }
        }
        int calls = f.call;
        f.inject = true; /* pass 2: rank 0 with the sums handed back */
        f.c.rank = 0;
        f.call = 0;
        moe_rank(m, &h, &cfg, 0, W, &dev);
        out = dev_out((size_t)n * 2);
        must(g_gpu->ops->moe(g_gpu, rows, xd, &dev.layers[0], &p, out), "moe, rank 0");
        uint16_t *got = dev_get(out, (size_t)n * 2);
        g_gpu->ops->unload_weights(g_gpu, &cfg, &dev);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += got[i] != ref[i];
        char what[160], detail[96];
        snprintf(what, sizeof what, "moe %s E %d k %d H %d I %d, rows %d, world %d = TP 1",
                 m->fp8 ? "mxfp8" : "bf16", m->E, m->k, m->H, m->I, rows, W);
        snprintf(detail, sizeof detail, "%lld of %lld values differ (%d all-reduces)",
                 (long long)bad, (long long)n, calls);
        check(bad == 0 && calls == 2, what, detail);
        for (int k = 0; k < 2; k++) {
            free(f.sum[k]);
            for (int r = 0; r < W; r++)
                free(f.got[k][r]);
        }
        free(got);
        p.tp = NULL;
    }
    free(ref);
    free(x);
    for (int e = 0; e < m->E; e++) {
        free(h.gate[e].w), free(h.gate[e].s), free(h.up[e].w), free(h.up[e].s);
        free(h.down[e].w), free(h.down[e].s);
    }
    free(h.gate), free(h.up), free(h.down);
    free(h.sh_gate.w), free(h.sh_up.w), free(h.sh_down.w), free(h.router), free(h.bias);
    release_dev();
}

static void test_moe(void) {
    /* widths of 4 chunks of 256 (m3_k_chunks): worlds 2 and 4 */
    moe_shape bf = {8, 2, 512, 1024, 1024, false}, f8 = {8, 2, 512, 1024, 1024, true};
    static const int rows_list[] = {1, 3, 16, 40};
    for (size_t i = 0; i < sizeof rows_list / sizeof *rows_list; i++)
        moe_case(&bf, rows_list[i]);
    moe_case(&f8, 3);
}

int main(void) {
    m3_status st = m3_cuda_backend_create(0, &g_gpu);
    if (st && gpu_no_device(st)) {
        printf("SKIP: no CUDA device: %s\n", m3_last_error());
        return GPU_TEST_SKIP;
    }
    must(st, "creating the CUDA backend");
    g_rng = gpu_test_seed(0x5eed3070ull);
    printf("test_cuda_worlds: seed %llu (set M3_TEST_SEED to vary)\n", (unsigned long long)g_rng);
    test_linear();
    test_moe();
    printf("\ntest_cuda_worlds: %d of %d checks passed%s\n", g_checks - g_fails, g_checks,
           g_fails ? " -- FAILED" : "");
    g_gpu->ops->destroy(g_gpu);
    free(g_dev);
    return g_fails ? 1 : 0;
}
