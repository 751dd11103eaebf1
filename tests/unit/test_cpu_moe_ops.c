/*
 * Unit tests of the CPU backend's SwiGLU and MoE ops (routing, the experts
 * a step's rows route to, the shared expert, the combine), against
 * references written from SPEC §2.3; experts nobody routes to sit in
 * memory that faults on any access (method: test_cpu_ops.c; shared parts:
 * cpu_ops_check.h).
 */
#include "cpu_ops_check.h"

/* ------------------------------------------------------------ swiglu */

static void swiglu_case(const char *what, int64_t n, const m3_swiglu *act) {
    /* beyond the limit on both sides, so both clamps are exercised */
    uint16_t *gate = rand_bf16(n, 12.0f), *up = rand_bf16(n, 12.0f), *ref = xalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        ref[i] = f2bf(ref_swiglu(bf2f(gate[i]), bf2f(up[i]), act));
    uint16_t *out[N_BE];
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->swiglu(g_be[i], n, gate, up, act, out[i]));
    }
    EXPECT_BF16(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    free(gate);
    free(up);
    free(ref);
    free_all((void **)out, N_BE);
}

/* Every bf16 gate bit pattern (NaNs, infinities, subnormals included)
 * against 8 random up values each: the elementwise math and its exp and
 * clamp conventions, exhaustively over the gate. */
static void swiglu_sweep(const m3_swiglu *act) {
    const int64_t n = 65536 * 8;
    uint16_t *gate = xalloc((size_t)n * 2), *up = rand_bf16(n, 9.0f), *ref = xalloc((size_t)n * 2);
    uint16_t *out[N_BE];
    for (int64_t i = 0; i < n; i++) {
        gate[i] = (uint16_t)(i % 65536);
        ref[i] = f2bf(ref_swiglu(bf2f(gate[i]), bf2f(up[i]), act));
    }
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->swiglu(g_be[i], n, gate, up, act, out[i]));
    }
    EXPECT_BF16("swiglu every gate", out[0], ref, n);
    EXPECT_SAME("swiglu every gate", out[0], out[1], (size_t)n * 2);
    free(gate);
    free(up);
    free(ref);
    free_all((void **)out, N_BE);
}

static void test_swiglu(void) {
    m3_swiglu m3a = {1.702f, 7.0f}, other = {1.0f, 3.0f};
    swiglu_case("swiglu", 40000, &m3a); /* several chunks of the pool */
    swiglu_case("swiglu alpha 1 limit 3", 1000, &other);
    swiglu_sweep(&m3a);

    /* hand, alpha 1.702, limit 7:
     * (1, 0):    1 * sigmoid(1.702)                  = 0.845796  -> 0.84765625
     * (10, 10):  g 7, u 7: 7 * sigmoid(11.914) * 8    = 55.99963  -> 56
     * (-10, 0):  gate not clamped from below: -10 * sigmoid(-17.02)
     *            = -4.05796e-7 -> -4.0605664e-7 (clamped at -7: -4.7e-5)
     * (1, -10):  u clamped to -7: 0.845796 * -6       = -5.074775 -> -5.0625
     * (-10,-10): -4.05796e-7 * -6 = 2.434776e-6       -> 2.4288893e-6
     * (8, 0.5):  7 * sigmoid(11.914) * 1.5            = 10.49993  -> 10.5
     * (0, 5):    0 */
    const float g[7] = {1, 10, -10, 1, -10, 8, 0}, u[7] = {0, 10, 0, -10, -10, 0.5f, 5};
    const float want[7] = {0.84765625f, 56, -4.0605664e-7f, -5.0625f, 2.4288893e-6f, 10.5f, 0};
    uint16_t gb[7], ub[7], out[7];
    for (int k = 0; k < 7; k++) {
        gb[k] = f2bf(g[k]);
        ub[k] = f2bf(u[k]);
    }
    fill16(out, 7, BF16_NAN);
    CHECK_OK(g_be[1]->ops->swiglu(g_be[1], 7, gb, ub, &m3a, out));
    for (int k = 0; k < 7; k++)
        EXPECT_BF16_IS(out[k], want[k]);

    /* NaN never turns into a number (SPEC §8; np.minimum / np.clip in the
     * numpy reference propagate it): a NaN gate or up gives a NaN output */
    uint16_t ng[2] = {BF16_NAN, f2bf(1)}, nu[2] = {f2bf(1), BF16_NAN}, no[2] = {0, 0};
    CHECK_OK(g_be[1]->ops->swiglu(g_be[1], 2, ng, nu, &m3a, no));
    if (!isnan(bf2f(no[0])) || !isnan(bf2f(no[1])))
        fprintf(stderr, "  swiglu(NaN, 1) = %g, swiglu(1, NaN) = %g: NaN input lost\n",
                bf2f(no[0]), bf2f(no[1]));
    CHECK(isnan(bf2f(no[0])));
    CHECK(isnan(bf2f(no[1])));
}

