/*
 * The CPU executor of the mono path (see cpu_mono.h): one sparse MoE layer
 * of a decode step as one threaded pass over the backend's pool
 * (m3_pool_run_all). Every pool thread walks the same phases; each phase
 * splits its work statically over the threads (contiguous ranges of a
 * fixed item list), and each item is computed wholly by one thread with
 * the stock ops' row kernels (cpu/cpu.h) in their order, so results never
 * depend on the thread count and equal the stock path's bits. Phases meet
 * at m3_pool_barrier:
 *
 *   norm      per row: residual += hidden; x = norm(residual); RoPE table
 *   proj      per weight row of q|k|v|iq|ik: every row's dot, rounded
 *   heads     per (row, head): norm + RoPE of q, k, iq, ik (one rounding);
 *             k, v, ik written to the cache at the row's slot
 *   scores    per (row, index head, visible block): the block's score
 *   select    per (row, index head): SPEC §3 selection
 *             (with indexer CP, one phase on thread 0 instead: the rows'
 *             index queries and keys gathered over the TP group,
 *             cp/cp_layer.h, the same selection bit for bit)
 *   attention per (row, query head): sparse attention, rounded
 *   o_proj    per weight row: TP 1 bf16; TP fp64 partial into this rank's
 *             peer slot -> [push, wait] -> sum over ranks, rounded
 *   post norm per row: residual += o; x = norm(residual)
 *   router    per (row, expert): fp32 logits
 *   route     per row: top-k by sigmoid + bias, weights
 *   gate/up   per (routed expert, width column) and shared column: gate,
 *             up and act of every row routed there, each rounded
 *   down      per (routed expert, output) and shared output: TP 1 bf16;
 *             TP fp64 partials into the peer slot -> [push, wait]
 *   combine   per (row, output): (TP: sum over ranks, rounded) y =
 *             bf16(scaling sum w_s down_s + shared) -> hidden
 *
 * Only real rows (slot >= 0) are computed; a padded row writes no cache,
 * its hidden is zeroed and its residual left alone. Only experts some row
 * routes to are read.
 *
 * The fault word is checked before every phase; once set (a bad slot or
 * page found on entry, a peer that did not arrive, an abort) every thread
 * skips the remaining phases' work but still meets every barrier, so the
 * pass always ends.
 *
 * TP all-reduce: the group holds per rank two slots (o_proj uses slot 0,
 * the MoE slot 1: a layer's reductions alternate, so consecutive
 * reductions never share a slot) and a tag per slot. A rank's threads
 * write their partials straight into its slot; after a barrier thread 0
 * publishes the tag (release) and waits until every rank's tag for that
 * slot equals (epoch, layer, which) (acquire), bounded by the group's
 * timeout; a barrier later every thread sums its elements over the slots
 * in rank order. A rank reuses a slot two reductions later, which needs
 * every peer's next push, which each peer makes only after it finished
 * reading: so nothing is overwritten while read and nothing is cleared.
 */
#include "cpu/cpu_mono.h"

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/bf16.h"
#include "core/pool.h"
#include "core/status.h"
#include "cp/cp_layer.h"
#include "cpu/cpu.h"
#include "cpu/cpu_mono_internal.h"
#include "dist/comm.h"

static inline double *peer_slot(const m3_cpu_mono_group *g, int rank, int which) {
    return g->buf + ((size_t)rank * 2 + (size_t)which) * g->cap;
}

