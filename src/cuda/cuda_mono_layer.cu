/*
 * One layer call of the mono executor (m3_cuda_mono_layer): the call's
 * checks, then its MonoArgs: the step's shapes and index item layout, the
 * layer's weights as zero-copy views (checked for dtype, shape and
 * alignment), the buffers, then the two launches (cuda_mono_kernels.cu).
 * cuda_mono.cu describes the design and owns the executor's state.
 */
#include "cuda/cuda_mono_host.h"

using namespace m3mono;

/* ---------------------------------------------------------------- per call */

static m3_status wmat_of(const m3_linear *l, int64_t n, int64_t k, const char *what, WMat *out) {
    const m3_tensor *w = &l->w;
    bool fp8 = w->dtype == M3_DT_F8_E4M3;
    if (!w->data || (w->dtype != M3_DT_BF16 && !fp8) || w->ndim != 2 || w->ne[0] != n ||
        w->ne[1] != k)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "weight %s is not a bf16 or e4m3 [%lld, %lld] matrix",
                         w->name ? w->name : what, (long long)n, (long long)k);
    int64_t esz = fp8 ? 1 : 2;
    if (w->nb[1] != esz || w->nb[0] < k * esz || w->nb[0] % 16 || (uintptr_t)w->data % 16)
        return MONO_FAIL(M3_ERR_UNSUPPORTED,
                         "weight %s: rows must be contiguous and 16-byte aligned",
                         w->name ? w->name : what);
    const m3_tensor *s = &l->scale;
    if (fp8 && (!s->data || s->dtype != M3_DT_U8 || s->ndim != 2 || s->ne[0] != n ||
                s->ne[1] != k / 32 || s->nb[1] != 1))
        return MONO_FAIL(M3_ERR_INVALID_ARG, "weight %s: MXFP8 scales must be u8 [%lld, %lld]",
                         w->name ? w->name : what, (long long)n, (long long)(k / 32));
    out->w = (const uint8_t *)w->data;
    out->w_row = w->nb[0];
    out->s = fp8 ? (const uint8_t *)s->data : NULL;
    out->s_row = fp8 ? s->nb[0] : 0;
    out->n = (int)n;
    out->fp8 = fp8;
    return M3_OK;
}

static m3_status wexp_of(const m3_linear *l, int E, int64_t n, int64_t k, const char *kind,
                         WExp *out) {
    WMat w0 = {};
    M3_TRY(wmat_of(&l[0], n, k, kind, &w0));
    const char *b0 = (const char *)l[0].w.data;
    const char *s0 = (const char *)l[0].scale.data;
    int64_t stride = E > 1 ? (const char *)l[1].w.data - b0 : 0;
    int64_t sstride = E > 1 && w0.fp8 ? (const char *)l[1].scale.data - s0 : 0;
    for (int e = 0; e < E; e++) {
        WMat we = {};
        M3_TRY(wmat_of(&l[e], n, k, kind, &we));
        if ((const char *)we.w != b0 + e * stride || we.fp8 != w0.fp8 || we.w_row != w0.w_row ||
            (w0.fp8 && ((const char *)we.s != s0 + e * sstride || we.s_row != w0.s_row)))
            return MONO_FAIL(M3_ERR_UNSUPPORTED,
                             "the %s experts are not laid out at a uniform stride", kind);
    }
    out->w = w0.w;
    out->s = w0.s;
    out->w_stride = stride;
    out->s_stride = sstride;
    out->w_row = w0.w_row;
    out->s_row = w0.s_row;
    out->fp8 = w0.fp8;
    return M3_OK;
}

static m3_status norm_w(const m3_tensor *t, int64_t n, const char *what, const uint16_t **out) {
    if (!t->data || t->dtype != M3_DT_BF16 || m3_tensor_nelem(t) != n || (uintptr_t)t->data % 16)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "norm weight %s is not an aligned bf16 [%lld]",
                         t->name ? t->name : what, (long long)n);
    *out = (const uint16_t *)t->data;
    return M3_OK;
}

