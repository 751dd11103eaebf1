/*
 * One forward step, stock path: embed, the layer loop, the final norm and
 * the logits. Each stock layer is SPEC §2.3 written as a sequence of
 * backend ops; read it top to bottom as the model's math. A fused executor
 * (the mono path, SPEC §5) may take a contiguous range of layers for a
 * step; the tensors at its boundaries (hidden, residual, caches) are the
 * same ones the stock layers use, so the paths interleave freely.
 */
#include <math.h>
#include <string.h>

#include "core/status.h"
#include "decode/engine.h"
#include "mono/mono.h"
#include "cp/cp_layer.h"
#include "cuda/cuda_cp.h"

/* TP: out = bf16(sum over ranks of s->partial [T, H]), summed in a fixed
 * order so every rank holds the same bits. The CPU's partials are fp64
 * (rounded after the sum, exactly as at TP 1); the GPU's fp32, each a
 * subtree of TP 1's chunk tree and summed as its top levels
 * (cuda/cuda_ksum.cuh), so also TP 1's bits. */
static m3_status reduce_partial(m3_engine *eng, int T, uint16_t *out) {
    int64_t n = (int64_t)T * eng->cfg.hidden_size;
    m3_comm *c = eng->comm;
    if (eng->partial_dtype == M3_DT_F64)
        M3_TRY(c->ops->all_reduce_sum_f64(c, (double *)eng->s.partial, n));
    else
        M3_TRY(c->ops->all_reduce_sum_f32(c, (float *)eng->s.partial, n));
    return eng->be->ops->round_bf16(eng->be, n, eng->partial_dtype, eng->s.partial, out);
}