/* unique per (epoch, layer, which) and never 0 */
static inline uint64_t make_tag(uint32_t epoch, int layer, int which) {
    return ((uint64_t)epoch << 32) | ((uint64_t)(layer & 0x3fffffff) << 2) |
           ((uint64_t)which << 1) | 1u;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Thread 0, after the barrier that ends the writes into this rank's slot:
 * publish it, then wait for every rank's push of the same reduction. Sets
 * PEER_WAIT on a wait past the timeout; returns at once when the fault
 * word is (or becomes) set. */
static void exchange(m3_cpu_mono *m, int which) {
    if (faulted(m))
        return;
    m3_cpu_mono_group *g = m->group;
    uint64_t tag = make_tag(m->c.epoch, m->c.layer, which);
    atomic_store_explicit(&g->tag[m->tp_rank][which].v, tag, memory_order_release);
    int64_t start = 0, deadline = 0, sleep_ns = 2000;
    for (int r = 0; r < g->world; r++) {
        for (int i = 0; atomic_load_explicit(&g->tag[r][which].v, memory_order_acquire) != tag;
             i++) {
            if (faulted(m))
                return; /* aborted */
            if (i < 256) {
                relax();
                continue;
            }
            if (!start) {
                start = now_ns();
                deadline = start + g->timeout_ms * 1000000;
            }
            if (now_ns() > deadline) {
                fault_set(m->fault, M3_MONO_FAULT_PEER_WAIT, m->c.layer, -1, r);
                return;
            }
            if (i < 2048) {
                sched_yield();
            } else {
                struct timespec ts = {0, sleep_ns};
                nanosleep(&ts, NULL);
                if (sleep_ns < 500000)
                    sleep_ns *= 2;
            }
        }
    }
}

/* ------------------------------------------------------------ phases */

/* [*b, *e): thread th's share of n items */
static inline void share(int64_t n, int th, int nth, int64_t *b, int64_t *e) {
    *b = n * th / nth;
    *e = n * (th + 1) / nth;
}

static inline const int32_t *row_table(const m3_step *st, int t) {
    return st->host.block_table + (int64_t)st->host.row_req[t] * st->max_blocks;
}

/* 1. residual += hidden (not on the first layer); x = norm; RoPE tables */
static void ph_norm(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    m3_rope rope = {m->cfg.rotary_dim, m->cfg.rope_theta};
    int64_t b, e;
    share(c->n_act, th, nth, &b, &e);
    for (int64_t a = b; a < e; a++) {
        int t = m->act[a];
        m3_add_norm_row(c->first ? NULL : c->hidden + (int64_t)t * m->H,
                        c->residual + (int64_t)t * m->H, c->lw->input_norm.data, m->H,
                        m->cfg.rms_norm_eps, m->tbuf[th], NULL, m->xf + a * m->H);
        m3_rope_table(c->st->host.positions[t], &rope, m->rope_cos + a * m->half,
                      m->rope_sin + a * m->half);
    }
}

/* out[a, n] = bf16(x[a] . row n) for the real rows, rows [b, e) of w */
static void linear_rows(const m3_cpu_mono *m, const m3_linear *w, int64_t b, int64_t e,
                        uint16_t *out, int64_t width, float *wrow) {
    int64_t K = w->w.ne[1];
    for (int64_t n = b; n < e; n++) {
        m3_linear_row_f32(w, n, wrow);
        for (int a = 0; a < m->c.n_act; a++)
            out[a * width + n] = m3_f32_to_bf16(m3_dot_f32(m->xf + a * K, wrow, K));
    }
}

/* 2. q, k, v, iq, ik: one column space over the five weights */
static void ph_proj(m3_cpu_mono *m, int th, int nth) {
    const m3_layer_weights *lw = m->c.lw;
    struct {
        const m3_linear *w;
        uint16_t *out;
    } seg[5] = {{&lw->q_proj, m->q},
                {&lw->k_proj, m->kk},
                {&lw->v_proj, m->v},
                {&lw->iq_proj, m->iq},
                {&lw->ik_proj, m->ik}};
    int64_t total = 0;
    for (int s = 0; s < 5; s++)
        total += seg[s].w->w.ne[0];
    int64_t b, e, base = 0;
    share(total, th, nth, &b, &e);
    for (int s = 0; s < 5; s++) {
        int64_t N = seg[s].w->w.ne[0];
        int64_t lo = b > base ? b - base : 0, hi = e - base < N ? e - base : N;
        if (lo < hi)
            linear_rows(m, seg[s].w, lo, hi, seg[s].out, N, m->tbuf[th]);
        base += N;
    }
}

/* 3. per (row, head): q, k, iq, ik normed + rotated (one rounding); k, v, ik
 * written at the row's slot */
static void ph_heads(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    const m3_layer_weights *lw = c->lw;
    int D = m->D, Di = m->Di, Nq = m->Nq, Nkv = m->Nkv, Ni = m->Ni, rot = m->cfg.rotary_dim;
    float eps = m->cfg.rms_norm_eps;
    int per_row = Nq + 2 * Nkv + Ni + 1;
    int64_t b, e;
    share((int64_t)c->n_act * per_row, th, nth, &b, &e);
    for (int64_t item = b; item < e; item++) {
        int a = (int)(item / per_row), j = (int)(item % per_row);
        int t = m->act[a];
        int64_t slot = c->st->host.slots[t];
        int64_t page = slot / M3_PAGE_TOKENS, off = slot % M3_PAGE_TOKENS;
        const float *cs = m->rope_cos + (int64_t)a * m->half;
        const float *sn = m->rope_sin + (int64_t)a * m->half;
        if (j < Nq) {
            m3_head_norm_rope_row(m->q + ((int64_t)a * Nq + j) * D, lw->q_norm.data, D, eps, rot,
                                  cs, sn, m->tbuf[th]);
        } else if ((j -= Nq) < Nkv) {
            uint16_t *head = m->kk + ((int64_t)a * Nkv + j) * D;
            m3_head_norm_rope_row(head, lw->k_norm.data, D, eps, rot, cs, sn, m->tbuf[th]);
            memcpy((uint16_t *)c->cl->k + m3_cache_offset(page, off, Nkv, j, D), head,
                   (size_t)D * 2);
        } else if ((j -= Nkv) < Nkv) {
            memcpy((uint16_t *)c->cl->v + m3_cache_offset(page, off, Nkv, j, D),
                   m->v + ((int64_t)a * Nkv + j) * D, (size_t)D * 2);
        } else if ((j -= Nkv) < Ni) {
            m3_head_norm_rope_row(m->iq + ((int64_t)a * Ni + j) * Di, lw->iq_norm.data, Di, eps,
                                  rot, cs, sn, m->tbuf[th]);
        } else {
            uint16_t *head = m->ik + (int64_t)a * Di;
            m3_head_norm_rope_row(head, lw->ik_norm.data, Di, eps, rot, cs, sn, m->tbuf[th]);
            memcpy((uint16_t *)c->cl->index + m3_cache_offset(page, off, 1, 0, Di), head,
                   (size_t)Di * 2);
        }
    }
}

/* 4. per (row, index head, visible block): the block's score */
static void ph_scores(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    int Di = m->Di, Ni = m->Ni;
    float scale = m3_index_scale(Di);
    float *q = m->tbuf[th], *kbuf = q + Di;
    int64_t b, e;
    share(m->score_first[c->n_act], th, nth, &b, &e);
    int a = 0, last_a = -1, last_h = -1;
    for (int64_t item = b; item < e; item++) {
        while (item >= m->score_first[a + 1])
            a++;
        int64_t local = item - m->score_first[a];
        int h = (int)(local / m->nblk[a]), blk = (int)(local % m->nblk[a]);
        int t = m->act[a];
        if (a != last_a || h != last_h) {
            m3_bf16_row_to_f32(m->iq + ((int64_t)a * Ni + h) * Di, q, Di);
            last_a = a;
            last_h = h;
        }
        int64_t kv_len = c->st->host.positions[t] + 1;
        m->scores[((int64_t)a * Ni + h) * c->mb + blk] =
            m3_index_block_score(q, c->cl->index, row_table(c->st, t)[blk],
                                 m3_block_keys(kv_len, blk), Di, scale, kbuf);
    }
}

/* 5. per (row, index head): the selected blocks */
static void ph_select(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    m3_select_params sp = {m->cfg.topk_blocks, m->cfg.init_blocks, m->cfg.local_blocks};
    int64_t b, e;
    share((int64_t)c->n_act * m->Ni, th, nth, &b, &e);
    for (int64_t item = b; item < e; item++) {
        int a = (int)(item / m->Ni);
        m3_select_row(m->scores + item * c->mb, m->nblk[a], &sp, m->sel + item * m->topk,
                      (int32_t *)m->tbuf[th]);
    }
}

/* 4-5 with indexer CP, thread 0 (every rank's thread 0 meets in the
 * gathers while the other threads wait at the barrier): the real rows as
 * one-row requests; a failure (a peer that aborted or did not arrive)
 * faults the step */
static void ph_cp(m3_cpu_mono *m, int th, int nth) {
    (void)nth;
    if (th != 0)
        return;
    const mono_call *c = &m->c;
    for (int a = 0; a < c->n_act; a++) {
        int t = m->act[a];
        m->cp_lens[a] = (int32_t)(c->st->host.positions[t] + 1);
        memcpy(m->cp_table + (size_t)a * m->max_blocks, row_table(c->st, t),
               (size_t)m->nblk[a] * sizeof(int32_t));
    }
    m3_cp_rows r = {c->n_act, c->n_act, m->Ni, m->Di, m->iq, c->cl->index, c->st->n_pages,
                    m->cp_table, m->max_blocks, m->cp_lens,
                    (int64_t)m->max_blocks * M3_PAGE_TOKENS};
    m3_select_params sp = {m->cfg.topk_blocks, m->cfg.init_blocks, m->cfg.local_blocks};
    float scale = m3_index_scale(m->Di);
    if (c->n_act > 0 && m3_cp_select_rows(m->cp, &r, scale, &sp, m->sel))
        fault_set(m->fault, M3_MONO_FAULT_ABORTED, c->layer, -1, 0);
}

/* 6. per (row, query head): attention over the group's selected blocks */
static void ph_attention(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    int D = m->D, Nq = m->Nq, group = m->Nq / m->Nkv;
    float scale = (float)(1.0 / sqrt((double)D));
    float *q = m->tbuf[th], *buf = q + (D + 1) / 2 * 2; /* 8-byte aligned */
    int64_t b, e;
    share((int64_t)c->n_act * Nq, th, nth, &b, &e);
    for (int64_t item = b; item < e; item++) {
        int a = (int)(item / Nq), h = (int)(item % Nq), g = h / group;
        int t = m->act[a];
        const int32_t *blocks = m->sel + ((int64_t)a * m->Ni + g) * m->topk;
        int nb = 0; /* (< nblk: a selection is; a stale one after an abort might not be) */
        while (nb < m->topk && blocks[nb] >= 0 && blocks[nb] < m->nblk[a])
            nb++;
        m3_bf16_row_to_f32(m->q + item * D, q, D);
        uint16_t *out = m->attn + item * D;
        m3_attend_head(q, g, m->Nkv, D, c->cl->k, c->cl->v, row_table(c->st, t), blocks, nb,
                       c->st->host.positions[t] + 1, scale, buf, out);
        m3_bf16_row_to_f32(out, m->attnf + item * D, D);
    }
}

/* 7. o_proj: TP 1 rounded into o; TP fp64 partials into the peer slot */
static void ph_oproj(m3_cpu_mono *m, int th, int nth) {
    const m3_linear *w = &m->c.lw->o_proj;
    int64_t K = w->w.ne[1], H = m->H;
    double *part = m->tp ? peer_slot(m->group, m->tp_rank, WHICH_O) : NULL;
    float *wrow = m->tbuf[th];
    int64_t b, e;
    share(H, th, nth, &b, &e);
    for (int64_t n = b; n < e; n++) {
        m3_linear_row_f32(w, n, wrow);
        for (int a = 0; a < m->c.n_act; a++) {
            const float *x = m->attnf + a * K;
            if (part)
                part[a * H + n] = m3_dot_f64(x, wrow, K);
            else
                m->o[a * H + n] = m3_f32_to_bf16(m3_dot_f32(x, wrow, K));
        }
    }
}

/* TP: o = bf16(sum over ranks in rank order), as the stock all-reduce and
 * round_bf16 do */
static void ph_oreduce(m3_cpu_mono *m, int th, int nth) {
    const m3_cpu_mono_group *g = m->group;
    int64_t b, e;
    share((int64_t)m->c.n_act * m->H, th, nth, &b, &e);
    for (int64_t i = b; i < e; i++) {
        double acc = 0;
        for (int r = 0; r < g->world; r++)
            acc += peer_slot(g, r, WHICH_O)[i];
        m->o[i] = m3_f32_to_bf16((float)acc);
    }
}

/* 8. residual += o; x = post-attention norm */
static void ph_post_norm(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    int64_t b, e;
    share(c->n_act, th, nth, &b, &e);
    for (int64_t a = b; a < e; a++)
        m3_add_norm_row(m->o + a * m->H, c->residual + (int64_t)m->act[a] * m->H,
                        c->lw->post_norm.data, m->H, m->cfg.rms_norm_eps, m->tbuf[th], NULL,
                        m->xf + a * m->H);
}

/* 9. fp32 router logits per (row, expert) */
static void ph_router(m3_cpu_mono *m, int th, int nth) {
    const float *w = m->c.lw->router.data;
    int64_t b, e;
    share((int64_t)m->c.n_act * m->E, th, nth, &b, &e);
    for (int64_t i = b; i < e; i++) {
        int64_t a = i / m->E, x = i % m->E;
        m->logits[i] = m3_dot_f32(m->xf + a * m->H, w + x * m->H, m->H);
    }
}

/* 10. routing per row */
static void ph_route(m3_cpu_mono *m, int th, int nth) {
    const m3_tensor *bias = &m->c.lw->router_bias;
    int64_t b, e;
    share(m->c.n_act, th, nth, &b, &e);
    for (int64_t a = b; a < e; a++)
        m3_route_row(m->logits + a * m->E, bias->data ? (const float *)bias->data : NULL, m->E,
                     m->k, m->ids + a * m->k, m->wts + a * m->k);
}

/* The routed experts in ascending id (distinct[0..n)), each one's (row,
 * slot) pairs a * k + s in row order (members[first[e] .. first[e + 1])):
 * built by every thread for itself from the routing. */
typedef struct expert_list {
    int32_t *first, *members, *distinct;
    int n;
} expert_list;

static expert_list build_list(const m3_cpu_mono *m, int th) {
    expert_list l;
    int E = m->E, pairs = m->c.n_act * m->k;
    int32_t *base = m->tlist[th];
    l.first = base;
    int32_t *fill = base + E + 1;
    l.members = fill + E;
    l.distinct = l.members + (size_t)m->max_rows * m->k;
    memset(l.first, 0, (size_t)(E + 1) * sizeof *l.first);
    for (int i = 0; i < pairs; i++)
        l.first[m->ids[i] + 1]++;
    l.n = 0;
    for (int e = 0; e < E; e++) {
        if (l.first[e + 1])
            l.distinct[l.n++] = e;
        l.first[e + 1] += l.first[e];
    }
    memcpy(fill, l.first, (size_t)E * sizeof *fill);
    for (int i = 0; i < pairs; i++)
        l.members[fill[m->ids[i]]++] = i;
    return l;
}

/* 11. gate, up (each rounded) and act (rounded) per routed expert column,
 * then the shared expert's columns */
static void ph_gate_up(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    const m3_layer_weights *lw = c->lw;
    expert_list l = build_list(m, th);
    int64_t I = c->I, Is = c->Is, H = m->H;
    const m3_swiglu act = {m->cfg.swiglu_alpha, m->cfg.swiglu_limit};
    float *grow = m->tbuf[th], *urow = grow + H;
    int64_t routed = (int64_t)l.n * I, total = routed + (c->has_shared ? Is : 0);
    int64_t b, e;
    share(total, th, nth, &b, &e);
    for (int64_t col = b; col < e; col++) {
        bool shared = col >= routed;
        int64_t n = shared ? col - routed : col % I;
        int ex = shared ? -1 : l.distinct[col / I];
        const m3_linear *gw = shared ? &lw->sh_gate : &lw->exp_gate[ex];
        const m3_linear *uw = shared ? &lw->sh_up : &lw->exp_up[ex];
        m3_linear_row_f32(gw, n, grow);
        m3_linear_row_f32(uw, n, urow);
        int cnt = shared ? c->n_act : l.first[ex + 1] - l.first[ex];
        for (int i = 0; i < cnt; i++) {
            int p = shared ? i : l.members[l.first[ex] + i];
            const float *x = m->xf + (int64_t)(shared ? p : p / m->k) * H;
            uint16_t g = m3_f32_to_bf16(m3_dot_f32(x, grow, H));
            uint16_t u = m3_f32_to_bf16(m3_dot_f32(x, urow, H));
            float y = m3_round_bf16(m3_swiglu_oai(m3_bf16_to_f32(g), m3_bf16_to_f32(u), &act));
            if (shared)
                m->shf[(int64_t)p * Is + n] = y;
            else
                m->actf[(int64_t)p * I + n] = y;
        }
    }
}

/* 12. down projections per routed expert output and shared output: TP 1
 * rounded; TP fp64 partials into the peer slot ((row, slot) pairs, then
 * the shared rows) */
static void ph_down(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    const m3_layer_weights *lw = c->lw;
    expert_list l = build_list(m, th);
    int64_t I = c->I, Is = c->Is, H = m->H, pairs = (int64_t)c->n_act * m->k;
    double *part = m->tp ? peer_slot(m->group, m->tp_rank, WHICH_MOE) : NULL;
    float *drow = m->tbuf[th];
    int64_t routed = (int64_t)l.n * H, total = routed + (c->has_shared ? H : 0);
    int64_t b, e;
    share(total, th, nth, &b, &e);
    for (int64_t col = b; col < e; col++) {
        bool shared = col >= routed;
        int64_t h = shared ? col - routed : col % H;
        int ex = shared ? -1 : l.distinct[col / H];
        const m3_linear *dw = shared ? &lw->sh_down : &lw->exp_down[ex];
        int64_t K = shared ? Is : I;
        m3_linear_row_f32(dw, h, drow);
        int cnt = shared ? c->n_act : l.first[ex + 1] - l.first[ex];
        for (int i = 0; i < cnt; i++) {
            int p = shared ? i : l.members[l.first[ex] + i];
            const float *x = shared ? m->shf + (int64_t)p * Is : m->actf + (int64_t)p * I;
            int64_t row = shared ? pairs + p : p; /* row of the peer slot */
            if (part)
                part[row * H + h] = m3_dot_f64(x, drow, K);
            else if (shared)
                m->shout[(int64_t)p * H + h] = m3_f32_to_bf16(m3_dot_f32(x, drow, K));
            else
                m->eout[(int64_t)p * H + h] = m3_f32_to_bf16(m3_dot_f32(x, drow, K));
        }
    }
}

/* an all-reduced fp64 element rounded as the stock path rounds it */
static inline float reduced(const m3_cpu_mono_group *g, int64_t i) {
    double acc = 0;
    for (int r = 0; r < g->world; r++)
        acc += peer_slot(g, r, WHICH_MOE)[i];
    return m3_round_bf16((float)acc);
}

/* 13. y = bf16(scaling sum_s w_s down_s + shared) into hidden; padded
 * rows' hidden zeroed */
static void ph_combine(m3_cpu_mono *m, int th, int nth) {
    const mono_call *c = &m->c;
    int64_t H = m->H, k = m->k, pairs = (int64_t)c->n_act * k;
    float down[MONO_MAX_TOPK];
    int64_t b, e;
    share((int64_t)c->n_act * H, th, nth, &b, &e);
    for (int64_t i = b; i < e; i++) {
        int64_t a = i / H, h = i % H;
        float shared = 0;
        for (int64_t s = 0; s < k; s++)
            down[s] = m->tp ? reduced(m->group, (a * k + s) * H + h)
                            : m3_bf16_to_f32(m->eout[(a * k + s) * H + h]);
        if (c->has_shared)
            shared = m->tp ? reduced(m->group, (pairs + a) * H + h)
                           : m3_bf16_to_f32(m->shout[a * H + h]);
        c->hidden[(int64_t)m->act[a] * H + h] = m3_moe_combine_elem(
            (int)k, m->wts + a * k, down, m->cfg.routed_scaling_factor, c->has_shared, shared);
    }
    if (th == 0)
        for (int t = 0; t < c->st->rows; t++)
            if (c->st->host.slots[t] < 0)
                memset(c->hidden + (int64_t)t * H, 0, (size_t)H * 2);
}

typedef void (*phase_fn)(m3_cpu_mono *m, int th, int nth);

/* a phase's work unless the fault word is set, then the barrier (always:
 * every thread meets every barrier, so the pass ends whatever it sees) */
static inline void phase(m3_cpu_mono *m, phase_fn fn, int th, int nth) {
    if (!faulted(m))
        fn(m, th, nth);
    m3_pool_barrier(m->pool);
}

static void pass(void *ctx, int th, int nth) {
    m3_cpu_mono *m = ctx;
    phase(m, ph_norm, th, nth);
    phase(m, ph_proj, th, nth);
    phase(m, ph_heads, th, nth);
    if (m->cp) {
        phase(m, ph_cp, th, nth);
    } else {
        phase(m, ph_scores, th, nth);
        phase(m, ph_select, th, nth);
    }
    phase(m, ph_attention, th, nth);
    phase(m, ph_oproj, th, nth);
    if (m->tp) {
        if (th == 0)
            exchange(m, WHICH_O);
        m3_pool_barrier(m->pool);
        phase(m, ph_oreduce, th, nth);
    }
    phase(m, ph_post_norm, th, nth);
    phase(m, ph_router, th, nth);
    phase(m, ph_route, th, nth);
    phase(m, ph_gate_up, th, nth);
    phase(m, ph_down, th, nth);
    if (m->tp) {
        if (th == 0)
            exchange(m, WHICH_MOE);
        m3_pool_barrier(m->pool);
    }
    if (!faulted(m))
        ph_combine(m, th, nth);
}

/* ------------------------------------------------------------ the layer */

static bool linear_ok(const m3_linear *l, int64_t rows, int64_t cols) {
    return l->w.data && l->w.ne[0] == rows && l->w.ne[1] == cols &&
           (l->w.dtype == M3_DT_BF16 || (l->w.dtype == M3_DT_F8_E4M3 && l->scale.data));
}

static m3_status check_weights(const m3_cpu_mono *m, int layer, const m3_layer_weights *lw,
                               int64_t *I, int64_t *Is) {
    int64_t H = m->H, D = m->D, Di = m->Di;
    const char *bad = NULL;
    if (!linear_ok(&lw->q_proj, (int64_t)m->Nq * D, H))
        bad = "q_proj";
    else if (!linear_ok(&lw->k_proj, (int64_t)m->Nkv * D, H))
        bad = "k_proj";
    else if (!linear_ok(&lw->v_proj, (int64_t)m->Nkv * D, H))
        bad = "v_proj";
    else if (!linear_ok(&lw->o_proj, H, (int64_t)m->Nq * D))
        bad = "o_proj";
    else if (!linear_ok(&lw->iq_proj, (int64_t)m->Ni * Di, H))
        bad = "index q_proj";
    else if (!linear_ok(&lw->ik_proj, Di, H))
        bad = "index k_proj";
    else if (!lw->input_norm.data || !lw->post_norm.data || !lw->q_norm.data ||
             !lw->k_norm.data || !lw->iq_norm.data || !lw->ik_norm.data)
        bad = "a norm weight";
    else if (!lw->router.data || lw->router.dtype != M3_DT_F32 || lw->router.ne[0] != m->E ||
             lw->router.ne[1] != H)
        bad = "the router";
    else if (!lw->exp_gate || !lw->exp_up || !lw->exp_down)
        bad = "the experts";
    if (bad)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: layer %d: %s is missing or has another "
                       "shape than the rank's config", layer, bad);
    *I = lw->exp_gate[0].w.ne[0];
    *Is = lw->sh_gate.w.data ? lw->sh_gate.w.ne[0] : 0;
    if (*I < 1 || *I > m->I || !linear_ok(&lw->exp_gate[0], *I, H) ||
        !linear_ok(&lw->exp_up[0], *I, H) || !linear_ok(&lw->exp_down[0], H, *I))
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: layer %d: expert width %lld (the config "
                       "says %d)", layer, (long long)*I, m->I);
    if (*Is > m->Is || (*Is && (!linear_ok(&lw->sh_up, *Is, H) ||
                                !linear_ok(&lw->sh_down, H, *Is))))
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: layer %d: shared expert width %lld (the "
                       "config says %d)", layer, (long long)*Is, m->Is);
    return M3_OK;
}