/* what a layer call must be given: a sparse attention + MoE layer, rows and
 * a block table within the executor's capacity, the step's metadata and the
 * caches on the device, 16-byte aligned */
static m3_status check_layer_call(const m3_cuda_mono *m, const m3_step *st, int layer,
                                  const m3_layer_weights *lw, const m3_cache_layer *cl,
                                  const uint16_t *hidden, const uint16_t *residual) {
    if (!m || !st || !lw || !cl || !hidden || !residual)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer: executor, step, weights, cache and "
                                             "activations are required");
    if (!lw->sparse || !lw->moe)
        return MONO_FAIL(M3_ERR_UNSUPPORTED,
                         "layer %d has %s attention and a %s FFN; the fused kernels run only "
                         "sparse attention + MoE layers",
                         layer, lw->sparse ? "sparse" : "dense", lw->moe ? "MoE" : "dense MLP");
    if (st->rows < 1 || st->rows > kMaxT)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: %d rows (1 to %d)", layer, st->rows,
                         kMaxT);
    if (st->max_blocks < 1 || st->max_blocks > m->max_blocks)
        return MONO_FAIL(M3_ERR_INVALID_ARG,
                         "layer %d: block table width %d is outside [1, %d] (the executor's "
                         "capacity)",
                         layer, st->max_blocks, m->max_blocks);
    if (st->n_pages < 1)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: the page pool is empty", layer);
    if (!st->dev.positions || !st->dev.slots || !st->dev.row_req || !st->dev.block_table)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: step metadata is not on the device",
                         layer);
    if (!cl->k || !cl->v || !cl->index)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: the K, V and index caches are required",
                         layer);
    uintptr_t al = (uintptr_t)cl->k | (uintptr_t)cl->v | (uintptr_t)cl->index |
                   (uintptr_t)hidden | (uintptr_t)residual;
    if (al % 16)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: caches and activations must be 16-byte "
                                             "aligned",
                         layer);
    if (m->world > 1 && !m->peers_set)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: TP world %d without peers (set_peers)",
                         layer, m->world);
    return M3_OK;
}

