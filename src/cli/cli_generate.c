/*
 * `m3 generate`: load a checkpoint (or the built-in tiny model), prefill a
 * prompt and decode. Until a tokenizer exists, --prompt maps each UTF-8 byte
 * of the text to the token id of its value (0-255); --prompt-ids takes ids
 * exactly as given. --dump-logits writes the logits each generated token
 * was chosen from as a float32 .npy [N, vocab]; --json prints one object
 * with the tokens and timings. --draft DIR decodes speculatively with a
 * DSpark drafter (docs/DSPARK.md): the same tokens, fewer target steps.
 * Several --prompt / --prompt-ids decode together as one batch (each
 * prompt a request of every step).
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "core/status.h"
#include "formats/npy.h"

#define CLI_MAX_PROMPTS 256

typedef struct gen_args {
    const char *prompts[CLI_MAX_PROMPTS]; /* each --prompt / --prompt-ids, in order */
    bool is_ids[CLI_MAX_PROMPTS];         /* --prompt-ids */
    int n_prompts;
    const char *model, *dump_logits, *device, *decode;
    const char *draft, *dump_draft_logits;
    int64_t max_tokens, top_k, threads, max_rows, seed, tp;
    double temperature, top_p;
    bool json, ignore_eos, no_graphs, indexer_cp;
} gen_args;

static void gen_usage(FILE *f) {
    fprintf(f,
            "usage: m3 generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3)...\n"
            "                   [--max-tokens N] [--temperature T] [--top-p P] [--top-k K]\n"
            "                   [--seed S] [--dump-logits FILE.npy] [--json] [--threads N]\n"
            "                   [--device cpu|cuda] [--no-graphs] [--max-rows N] [--ignore-eos]\n"
            "                   [--tp N] [--decode stock|mono|auto] [--indexer-cp]\n"
            "                   [--draft DIR [--dump-draft-logits FILE.npy]]\n"
            "\n"
            "  --model DIR        checkpoint folder (default: the built-in tiny model)\n"
            "  --prompt TEXT      each UTF-8 byte becomes the token id of its value\n"
            "  --prompt-ids LIST  comma-separated token ids, used exactly as given\n"
            "                     (several --prompt / --prompt-ids: a batch, decoded together;\n"
            "                     each prompt's tokens print on a line of their own)\n"
            "  --max-tokens N     tokens to generate (default 32)\n"
            "  --temperature T    0 (default) is greedy\n"
            "  --top-p P, --top-k K, --seed S   sampling filters and seed\n"
            "  --dump-logits F    write each generated token's logits, float32 [N, vocab]\n"
            "  --json             print one JSON object: tokens and timings\n"
            "  --threads N        CPU threads (default: all cores)\n"
            "  --device D         cpu (default) or cuda (an NVIDIA Hopper GPU)\n"
            "  --no-graphs        cuda: run decode and verify steps eagerly, not from CUDA\n"
            "                     graphs\n"
            "  --max-rows N       rows per step, the prefill chunk (default 256)\n"
            "  --ignore-eos       do not stop at the end-of-sequence token\n"
            "  --tp N             tensor-parallel ranks, one thread each (cuda: one GPU each,\n"
            "                     GPUs 0 .. N - 1, through NCCL; default 1)\n"
            "  --indexer-cp       sparse layers score and select blocks with indexer context\n"
            "                     parallelism over the TP ranks (cpu, stock and mono;\n"
            "                     off by default)\n"
            "  --decode P         stock (op by op), mono (fused layers for decode steps) or\n"
            "                     auto (mono where its plan allows); default: auto on the\n"
            "                     cpu; on cuda auto for steps of up to 4 rows at --tp 1\n"
            "                     (where the fused kernels are faster), else stock\n"
            "  --draft DIR        speculative decoding with the DSpark drafter in DIR: the\n"
            "                     target verifies its drafts, the tokens are the same\n"
            "                     (greedy only); --json adds \"spec\"\n"
            "  --dump-draft-logits F  with --draft: each draft step's rows' logits,\n"
            "                     float32 [steps x block, vocab]\n");
}

