/*
 * The CPU mono executor's setup (see cpu_mono.h; cpu_mono.c describes the
 * pass): the fault word API, the TP group's peer buffers and tags, and the
 * executor with its scratch, sized once for max_rows rows.
 */
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "cpu/cpu.h"
#include "cpu/cpu_mono_internal.h"

const int32_t *m3_cpu_mono_fault_word(m3_cpu_mono *m) {
    /* _Atomic int32_t has int32_t's size and representation; readers use
     * atomic loads (__atomic_load_n) */
    return (const int32_t *)m->fault;
}

void m3_cpu_mono_set_fault(m3_cpu_mono *m, int code, int layer, int row, int value) {
    if (m)
        fault_set(m->fault, code, layer, row, value);
}

void m3_cpu_mono_abort_all(m3_cpu_mono *m) {
    if (!m)
        return;
    if (!m->group) {
        fault_set(m->fault, M3_MONO_FAULT_ABORTED, -1, -1, m->tp_rank);
        return;
    }
    for (int r = 0; r < m->group->world; r++)
        fault_set(m->group->fault[r].w, M3_MONO_FAULT_ABORTED, -1, -1, m->tp_rank);
}

void m3_cpu_mono_clear_fault(m3_cpu_mono *m) {
    if (!m)
        return;
    for (int i = 1; i < 4; i++)
        atomic_store(&m->fault[i], 0);
    atomic_store(&m->fault[0], 0);
}

/* ------------------------------------------------------------ group */

m3_status m3_cpu_mono_group_create(int world, int max_rows, const m3_config *cfg,
                                   int64_t timeout_ms, m3_cpu_mono_group **out) {
    if (!out || !cfg)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_cpu_mono_group_create: NULL argument");
    *out = NULL;
    if (world < 1 || world > M3_MAX_TP)
        return m3_fail(M3_ERR_INVALID_ARG, "mono group: world %d is outside [1, %d]", world,
                       M3_MAX_TP);
    if (max_rows < 1 || max_rows > MONO_MAX_ROWS)
        return m3_fail(M3_ERR_INVALID_ARG, "mono group: max_rows %d is outside [1, %d]",
                       max_rows, MONO_MAX_ROWS);
    if (timeout_ms < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "mono group: peer wait timeout %lld ms is negative",
                       (long long)timeout_ms);
    /* experts_per_tok 0: a model without MoE layers, which the mono
     * refusals then name (the group is made before them, at every TP size
     * above 1, also under auto, so it must not refuse first) */
    if (cfg->hidden_size < 1 || cfg->experts_per_tok < 0 ||
        cfg->experts_per_tok > MONO_MAX_TOPK)
        return m3_fail(M3_ERR_UNSUPPORTED, "mono group: hidden %d / experts per token %d",
                       cfg->hidden_size, cfg->experts_per_tok);
    m3_cpu_mono_group *g = aligned_alloc(64, (sizeof *g + 63) / 64 * 64);
    if (!g)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating a mono group");
    memset(g, 0, sizeof *g);
    g->world = world;
    g->max_rows = max_rows;
    g->k = cfg->experts_per_tok;
    g->H = cfg->hidden_size;
    g->timeout_ms = timeout_ms ? timeout_ms : 60000;
    g->cap = (size_t)(g->k + 1) * (size_t)max_rows * (size_t)g->H;
    for (int r = 0; r < M3_MAX_TP; r++) {
        for (int s = 0; s < 2; s++)
            atomic_init(&g->tag[r][s].v, 0); /* 0: never a tag (tags are odd) */
        for (int i = 0; i < 4; i++)
            atomic_init(&g->fault[r].w[i], 0);
    }
    if (world > 1) {
        g->buf = calloc((size_t)world * 2 * g->cap, sizeof *g->buf);
        if (!g->buf) {
            size_t bytes = (size_t)world * 2 * g->cap * sizeof(double);
            free(g);
            return m3_fail(M3_ERR_NO_MEMORY, "out of memory for the mono group's peer buffers "
                           "(%zu bytes)", bytes);
        }
    }
    *out = g;
    return M3_OK;
}

void m3_cpu_mono_group_free(m3_cpu_mono_group *g) {
    if (!g)
        return;
    free(g->buf);
    free(g);
}

/* ------------------------------------------------------------ executor */

void m3_cpu_mono_free(m3_cpu_mono *m) {
    if (!m)
        return;
    void *bufs[] = {m->act,  m->nblk,   m->score_first, m->rope_cos, m->rope_sin, m->xf,
                    m->q,    m->kk,     m->v,           m->iq,       m->ik,       m->scores,
                    m->sel,  m->attn,   m->attnf,       m->o,        m->logits,   m->ids,
                    m->wts,  m->actf,   m->shf,         m->eout,     m->shout,
                    m->cp_table, m->cp_lens};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        free(bufs[i]);
    for (int t = 0; m->tbuf && t < m->n_threads; t++)
        free(m->tbuf[t]);
    for (int t = 0; m->tlist && t < m->n_threads; t++)
        free(m->tlist[t]);
    free(m->tbuf);
    free(m->tlist);
    free(m);
}

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