/* the step's shapes, its index items' layout and the model's scalars */
static void args_shapes(const m3_cuda_mono *m, const m3_step *st, int layer, bool first,
                        MonoArgs *a) {
    const m3_config *c = &m->cfg;
    const int H = c->hidden_size, Nq = c->num_q_heads, Nkv = c->num_kv_heads;
    const int Ni = c->index_heads, E = c->num_experts, I = c->expert_dim, Is = c->shared_dim;
    a->T = st->rows;
    a->H = H;
    a->Nq = Nq;
    a->Nkv = Nkv;
    a->Ni = Ni;
    a->E = E;
    a->K = c->experts_per_tok;
    a->I = I;
    a->Is = Is;
    a->half = c->rotary_dim / 2;
    a->topk = c->topk_blocks;
    a->init = c->init_blocks;
    a->local = c->local_blocks;
    a->mb = st->max_blocks;
    a->group = Nq / Nkv;
    a->mtiles = m->mtiles;
    a->S = m->S;
    /* index items. Fixed slices: G per row, row t's blocks j, j + G, ...;
     * at long contexts few, long items, and those taken late end late
     * (docs/PERF.md, sixteenth session). Claims: Gc items, one per CTA at
     * most, each taking runs of pages of any row at run time; a claim costs
     * atomics and round trips, so where slices are short (one row: 3 pages
     * at 128K) fixed slices are faster. M3_MONO_IDX_CLAIM: -1 (default)
     * chooses per step from idx_min_pages pages a slice: here where the
     * tables' width settles it, else on the device from the rows' real
     * pages (under graphs a->mb is the context's capacity); 0 fixed, 1
     * claims. Where claims do not exist (fewer than kIdxClaimMinRows rows)
     * two slices per CTA and row: at 128K a row's 1,024 pages in 396 items
     * left a tail of three-page items on the CTAs that ran q, k and v, and
     * items of one or two pages end sooner (-1.5% at one row, -4% at two;
     * the items with no pages at short contexts return at once: +0.3% at
     * 4K; docs/PERF.md, twenty-fifth session). */
    const int slices = m->idx_slices ? m->idx_slices : a->T < kIdxClaimMinRows ? 2 : 1;
    int G = slices * m->P / a->T;
    a->G = G < 1 ? 1 : (G > a->mb ? a->mb : G);
    const int64_t pages_cap = (int64_t)a->T * a->mb;
    a->Gc = (int)(pages_cap < m->P ? pages_cap : m->P);
    a->Gc = a->Gc < 1 ? 1 : a->Gc;
    a->idx_run = m->idx_run;
    a->idx_min_pages = m->idx_min_pages;
    if (a->T < kIdxClaimMinRows)
        a->idx_claim = 0; /* (their kernels hold fixed slices only) */
    else if (m->idx_claim >= 0)
        a->idx_claim = m->idx_claim;
    else
        a->idx_claim = (a->mb + a->G - 1) / a->G < a->idx_min_pages ? 0 : 2;
    a->rt_tiles = m->rt_tiles;
    a->Ntot = m->Ntot;
    a->off_ik = Ni * kHD;
    a->off_k = a->off_ik + kHD;
    a->off_v = a->off_k + Nkv * kHD;
    a->off_q = a->off_v + Nkv * kHD;
    a->layer = layer;
    a->world = m->world;
    a->rank = m->rank;
    a->first = first;
    a->sel_staged = m->sel_staged;
    a->smem = (int)m->smem;
    const int pset = m->p_unsplit_from > 0 && a->T >= m->p_unsplit_from; /* plan_splits */
    memcpy(a->s_p, m->s_p[pset], sizeof a->s_p);
    memcpy(a->p_item0, m->p_item0[pset], sizeof a->p_item0);
    a->s_pmax = m->s_pmax;
    a->s_o = m->s_o;
    a->s_rt = m->s_rt;
    a->s_shgu = m->s_shgu;
    a->s_shdn = m->s_shdn;
    a->n_pages = st->n_pages;
    a->eps = c->rms_norm_eps;
    a->scaling = c->routed_scaling_factor;
    a->alpha = c->swiglu_alpha;
    a->limit = c->swiglu_limit;
    /* as the stock path forms them: the attention scale rounded to fp32,
     * then times log2(e) (cuda_attention.cu); the index scale in one go
     * (forward.c) */
    const float attn_scale = (float)(1.0 / sqrt((double)kHD));
    a->attn_scale_log2 = (float)((double)attn_scale * 1.4426950408889634);
    a->idx_scale = m3_index_scale(kHD);
}

/* zero-copy views of the layer's weights, each checked for shape, dtype and
 * alignment */
