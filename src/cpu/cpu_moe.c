/*
 * The MoE FFN on the CPU (SPEC §2.3 step 7): the fp32 router, then each
 * expert that at least one row routed to runs once over its gathered rows
 * (so only routed experts' weights are read), then the shared expert, then
 * one fp32 sum per row in routing-rank order, rounded once. At TP > 1 each
 * rank holds a slice of every expert's width: its down outputs are fp64
 * partial sums, all-reduced in rank order before the SPEC's rounding, so
 * every rank computes exactly the TP 1 result.
 */
#include <string.h>

#include "core/bf16.h"
#include "core/status.h"
#include "cpu/cpu.h"

typedef struct moe_buffers {
    float *logits;      /* [rows, E] */
    int32_t *ids;       /* [rows, k] */
    float *weights;     /* [rows, k] */
    int32_t *members;   /* [rows * k]: row * k + slot, grouped by expert */
    int32_t *first;     /* [E + 1]: each expert's range in members */
    uint16_t *xe;       /* [rows, H]: gathered rows */
    uint16_t *gate, *up, *act; /* [rows, max(I, Is)] */
    /* down outputs: bf16, or at TP > 1 this rank's unrounded fp64 partials,
     * all-reduced before they are rounded */
    void *down;         /* [rows, H] */
    void *eout;         /* [rows * k, H]: each (row, slot)'s expert output */
    void *shared;       /* [rows, H] */
    size_t down_size;   /* 2 or 8 bytes */
} moe_buffers;

static m3_status carve(m3_cpu *cpu, int rows, int E, int k, int64_t H, int64_t width,
                       size_t dsz, moe_buffers *b) {
    size_t sizes[11] = {
        (size_t)rows * E * 4, (size_t)rows * k * 4, (size_t)rows * k * 4, (size_t)rows * k * 4,
        (size_t)(E + 1) * 4,  (size_t)rows * H * 2, (size_t)rows * width * 2 * 3,
        (size_t)rows * H * dsz, (size_t)rows * k * H * dsz, (size_t)rows * H * dsz, 0};
    b->down_size = dsz;
    size_t total = 0;
    for (int i = 0; i < 10; i++)
        total += (sizes[i] + 63) / 64 * 64;
    char *base;
    M3_TRY(m3_cpu_scratch(cpu, M3_SCRATCH_MOE, total, (void **)&base));
    void *parts[10];
    for (int i = 0; i < 10; i++) {
        parts[i] = base;
        base += (sizes[i] + 63) / 64 * 64;
    }
    b->logits = parts[0];
    b->ids = parts[1];
    b->weights = parts[2];
    b->members = parts[3];
    b->first = parts[4];
    b->xe = parts[5];
    b->gate = parts[6];
    b->up = b->gate + (size_t)rows * width;
    b->act = b->up + (size_t)rows * width;
    b->down = parts[7];
    b->eout = parts[8];
    b->shared = parts[9];
    return M3_OK;
}

/* gate/up projections, the activation and the down projection of one
 * expert (or the shared expert, or a dense MLP) over n gathered rows. */
static m3_status run_ffn(m3_backend *be, int n, const uint16_t *x, const m3_linear *gate,
                         const m3_linear *up, const m3_linear *down, const m3_swiglu *act,
                         moe_buffers *b, void *out) {
    int64_t width = gate->w.ne[0];
    M3_TRY(m3_cpu_linear(be, n, x, gate, M3_DT_BF16, b->gate));
    M3_TRY(m3_cpu_linear(be, n, x, up, M3_DT_BF16, b->up));
    M3_TRY(m3_cpu_swiglu(be, (int64_t)n * width, b->gate, b->up, act, b->act));
    return m3_cpu_linear(be, n, b->act, down, b->down_size == 8 ? M3_DT_F64 : M3_DT_BF16, out);
}

/* Group (row, slot) pairs by expert: counting sort, stable in row order. */
static void group_by_expert(int rows, int E, int k, moe_buffers *b) {
    memset(b->first, 0, (size_t)(E + 1) * sizeof *b->first);
    for (int i = 0; i < rows * k; i++)
        b->first[b->ids[i] + 1]++;
    for (int e = 0; e < E; e++)
        b->first[e + 1] += b->first[e];
    int32_t fill[4096];
    memcpy(fill, b->first, (size_t)E * sizeof *fill);
    for (int i = 0; i < rows * k; i++)
        b->members[fill[b->ids[i]]++] = i;
}