/* 64-byte aligned, at least one cache line */
static void *alloc64(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
}

/* the scratch of one pass, sized for max_rows rows, zeroed; per thread the
 * largest phase's floats and the routing lists */
static m3_status alloc_scratch(m3_cpu_mono *m) {
    size_t R = (size_t)m->max_rows, H = (size_t)m->H, D = (size_t)m->D, Di = (size_t)m->Di;
    size_t K = (size_t)m->k, E = (size_t)m->E;
    size_t half = (size_t)(m->half > 0 ? m->half : 1);
    struct {
        void **p;
        size_t bytes;
    } want[] = {
        {(void **)&m->act, R * 4},
        {(void **)&m->nblk, R * 4},
        {(void **)&m->score_first, (R + 1) * 8},
        {(void **)&m->rope_cos, R * half * 4},
        {(void **)&m->rope_sin, R * half * 4},
        {(void **)&m->xf, R * H * 4},
        {(void **)&m->q, R * (size_t)m->Nq * D * 2},
        {(void **)&m->kk, R * (size_t)m->Nkv * D * 2},
        {(void **)&m->v, R * (size_t)m->Nkv * D * 2},
        {(void **)&m->iq, R * (size_t)m->Ni * Di * 2},
        {(void **)&m->ik, R * Di * 2},
        {(void **)&m->scores, R * (size_t)m->Ni * (size_t)m->max_blocks * 4},
        {(void **)&m->sel, R * (size_t)m->Ni * (size_t)m->topk * 4},
        {(void **)&m->attn, R * (size_t)m->Nq * D * 2},
        {(void **)&m->attnf, R * (size_t)m->Nq * D * 4},
        {(void **)&m->o, R * H * 2},
        {(void **)&m->logits, R * E * 4},
        {(void **)&m->ids, R * K * 4},
        {(void **)&m->wts, R * K * 4},
        {(void **)&m->actf, R * K * (size_t)m->I * 4},
        {(void **)&m->shf, R * (size_t)(m->Is > 0 ? m->Is : 1) * 4},
        {(void **)&m->eout, R * K * H * 2},
        {(void **)&m->shout, R * H * 2},
        {(void **)&m->cp_table, R * (size_t)m->max_blocks * 4},
        {(void **)&m->cp_lens, R * 4},
    };
    m3_status st = M3_OK;
    for (size_t i = 0; i < sizeof want / sizeof *want && !st; i++) {
        *want[i].p = alloc64(want[i].bytes);
        if (!*want[i].p)
            st = m3_fail(M3_ERR_NO_MEMORY, "out of memory for the CPU mono executor's scratch");
        else
            memset(*want[i].p, 0, want[i].bytes); /* ids stay valid expert ids */
    }
    /* per-thread scratch: the largest phase's need (see each phase) */
    size_t fl = 2 * H;                                            /* norms, gate/up rows */
    fl = max_sz(fl, 2 * max_sz(D, Di));                           /* head norm, scores */
    fl = max_sz(fl, (size_t)m->topk + 1);                         /* selection */
    fl = max_sz(fl, (D + 2) + M3_ATTEND_BUF_FLOATS(D, (size_t)m->topk * M3_PAGE_TOKENS));
    fl = max_sz(fl, (size_t)m->Nq * D);                           /* o_proj rows */
    fl = max_sz(fl, max_sz((size_t)m->I, (size_t)m->Is));         /* down rows */
    size_t list_ints = (E + 1) + E + R * K + E;
    if (!st) {
        m->tbuf = calloc((size_t)m->n_threads, sizeof *m->tbuf);
        m->tlist = calloc((size_t)m->n_threads, sizeof *m->tlist);
        if (!m->tbuf || !m->tlist)
            st = m3_fail(M3_ERR_NO_MEMORY, "out of memory for the CPU mono executor");
    }
    for (int t = 0; t < m->n_threads && !st; t++) {
        m->tbuf[t] = alloc64(fl * sizeof(float));
        m->tlist[t] = alloc64(list_ints * sizeof(int32_t));
        if (!m->tbuf[t] || !m->tlist[t])
            st = m3_fail(M3_ERR_NO_MEMORY, "out of memory for the CPU mono executor's threads");
    }
    return st;
}

/* what the executor runs: shapes the pass handles, a rank of its group
 * with the group's widths */
