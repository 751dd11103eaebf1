/*
 * `m3 bench layer` (and `draft`, `linear`, `indexer`): parse the points to
 * measure, run them (bench/), and print a table (or JSON for machines) of
 * time, bytes, floor and their ratio per point.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_draft.h"
#include "bench/bench_layer.h"
#include "cli/cli.h"
#include "core/status.h"
#include "cuda/cuda_bench.h"
#include "cp/indexer_cp.h"
#include "cuda/cuda_cp.h"

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: m3 bench layer (--model DIR | --preset NAME [--layers N])\n"
            "                      [--rows 1,2,4,8,16] [--context 4096,32768,131072]\n"
            "                      [--path stock,mono,stock-cp] [--layer L] [--iters N] [--gpu N]\n"
            "                      [--warmup-ms MS] [--span N] [--tp N] [--json]\n"
            "\n"
            "  --path LIST     the paths to time, comma-separated (default stock): stock,\n"
            "                  mono, stock-cp (the stock path with indexer context\n"
            "                  parallelism: --tp 2 or more; a rank's floor counts its share\n"
            "                  of the index cache)\n"
            "  --preset NAME   a preset (e.g. m3-tp4-rank) cut to --layers (default 4, or\n"
            "                  all of a smaller preset's), synthesized on first use into\n"
            "                  the model cache\n"
            "  --layer L       the layer to time (default: the first sparse MoE layer)\n"
            "  --span N        time layers L .. L + N - 1 in one graph (default 1) and\n"
            "                  report the mean per layer (time, bytes, floor): what a\n"
            "                  layer costs among its neighbours, whose work may overlap\n"
            "  --iters N       timed graph replays per point (default 50)\n"
            "  --warmup-ms MS  untimed replays before them: at least 3, for at least MS\n"
            "                  milliseconds (default %.0f; a point right after a heavier\n"
            "                  one runs slower for a while)\n"
            "  --tp N          tensor parallel over GPUs --gpu .. --gpu + N - 1: the time is\n"
            "                  the slowest rank's, the floor one rank's bytes over one GPU's\n"
            "                  bandwidth; 'all-reduce us' times the stock path's all-reduces\n"
            "                  alone\n"
            "  --json          print JSON instead of the table\n"
            "  Each point also times one kernel that only reads the step's bytes\n"
            "  ('read-only us', JSON read_us): what streaming them alone costs, and\n"
            "  the medians of its replays' first and last thirds ('thirds us', JSON\n"
            "  first_third_us, last_third_us): a point still warming up shows the first\n"
            "  above the last.\n"
            "\n"
            "       m3 bench linear [--rows 1,2,4,8,16] [--shapes NxK,...] [--iters N]\n"
            "  the decode linear against cuBLAS (default: one m3-tp4-rank layer's shapes,\n"
            "  a dense layer's MLP and the lm_head)\n"
            "\n"
            "       m3 bench indexer [--batch 1,8,32] [--context 32768,131072,1048576]\n"
            "                        [--world 1,2,4,8] [--heads 4] [--topk 16] [--iters N] [--json]\n"
            "                        [--target-grid N] [--min-blocks N]  (the chunk rule's constants)\n"
            "  indexer context parallelism: one rank's block scores + local top-k + merge\n"
            "  (world > 1 emulated on one GPU by scoring rank 0's share)\n"
            "\n"
            "       m3 bench draft --model DIR --draft DIR [--requests 1,2,4,8]\n"
            "                      [--context 1024,32768] [--iters N] [--gpu N] [--json]\n"
            "  one DSpark draft step, whole and in parts (draft layers with the final norm,\n"
            "  lm_head, Markov head), each against its floor\n",
            M3_BENCH_WARMUP_MS);
}

/* "1,2,4" -> values; false with a message on a bad list. */
static bool parse_list(const char *flag, const char *text, int64_t lo, int64_t hi, int64_t *out,
                       int *n) {
    *n = 0;
    char *copy = strdup(text), *save = NULL;
    bool ok = copy != NULL;
    for (char *tok = ok ? strtok_r(copy, ",", &save) : NULL; ok && tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (*n == M3_BENCH_MAX_POINTS) {
            fprintf(stderr, "m3 bench: %s lists more than %d values\n", flag, M3_BENCH_MAX_POINTS);
            ok = false;
        } else {
            ok = cli_int(flag, tok, lo, hi, &out[(*n)++]);
        }
    }
    free(copy);
    if (ok && !*n) {
        fprintf(stderr, "m3 bench: %s is empty\n", flag);
        ok = false;
    }
    return ok;
}