/* The stock path of one layer: hidden/residual in, hidden/residual out. */
m3_status m3_stock_layer(m3_engine *eng, const m3_step *st, int li, bool first) {
    const m3_config *c = &eng->cfg;
    const m3_backend_ops *op = eng->be->ops;
    m3_backend *be = eng->be;
    const m3_layer_weights *lw = &eng->w.layers[li];
    const m3_cache_layer *cl = &eng->cache.layers[li];
    m3_scratch *s = &eng->s;
    int T = st->rows, H = c->hidden_size, D = c->head_dim, Di = c->index_dim;
    int Nq = c->num_q_heads, Nkv = c->num_kv_heads, Ni = c->index_heads;
    m3_rope rope = {c->rotary_dim, c->rope_theta};

    /* 1. residual = hidden + residual (layer 0: the embedding), x = norm */
    M3_TRY(op->add_rmsnorm(be, T, H, first ? NULL : s->hidden, s->residual, &lw->input_norm,
                           c->rms_norm_eps, s->x));
    /* 2-3. q, k, v (and a sparse layer's index query and key: one pass
     * where the backend can); per-head norm + RoPE (one rounding) */
    const m3_linear *proj[5] = {&lw->q_proj, &lw->k_proj, &lw->v_proj, &lw->iq_proj,
                                &lw->ik_proj};
    void *proj_out[5] = {s->q, s->k, s->v, s->iq, s->ik};
    M3_TRY(m3_linear_group(be, T, s->x, lw->sparse ? 5 : 3, proj, M3_DT_BF16, proj_out));
    M3_TRY(op->head_norm_rope(be, T, Nq, D, s->q, (int64_t)Nq * D, &lw->q_norm, c->rms_norm_eps,
                              st->dev.positions, &rope));
    M3_TRY(op->head_norm_rope(be, T, Nkv, D, s->k, (int64_t)Nkv * D, &lw->k_norm,
                              c->rms_norm_eps, st->dev.positions, &rope));
    /* 4. the cache before attention, so a row sees itself */
    M3_TRY(op->cache_write(be, T, st->dev.slots, Nkv, D, s->k, (int64_t)Nkv * D, cl->k));
    M3_TRY(op->cache_write(be, T, st->dev.slots, Nkv, D, s->v, (int64_t)Nkv * D, cl->v));

    const int32_t *selected = NULL;
    if (lw->sparse) {
        /* SPEC §3: index queries/key (projected above), block scores,
         * per-head selection */
        M3_TRY(op->head_norm_rope(be, T, Ni, Di, s->iq, (int64_t)Ni * Di, &lw->iq_norm,
                                  c->rms_norm_eps, st->dev.positions, &rope));
        M3_TRY(op->head_norm_rope(be, T, 1, Di, s->ik, Di, &lw->ik_norm, c->rms_norm_eps,
                                  st->dev.positions, &rope));
        M3_TRY(op->cache_write(be, T, st->dev.slots, 1, Di, s->ik, Di, cl->index));
        float scale = m3_index_scale(Di);
        m3_select_params sp = {c->topk_blocks, c->init_blocks, c->local_blocks};
        if (eng->opts.indexer_cp && m3_cp_layer_ok(eng, st)) {
            M3_TRY(m3_cp_layer_select(eng, st, cl->index, scale, &sp));
            eng->cp_selects++;
        } else {
            M3_TRY(op->index_scores(be, st, Ni, Di, s->iq, cl->index, scale, s->scores));
            M3_TRY(op->select_blocks(be, st, Ni, s->scores, &sp, s->selected));
        }
        selected = s->selected;
    }
    /* 5. attention (dense, or over the selected blocks) */
    M3_TRY(op->attention(be, st, Nq, Nkv, D, s->q, cl->k, cl->v, selected, c->topk_blocks,
                         (float)(1.0 / sqrt((double)D)), s->attn));
    /* 6. o_proj (row-parallel at TP > 1: all-reduced, then rounded), residual,
     * post-attention norm */
    if (eng->tp_size > 1) {
        M3_TRY(op->linear(be, T, s->attn, &lw->o_proj, eng->partial_dtype, s->partial));
        M3_TRY(reduce_partial(eng, T, s->o));
    } else {
        M3_TRY(op->linear(be, T, s->attn, &lw->o_proj, M3_DT_BF16, s->o));
    }
    M3_TRY(op->add_rmsnorm(be, T, H, s->o, s->residual, &lw->post_norm, c->rms_norm_eps, s->x));
    /* 7. FFN: MoE or the dense SwiGLU-OAI MLP */
    m3_swiglu act = {c->swiglu_alpha, c->swiglu_limit};
    bool tp = eng->tp_size > 1;
    if (lw->moe) {
        m3_moe_params mp = {c->num_experts, c->experts_per_tok, c->routed_scaling_factor, act,
                            tp ? eng->comm : NULL};
        return op->moe(be, T, s->x, lw, &mp, s->hidden);
    }
    const m3_linear *gate_up[2] = {&lw->mlp_gate, &lw->mlp_up};
    void *gate_up_out[2] = {s->gate, s->up};
    M3_TRY(m3_linear_group(be, T, s->x, 2, gate_up, M3_DT_BF16, gate_up_out));
    M3_TRY(op->swiglu(be, (int64_t)T * c->dense_dim, s->gate, s->up, &act, s->act));
    if (!tp)
        return op->linear(be, T, s->act, &lw->mlp_down, M3_DT_BF16, s->hidden);
    M3_TRY(op->linear(be, T, s->act, &lw->mlp_down, eng->partial_dtype, s->partial));
    return reduce_partial(eng, T, s->hidden);
}

/* final = norm(hidden + residual) of the wanted rows (s->out_rows, in
 * backend memory); logits = final lm_head^T into s->logits. */
