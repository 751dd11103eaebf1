/*
 * SPEC §7's drafter dispatch (spec/draft_forward.c pick_kernels) on the
 * CPU: when the fused drafter layers run and when they are off, and why.
 * The CPU backend has no such kernels, so the CPU case checks the reason
 * it gives; the rest runs the CPU backend with a recording stand-in for the
 * three draft_layers ops (its "kernel" runs the stock drafter's final norm
 * only: the tokens stay plain greedy's, as the verify rule guarantees
 * whatever the drafts), and checks the lifecycle: the runner built once an
 * attach, with the drafter's shapes, buffers and cache; run once a draft
 * step with its request count; freed at detach; a build that refuses the
 * shapes turns the kernels off with its message; any other build failure
 * ends the run; M3_DRAFT_LAYERS=ops switches them off, another value is
 * refused; a drafter of a block other than 7 is refused.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/status.h"
#include "spec/drafter.h"

#define N_PROMPT 150
#define MAX_NEW 24

static char g_tmp[] = "/tmp/m3_test_draft_dispatch_XXXXXX";

/* the stand-in's record */
static struct {
    int builds, runs, frees;
    int max_n, min_n;
    m3_status build_result; /* what build returns */
    m3_draft_layers_args args;
    m3_backend_ops ops;     /* the CPU's, with the stand-in */
    const m3_backend_ops *cpu;
    int runner;             /* its address is the runner */
} g;

static m3_status fake_build(m3_backend *be, const m3_draft_layers_args *a, void **runner) {
    (void)be;
    g.builds++;
    g.args = *a;
    *runner = NULL;
    if (g.build_result == M3_ERR_UNSUPPORTED)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft layers: fake shapes not supported");
    if (g.build_result)
        return m3_fail(g.build_result, "draft layers: fake device failure");
    *runner = &g.runner;
    return M3_OK;
}

static m3_status fake_run(m3_backend *be, void *runner, int n) {
    CHECK(runner == &g.runner);
    g.runs++;
    g.max_n = n > g.max_n ? n : g.max_n;
    g.min_n = n < g.min_n ? n : g.min_n;
    /* the final norm of the embedding: finite rows for the lm_head */
    return g.cpu->add_rmsnorm(be, n * g.args.block, g.args.hidden_size, NULL, g.args.residual,
                              g.args.final_norm, g.args.eps, g.args.final);
}

static void fake_free(m3_backend *be, void *runner) {
    (void)be;
    CHECK(runner == &g.runner);
    g.frees++;
}

static m3_engine *make_engine(m3_model *m, int max_seqs) {
    m3_engine_opts o = m3_engine_defaults();
    o.threads = 2;
    o.max_rows = 64;
    o.max_seqs = max_seqs;
    o.max_tokens = (int64_t)max_seqs * (N_PROMPT + MAX_NEW + 128);
    m3_engine *e = NULL;
    CHECK_OK(m3_engine_create(m, &o, &e));
    return e;
}

static m3_drafter *make_drafter(m3_model *m, const char *name, int block) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, name);
    m3_synth_draft_opts d = {2, block, 0, false};
    m3_synth_opts so = {9, false, 0};
    m3_drafter *dr = NULL;
    m3_model_opts mo = {false};
    CHECK_OK(m3_synth_drafter(m3_model_config(m), dir, &d, &so));
    CHECK_OK(m3_drafter_load(dir, m, &mo, &dr));
    return dr;
}

/* A speculative run of n prompts on engine e; the status; tokens checked
 * against plain (when it succeeds). */
static m3_status spec_run(m3_engine *e, m3_drafter *d, int n, const int32_t *const *prompts,
                          const int32_t plain[][MAX_NEW], m3_spec_stats *stats) {
    int lens[3] = {N_PROMPT, N_PROMPT - 31, N_PROMPT - 62};
    m3_gen_opts go = m3_gen_defaults();
    go.max_new_tokens = MAX_NEW;
    go.stop_at_eos = false;
    m3_gen_result res[3];
    *stats = (m3_spec_stats){.keep_steps = true};
    m3_status st = m3_generate_speculative_batch(e, d, n, prompts, lens, &go, res, stats);
    for (int r = 0; !st && r < n; r++) {
        CHECK(res[r].n_tokens == MAX_NEW && !memcmp(res[r].tokens, plain[r], MAX_NEW * 4));
        free(res[r].tokens);
    }
    return st;
}