static void print_table(const m3_bench_layer_result *r) {
    printf("read bandwidth: %.0f GB/s\n", r->read_gb_per_s);
    printf("| path | tp | layer | rows | context | time us | min us | MB read | floor us | "
           "time/floor | read-only us | all-reduce us | experts | sets | thirds us |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < r->n_points; i++) {
        const m3_bench_point *p = &r->points[i];
        char layer[32]; /* a span: its layers (the figures are means per layer) */
        if (p->span > 1)
            snprintf(layer, sizeof layer, "%d-%d", p->layer, p->layer + p->span - 1);
        else
            snprintf(layer, sizeof layer, "%d", p->layer);
        printf("| %s | %d | %s | %d | %lld | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f "
               "| %d | %.1f / %.1f |\n",
               p->path, p->tp, layer, p->rows, (long long)p->context, p->median_us, p->min_us,
               p->bytes / 1e6, p->floor_us, p->median_us / p->floor_us, p->read_us, p->allreduce_us,
               p->unique_experts, p->sets, p->first_third_us, p->last_third_us);
    }
}

static void print_json(const m3_bench_layer_result *r) {
    cJSON *o = cJSON_CreateObject(), *pts = cJSON_CreateArray();
    cJSON_AddNumberToObject(o, "read_gb_per_s", r->read_gb_per_s);
    for (int i = 0; i < r->n_points; i++) {
        const m3_bench_point *p = &r->points[i];
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "path", p->path);
        cJSON_AddNumberToObject(j, "layer", p->layer);
        cJSON_AddNumberToObject(j, "span", p->span);
        cJSON_AddNumberToObject(j, "rows", p->rows);
        cJSON_AddNumberToObject(j, "context", (double)p->context);
        cJSON_AddNumberToObject(j, "median_us", p->median_us);
        cJSON_AddNumberToObject(j, "min_us", p->min_us);
        if (!isnan(p->first_third_us)) { /* (cJSON writes NaN as null) */
            cJSON_AddNumberToObject(j, "first_third_us", p->first_third_us);
            cJSON_AddNumberToObject(j, "last_third_us", p->last_third_us);
        }
        cJSON_AddNumberToObject(j, "bytes", p->bytes);
        cJSON_AddNumberToObject(j, "weight_bytes", p->weight_bytes);
        cJSON_AddNumberToObject(j, "cache_bytes", p->cache_bytes);
        cJSON_AddNumberToObject(j, "floor_us", p->floor_us);
        cJSON_AddNumberToObject(j, "read_us", p->read_us);
        cJSON_AddNumberToObject(j, "unique_experts", p->unique_experts);
        cJSON_AddNumberToObject(j, "sets", p->sets);
        cJSON_AddNumberToObject(j, "tp", p->tp);
        cJSON_AddNumberToObject(j, "allreduce_us", p->allreduce_us);
        cJSON_AddItemToArray(pts, j);
    }
    cJSON_AddItemToObject(o, "points", pts);
    char *text = cJSON_Print(o);
    if (text)
        printf("%s\n", text);
    free(text);
    cJSON_Delete(o);
}