/* ------------------------------------------------------------ moe */

/* An MoE layer's weights, built by hand; `mem` owns every buffer. */
typedef struct moe_fx {
    int H, I, Is, E;
    m3_layer_weights lw;
    m3_linear lin[3 * 16 + 3];
    void *mem[3 * 2 * 16 + 3 * 2 + 2];
    int n_mem;
    void *maps[8]; /* guarded (PROT_NONE) mappings */
    size_t map_bytes[8];
    int n_maps;
} moe_fx;

/* How an expert's weights are made: live random values; all NaN (a read
 * that reaches an output shows); or memory that faults on any access (a
 * read at all shows, even one whose result is dropped). */
enum fx_kind { FX_LIVE, FX_NAN, FX_GUARDED };

static void *fx_guarded(moe_fx *f, size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "test_cpu_moe_ops: mmap failed\n");
        exit(2);
    }
    f->maps[f->n_maps] = p;
    f->map_bytes[f->n_maps++] = bytes;
    return p;
}

static void moe_fx_free(moe_fx *f) {
    free_all(f->mem, f->n_mem);
    for (int i = 0; i < f->n_maps; i++)
        munmap(f->maps[i], f->map_bytes[i]);
}

/* A fault inside moe means it touched a guarded expert's weights. */
static void on_guard_fault(int sig) {
    static const char msg[] = "test_cpu_moe_ops: FAILED: moe read the weights of an expert that no "
                              "row routed to (guarded memory faulted)\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    (void)sig;
    _exit(1);
}

static void *fx_keep(moe_fx *f, void *p) {
    f->mem[f->n_mem++] = p;
    return p;
}

/* A [N, K] linear (bf16 or MXFP8) of the given kind. */
static m3_linear fx_linear(moe_fx *f, int64_t N, int64_t K, bool mxfp8, enum fx_kind kind) {
    if (kind == FX_GUARDED && mxfp8)
        return lin_mxfp8(fx_guarded(f, (size_t)(N * K)), fx_guarded(f, (size_t)(N * K / 32)), N, K);
    if (kind == FX_GUARDED)
        return lin_bf16(fx_guarded(f, (size_t)(N * K * 2)), N, K);
    bool nan = kind == FX_NAN;
    if (!mxfp8) {
        uint16_t *w = fx_keep(f, rand_bf16(N * K, 0.3f));
        if (nan)
            fill16(w, N * K, BF16_NAN);
        return lin_bf16(w, N, K);
    }
    uint8_t *q = fx_keep(f, xalloc((size_t)(N * K))), *s = fx_keep(f, xalloc((size_t)(N * K / 32)));
    for (int64_t k = 0; k < N * K; k++)
        q[k] = nan ? 0x7f : rand_e4m3();
    for (int64_t k = 0; k < N * K / 32; k++)
        s[k] = nan ? 255 : (uint8_t)(120 + rng_below(3)); /* 2^-7 .. 2^-5 */
    return lin_mxfp8(q, s, N, K);
}

/* gate/up/act/down of one expert for one row: bf16 at each rounding point. */
static void ref_ffn(const uint16_t *x, const m3_linear *gate, const m3_linear *up,
                    const m3_linear *down, const m3_swiglu *act, float *out) {
    int64_t W = gate->w.ne[0], H = down->w.ne[0];
    float *g = xalloc((size_t)W * 4), *u = xalloc((size_t)W * 4);
    uint16_t *a = xalloc((size_t)W * 2);
    ref_linear(1, x, gate, g);
    ref_linear(1, x, up, u);
    for (int64_t i = 0; i < W; i++)
        a[i] = f2bf(ref_swiglu(rbf(g[i]), rbf(u[i]), act));
    ref_linear(1, a, down, out);
    for (int64_t h = 0; h < H; h++)
        out[h] = rbf(out[h]);
    free(g);
    free(u);
    free(a);
}