static int parse_args(int argc, char **argv, gen_args *a) {
    *a = (gen_args){.max_tokens = 32, .top_p = 1.0, .max_rows = 256, .device = "cpu",
                    .decode = NULL, .tp = 1};
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v;
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
            gen_usage(stdout);
            return -1;
        }
        if (!strcmp(f, "--json")) {
            a->json = true;
            continue;
        }
        if (!strcmp(f, "--ignore-eos")) {
            a->ignore_eos = true;
            continue;
        }
        if (!strcmp(f, "--indexer-cp")) {
            a->indexer_cp = true;
            continue;
        }
        if (!strcmp(f, "--no-graphs")) {
            a->no_graphs = true;
            continue;
        }
        if (!(v = cli_value(argc, argv, &i)))
            return CLI_USAGE;
        bool ok = true;
        if (!strcmp(f, "--model"))
            a->model = v;
        else if (!strcmp(f, "--prompt") || !strcmp(f, "--prompt-ids")) {
            if (a->n_prompts == CLI_MAX_PROMPTS) {
                fprintf(stderr, "m3 generate: at most %d prompts\n", CLI_MAX_PROMPTS);
                return CLI_USAGE;
            }
            a->is_ids[a->n_prompts] = !strcmp(f, "--prompt-ids");
            a->prompts[a->n_prompts++] = v;
        }
        else if (!strcmp(f, "--dump-logits"))
            a->dump_logits = v;
        else if (!strcmp(f, "--device"))
            a->device = v;
        else if (!strcmp(f, "--draft"))
            a->draft = v;
        else if (!strcmp(f, "--dump-draft-logits"))
            a->dump_draft_logits = v;
        else if (!strcmp(f, "--decode"))
            a->decode = v;
        else if (!strcmp(f, "--tp"))
            ok = cli_int(f, v, 1, 8, &a->tp);
        else if (!strcmp(f, "--max-tokens"))
            ok = cli_int(f, v, 0, 1 << 24, &a->max_tokens);
        else if (!strcmp(f, "--top-k"))
            ok = cli_int(f, v, 0, 1 << 24, &a->top_k);
        else if (!strcmp(f, "--threads"))
            ok = cli_int(f, v, 0, 1024, &a->threads);
        else if (!strcmp(f, "--max-rows"))
            ok = cli_int(f, v, 1, 65536, &a->max_rows);
        else if (!strcmp(f, "--seed"))
            ok = cli_int(f, v, 0, INT64_MAX, &a->seed);
        else if (!strcmp(f, "--temperature"))
            ok = cli_float(f, v, 0, 1e6, &a->temperature);
        else if (!strcmp(f, "--top-p"))
            ok = cli_float(f, v, 1e-9, 1, &a->top_p);
        else {
            fprintf(stderr, "m3 generate: unknown option '%s'\n", f);
            gen_usage(stderr);
            return CLI_USAGE;
        }
        if (!ok)
            return CLI_USAGE;
    }
    if (!a->n_prompts) {
        fprintf(stderr, "m3 generate: give a prompt: --prompt TEXT or --prompt-ids LIST\n");
        return CLI_USAGE;
    }
    if (a->n_prompts > 1 && (a->dump_logits || a->dump_draft_logits)) {
        fprintf(stderr, "m3 generate: %s takes one prompt; %d were given\n",
                a->dump_logits ? "--dump-logits" : "--dump-draft-logits", a->n_prompts);
        return CLI_USAGE;
    }
    if (strcmp(a->device, "cpu") && strcmp(a->device, "cuda")) {
        fprintf(stderr, "m3 generate: --device %s: expected cpu or cuda\n", a->device);
        return CLI_USAGE;
    }
    if (a->dump_draft_logits && !a->draft) {
        fprintf(stderr, "m3 generate: --dump-draft-logits needs --draft\n");
        return CLI_USAGE;
    }
    if (a->decode && strcmp(a->decode, "stock") && strcmp(a->decode, "mono") &&
        strcmp(a->decode, "auto")) {
        fprintf(stderr, "m3 generate: --decode %s: expected stock, mono or auto\n", a->decode);
        return CLI_USAGE;
    }
    return CLI_OK;
}