static int parse_args(int argc, char **argv, m3_bench_layer_opts *o, const char **preset,
                      int64_t *layers, bool *json) {
    int64_t v, rows[M3_BENCH_MAX_POINTS];
    int n = 0;
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i], *val;
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
            bench_usage(stdout);
            return -1;
        }
        if (!strcmp(f, "--json")) {
            *json = true;
            continue;
        }
        if (!(val = cli_value(argc, argv, &i)))
            return CLI_USAGE;
        bool ok = true;
        v = 0;
        if (!strcmp(f, "--model")) {
            o->model_dir = val;
        } else if (!strcmp(f, "--preset")) {
            *preset = val;
        } else if (!strcmp(f, "--path")) {
            o->path = val;
        } else if (!strcmp(f, "--layers")) {
            ok = cli_int(f, val, 1, M3_MAX_LAYERS, layers);
        } else if (!strcmp(f, "--layer")) {
            ok = cli_int(f, val, 0, M3_MAX_LAYERS - 1, &v);
            o->layer = (int)v;
        } else if (!strcmp(f, "--span")) {
            ok = cli_int(f, val, 1, M3_MAX_LAYERS, &v);
            o->span = (int)v;
        } else if (!strcmp(f, "--iters")) {
            ok = cli_int(f, val, 1, 100000, &v);
            o->iters = (int)v;
        } else if (!strcmp(f, "--gpu")) {
            ok = cli_int(f, val, 0, 64, &v);
            o->gpu = (int)v;
        } else if (!strcmp(f, "--warmup-ms")) {
            ok = cli_int(f, val, 0, 600000, &v);
            o->warmup_ms = (double)v;
        } else if (!strcmp(f, "--tp")) {
            ok = cli_int(f, val, 1, M3_MAX_TP, &v);
            o->tp = (int)v;
        } else if (!strcmp(f, "--rows")) {
            ok = parse_list(f, val, 1, 16, rows, &n);
            o->n_rows = n;
            for (int k = 0; k < n; k++)
                o->rows[k] = (int)rows[k];
        } else if (!strcmp(f, "--context")) {
            ok = parse_list(f, val, 2, (int64_t)1 << 32, o->contexts, &o->n_contexts);
        } else {
            fprintf(stderr, "m3 bench: unknown option '%s'\n", f);
            return CLI_USAGE;
        }
        if (!ok)
            return CLI_USAGE;
    }
    if (!!o->model_dir == !!*preset) {
        fprintf(stderr, "m3 bench: give exactly one of --model or --preset\n");
        return CLI_USAGE;
    }
    return CLI_OK;
}

/* `m3 bench linear`: the decode GEMV against cuBLAS on the projection
 * shapes of one m3-tp4-rank layer (or --shapes NxK,...), per row count. */
static int bench_linear(int argc, char **argv) {
    int64_t rows[M3_BENCH_MAX_POINTS] = {1, 2, 4, 8, 16}, v;
    int n_rows = 5, iters = 50, gpu = 0;
    int64_t shapes[M3_BENCH_MAX_POINTS][2] = {
        {2048, 6144}, {6144, 2048}, {128, 6144}, {768, 6144},
        {6144, 768},  {3072, 6144}, {6144, 3072}, {200064, 6144}};
    int n_shapes = 8;
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i], *val = cli_value(argc, argv, &i);
        if (!val)
            return CLI_USAGE;
        if (!strcmp(f, "--rows")) {
            if (!parse_list(f, val, 1, 65536, rows, &n_rows))
                return CLI_USAGE;
        } else if (!strcmp(f, "--iters") || !strcmp(f, "--gpu")) {
            if (!cli_int(f, val, !strcmp(f, "--gpu") ? 0 : 1, 100000, &v))
                return CLI_USAGE;
            *(!strcmp(f, "--gpu") ? &gpu : &iters) = (int)v;
        } else if (!strcmp(f, "--shapes")) {
            n_shapes = 0;
            for (const char *p = val; *p && n_shapes < M3_BENCH_MAX_POINTS;) {
                long long a, b;
                int used = 0;
                if (sscanf(p, "%lldx%lld%n", &a, &b, &used) != 2 || a < 1 || b < 8 || b % 8) {
                    fprintf(stderr, "m3 bench: --shapes wants NxK[,NxK...] with K a multiple "
                                    "of 8, got '%s'\n", p);
                    return CLI_USAGE;
                }
                shapes[n_shapes][0] = a;
                shapes[n_shapes++][1] = b;
                p += used;
                p += *p == ',';
            }
        } else {
            fprintf(stderr, "m3 bench: unknown option '%s'\n", f);
            return CLI_USAGE;
        }
    }
    m3_backend *be = NULL;
    m3_status st = m3_cuda_backend_create(gpu, &be);
    if (st)
        return cli_report("bench", st);
    /* "linear op": what the engine runs for a column-parallel weight (the
     * GEMV to 16 rows, then cuBLAS on its 16 row blocks, one batched call);
     * "cuBLAS pieces": a row-parallel weight's GEMM (K cut into its chunks,
     * then the tree), at any row count; "one GEMM": a single uncut cuBLAS
     * call, what the cuts cost */
    printf("| N x K | rows | MB | linear op us (GB/s) | cuBLAS pieces us (GB/s) | one GEMM us "
           "(GB/s) | faster |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int s = 0; s < n_shapes && !st; s++)
        for (int r = 0; r < n_rows && !st; r++) {
            double g, c, o, mb = (double)shapes[s][0] * shapes[s][1] * 2 / 1e6;
            st = m3_cuda_bench_linear(be, (int)rows[r], shapes[s][0], shapes[s][1], iters, &g, &c,
                                      &o);
            if (!st)
                printf("| %lld x %lld | %lld | %.1f | %.1f (%.0f) | %.1f (%.0f) | %.1f (%.0f) | "
                       "%s |\n",
                       (long long)shapes[s][0], (long long)shapes[s][1], (long long)rows[r], mb,
                       g, mb * 1e3 / g, c, mb * 1e3 / c, o, mb * 1e3 / o,
                       g <= c ? "linear op" : "cuBLAS pieces");
        }
    be->ops->destroy(be);
    return st ? cli_report("bench", st) : CLI_OK;
}