static m3_status final_logits(m3_engine *eng, int n_out) {
    const m3_config *c = &eng->cfg;
    const m3_backend_ops *op = eng->be->ops;
    m3_backend *be = eng->be;
    m3_scratch *s = &eng->s;
    int H = c->hidden_size;
    M3_TRY(op->gather_rows(be, n_out, s->out_rows, H, s->hidden, s->out_hidden));
    M3_TRY(op->gather_rows(be, n_out, s->out_rows, H, s->residual, s->out_residual));
    M3_TRY(op->add_rmsnorm(be, n_out, H, s->out_hidden, s->out_residual, &eng->w.norm,
                           c->rms_norm_eps, s->final));
    /* vocab-parallel: this rank's share of the full lm_head's row blocks */
    int tp = eng->tp_size;
    bool blocks = eng->vocab_full % M3_N_BLOCKS == 0 && M3_N_BLOCKS % tp == 0;
    m3_linear head = {eng->w.lm_head, {0}, 0, blocks ? M3_N_BLOCKS / tp : 0};
    return op->linear(be, n_out, s->final, &head, M3_DT_F32, s->logits);
}

/* Tap of layer li: row t's bf16(hidden + residual) -- the residual stream
 * the next layer (or the final norm) reads -- into its slice of eng->taps
 * [T, n_taps, H], on the backend (a graph captures it). */
static m3_status capture_tap(m3_engine *eng, const m3_step *st, int li) {
    int64_t H = eng->cfg.hidden_size, k = eng->n_taps;
    return eng->be->ops->add_rows(eng->be, st->rows, (int)H, eng->s.hidden, eng->s.residual,
                                  k * H, eng->taps + eng->tap_of[li] * H);
}

m3_status m3_forward_device(m3_engine *eng, const m3_step *st, int n_out) {
    const m3_config *c = &eng->cfg;
    m3_backend *be = eng->be;
    /* vocab-parallel embedding: each row's vector comes from one rank */
    M3_TRY(be->ops->embed(be, st->rows, st->dev.tokens, &eng->w.embed, eng->vocab_start,
                          eng->s.residual));
    if (eng->tp_size > 1)
        M3_TRY(eng->comm->ops->all_reduce_sum_bf16(eng->comm, eng->s.residual,
                                                   (int64_t)st->rows * c->hidden_size));
    /* the mono path takes its layer range when its plan allows (SPEC §5) */
    m3_mono *mono = eng->mono;
    bool fused = false;
    m3_status failure = M3_OK;
    if (mono && m3_mono_get_health(mono).state == M3_MONO_CLOSED)
        mono = NULL; /* closed: stock from now on */
    if (mono) {
        failure = m3_mono_bind_cache(mono, &eng->cache, st->n_pages, st->capturing);
        /* (taps need every layer's boundary: stock) */
        fused = !failure && !eng->n_taps && m3_mono_plan(mono, st, false, NULL);
    }
    int first = fused ? m3_mono_first_layer(mono) : -1;
    for (int li = 0; li < c->num_layers && !failure; li++) {
        if (li == first) {
            failure = m3_mono_run(mono, st, eng->s.hidden, eng->s.residual);
            li = m3_mono_last_layer(mono);
            continue;
        }
        failure = m3_stock_layer(eng, st, li, li == 0);
        if (!failure && eng->n_taps && eng->tap_of[li] >= 0)
            failure = capture_tap(eng, st, li);
        if (failure)
            m3_fail_context(failure, "layer %d", li);
        else if (eng->layer_hook)
            eng->layer_hook(eng->layer_hook_user, li, st, eng->s.hidden, eng->s.residual);
    }
    if (fused)
        eng->mono_steps++;
    else
        eng->stock_steps++;
    if (mono) /* before logits and sampling: abort a failed step, check the fault word */
        failure = m3_mono_after_step(mono, fused, failure);
    M3_TRY(failure);
    /* GPU indexer CP's error word (a bad length or page; the engine builds
     * neither, so this is a guard), read on eager steps: a replay cannot */
    if (eng->cp_err && !st->capturing)
        M3_TRY(m3_cuda_cp_error(be, eng->cp_err));
    return final_logits(eng, n_out);
}