/* Prompt k as token ids; *n = count. Returns a usage error code. */
static int prompt_tokens(const gen_args *a, int k, int32_t **out, int *n) {
    *n = 0;
    const char *text = a->prompts[k], *flag = a->is_ids[k] ? "--prompt-ids" : "--prompt";
    char which[32] = "", named[32] = ""; /* which of several prompts */
    if (a->n_prompts > 1) {
        snprintf(which, sizeof which, " in prompt %d", k);
        snprintf(named, sizeof named, ", prompt %d", k);
    }
    if (!a->is_ids[k]) {
        size_t len = strlen(text);
        *out = malloc((len + 1) * sizeof **out);
        for (size_t i = 0; *out && i < len; i++)
            (*out)[(*n)++] = (uint8_t)text[i];
        if (*out && !len) {
            fprintf(stderr, "m3 generate: the prompt is empty (%s%s): at least one token is "
                            "needed\n", flag, named);
            return CLI_USAGE;
        }
        return *out ? CLI_OK : CLI_FAILED;
    }
    size_t cap = 1 + strlen(text) / 2 + 1;
    *out = malloc(cap * sizeof **out);
    if (!*out)
        return CLI_FAILED;
    const char *p = text;
    while (*p) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || (*end && *end != ',') || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "m3 generate: --prompt-ids must be comma-separated non-negative "
                            "integers; bad entry %d ('%.20s')%s\n",
                    *n, p, which);
            return CLI_USAGE;
        }
        (*out)[(*n)++] = (int32_t)v;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) {
            fprintf(stderr, "m3 generate: --prompt-ids ends with a comma%s\n", which);
            return CLI_USAGE;
        }
    }
    if (!*n) {
        fprintf(stderr, "m3 generate: the prompt is empty (--prompt-ids%s): at least one token "
                        "is needed\n", named);
        return CLI_USAGE;
    }
    return CLI_OK;
}

typedef struct dump_ctx {
    m3_npy_writer *npy;
    m3_status failed;
} dump_ctx;

static int on_token(void *user, int32_t token, const float *logits, int vocab) {
    dump_ctx *d = user;
    if (d->npy && !d->failed)
        d->failed = m3_npy_append_row(d->npy, logits);
    return d->failed != M3_OK;
}

/* The "spec" object of --json: the drafter's steps. */
static cJSON *spec_json(const m3_spec_stats *s, int block) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "block", block);
    cJSON_AddNumberToObject(o, "cycles", (double)s->cycles);
    cJSON_AddNumberToObject(o, "batch_steps", (double)s->batch_steps);
    cJSON_AddNumberToObject(o, "verify_steps", (double)s->verify_steps);
    cJSON_AddNumberToObject(o, "drafted", (double)s->drafted);
    cJSON_AddNumberToObject(o, "accepted", (double)s->accepted);
    /* tokens per target step of a draft cycle: accepted drafts + 1 */
    cJSON_AddNumberToObject(o, "acceptance_length",
                            s->cycles ? (double)(s->accepted + s->cycles) / s->cycles : 0);
    cJSON_AddNumberToObject(o, "draft_seconds", s->draft_seconds);
    cJSON_AddNumberToObject(o, "draft_replays", (double)s->draft_replays);
    /* SPEC §7's drafter kernels: the steps they ran, or why they did not */
    cJSON_AddNumberToObject(o, "kernel_draft_steps", (double)s->kernel_draft_steps);
    cJSON_AddStringToObject(o, "draft_kernels_off", s->draft_kernels_off);
    cJSON_AddNumberToObject(o, "verify_seconds", s->verify_seconds);
    cJSON *steps = cJSON_AddArrayToObject(o, "steps");
    for (int i = 0; i < s->n_steps; i++) {
        const m3_spec_step *st = &s->steps[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "request", st->request);
        cJSON_AddNumberToObject(e, "pos", (double)st->pos);
        cJSON_AddNumberToObject(e, "anchor", st->anchor);
        cJSON_AddItemToObject(e, "drafts", cJSON_CreateIntArray(st->drafts, st->n_drafts));
        cJSON_AddNumberToObject(e, "verified", st->verified);
        cJSON_AddNumberToObject(e, "accepted", st->accepted);
        cJSON_AddItemToArray(steps, e);
    }
    return o;
}