/* `m3 bench indexer`: one CP rank's scores + local top-k + merge per
 * (batch, context, world), against the floor (the index cache bytes the
 * rank must read / the measured read bandwidth). */
static int bench_indexer(int argc, char **argv) {
    int64_t batch[M3_BENCH_MAX_POINTS] = {1, 8, 32}, ctx[M3_BENCH_MAX_POINTS] = {32768, 131072,
                                                                                1048576};
    int64_t world[M3_BENCH_MAX_POINTS] = {1, 2, 4, 8}, v;
    int nb = 3, nc = 3, nw = 4, iters = 20, gpu = 0, heads = 4;
    int target_grid = M3_CP_SCORE_TARGET_GRID, min_blocks = M3_CP_SCORE_MIN_BLOCKS;
    m3_select_params p = {16, 0, 1}; /* the m3 preset's selection */
    bool json = false;
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--json")) {
            json = true;
            continue;
        }
        const char *val = cli_value(argc, argv, &i);
        if (!val)
            return CLI_USAGE;
        if (!strcmp(f, "--batch")) {
            if (!parse_list(f, val, 1, 1024, batch, &nb))
                return CLI_USAGE;
        } else if (!strcmp(f, "--context")) {
            if (!parse_list(f, val, 1, INT32_MAX, ctx, &nc))
                return CLI_USAGE;
        } else if (!strcmp(f, "--world")) {
            if (!parse_list(f, val, 1, 64, world, &nw))
                return CLI_USAGE;
        } else if (!strcmp(f, "--target-grid") || !strcmp(f, "--min-blocks")) {
            if (!cli_int(f, val, 1, 1 << 20, &v))
                return CLI_USAGE;
            *(!strcmp(f, "--target-grid") ? &target_grid : &min_blocks) = (int)v;
        } else if (!strcmp(f, "--iters") || !strcmp(f, "--gpu") || !strcmp(f, "--heads") ||
                   !strcmp(f, "--topk")) {
            if (!cli_int(f, val, !strcmp(f, "--gpu") ? 0 : 1, 100000, &v))
                return CLI_USAGE;
            if (!strcmp(f, "--iters"))
                iters = (int)v;
            else if (!strcmp(f, "--gpu"))
                gpu = (int)v;
            else if (!strcmp(f, "--heads"))
                heads = (int)v;
            else
                p.topk = (int)v;
        } else {
            fprintf(stderr, "m3 bench: unknown option '%s'\n", f);
            return CLI_USAGE;
        }
    }
    m3_status st = m3_cp_set_chunk_rule(target_grid, min_blocks);
    if (st)
        return cli_report("bench", st);
    m3_backend *be = NULL;
    st = m3_cuda_backend_create(gpu, &be);
    if (st)
        return cli_report("bench", st);
    double gbps = 0;
    st = m3_cuda_read_bandwidth(be, (size_t)2 << 30, 20, &gbps);
    if (!st && json)
        printf("{\"read_gb_per_s\": %.1f, \"heads\": %d, \"topk\": %d, \"points\": [", gbps, heads,
               p.topk);
    else if (!st)
        printf("read bandwidth %.0f GB/s, %d index heads, top-%d, chunk rule: target grid %d, "
               "min blocks %d\n\n"
               "| batch | context | world | MB read | floor us | us | x floor | world-1 us / us |\n"
               "|---|---|---|---|---|---|---|---|\n",
               gbps, heads, p.topk, target_grid, min_blocks);
    int n = 0;
    for (int b = 0; b < nb && !st; b++)
        for (int c = 0; c < nc && !st; c++) {
            double us1 = 0;
            for (int w = 0; w < nw && !st; w++) {
                double us = 0, bytes = 0;
                fprintf(stderr, "m3 bench indexer: batch %lld context %lld world %lld\n",
                        (long long)batch[b], (long long)ctx[c], (long long)world[w]);
                st = m3_cuda_bench_indexer(be, (int)batch[b], ctx[c], (int)world[w], heads, &p,
                                           iters, &us, &bytes);
                if (st)
                    break;
                const double floor_us = bytes / (gbps * 1e3);
                if (world[w] == 1)
                    us1 = us;
                if (json)
                    printf("%s\n  {\"batch\": %lld, \"context\": %lld, \"world\": %lld, "
                           "\"bytes\": %.0f, \"floor_us\": %.2f, \"us\": %.2f}",
                           n ? "," : "", (long long)batch[b], (long long)ctx[c],
                           (long long)world[w], bytes, floor_us, us);
                else {
                    char speedup[32] = ""; /* against world 1, when it was measured */
                    if (us1 > 0)
                        snprintf(speedup, sizeof speedup, "%.2f", us1 / us);
                    printf("| %lld | %lld | %lld | %.1f | %.1f | %.1f | %.2f | %s |\n",
                           (long long)batch[b], (long long)ctx[c], (long long)world[w], bytes / 1e6,
                           floor_us, us, us / floor_us, speedup);
                }
                n++;
            }
        }
    if (!st && json)
        printf("\n]}\n");
    be->ops->destroy(be);
    return st ? cli_report("bench", st) : CLI_OK;
}