/* Router: ids of the top-k experts by sigmoid(l) + bias, ties to the lower
 * id, NaN keys lowest; weights s / (sum of chosen s in rank order, fp32). */
static void ref_route(const float *logits, const float *bias, int E, int k, int *ids, float *w) {
    float s[64], key[64];
    bool taken[64] = {false};
    for (int e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + ref_exp(-logits[e]));
        key[e] = s[e] + (bias ? bias[e] : 0.0f);
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool better = best < 0 || (!isnan(key[e]) && (isnan(key[best]) || key[e] > key[best]));
            if (!taken[e] && better)
                best = e;
        }
        taken[best] = true;
        ids[j] = best;
    }
    float sum = s[ids[0]];
    for (int j = 1; j < k; j++)
        sum += s[ids[j]];
    for (int j = 0; j < k; j++)
        w[j] = s[ids[j]] / sum;
}

/* y = bf16(scaling * (sum_j w_j e_j in rank order, fp32) + shared). The
 * chosen ids are returned in ids [rows, k] for the caller's checks. */
static void ref_moe(const moe_fx *f, int rows, const uint16_t *x, const m3_moe_params *p,
                    uint16_t *out, int *ids) {
    const m3_layer_weights *lw = &f->lw;
    int k = p->top_k, H = f->H;
    float *logits = xalloc((size_t)f->E * 4), *e = xalloc((size_t)k * H * 4);
    float *sh = xalloc((size_t)H * 4), w[64];
    double *xd = xalloc((size_t)H * 8), *rw = xalloc((size_t)H * 8);
    for (int t = 0; t < rows; t++) {
        const uint16_t *xt = x + (int64_t)t * H;
        for (int i = 0; i < H; i++)
            xd[i] = bf2f(xt[i]);
        for (int ex = 0; ex < f->E; ex++) { /* fp32 router weight, double accumulation */
            for (int i = 0; i < H; i++)
                rw[i] = ((const float *)lw->router.data)[(int64_t)ex * H + i];
            logits[ex] = ref_dot(xd, rw, H);
        }
        ref_route(logits, lw->router_bias.data, f->E, k, ids + t * k, w);
        for (int j = 0; j < k; j++) {
            int ex = ids[t * k + j];
            ref_ffn(xt, &lw->exp_gate[ex], &lw->exp_up[ex], &lw->exp_down[ex], &p->act, e + j * H);
        }
        if (lw->sh_gate.w.data)
            ref_ffn(xt, &lw->sh_gate, &lw->sh_up, &lw->sh_down, &p->act, sh);
        for (int h = 0; h < H; h++) {
            float acc = 0;
            for (int j = 0; j < k; j++)
                acc += w[j] * e[j * H + h];
            float y = p->routed_scaling * acc;
            if (lw->sh_gate.w.data)
                y += sh[h];
            out[(int64_t)t * H + h] = f2bf(y);
        }
    }
    free(logits);
    free(e);
    free(sh);
    free(xd);
    free(rw);
}

/* Random layer: experts of width I (even ids bf16, odd MXFP8), a shared
 * expert of width Is (bf16); experts 0 and 5 get bias -100 so no row
 * routes to them: expert 0's weights are NaN, expert 5's fault on any
 * access. Experts 2 and 6 have the same router row and bias, so their
 * keys always tie (2 must win). */
