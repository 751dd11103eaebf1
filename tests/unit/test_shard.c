/*
 * The sums' cut that keeps GPU TP bits world-invariant, on the host side
 * (core/tensor.h, model/model.c, model/shard.c; the GPU side is
 * tests/gpu/test_cuda_worlds.c): m3_k_chunks's rule on the widths that
 * matter, the loader marking o_proj and the down projections row-parallel
 * (k_chunks) and q/k/v, the index query and gate/up column-parallel
 * (n_chunks), and a TP shard holding its share of both, or 0 where the
 * world does not divide them.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/status.h"
#include "model/model.h"
#include "model/shard.h"

static void test_rule(void) {
    /* M3's widths: o_proj 64 x 128, dense down, expert and shared down,
     * the hidden size (every column-parallel K) */
    CHECK(m3_k_chunks(8192) == 8);
    CHECK(m3_k_chunks(12288) == 8);
    CHECK(m3_k_chunks(3072) == 4);
    CHECK(m3_k_chunks(6144) == 8);
    /* a TP 4 rank's shapes as a model of their own (m3-tp4-rank) */
    CHECK(m3_k_chunks(2048) == 8);
    CHECK(m3_k_chunks(768) == 1);
    /* not a multiple of 256: chunks of a multiple of 8, else one */
    CHECK(m3_k_chunks(240) == 2);
    CHECK(m3_k_chunks(128) == 8);
    CHECK(m3_k_chunks(200) == 1);
    CHECK(m3_k_chunks(12) == 1);
}

static int ffn_chunks(const m3_linear *l) { return l->w.data ? l->k_chunks : -1; }

static void test_marks(const m3_model *m) {
    const m3_config *c = m3_model_config(m);
    const m3_weights *w = &m->w;
    for (int i = 0; i < c->num_layers; i++) {
        const m3_layer_weights *l = &w->layers[i];
        CHECK(l->o_proj.k_chunks == m3_k_chunks(l->o_proj.w.ne[1]));
        CHECK(l->q_proj.k_chunks == 0 && l->q_proj.n_chunks == M3_N_BLOCKS);
        CHECK(l->k_proj.n_chunks == M3_N_BLOCKS && l->v_proj.n_chunks == M3_N_BLOCKS);
        CHECK(l->o_proj.n_chunks == 0);
        if (l->sparse)
            CHECK(l->iq_proj.n_chunks == M3_N_BLOCKS && l->ik_proj.n_chunks == 0);
        if (!l->moe) {
            CHECK(ffn_chunks(&l->mlp_down) == m3_k_chunks(c->dense_dim));
            CHECK(l->mlp_gate.n_chunks == M3_N_BLOCKS && l->mlp_up.n_chunks == M3_N_BLOCKS);
            continue;
        }
        for (int e = 0; e < c->num_experts; e++)
            CHECK(l->exp_down[e].k_chunks == m3_k_chunks(c->expert_dim) &&
                  l->exp_gate[e].k_chunks == 0);
        if (c->shared_dim)
            CHECK(l->sh_down.k_chunks == m3_k_chunks(c->shared_dim) &&
                  l->sh_gate.n_chunks == M3_N_BLOCKS);
    }
}

/* A rank's share: full / tp where tp divides it, else 0. */
static int share(int full, int tp) { return full % tp == 0 ? full / tp : 0; }

static void test_shards(const m3_model *m) {
    const m3_config *c = m3_model_config(m);
    for (int tp = 2; tp <= 4; tp *= 2) {
        if (m3_tp_check(c, tp))
            continue;
        m3_weights s;
        CHECK_OK(m3_tp_shard(c, &m->w, tp - 1, tp, &s));
        const m3_layer_weights *f = &m->w.layers[c->num_layers - 1];
        const m3_layer_weights *l = &s.layers[c->num_layers - 1];
        CHECK(l->o_proj.k_chunks == share(f->o_proj.k_chunks, tp));
        CHECK(l->q_proj.n_chunks == share(M3_N_BLOCKS, tp));
        /* the KV heads: split while there are enough, else replicated
         * (a rank holds one of them: its share of the blocks is theirs) */
        int kv_split = c->num_kv_heads >= tp ? tp : c->num_kv_heads;
        CHECK(l->k_proj.n_chunks == share(M3_N_BLOCKS, kv_split));
        if (f->moe) {
            CHECK(l->exp_down[0].k_chunks == share(f->exp_down[0].k_chunks, tp));
            CHECK(l->exp_gate[0].n_chunks == 0); /* experts: always the GEMV */
            CHECK(l->sh_up.n_chunks == share(M3_N_BLOCKS, tp));
        }
        const m3_layer_weights *d = &s.layers[0], *fd = &m->w.layers[0];
        if (!fd->moe)
            CHECK(d->mlp_down.k_chunks == share(fd->mlp_down.k_chunks, tp));
        m3_tp_shard_free(c, &s);
    }
}

int main(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/m3_test_shard_%d", (int)getpid());
    test_rule();
    m3_config c;
    CHECK_OK(m3_preset("tiny", &c));
    m3_synth_opts so = {7, false, 0};
    m3_model *m = NULL;
    m3_model_opts mo = {false};
    m3_status st = m3_synth(&c, dir, &so);
    if (!st)
        st = m3_model_load(dir, &mo, &m);
    CHECK_OK(st);
    if (!st) {
        test_marks(m);
        test_shards(m);
        m3_model_free(m);
    }
    check_remove_dir(dir);
    return check_summary("test_shard");
}