/* The engine's step counts into o. */
static void add_engine_stats(cJSON *o, m3_engine_stats stats) {
    cJSON_AddNumberToObject(o, "mono_steps", (double)stats.mono_steps);
    cJSON_AddNumberToObject(o, "stock_steps", (double)stats.stock_steps);
    cJSON_AddNumberToObject(o, "graph_replays", (double)stats.graph_replays);
    if (stats.mono_first_layer >= 0) { /* the layers a mono step fuses */
        int layers[2] = {stats.mono_first_layer, stats.mono_last_layer};
        cJSON_AddItemToObject(o, "mono_layers", cJSON_CreateIntArray(layers, 2));
    } else {
        cJSON_AddNullToObject(o, "mono_layers");
    }
}

/* One request's tokens and outcome into o. */
static void add_request(cJSON *o, const m3_gen_result *r) {
    cJSON_AddItemToObject(o, "tokens", cJSON_CreateIntArray(r->tokens, r->n_tokens));
    cJSON_AddNumberToObject(o, "n_prompt", r->n_prompt);
    cJSON_AddNumberToObject(o, "n_generated", r->n_tokens);
    cJSON_AddBoolToObject(o, "stopped_at_eos", r->stopped_at_eos);
    cJSON_AddNumberToObject(o, "prefill_seconds", r->prefill_seconds);
}

/* res [n]: one prompt prints as ever; a batch prints each request's
 * tokens (JSON: "requests") and the batch's totals. */
static void print_result(const gen_args *a, const m3_gen_result *res, int n,
                         m3_engine_stats stats, const m3_spec_stats *spec, int block) {
    int64_t n_prompt = 0, decode_tokens = 0, generated = 0;
    double prefill_s = 0, decode_s = res[0].decode_seconds; /* the batch's, shared */
    for (int i = 0; i < n; i++) {
        n_prompt += res[i].n_prompt;
        generated += res[i].n_tokens;
        prefill_s += res[i].prefill_seconds;
        decode_tokens += res[i].n_tokens > 1 ? res[i].n_tokens - 1 : 0; /* the first: prefill's */
    }
    double prefill_tps = prefill_s > 0 ? n_prompt / prefill_s : 0;
    double decode_tps = decode_s > 0 ? decode_tokens / decode_s : 0;
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        if (n == 1) {
            add_request(o, &res[0]);
        } else {
            cJSON *reqs = cJSON_AddArrayToObject(o, "requests");
            for (int i = 0; i < n; i++) {
                cJSON *r = cJSON_CreateObject();
                add_request(r, &res[i]);
                cJSON_AddItemToArray(reqs, r);
            }
            cJSON_AddNumberToObject(o, "n_prompt", (double)n_prompt);
            cJSON_AddNumberToObject(o, "prefill_seconds", prefill_s);
        }
        cJSON_AddNumberToObject(o, "decode_seconds", decode_s);
        cJSON_AddNumberToObject(o, "prefill_tokens_per_s", prefill_tps);
        cJSON_AddNumberToObject(o, "decode_tokens_per_s", decode_tps);
        add_engine_stats(o, stats);
        if (spec)
            cJSON_AddItemToObject(o, "spec", spec_json(spec, block));
        char *text = cJSON_PrintUnformatted(o);
        if (text)
            printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return;
    }
    for (int i = 0; i < n; i++) {
        if (n == 1)
            printf("tokens:");
        else
            printf("tokens[%d]:", i);
        for (int t = 0; t < res[i].n_tokens; t++)
            printf(" %d", res[i].tokens[t]);
        printf("\n");
    }
    char reqs[48] = "";
    if (n > 1)
        snprintf(reqs, sizeof reqs, " over %d requests", n);
    fprintf(stderr, "prefill: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)n_prompt,
            prefill_s, prefill_tps);
    fprintf(stderr, "decode: %lld tokens in %.3f s (%.1f tokens/s)%s%s\n",
            (long long)generated, decode_s, decode_tps, reqs,
            n == 1 && res[0].stopped_at_eos ? ", stopped at end-of-sequence" : "");
    if (spec && spec->cycles && spec->batch_steps)
        fprintf(stderr,
                "draft: %lld cycles%s, %lld of %lld drafts accepted (%.2f tokens a cycle); a "
                "step %.2f ms drafting, %.2f ms verifying\n",
                (long long)spec->cycles, reqs, (long long)spec->accepted,
                (long long)spec->drafted, (double)(spec->accepted + spec->cycles) / spec->cycles,
                1e3 * spec->draft_seconds / spec->batch_steps,
                1e3 * spec->verify_seconds / spec->batch_steps);
}