static void moe_fx_random(moe_fx *f, int E, int H, int I, int Is) {
    memset(f, 0, sizeof *f);
    f->H = H, f->I = I, f->Is = Is, f->E = E;
    float *router = fx_keep(f, xalloc((size_t)E * H * 4));
    float *bias = fx_keep(f, xalloc((size_t)E * 4));
    for (int k = 0; k < E * f->H; k++)
        router[k] = rng_sym(0.3f);
    for (int e = 0; e < E; e++)
        bias[e] = (e == 0 || e == 5) ? -100.0f : rng_sym(0.2f);
    memcpy(router + 6 * f->H, router + 2 * f->H, (size_t)f->H * 4);
    bias[6] = bias[2];
    int64_t ne[2] = {E, f->H}, neb[1] = {E};
    f->lw.moe = true;
    f->lw.router = m3_tensor_make(M3_DT_F32, 2, ne, router);
    f->lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, bias);
    for (int e = 0; e < E; e++) {
        bool fp8 = e % 2 == 1;
        enum fx_kind kind = e == 0 ? FX_NAN : e == 5 ? FX_GUARDED : FX_LIVE;
        f->lin[3 * e] = fx_linear(f, f->I, f->H, fp8, kind);
        f->lin[3 * e + 1] = fx_linear(f, f->I, f->H, fp8, kind);
        f->lin[3 * e + 2] = fx_linear(f, f->H, f->I, fp8, kind);
    }
    f->lin[3 * E] = fx_linear(f, f->Is, f->H, false, FX_LIVE);
    f->lin[3 * E + 1] = fx_linear(f, f->Is, f->H, false, FX_LIVE);
    f->lin[3 * E + 2] = fx_linear(f, f->H, f->Is, false, FX_LIVE);
}

/* Binds the per-expert arrays the layer weights point at (3 per expert,
 * stored interleaved, copied into separate arrays). */
static void moe_fx_bind(moe_fx *f, m3_linear *g, m3_linear *u, m3_linear *d, bool shared) {
    for (int e = 0; e < f->E; e++) {
        g[e] = f->lin[3 * e];
        u[e] = f->lin[3 * e + 1];
        d[e] = f->lin[3 * e + 2];
    }
    f->lw.exp_gate = g, f->lw.exp_up = u, f->lw.exp_down = d;
    m3_linear none = {{0}, {0}, 0, 0};
    f->lw.sh_gate = shared ? f->lin[3 * f->E] : none;
    f->lw.sh_up = shared ? f->lin[3 * f->E + 1] : none;
    f->lw.sh_down = shared ? f->lin[3 * f->E + 2] : none;
}

static void moe_case(const char *what, moe_fx *f, bool shared, int rows) {
    enum { K = 3 };
    m3_linear g[16], u[16], d[16];
    moe_fx_bind(f, g, u, d, shared);
    m3_moe_params p = {f->E, K, 2.0f, {1.702f, 7.0f}, NULL};
    int64_t n = (int64_t)rows * f->H;
    uint16_t *x = rand_bf16(n, 1.0f), *ref = xalloc((size_t)n * 2), *out[N_BE];
    int *ids = xalloc((size_t)rows * K * sizeof *ids);
    ref_moe(f, rows, x, &p, ref, ids);
    struct sigaction guard = {0}, old_segv, old_bus;
    guard.sa_handler = on_guard_fault;
    sigaction(SIGSEGV, &guard, &old_segv);
    sigaction(SIGBUS, &guard, &old_bus);
    for (int i = 0; i < N_BE; i++) {
        out[i] = poisoned16(n);
        CHECK_OK(g_be[i]->ops->moe(g_be[i], rows, x, &f->lw, &p, out[i]));
    }
    sigaction(SIGSEGV, &old_segv, NULL);
    sigaction(SIGBUS, &old_bus, NULL);
    EXPECT_BF16(what, out[0], ref, n);
    EXPECT_SAME(what, out[0], out[1], (size_t)n * 2);
    /* the NaN-weighted experts were never routed to, and never read */
    bool finite = true;
    for (int64_t k = 0; k < n; k++)
        finite &= isfinite(bf2f(out[0][k])) != 0;
    CHECK(finite);
    bool unrouted = true;
    for (int k = 0; k < rows * K; k++)
        unrouted &= ids[k] != 0 && ids[k] != 5;
    CHECK(unrouted);
    free(ids);
    free(x);
    free(ref);
    free_all((void **)out, N_BE);
}

/* Hand-built layers with alpha 0 (sigmoid(0) = 1/2 exactly, act = g (u+1)/2)
 * and H = 2, x = {1, 0}, so each projection picks column 0 of its weight. */