static void print_draft(const m3_bench_draft_result *r, bool json) {
    if (json) {
        cJSON *o = cJSON_CreateObject(), *pts = cJSON_AddArrayToObject(o, "points");
        cJSON_AddNumberToObject(o, "read_gb_per_s", r->read_gb_per_s);
        cJSON_AddNumberToObject(o, "block", r->block);
        cJSON_AddNumberToObject(o, "layers", r->layers);
        for (int i = 0; i < r->n_points; i++) {
            const m3_bench_draft_point *p = &r->points[i];
            cJSON *j = cJSON_CreateObject();
            cJSON_AddNumberToObject(j, "requests", p->requests);
            cJSON_AddNumberToObject(j, "context", (double)p->context);
            for (int k = 0; k < M3_BENCH_DRAFT_PARTS; k++) {
                cJSON *q = cJSON_AddObjectToObject(j, m3_bench_draft_part_name(k));
                cJSON_AddNumberToObject(q, "median_us", p->median_us[k]);
                cJSON_AddNumberToObject(q, "min_us", p->min_us[k]);
                cJSON_AddNumberToObject(q, "bytes", p->bytes[k]);
                cJSON_AddNumberToObject(q, "floor_us", p->floor_us[k]);
            }
            cJSON_AddItemToArray(pts, j);
        }
        char *text = cJSON_Print(o);
        if (text)
            printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return;
    }
    printf("read bandwidth: %.0f GB/s; %d draft layers, block %d\n", r->read_gb_per_s,
           r->layers, r->block);
    printf("| requests | context | part | time us | min us | MB read | floor us | time/floor |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < r->n_points; i++) {
        const m3_bench_draft_point *p = &r->points[i];
        for (int k = 0; k < M3_BENCH_DRAFT_PARTS; k++)
            printf("| %d | %lld | %s | %.1f | %.1f | %.1f | %.1f | %.2f |\n", p->requests,
                   (long long)p->context, m3_bench_draft_part_name(k), p->median_us[k],
                   p->min_us[k], p->bytes[k] / 1e6, p->floor_us[k],
                   p->median_us[k] / p->floor_us[k]);
        double sum = p->median_us[1] + p->median_us[2] + p->median_us[3];
        printf("| %d | %lld | parts' sum | %.1f | | | | %.2f |\n", p->requests,
               (long long)p->context, sum, sum / p->floor_us[0]);
    }
}