m3_status m3_cpu_mono_layer(m3_cpu_mono *m, const m3_step *st, int layer,
                            const m3_layer_weights *lw, const m3_cache_layer *cl, bool first,
                            uint32_t epoch, uint16_t *hidden, uint16_t *residual) {
    if (!m || !st || !lw || !cl || !hidden || !residual)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_cpu_mono_layer: executor, step, weights, cache, "
                       "hidden and residual are required");
    if (faulted(m))
        return M3_OK; /* sticky: the lifecycle reports it */
    if (layer < 0 || layer >= m->cfg.num_layers)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: layer %d is outside [0, %d)", layer,
                       m->cfg.num_layers);
    if (!lw->sparse || !lw->moe)
        return m3_fail(M3_ERR_INVALID_ARG, "the mono path takes sparse MoE layers; layer %d is "
                       "%s attention with a %s FFN", layer, lw->sparse ? "sparse" : "dense",
                       lw->moe ? "MoE" : "dense MLP");
    if (st->rows < 0 || st->rows > m->max_rows)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: a step of %d rows; the executor takes at "
                       "most max_rows = %d", st->rows, m->max_rows);
    if (st->rows == 0)
        return M3_OK;
    if (!cl->k || !cl->v || !cl->index)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: layer %d has no %s cache", layer,
                       !cl->k ? "K" : !cl->v ? "V" : "index");
    const m3_step_arrays *h = &st->host;
    if (!h->positions || !h->slots || !h->row_req || !h->block_table || !h->query_start)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: the step has no positions, slots, rows' "
                       "requests, query starts or block table");
    if (st->n_reqs < 1 || st->n_prefill > 0 || st->max_query_len > 1)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: the step is not decode-only (%d requests, "
                       "%d prefill, longest query %d rows)", st->n_reqs, st->n_prefill,
                       st->max_query_len);
    for (int r = 0; r < st->n_reqs; r++)
        if (h->query_start[r + 1] - h->query_start[r] != 1)
            return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: the step is not decode-only: request %d "
                           "has %d rows", r, h->query_start[r + 1] - h->query_start[r]);
    if (st->max_blocks < 1 || st->max_blocks > m->max_blocks)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: block table width %d is outside [1, %d]",
                       st->max_blocks, m->max_blocks);
    int64_t I = 0, Is = 0;
    M3_TRY(check_weights(m, layer, lw, &I, &Is));
    if (m->tp && !m->group->buf)
        return m3_fail(M3_ERR_INTERNAL, "CPU mono: a TP group without peer buffers");

    /* the real rows; malformed metadata is an error, a slot or page past the
     * pool a fault (before anything is written) */
    int n_act = 0;
    m->score_first[0] = 0;
    for (int t = 0; t < st->rows; t++) {
        if (h->slots[t] < 0)
            continue;
        if (h->row_req[t] < 0 || h->row_req[t] >= st->n_reqs || h->positions[t] < 0)
            return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: row %d has request %d, position %lld",
                           t, h->row_req[t], (long long)h->positions[t]);
        int64_t nb = (h->positions[t] + M3_PAGE_TOKENS) / M3_PAGE_TOKENS; /* ceil(kv_len/128) */
        if (nb > st->max_blocks)
            return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: row %d at position %lld needs %lld "
                           "blocks; the block table has %d", t, (long long)h->positions[t],
                           (long long)nb, st->max_blocks);
        m->act[n_act] = t;
        m->nblk[n_act] = (int32_t)nb;
        m->score_first[n_act + 1] = m->score_first[n_act] + (int64_t)m->Ni * nb;
        n_act++;
    }
    for (int a = 0; a < n_act; a++) {
        int t = m->act[a];
        if (h->slots[t] >= st->n_pages * M3_PAGE_TOKENS) {
            int64_t s = h->slots[t];
            fault_set(m->fault, M3_MONO_FAULT_SLOT, layer, t, s > INT32_MAX ? INT32_MAX : (int)s);
            return M3_OK;
        }
        const int32_t *table = row_table(st, t);
        for (int b = 0; b < m->nblk[a]; b++)
            if (table[b] < 0 || table[b] >= st->n_pages) {
                fault_set(m->fault, M3_MONO_FAULT_PAGE, layer, t, table[b]);
                return M3_OK;
            }
    }

    m->c = (mono_call){st,    layer,   lw,          cl,           first,   epoch,
                       hidden, residual, n_act, st->max_blocks, (int)I, (int)Is, Is > 0};
    m3_pool_run_all(m->pool, pass, m);
    return M3_OK;
}