static void moe_tiny(void) {
    m3_backend *be = g_be[1];
    uint16_t x[2] = {f2bf(1), 0}, out[2];
    /* A: router logits {0, 0, 1}, bias {0, -1, 0}, top 2: keys {0.5, -0.5,
     * 0.731059} -> experts 2, 0; weights 0.731059/1.231059 = 0.593838 and
     * 0.406162. Expert 0: g 2, u 1 -> act 2, down {1,-1} -> {2,-2}. Expert
     * 2: g 1, u 3 -> act 2, down {0.5, 0.25} -> {1, 0.5}. Shared: g 4, u 0
     * -> act 2, down {0.25, 1} -> {0.5, 2}. y = 2 (0.593838 {1,0.5} +
     * 0.406162 {2,-2}) + {0.5, 2} = {3.312309, 0.969227} -> {3.3125, 0.96875}.
     * Expert 1 (NaN weights) is not chosen and must not be read. */
    float router[6] = {0, 0, 0, 0, 1, 0}, bias[3] = {0, -1, 0};
    /* experts 0, 1, 2 and (index 3) the shared one */
    const float gw[4][2] = {{2, 0}, {NAN, NAN}, {1, 0}, {4, 0}};
    const float uw[4][2] = {{1, 0}, {NAN, NAN}, {3, 0}, {0, 0}};
    const float dw[4][2] = {{1, -1}, {NAN, NAN}, {0.5f, 0.25f}, {0.25f, 1}};
    uint16_t wg[4][2], wu[4][2], wd[4][2];
    m3_linear lg[4], lu[4], ld[4];
    for (int e = 0; e < 4; e++) {
        for (int i = 0; i < 2; i++)
            wg[e][i] = f2bf(gw[e][i]), wu[e][i] = f2bf(uw[e][i]), wd[e][i] = f2bf(dw[e][i]);
        lg[e] = lin_bf16(wg[e], 1, 2), lu[e] = lin_bf16(wu[e], 1, 2), ld[e] = lin_bf16(wd[e], 2, 1);
    }
    int64_t ne[2] = {3, 2}, neb[1] = {3};
    m3_layer_weights lw = {0};
    lw.moe = true;
    lw.router = m3_tensor_make(M3_DT_F32, 2, ne, router);
    lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, bias);
    lw.exp_gate = lg, lw.exp_up = lu, lw.exp_down = ld;
    lw.sh_gate = lg[3], lw.sh_up = lu[3], lw.sh_down = ld[3];
    m3_moe_params p = {3, 2, 2.0f, {0.0f, 7.0f}, NULL};
    fill16(out, 2, BF16_NAN);
    CHECK_OK(be->ops->moe(be, 1, x, &lw, &p, out));
    EXPECT_BF16_IS(out[0], 3.3125f);
    EXPECT_BF16_IS(out[1], 0.96875f);

    /* B, ties: the same experts 0-2, router all zero, bias {0.2, 0.2, 0.1},
     * top 1: keys {0.7, 0.7, 0.6}, experts 0 and 1 tie and the lower id (0)
     * wins (expert 1 has NaN weights); weight 1, no shared expert, scaling
     * 1: y = expert 0 = {2, -2}. */
    float r0[6] = {0}, b2[3] = {0.2f, 0.2f, 0.1f};
    lw.router = m3_tensor_make(M3_DT_F32, 2, ne, r0);
    lw.router_bias = m3_tensor_make(M3_DT_F32, 1, neb, b2);
    m3_linear none = {{0}, {0}, 0, 0};
    lw.sh_gate = lw.sh_up = lw.sh_down = none;
    m3_moe_params p1 = {3, 1, 1.0f, {0.0f, 7.0f}, NULL};
    fill16(out, 2, BF16_NAN);
    CHECK_OK(be->ops->moe(be, 1, x, &lw, &p1, out));
    EXPECT_BF16_IS(out[0], 2.0f);
    EXPECT_BF16_IS(out[1], -2.0f);
}

static void test_moe(void) {
    moe_fx f;
    moe_fx_random(&f, 8, 64, 32, 48);
    moe_case("moe with shared expert", &f, true, 6);
    moe_case("moe without shared expert", &f, false, 6);
    moe_case("moe one row", &f, true, 1);
    moe_fx_free(&f);
    /* wider, and enough rows that every thread takes some of the work */
    moe_fx_random(&f, 8, 256, 64, 96);
    moe_case("moe 40 rows", &f, true, 40);
    moe_fx_free(&f);
    moe_tiny();
}

/* ------------------------------------------------------------ main */

int main(void) {
    void (*const tests[])(void) = {test_swiglu, test_moe};
    return cpu_ops_main("test_cpu_moe_ops", tests, (int)(sizeof tests / sizeof *tests));
}