static m3_status args_weights(const m3_cuda_mono *m, const m3_layer_weights *lw, int layer,
                              MonoArgs *a) {
    const m3_config *c = &m->cfg;
    const int H = c->hidden_size, Nq = c->num_q_heads, Nkv = c->num_kv_heads;
    const int Ni = c->index_heads, E = c->num_experts, I = c->expert_dim, Is = c->shared_dim;
    M3_TRY(wmat_of(&lw->iq_proj, (int64_t)Ni * kHD, H, "index_q_proj", &a->wiq));
    M3_TRY(wmat_of(&lw->ik_proj, kHD, H, "index_k_proj", &a->wik));
    M3_TRY(wmat_of(&lw->k_proj, (int64_t)Nkv * kHD, H, "k_proj", &a->wk));
    M3_TRY(wmat_of(&lw->v_proj, (int64_t)Nkv * kHD, H, "v_proj", &a->wv));
    M3_TRY(wmat_of(&lw->q_proj, (int64_t)Nq * kHD, H, "q_proj", &a->wq));
    M3_TRY(wmat_of(&lw->o_proj, H, (int64_t)Nq * kHD, "o_proj", &a->wo));
    if (Is) {
        M3_TRY(wmat_of(&lw->sh_gate, Is, H, "shared gate_proj", &a->shg));
        M3_TRY(wmat_of(&lw->sh_up, Is, H, "shared up_proj", &a->shu));
        M3_TRY(wmat_of(&lw->sh_down, H, Is, "shared down_proj", &a->shd));
    }
    if (!lw->exp_gate || !lw->exp_up || !lw->exp_down)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "layer %d: expert weights are missing", layer);
    M3_TRY(wexp_of(lw->exp_gate, E, I, H, "gate", &a->eg));
    M3_TRY(wexp_of(lw->exp_up, E, I, H, "up", &a->eu));
    M3_TRY(wexp_of(lw->exp_down, E, H, I, "down", &a->ed));
    M3_TRY(norm_w(&lw->input_norm, H, "input_layernorm", &a->in_norm));
    M3_TRY(norm_w(&lw->post_norm, H, "post_attention_layernorm", &a->post_norm));
    M3_TRY(norm_w(&lw->q_norm, kHD, "q_norm", &a->q_norm));
    M3_TRY(norm_w(&lw->k_norm, kHD, "k_norm", &a->k_norm));
    M3_TRY(norm_w(&lw->iq_norm, kHD, "index_q_norm", &a->iq_norm));
    M3_TRY(norm_w(&lw->ik_norm, kHD, "index_k_norm", &a->ik_norm));
    const m3_tensor *rt = &lw->router;
    if (!rt->data || rt->dtype != M3_DT_F32 || rt->ndim != 2 || rt->ne[0] != E ||
        rt->ne[1] != H || !m3_tensor_is_contiguous(rt) || (uintptr_t)rt->data % 16)
        return MONO_FAIL(M3_ERR_INVALID_ARG, "router %s is not a contiguous f32 [%d, %d]",
                         rt->name ? rt->name : "gate", E, H);
    a->router = (const float *)rt->data;
    if (lw->router_bias.data) {
        if (lw->router_bias.dtype != M3_DT_F32 || m3_tensor_nelem(&lw->router_bias) != E)
            return MONO_FAIL(M3_ERR_INVALID_ARG, "router bias is not f32 [%d]", E);
        a->rbias = (const float *)lw->router_bias.data;
    }
    return M3_OK;
}

/* the step's metadata, the caches and activations, the executor's scratch
 * and counters, and the per-step choices of the tuning knobs */