int main(void) {
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    m3_config cfg;
    char tdir[600];
    snprintf(tdir, sizeof tdir, "%s/tiny", g_tmp);
    m3_synth_opts so = {7, false, 0};
    m3_model *m = NULL;
    m3_model_opts mo = {false};
    CHECK_OK(m3_preset("tiny", &cfg));
    CHECK_OK(m3_synth(&cfg, tdir, &so));
    CHECK_OK(m3_model_load(tdir, &mo, &m));
    m3_drafter *d = m ? make_drafter(m, "draft", 7) : NULL;
    if (!m || !d)
        return check_summary("test_draft_dispatch");

    /* three prompts and their plain greedy tokens */
    static int32_t buf[3][N_PROMPT], plain[3][MAX_NEW];
    const int32_t *prompts[3];
    for (int r = 0; r < 3; r++) {
        for (int i = 0; i < N_PROMPT; i++)
            buf[r][i] = (int32_t)((i * 41 + 3 + 7 * r) % cfg.vocab_size);
        prompts[r] = buf[r];
        m3_engine *e = make_engine(m, 1);
        m3_gen_opts go = m3_gen_defaults();
        go.max_new_tokens = MAX_NEW;
        go.stop_at_eos = false;
        m3_gen_result res;
        CHECK_OK(m3_generate(e, buf[r], N_PROMPT - 31 * r, &go, &res));
        if (res.tokens)
            memcpy(plain[r], res.tokens, sizeof plain[r]);
        free(res.tokens);
        m3_engine_free(e);
    }

    /* the CPU backend: no kernels, and it says so */
    m3_engine *e = make_engine(m, 3);
    m3_spec_stats s;
    CHECK_OK(spec_run(e, d, 1, prompts, plain, &s));
    CHECK(s.kernel_draft_steps == 0 && strstr(s.draft_kernels_off, "no fused drafter kernels"));
    m3_spec_stats_free(&s);

    /* off by default (slower so far), with the reason */
    g.cpu = e->be->ops;
    g.ops = *g.cpu;
    g.ops.draft_layers_build = fake_build;
    g.ops.draft_layers_run = fake_run;
    g.ops.draft_layers_free = fake_free;
    e->be->ops = &g.ops;
    CHECK_OK(spec_run(e, d, 1, prompts, plain, &s));
    CHECK(g.builds == 0 && s.kernel_draft_steps == 0 && strstr(s.draft_kernels_off, "default"));
    m3_spec_stats_free(&s);

    /* asked for: built once an attach, run every draft step, freed */
    setenv("M3_DRAFT_LAYERS", "fused", 1);
    g.min_n = 1 << 30;
    CHECK_OK(spec_run(e, d, 3, prompts, plain, &s));
    CHECK(g.builds == 1 && g.frees == 1);
    /* one launch a draft step, whatever its requests (a verify step may
     * follow none, where no request had room to draft) */
    CHECK(s.kernel_draft_steps == g.runs && g.runs > 0 && g.runs <= s.batch_steps &&
          !s.draft_kernels_off[0]);
    CHECK(g.min_n >= 1 && g.max_n == 3); /* up to max_reqs requests a launch */
    CHECK(g.args.n_layers == 2 && g.args.block == 7 && g.args.max_reqs == 3 &&
          g.args.hidden_size == cfg.hidden_size && g.args.head_dim == cfg.head_dim &&
          g.args.q_heads == cfg.num_q_heads && g.args.kv_heads == cfg.num_kv_heads);
    CHECK(g.args.layers && g.args.final_norm && g.args.k_cache && g.args.v_cache &&
          g.args.positions && g.args.pages && g.args.residual && g.args.final);
    m3_spec_stats_free(&s);
    /* a second run attaches again: a new runner (a new cache) */
    CHECK_OK(spec_run(e, d, 1, prompts, plain, &s));
    CHECK(g.builds == 2 && g.frees == 2 && s.kernel_draft_steps == s.n_steps);
    m3_spec_stats_free(&s);

    /* a build that refuses the shapes: off, with its reason; the run goes on */
    g.build_result = M3_ERR_UNSUPPORTED;
    int runs = g.runs;
    CHECK_OK(spec_run(e, d, 1, prompts, plain, &s));
    CHECK(g.builds == 3 && g.runs == runs && g.frees == 2 && s.kernel_draft_steps == 0 &&
          strstr(s.draft_kernels_off, "fake shapes not supported"));
    m3_spec_stats_free(&s);
    /* any other failure ends the run with its message */
    g.build_result = M3_ERR_DEVICE;
    CHECK_FAILS(spec_run(e, d, 1, prompts, plain, &s), M3_ERR_DEVICE, "fake device failure");
    m3_spec_stats_free(&s);
    g.build_result = M3_OK;

    /* M3_DRAFT_LAYERS: ops switches them off; another value is refused */
    int builds = g.builds;
    setenv("M3_DRAFT_LAYERS", "ops", 1);
    CHECK_OK(spec_run(e, d, 1, prompts, plain, &s));
    CHECK(g.builds == builds && s.kernel_draft_steps == 0 &&
          strstr(s.draft_kernels_off, "M3_DRAFT_LAYERS=ops"));
    m3_spec_stats_free(&s);
    setenv("M3_DRAFT_LAYERS", "fast", 1);
    CHECK_FAILS(spec_run(e, d, 1, prompts, plain, &s), M3_ERR_INVALID_ARG,
                "M3_DRAFT_LAYERS=fast");
    m3_spec_stats_free(&s);
    setenv("M3_DRAFT_LAYERS", "fused", 1);

    /* a drafter of another block: the kernels serve 7 speculative tokens */
    m3_drafter *d4 = make_drafter(m, "draft4", 4);
    if (d4) {
        builds = g.builds;
        m3_engine *e1 = make_engine(m, 1);
        const m3_backend_ops *cpu = e1->be->ops;
        e1->be->ops = &g.ops;
        m3_gen_opts go = m3_gen_defaults();
        go.max_new_tokens = MAX_NEW;
        go.stop_at_eos = false;
        m3_gen_result res;
        s = (m3_spec_stats){0};
        CHECK_OK(m3_generate_speculative(e1, d4, buf[0], N_PROMPT, &go, &res, &s));
        CHECK(g.builds == builds && s.kernel_draft_steps == 0 &&
              strstr(s.draft_kernels_off, "7 speculative tokens"));
        CHECK(res.tokens && !memcmp(res.tokens, plain[0], sizeof plain[0]));
        free(res.tokens);
        e1->be->ops = cpu;
        m3_engine_free(e1);
        m3_drafter_free(d4);
    }

    unsetenv("M3_DRAFT_LAYERS");
    e->be->ops = g.cpu;
    m3_engine_free(e);
    m3_drafter_free(d);
    m3_model_free(m);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_tmp);
    return check_summary("test_draft_dispatch");
}