/* Write each draft step's [block, vocab] logits as rows of an .npy. */
static m3_status dump_drafts(const char *path, const m3_spec_stats *s, int block, int vocab) {
    m3_npy_writer *npy = NULL;
    M3_TRY(m3_npy_open(path, vocab, &npy));
    m3_status st = M3_OK;
    for (int64_t i = 0; i < (int64_t)s->n_steps * block && !st; i++)
        st = m3_npy_append_row(npy, s->draft_logits + i * vocab);
    m3_status closed = m3_npy_close(npy);
    return st ? st : closed;
}

/* The engine for n prompts of lens tokens: one sequence each, a cache
 * that holds the run (each prompt capped at the model's context, so that a
 * longer one is refused by the generator with the limit named). */
static m3_status make_engine(const gen_args *a, m3_model *model, const int *lens, int n,
                             m3_engine **eng) {
    m3_engine_opts eo = m3_engine_defaults();
    eo.threads = (int)a->threads;
    eo.device = strcmp(a->device, "cuda") ? M3_DEVICE_CPU : M3_DEVICE_CUDA;
    eo.graphs = !a->no_graphs;
    eo.max_rows = (int)a->max_rows;
    eo.max_seqs = n;
    eo.tp = (int)a->tp;
    eo.indexer_cp = a->indexer_cp;
    eo.decode = !a->decode                   ? M3_DECODE_DEFAULT
                : !strcmp(a->decode, "stock") ? M3_DECODE_STOCK
                : !strcmp(a->decode, "mono")  ? M3_DECODE_MONO
                                              : M3_DECODE_AUTO;
    int64_t ctx = m3_model_config(model)->max_position_embeddings;
    eo.max_tokens = 0;
    for (int i = 0; i < n; i++) {
        int64_t need = lens[i] + a->max_tokens < ctx ? lens[i] + a->max_tokens : ctx;
        /* a batch: whole pages each, as the sequences hold them */
        eo.max_tokens += n == 1 ? need : (need + 127) / 128 * 128;
    }
    return m3_engine_create(model, &eo, eng);
}