typedef struct combine_job {
    const moe_buffers *b;
    int k;
    int64_t H;
    float scaling;
    bool has_shared;
    uint16_t *out;
} combine_job;

/* element i of a down-output buffer, rounded as SPEC §2.3 says: an fp64
 * (all-reduced) sum is rounded to fp32 as a dot product is, then to bf16 */
static float down_at(const moe_buffers *b, const void *buf, int64_t i) {
    if (b->down_size == 8)
        return m3_bf16_to_f32(m3_f32_to_bf16((float)((const double *)buf)[i]));
    return m3_bf16_to_f32(((const uint16_t *)buf)[i]);
}

uint16_t m3_moe_combine_elem(int k, const float *weights, const float *down, float scaling,
                             bool has_shared, float shared) {
    float acc = 0;
    for (int s = 0; s < k; s++)
        acc += weights[s] * down[s];
    float y = scaling * acc;
    if (has_shared)
        y += shared;
    return m3_f32_to_bf16(y);
}

static void combine_rows(void *ctx, int64_t begin, int64_t end, int thread) {
    const combine_job *j = ctx;
    float down[64];
    for (int64_t t = begin; t < end; t++) {
        for (int64_t h = 0; h < j->H; h++) {
            for (int s = 0; s < j->k; s++)
                down[s] = down_at(j->b, j->b->eout, (t * j->k + s) * j->H + h);
            float shared = j->has_shared ? down_at(j->b, j->b->shared, t * j->H + h) : 0.0f;
            j->out[t * j->H + h] = m3_moe_combine_elem(j->k, j->b->weights + t * j->k, down,
                                                       j->scaling, j->has_shared, shared);
        }
    }
}

m3_status m3_cpu_moe(m3_backend *be, int rows, const uint16_t *x, const m3_layer_weights *lw,
                     const m3_moe_params *p, uint16_t *out) {
    m3_cpu *cpu = m3_cpu_of(be);
    bool tp = p->tp && p->tp->world > 1;
    size_t dsz = tp ? 8 : 2;
    int E = p->num_experts, k = p->top_k;
    int64_t H = lw->router.ne[1];
    int64_t I = lw->exp_gate[0].w.ne[0], Is = lw->sh_gate.w.data ? lw->sh_gate.w.ne[0] : 0;
    if (E > 4096 || k > 64)
        return m3_fail(M3_ERR_INTERNAL, "moe: %d experts / top %d beyond the CPU limits", E, k);
    moe_buffers b;
    M3_TRY(carve(cpu, rows, E, k, H, I > Is ? I : Is, dsz, &b));

    M3_TRY(m3_cpu_linear_f32w(cpu, rows, x, &lw->router, b.logits));
    const float *bias = lw->router_bias.data ? (const float *)lw->router_bias.data : NULL;
    for (int t = 0; t < rows; t++)
        m3_route_row(b.logits + (int64_t)t * E, bias, E, k, b.ids + t * k, b.weights + t * k);

    group_by_expert(rows, E, k, &b);
    for (int e = 0; e < E; e++) {
        int n = b.first[e + 1] - b.first[e];
        if (!n)
            continue; /* never routed to: its weights are not read */
        const int32_t *mem = b.members + b.first[e];
        for (int i = 0; i < n; i++)
            memcpy(b.xe + (int64_t)i * H, x + (int64_t)(mem[i] / k) * H, (size_t)H * 2);
        M3_TRY(run_ffn(be, n, b.xe, &lw->exp_gate[e], &lw->exp_up[e], &lw->exp_down[e], &p->act,
                       &b, b.down));
        for (int i = 0; i < n; i++)
            memcpy((char *)b.eout + (size_t)mem[i] * (size_t)H * dsz,
                   (char *)b.down + (size_t)i * (size_t)H * dsz, (size_t)H * dsz);
    }
    if (Is)
        M3_TRY(run_ffn(be, rows, x, &lw->sh_gate, &lw->sh_up, &lw->sh_down, &p->act, &b,
                       b.shared));
    if (tp) { /* whole down outputs on every rank, then rounded as at TP 1 */
        M3_TRY(p->tp->ops->all_reduce_sum_f64(p->tp, b.eout, (int64_t)rows * k * H));
        if (Is)
            M3_TRY(p->tp->ops->all_reduce_sum_f64(p->tp, b.shared, (int64_t)rows * H));
    }
    combine_job cj = {&b, k, H, p->routed_scaling, Is > 0, out};
    m3_pool_for(cpu->pool, rows, 1, combine_rows, &cj);
    return M3_OK;
}