/* `m3 bench draft`: a DSpark draft step's parts against their floors. */
static int bench_draft(int argc, char **argv) {
    m3_bench_draft_opts o = {.n_requests = 4, .requests = {1, 2, 4, 8}, .n_contexts = 2,
                             .contexts = {1024, 32768}, .iters = 50};
    bool json = false;
    int64_t v, list[M3_BENCH_MAX_POINTS];
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i], *val;
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
            bench_usage(stdout);
            return CLI_OK;
        }
        if (!strcmp(f, "--json")) {
            json = true;
            continue;
        }
        if (!(val = cli_value(argc, argv, &i)))
            return CLI_USAGE;
        bool ok = true;
        if (!strcmp(f, "--model")) {
            o.model_dir = val;
        } else if (!strcmp(f, "--draft")) {
            o.draft_dir = val;
        } else if (!strcmp(f, "--requests")) {
            ok = parse_list(f, val, 1, M3_MAX_DRAFT_REQS, list, &o.n_requests);
            for (int k = 0; ok && k < o.n_requests; k++)
                o.requests[k] = (int)list[k];
        } else if (!strcmp(f, "--context")) {
            ok = parse_list(f, val, 1, (int64_t)1 << 32, o.contexts, &o.n_contexts);
        } else if (!strcmp(f, "--iters") || !strcmp(f, "--gpu")) {
            ok = cli_int(f, val, !strcmp(f, "--gpu") ? 0 : 1, 100000, &v);
            *(!strcmp(f, "--gpu") ? &o.gpu : &o.iters) = (int)v;
        } else {
            fprintf(stderr, "m3 bench: unknown option '%s'\n", f);
            return CLI_USAGE;
        }
        if (!ok)
            return CLI_USAGE;
    }
    if (!o.model_dir || !o.draft_dir) {
        fprintf(stderr, "m3 bench draft: give both --model and --draft\n");
        return CLI_USAGE;
    }
    m3_bench_draft_result *r = malloc(sizeof *r);
    m3_status st = r ? m3_bench_draft(&o, r) : m3_fail(M3_ERR_NO_MEMORY, "out of memory");
    if (!st)
        print_draft(r, json);
    free(r);
    return st ? cli_report("bench", st) : CLI_OK;
}

int cmd_bench(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "draft"))
        return bench_draft(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "indexer"))
        return bench_indexer(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "linear"))
        return bench_linear(argc, argv);
    if (argc < 2 || strcmp(argv[1], "layer")) {
        if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
            bench_usage(stdout);
            return CLI_OK;
        }
        fprintf(stderr, "m3 bench: expected 'layer', 'linear', 'indexer' or 'draft'\n");
        bench_usage(stderr);
        return CLI_USAGE;
    }
    m3_bench_layer_opts o = {
        .layer = -1, .span = 1, .path = "stock", .iters = 50, .warmup_ms = M3_BENCH_WARMUP_MS};
    const int default_rows[] = {1, 2, 4, 8, 16};
    o.n_rows = 5;
    memcpy(o.rows, default_rows, sizeof default_rows);
    o.n_contexts = 3;
    o.contexts[0] = 4096;
    o.contexts[1] = 32768;
    o.contexts[2] = 131072;
    const char *preset = NULL;
    int64_t layers = 0; /* not given: 4, or all of a smaller preset's */
    bool json = false;
    int rc = parse_args(argc, argv, &o, &preset, &layers, &json);
    if (rc)
        return rc < 0 ? CLI_OK : rc;
    char dir[4096];
    if (preset) {
        m3_config pc;
        m3_status st = m3_preset(preset, &pc);
        if (st)
            return cli_report("bench", st);
        if (!layers)
            layers = pc.num_layers > 4 ? 4 : 0;
        st = cli_cached_preset(preset, (int)layers, dir, sizeof dir);
        if (st)
            return cli_report("bench", st);
        o.model_dir = dir;
    }
    /* each path of the list is its own run (its own engine and bandwidth
     * measurement); the points are reported together */
    m3_bench_layer_result *r = malloc(sizeof *r), *one = malloc(sizeof *one);
    char *paths = strdup(o.path), *save = NULL;
    m3_status st = r && one && paths ? M3_OK : m3_fail(M3_ERR_NO_MEMORY, "out of memory");
    if (!st)
        memset(r, 0, sizeof *r);
    for (char *p = st ? NULL : strtok_r(paths, ",", &save); p && !st;
         p = strtok_r(NULL, ",", &save)) {
        o.path = p;
        st = m3_bench_layer(&o, one);
        if (!r->n_points)
            r->read_gb_per_s = one->read_gb_per_s;
        int cap = (int)(sizeof r->points / sizeof *r->points);
        for (int i = 0; !st && i < one->n_points; i++) {
            if (r->n_points == cap) {
                st = m3_fail(M3_ERR_INVALID_ARG, "more than %d points in one bench run", cap);
                break;
            }
            r->points[r->n_points++] = one->points[i];
        }
    }
    free(paths);
    free(one);
    if (!st) {
        if (json)
            print_json(r);
        else
            print_table(r);
    }
    free(r);
    return st ? cli_report("bench", st) : CLI_OK;
}