static m3_status check_create(const m3_config *c, int max_rows, int max_blocks, int tp_rank,
                              const m3_cpu_mono_group *group) {
    if (max_rows < 1 || max_rows > MONO_MAX_ROWS)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: max_rows %d is outside [1, %d]", max_rows,
                       MONO_MAX_ROWS);
    if (max_blocks < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: max_blocks %d", max_blocks);
    const int world = group ? group->world : 1;
    if (tp_rank < 0 || tp_rank >= world)
        return m3_fail(M3_ERR_INVALID_ARG, "CPU mono: TP rank %d of a group of %d", tp_rank,
                       world);
    if (group && (group->H != c->hidden_size || group->k != c->experts_per_tok ||
                  max_rows > group->max_rows))
        return m3_fail(M3_ERR_INVALID_ARG,
                       "CPU mono: the group holds hidden %lld, top %d, %d rows; this rank has "
                       "hidden %d, top %d, %d rows",
                       (long long)group->H, group->k, group->max_rows, c->hidden_size,
                       c->experts_per_tok, max_rows);
    if (c->hidden_size < 1 || c->head_dim < 1 || c->index_dim < 1 || c->num_q_heads < 1 ||
        c->num_kv_heads < 1 || c->num_q_heads % c->num_kv_heads)
        return m3_fail(M3_ERR_UNSUPPORTED, "CPU mono: hidden %d, head_dim %d, index_dim %d, "
                       "%d query / %d KV heads", c->hidden_size, c->head_dim, c->index_dim,
                       c->num_q_heads, c->num_kv_heads);
    if (c->index_heads != c->num_kv_heads)
        return m3_fail(M3_ERR_UNSUPPORTED, "CPU mono: %d index heads for %d KV heads (must be "
                       "equal)", c->index_heads, c->num_kv_heads);
    if (c->block_size != M3_PAGE_TOKENS)
        return m3_fail(M3_ERR_UNSUPPORTED, "CPU mono: sparse block size %d is not the page "
                       "size %d", c->block_size, M3_PAGE_TOKENS);
    if (c->rotary_dim < 0 || c->rotary_dim % 2 || c->rotary_dim > c->head_dim ||
        c->rotary_dim > c->index_dim)
        return m3_fail(M3_ERR_UNSUPPORTED, "CPU mono: rotary_dim %d (head_dim %d, index_dim %d)",
                       c->rotary_dim, c->head_dim, c->index_dim);
    if (c->topk_blocks < 1)
        return m3_fail(M3_ERR_UNSUPPORTED, "CPU mono: topk_blocks %d", c->topk_blocks);
    if (c->num_experts < 1 || c->experts_per_tok < 1 || c->experts_per_tok > MONO_MAX_TOPK ||
        c->experts_per_tok > c->num_experts || c->expert_dim < 1 || c->shared_dim < 0)
        return m3_fail(M3_ERR_UNSUPPORTED, "CPU mono: %d experts, top %d, width %d, shared %d "
                       "(top at most %d)", c->num_experts, c->experts_per_tok, c->expert_dim,
                       c->shared_dim, MONO_MAX_TOPK);
    return M3_OK;
}

m3_status m3_cpu_mono_create(m3_backend *be, const m3_config *cfg, int max_rows, int max_blocks,
                             int tp_rank, m3_cpu_mono_group *group, m3_comm *cp,
                             m3_cpu_mono **out) {
    if (!out)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_cpu_mono_create: out is NULL");
    *out = NULL;
    if (!be || !cfg)
        return m3_fail(M3_ERR_INVALID_ARG, "m3_cpu_mono_create: backend and config are required");
    if (!be->ops || !be->ops->name || strcmp(be->ops->name, "cpu"))
        return m3_fail(M3_ERR_UNSUPPORTED, "the CPU mono executor needs the CPU backend, not %s",
                       be->ops && be->ops->name ? be->ops->name : "?");
    M3_TRY(check_create(cfg, max_rows, max_blocks, tp_rank, group));
    const m3_config *c = cfg;
    m3_cpu_mono *m = m3_calloc(1, sizeof *m, "CPU mono executor");
    if (!m)
        return M3_ERR_NO_MEMORY;
    m3_cpu *cpu = m3_cpu_of(be);
    m->pool = cpu->pool;
    m->n_threads = m3_pool_size(cpu->pool);
    m->max_rows = max_rows;
    m->max_blocks = max_blocks;
    m->tp_rank = tp_rank;
    m->group = group;
    m->tp = group && group->world > 1;
    m->cp = cp;
    m->cfg = *c;
    for (int i = 0; i < 4; i++)
        atomic_init(&m->own_fault[i], 0);
    m->fault = group ? group->fault[tp_rank].w : m->own_fault;
    m->H = c->hidden_size;
    m->D = c->head_dim;
    m->Di = c->index_dim;
    m->Nq = c->num_q_heads;
    m->Nkv = c->num_kv_heads;
    m->Ni = c->index_heads;
    m->E = c->num_experts;
    m->k = c->experts_per_tok;
    m->half = c->rotary_dim / 2;
    m->topk = c->topk_blocks;
    m->I = c->expert_dim;
    m->Is = c->shared_dim;
    m3_status st = alloc_scratch(m);
    if (st) {
        m3_cpu_mono_free(m);
        return st;
    }
    *out = m;
    return M3_OK;
}