static int generate(const gen_args *a, const int32_t *const *prompts, const int *lens, int n) {
    char dir[4096];
    m3_status st = M3_OK;
    if (a->model)
        snprintf(dir, sizeof dir, "%s", a->model);
    else if ((st = cli_builtin_tiny(dir, sizeof dir)))
        return cli_report("generate", st);
    m3_model *model = NULL;
    m3_drafter *drafter = NULL;
    m3_spec_stats spec = {0};
    m3_engine *eng = NULL;
    dump_ctx dump = {0};
    m3_gen_result *res = calloc((size_t)n, sizeof *res);
    m3_model_opts mo = {true};
    st = res ? m3_model_load(dir, &mo, &model) : m3_fail(M3_ERR_NO_MEMORY, "out of memory");
    if (!st)
        st = make_engine(a, model, lens, n, &eng);
    if (!st && a->draft)
        st = m3_drafter_load(a->draft, model, &mo, &drafter);
    if (!st && !drafter && m3_engine_mono_refusal(eng)[0]) /* once, at start: the run goes stock */
        fprintf(stderr, "m3 generate: %s; decode steps run the stock path\n",
                m3_engine_mono_refusal(eng));
    if (!st && a->dump_logits)
        st = m3_npy_open(a->dump_logits, m3_model_config(model)->vocab_size, &dump.npy);
    if (!st) {
        m3_gen_opts go = m3_gen_defaults();
        go.max_new_tokens = (int)a->max_tokens;
        go.sampler = (m3_sampler){(float)a->temperature, (int)a->top_k, (float)a->top_p,
                                  (uint64_t)a->seed};
        go.stop_at_eos = !a->ignore_eos;
        /* only --dump-logits (one prompt) reads each token's logits:
         * without it they stay on the device (a decode step's row of
         * vocabulary floats, a verify step's B + 1 rows) */
        go.on_token = a->dump_logits ? on_token : NULL;
        go.user = &dump;
        spec.keep_steps = a->json;
        spec.keep_draft_logits = a->dump_draft_logits != NULL;
        if (drafter)
            st = m3_generate_speculative_batch(eng, drafter, n, prompts, lens, &go, res, &spec);
        else
            st = m3_generate_batch(eng, n, prompts, lens, &go, res);
        /* where the drafter kernels were asked for but did not run: why, once */
        const char *want = getenv("M3_DRAFT_LAYERS");
        if (drafter && want && !strcmp(want, "fused") && spec.draft_kernels_off[0])
            fprintf(stderr, "m3 generate: the drafter's fused kernels are off (%s); its layers "
                    "ran op by op\n", spec.draft_kernels_off);
        if (!st && dump.failed)
            st = dump.failed;
    }
    if (dump.npy) {
        m3_status closed = m3_npy_close(dump.npy);
        if (!st)
            st = closed;
    }
    if (!st && a->dump_draft_logits)
        st = dump_drafts(a->dump_draft_logits, &spec, m3_drafter_block(drafter),
                         m3_model_config(model)->vocab_size);
    if (!st) {
        print_result(a, res, n, m3_engine_get_stats(eng), drafter ? &spec : NULL,
                     m3_drafter_block(drafter));
        /* tokens that never reach the reader are a failure, not a success */
        if (fflush(stdout) != 0 || ferror(stdout))
            st = m3_fail(M3_ERR_IO, "writing the result to standard output failed");
    }
    for (int i = 0; res && i < n; i++)
        free(res[i].tokens);
    free(res);
    m3_spec_stats_free(&spec);
    m3_engine_free(eng);
    m3_drafter_free(drafter);
    m3_model_free(model);
    return st ? cli_report("generate", st) : CLI_OK;
}

int cmd_generate(int argc, char **argv) {
    gen_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc < 0 ? CLI_OK : rc;
    int32_t *prompts[CLI_MAX_PROMPTS] = {0};
    int lens[CLI_MAX_PROMPTS] = {0};
    for (int k = 0; !rc && k < a.n_prompts; k++)
        rc = prompt_tokens(&a, k, &prompts[k], &lens[k]);
    if (!rc)
        rc = generate(&a, (const int32_t *const *)prompts, lens, a.n_prompts);
    for (int k = 0; k < a.n_prompts; k++)
        free(prompts[k]);
    return rc;
}