static void args_buffers(const m3_cuda_mono *m, const m3_step *st, const m3_cache_layer *cl,
                         uint16_t *hidden, uint16_t *residual, MonoArgs *a) {
    a->pos = st->dev.positions;
    a->slots = st->dev.slots;
    a->row_req = st->dev.row_req;
    a->btab = st->dev.block_table;
    a->kc = (uint16_t *)cl->k;
    a->vc = (uint16_t *)cl->v;
    a->ic = (uint16_t *)cl->index;
    a->hidden = hidden;
    a->residual = residual;
    a->x1 = m->x1;
    a->proj = m->proj;
    a->attn = m->attn;
    a->o = m->o;
    a->x2 = m->x2;
    a->act = m->act;
    a->sh_act = m->sh_act;
    a->scores = m->scores;
    a->rope = m->rope;
    a->sel = m->sel;
    a->att_ml = m->att_ml;
    a->att_acc = m->att_acc;
    a->logits = m->logits;
    a->rw = m->rw;
    a->rids = m->rids;
    a->uniq = m->uniq;
    a->ufirst = m->ufirst;
    a->members = m->members;
    a->n_uniq = m->n_uniq;
    a->eout = m->eout;
    a->sh_out = m->sh_out;
    a->part_proj = m->part_proj;
    a->part_o = m->part_o;
    a->part_rt = m->part_rt;
    a->part_shgu = m->part_shgu;
    a->part_shdn = m->part_shdn;
    a->ctr = m->ctr;
    a->calls = m->calls;
    a->n_ctr = m->n_ctr;
    a->o_post = m->o_post;
    a->o_head = m->o_head;
    a->o_sel = m->o_sel;
    a->o_att = m->o_att;
    a->o_otile = m->o_otile;
    a->o_rtile = m->o_rtile;
    a->o_shgu = m->o_shgu;
    a->o_shdn = m->o_shdn;
    a->o_egu = m->o_egu;
    a->o_idxq = m->o_idxq;
    a->o_comb = m->o_comb;
    a->fault = m->fault;
    a->peers = m->peers_dev;
    a->landing = m->landing;
    a->spin_ns = m->spin_ns;
    a->poll_acquire = m->poll_acquire;
    a->shdn_early = m->shdn_early >= 0 ? m->shdn_early : 100;
    a->edn_sub = m->edn_sub ? m->edn_sub : (a->T > 2 ? 8 : a->T == 2 ? 6 : 5);
    a->shdn_sub = a->Is && m->s_shdn == 1 && a->Is <= kKC && !a->shd.fp8
                      ? (m->shdn_sub ? m->shdn_sub : a->edn_sub)
                      : 1;
    {
        /* the walk's member group: 1 row, else 2 (the kernel's ENR at 2
         * rows, two at a time at 3-8); tiles per item: 3 at 2 rows
         * (twenty-second session), 4 at 3-8 (thirty-first) */
        const int xs = a->T <= 1 ? gu_xs_bytes<1>(a->H) : gu_xs_bytes<2>(a->H);
        const bool walk = a->T <= 8 && !a->eg.fp8 && !a->eu.fp8 && gu_fits(xs, (int)m->smem);
        a->egu_walk = walk && a->T > 2;
        a->egu_sub = !walk ? 1 : m->egu_sub ? m->egu_sub : (a->T == 1 ? 1 : a->T == 2 ? 3 : 4);
    }
    /* CTAs of their own for norm2 and the plan only where more CTAs than
     * rows run the queue; dry runs only at world 1 (a dry all-reduce would
     * wait for peers) */
    a->pin = m->pin >= 0 ? m->pin : (a->T <= 8 && m->world == 1 ? 2 : 0);
    if (m->P <= a->T)
        a->pin = 0;
    if (a->pin >= 2 && m->world > 1)
        a->pin = 1;
    a->dry_rows = m->dry_rows;
    a->dry_logits = m->dry_logits;
    a->dry_plan = m->dry_plan;
    a->trace = m->tracing ? m->trace : NULL;
    a->trace_n = m->trace_n;
    a->trace_cap = m->trace_cap;
    memcpy(a->inv_freq, m->inv_freq, sizeof a->inv_freq);
}

extern "C" m3_status m3_cuda_mono_layer(m3_cuda_mono *m, const m3_step *st, int layer,
                                        const m3_layer_weights *lw, const m3_cache_layer *cl,
                                        bool first, uint32_t epoch, uint16_t *hidden,
                                        uint16_t *residual) {
    M3_TRY(check_layer_call(m, st, layer, lw, cl, hidden, residual));
    /* the landing tags come from a device-side count of calls (see
     * mono_post_kernel), so a graph replay does not reuse the tags it was
     * captured with; the epoch is not needed for them */
    (void)epoch;
    MonoArgs a;
    memset(&a, 0, sizeof a);
    args_shapes(m, st, layer, first, &a);
    M3_TRY(args_weights(m, lw, layer, &a));
    args_buffers(m, st, cl, hidden, residual, &a);
    m3_status s = launch_layer(m->cu->stream, m->P, m->smem, a);
    /* Each kernel zeroes the other's counters (zero_other): after a pre
     * launch whose post launch failed, its counters would stay dirty for the
     * next call, so zero them all here (best effort: the error is returned). */
    if (s)
        (void)cudaMemsetAsync(m->ctr, 0, (size_t)m->n_ctr * sizeof *m->ctr, m->cu->stream);
    return s;
}
