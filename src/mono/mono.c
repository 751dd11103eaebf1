/*
 * The mono path's lifecycle (see mono.h): refusals agreed over the TP
 * group, cache binding by identity, the per-step plan, the fault word's
 * check after each step, health and close. The executor behind it is the
 * backend's fused layer kernel set, reached through a small table so the
 * lifecycle is one piece of code for the CPU and the GPU.
 */
#include "mono/mono.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "cpu/cpu_mono.h"
#include "cuda/cuda_mono.h"
#include "decode/engine.h"

/* The backend's fused executor. */
typedef struct exec_ops {
    const char *name;
    size_t cache_align; /* bytes a cache buffer must be aligned to */
    m3_status (*layer)(void *x, const m3_step *st, int li, const m3_layer_weights *lw,
                       const m3_cache_layer *cl, bool first, uint32_t epoch, uint16_t *hidden,
                       uint16_t *residual);
    m3_status (*read_fault)(void *x, int32_t out[4]);
    /* after a step: CPU reads the word; GPU launches the asserting check */
    m3_status (*check_fault)(void *x);
    m3_status (*set_fault)(void *x, int code, int layer);
    void (*abort_all)(void *x);
    m3_status (*clear_fault)(void *x);
    void (*destroy)(void *x);
} exec_ops;

typedef struct bound_layer {
    bool bound;
    m3_cache_layer ptrs;
    int64_t n_pages;
} bound_layer;

struct m3_mono {
    m3_engine *eng;           /* the rank engine */
    m3_mono_config cfg;
    const exec_ops *ops;
    void *exec;
    m3_mono_state state;
    const m3_layer_weights **views; /* [num_layers]: zero-copy, the engine's own */
    bound_layer *bound;       /* [num_layers] */
    uint32_t epoch;
    int64_t mono_steps, stock_steps, binds;
    int32_t fault[4];
};

/* ------------------------------------------------------------ executors */

static m3_status cpu_layer(void *x, const m3_step *st, int li, const m3_layer_weights *lw,
                           const m3_cache_layer *cl, bool first, uint32_t epoch,
                           uint16_t *hidden, uint16_t *residual) {
    return m3_cpu_mono_layer(x, st, li, lw, cl, first, epoch, hidden, residual);
}
static m3_status cpu_read_fault(void *x, int32_t out[4]) {
    const int32_t *w = m3_cpu_mono_fault_word(x);
    for (int i = 0; i < 4; i++)
        out[i] = __atomic_load_n(&w[i], __ATOMIC_ACQUIRE);
    return M3_OK;
}
static m3_status cpu_check_fault(void *x) { return M3_OK; } /* read by the lifecycle */
static m3_status cpu_set_fault(void *x, int code, int layer) {
    m3_cpu_mono_set_fault(x, code, layer, -1, 0);
    return M3_OK;
}
static void cpu_abort_all(void *x) { m3_cpu_mono_abort_all(x); }
static m3_status cpu_clear_fault(void *x) {
    m3_cpu_mono_clear_fault(x);
    return M3_OK;
}
static void cpu_destroy(void *x) { m3_cpu_mono_free(x); }

static const exec_ops cpu_exec = {"cpu",           16,           cpu_layer,
                                  cpu_read_fault,  cpu_check_fault, cpu_set_fault,
                                  cpu_abort_all,   cpu_clear_fault, cpu_destroy};

static m3_status cuda_layer(void *x, const m3_step *st, int li, const m3_layer_weights *lw,
                            const m3_cache_layer *cl, bool first, uint32_t epoch,
                            uint16_t *hidden, uint16_t *residual) {
    return m3_cuda_mono_layer(x, st, li, lw, cl, first, epoch, hidden, residual);
}
static m3_status cuda_read_fault(void *x, int32_t out[4]) { return m3_cuda_mono_read_fault(x, out); }
static m3_status cuda_check_fault(void *x) { return m3_cuda_mono_check_fault(x); }
static m3_status cuda_set_fault(void *x, int code, int layer) {
    return m3_cuda_mono_set_fault(x, code, layer);
}
/* every rank's fault word (world 1: this rank's) */
static void cuda_abort_all(void *x) { (void)m3_cuda_mono_abort_all(x); }
static m3_status cuda_clear_fault(void *x) { return m3_cuda_mono_clear_fault(x); }
static void cuda_destroy(void *x) { m3_cuda_mono_free(x); }

static const exec_ops cuda_exec = {"cuda",           256,              cuda_layer,
                                   cuda_read_fault,  cuda_check_fault, cuda_set_fault,
                                   cuda_abort_all,   cuda_clear_fault, cuda_destroy};

/* ------------------------------------------------------------ config, refusals */

m3_status m3_mono_default_config(const m3_engine *eng, int max_rows, m3_mono_config *out) {
    const m3_config *c = &eng->cfg;
    memset(out, 0, sizeof *out);
    /* the longest run of sparse MoE layers, the later one on a tie (M3:
     * layers 3..59); the layers outside it run stock */
    int first = -1, last = -2;
    for (int i = 0, j; i < c->num_layers; i = j + 1) {
        for (j = i; j < c->num_layers && c->layer_sparse[j] && c->layer_moe[j]; j++)
            ;
        if (j > i && j - i >= last - first + 1)
            first = i, last = j - 1;
    }
    if (first < 0)
        return m3_fail(M3_ERR_UNSUPPORTED, "the mono path runs sparse MoE layers and none of the "
                       "model's %d layers is one", c->num_layers);
    /* an experiment's knob (docs/PERF.md, tuning): M3_MONO_FIRST_LAYER=n
     * leaves the range's layers before n to the stock path, e.g. to find the
     * layer from which the two paths' results part */
    const char *env = getenv("M3_MONO_FIRST_LAYER");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end || v < 0 || v > last)
            return m3_fail(M3_ERR_INVALID_ARG, "M3_MONO_FIRST_LAYER=%s: not a layer in 0..%d "
                           "(the fused range is %d..%d)", env, last, first, last);
        first = v > first ? (int)v : first;
    }
    out->first_layer = first;
    out->last_layer = last;
    out->max_rows = max_rows > 0 ? max_rows : M3_CUDA_MONO_MAX_ROWS;
    for (int w = 1; out->n_widths < M3_MONO_MAX_WIDTHS; w *= 2) {
        out->widths[out->n_widths++] = w < out->max_rows ? w : out->max_rows;
        if (w >= out->max_rows)
            break;
    }
    out->tp_size = eng->tp_size > 0 ? eng->tp_size : 1;
    return M3_OK;
}

/* Append one reason to buf, counted in *n. */
static void refuse(char *buf, size_t size, int *n, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void refuse(char *buf, size_t size, int *n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    m3_reasons_vadd(buf, size, fmt, ap);
    va_end(ap);
    (*n)++;
}

static void refuse_layers(const m3_engine *eng, const m3_mono_config *mc, char *buf, size_t size,
                          int *n) {
    const m3_config *c = &eng->cfg;
    bool cuda = eng->opts.device == M3_DEVICE_CUDA;
    for (int i = mc->first_layer; i <= mc->last_layer; i++) {
        const m3_layer_weights *lw = &eng->w.layers[i];
        if (!lw->sparse || !lw->moe)
            refuse(buf, size, n, "layer %d is not sparse attention + MoE (%s attention, %s FFN)",
                   i, lw->sparse ? "sparse" : "dense", lw->moe ? "MoE" : "dense");
        const m3_linear *lin[] = {&lw->q_proj, &lw->k_proj, &lw->v_proj, &lw->o_proj};
        for (size_t k = 0; k < sizeof lin / sizeof *lin; k++)
            if (lin[k]->w.data && lin[k]->w.dtype != M3_DT_BF16 &&
                lin[k]->w.dtype != M3_DT_F8_E4M3)
                refuse(buf, size, n, "layer %d: %s has dtype %s (bf16 or MXFP8 only)", i,
                       lin[k]->w.name ? lin[k]->w.name : "a projection",
                       m3_dtype_name(lin[k]->w.dtype));
        if (lw->moe && lw->router.dtype != M3_DT_F32)
            refuse(buf, size, n, "layer %d: the router is %s, not F32", i,
                   m3_dtype_name(lw->router.dtype));
    }
    if (cuda && (c->head_dim != 128 || c->index_dim != 128 || c->rotary_dim > c->head_dim))
        refuse(buf, size, n, "cuda: head_dim %d / index_dim %d / rotary_dim %d (the fused "
               "kernels take 128 / 128 / <= 128)", c->head_dim, c->index_dim, c->rotary_dim);
    if (cuda && c->hidden_size % 256)
        refuse(buf, size, n, "cuda: hidden_size %d is not a multiple of 256", c->hidden_size);
}

int m3_mono_model_refusals(const m3_engine *eng, const m3_mono_config *mc, char *buf,
                           size_t size) {
    const m3_config *c = &eng->cfg;
    int n = 0;
    if (size)
        buf[0] = 0;
    if (!eng->be) {
        refuse(buf, size, &n, "no backend (a TP front engine: build one per rank)");
        return n;
    }
    const char *be = eng->be->ops->name;
    if (strcmp(be, "cpu") && strcmp(be, "cuda"))
        refuse(buf, size, &n, "backend %s has no fused executor", be);
    if (mc->first_layer < 0 || mc->last_layer >= c->num_layers ||
        mc->first_layer > mc->last_layer)
        refuse(buf, size, &n, "layer range [%d, %d] is not inside [0, %d]", mc->first_layer,
               mc->last_layer, c->num_layers - 1);
    else
        refuse_layers(eng, mc, buf, size, &n);
    if (mc->max_rows < 1 || mc->max_rows > M3_CUDA_MONO_MAX_ROWS)
        refuse(buf, size, &n, "max_rows %d is outside [1, %d]", mc->max_rows,
               M3_CUDA_MONO_MAX_ROWS);
    bool widths_ok = mc->n_widths >= 1 && mc->n_widths <= M3_MONO_MAX_WIDTHS &&
                     mc->widths[mc->n_widths - 1] == mc->max_rows;
    for (int i = 0; widths_ok && i < mc->n_widths; i++)
        widths_ok = mc->widths[i] >= 1 && (i == 0 || mc->widths[i] > mc->widths[i - 1]);
    if (!widths_ok)
        refuse(buf, size, &n, "row widths must ascend, at most %d of them, ending at max_rows %d",
               M3_MONO_MAX_WIDTHS, mc->max_rows);
    int tp = eng->tp_size > 0 ? eng->tp_size : 1;
    if (mc->tp_size != tp)
        refuse(buf, size, &n, "tp_size %d but the engine runs %d ranks", mc->tp_size, tp);
    if (eng->opts.indexer_cp && eng->opts.device == M3_DEVICE_CUDA)
        refuse(buf, size, &n, "cuda: indexer context parallelism is not built into the fused "
               "kernels (it runs in the stock path's layers)");
    if (c->block_size != M3_PAGE_TOKENS)
        refuse(buf, size, &n, "sparse block size %d is not the page size %d", c->block_size,
               M3_PAGE_TOKENS);
    if (c->index_heads != c->num_kv_heads)
        refuse(buf, size, &n, "index heads %d != KV heads %d", c->index_heads, c->num_kv_heads);
    return n;
}

/* ------------------------------------------------------------ lifecycle */

/* true on every rank iff ok on every rank; a failed agreement counts as no */
static bool agree(m3_engine *eng, bool ok) {
    bool all = false;
    if (m3_comm_agree(eng->comm, ok, &all))
        return false;
    return all;
}

m3_status m3_mono_create(m3_engine *eng, const m3_mono_config *cfg, void *group, m3_mono **out) {
    *out = NULL;
    char reasons[1024];
    int n = m3_mono_model_refusals(eng, cfg, reasons, sizeof reasons);
    if (!agree(eng, n == 0)) {
        if (n)
            return m3_fail(M3_ERR_UNSUPPORTED, "mono decode refused: %s", reasons);
        return m3_fail(M3_ERR_UNSUPPORTED, "mono decode refused on another TP rank");
    }
    m3_mono *m = m3_calloc(1, sizeof *m, "mono");
    m3_status st = m ? M3_OK : M3_ERR_NO_MEMORY;
    int L = eng->cfg.num_layers;
    if (!st) {
        m->eng = eng;
        m->cfg = *cfg;
        m->views = m3_calloc((size_t)L, sizeof *m->views, "mono views");
        m->bound = m3_calloc((size_t)L, sizeof *m->bound, "mono bindings");
        st = m->views && m->bound ? M3_OK : M3_ERR_NO_MEMORY;
    }
    if (!st) {
        for (int i = cfg->first_layer; i <= cfg->last_layer; i++)
            m->views[i] = &eng->w.layers[i]; /* views: the stock weights stay in place */
        bool cuda = eng->opts.device == M3_DEVICE_CUDA;
        m->ops = cuda ? &cuda_exec : &cpu_exec;
        st = cuda ? m3_cuda_mono_create(eng->be, &eng->cfg, eng->max_blocks, eng->tp_rank,
                                        cfg->tp_size, (m3_cuda_mono **)&m->exec)
                  : m3_cpu_mono_create(eng->be, &eng->cfg, cfg->max_rows, eng->max_blocks,
                                       eng->tp_rank, group,
                                       eng->opts.indexer_cp ? eng->comm : NULL,
                                       (m3_cpu_mono **)&m->exec);
    }
    /* an executor failing on one rank fails them all, like a refusal */
    bool all_ok = agree(eng, st == M3_OK);
    if (!st && !all_ok)
        st = m3_fail(M3_ERR_UNSUPPORTED, "mono decode: the executor failed on another TP rank");
    if (st) {
        m3_mono_free(m);
        return st;
    }
    *out = m;
    return M3_OK;
}

m3_status m3_mono_connect_gpus(m3_mono *const *monos, int world) {
    void *landings[M3_MAX_TP];
    int32_t *faults[M3_MAX_TP];
    if (world < 2 || world > M3_MAX_TP)
        return m3_fail(M3_ERR_INVALID_ARG, "mono: connecting a TP world of %d GPUs", world);
    for (int r = 0; r < world; r++) {
        if (!monos[r] || monos[r]->ops != &cuda_exec)
            return m3_fail(M3_ERR_INVALID_ARG, "mono: TP rank %d has no CUDA executor", r);
        landings[r] = m3_cuda_mono_landing(monos[r]->exec);
        faults[r] = m3_cuda_mono_fault_word(monos[r]->exec);
    }
    for (int r = 0; r < world; r++) {
        M3_TRY(m3_engine_bind_thread(monos[r]->eng));
        m3_status st = m3_cuda_mono_set_peers(monos[r]->exec, landings, faults, world);
        if (st)
            return m3_fail_context(st, "TP rank %d", r);
    }
    return M3_OK;
}

/* Is this layer's cache usable by the executor? */
static m3_status check_binding(const m3_mono *m, int li, const m3_cache_layer *cl) {
    size_t a = m->ops->cache_align;
    const void *ptrs[3] = {cl->k, cl->v, cl->index};
    const char *names[3] = {"K", "V", "index"};
    for (int k = 0; k < 3; k++) {
        if (!ptrs[k])
            return m3_fail(M3_ERR_INVALID_ARG, "mono: layer %d has no %s cache", li, names[k]);
        if ((uintptr_t)ptrs[k] % a)
            return m3_fail(M3_ERR_INVALID_ARG, "mono: layer %d's %s cache at %p is not %zu-byte "
                           "aligned", li, names[k], ptrs[k], a);
    }
    return M3_OK;
}

m3_status m3_mono_bind_cache(m3_mono *m, const m3_cache *cache, int64_t n_pages, bool capturing) {
    m3_status st = M3_OK;
    if (m->state == M3_MONO_CLOSED)
        st = m3_fail(M3_ERR_INVALID_ARG, "mono: bind_cache after close");
    if (!st && (!cache || !cache->layers))
        st = m3_fail(M3_ERR_INVALID_ARG, "mono: no cache to bind");
    for (int i = m->cfg.first_layer; !st && i <= m->cfg.last_layer; i++) {
        const m3_cache_layer *cl = &cache->layers[i];
        bound_layer *b = &m->bound[i];
        bool same = b->bound && b->n_pages == n_pages && !memcmp(&b->ptrs, cl, sizeof *cl);
        if (same)
            continue;
        if (capturing) {
            st = m3_fail(M3_ERR_INVALID_ARG, "mono: layer %d's cache would be %s during a graph "
                         "capture", i, b->bound ? "rebound" : "bound for the first time");
            break;
        }
        st = check_binding(m, i, cl);
        if (!st) {
            b->bound = true;
            b->ptrs = *cl;
            b->n_pages = n_pages;
            m->binds++;
        }
    }
    if (!agree(m->eng, st == M3_OK) && !st)
        st = m3_fail(M3_ERR_INVALID_ARG, "mono: binding the cache failed on another TP rank");
    return st;
}

const char *m3_mono_decision_name(m3_mono_decision d) {
    static const char *names[] = {"mono", "closed", "no forward context", "pipeline intermediates",
                                  "prefill", "too many rows", "piecewise graph",
                                  "no sparse metadata", "faulted", "cache not bound"};
    return (unsigned)d < sizeof names / sizeof *names ? names[d] : "unknown";
}

m3_mono_decision m3_mono_decide_step(const m3_mono *m, const m3_step *st) {
    if (m->state == M3_MONO_CLOSED)
        return M3_MONO_STEP_CLOSED;
    if (!st)
        return M3_MONO_STEP_NO_CONTEXT;
    if (m->state == M3_MONO_FAULTED)
        return M3_MONO_STEP_FAULTED;
    if (st->n_prefill > 0 || st->max_query_len > 1 || st->n_decode != st->n_reqs)
        return M3_MONO_STEP_PREFILL;
    if (st->rows > m->cfg.max_rows)
        return M3_MONO_STEP_TOO_MANY_ROWS;
    if (st->graph_mode == M3_GRAPH_PIECEWISE)
        return M3_MONO_STEP_PIECEWISE;
    if (!st->dev.block_table || !st->dev.seq_lens || !st->dev.slots || st->max_blocks < 1)
        return M3_MONO_STEP_NO_METADATA;
    for (int i = m->cfg.first_layer; i <= m->cfg.last_layer; i++)
        if (!m->bound[i].bound || !m->views[i])
            return M3_MONO_STEP_UNBOUND;
    return M3_MONO_STEP_MONO;
}

/* begin_step: a new epoch (the same on every rank: every rank plans the
 * same steps). The slot mapping is read by the kernels from the step
 * itself (st->dev.slots[0 .. rows)). */
static void begin_step(m3_mono *m, const m3_step *st) {
    m->epoch++;
    (void)st;
}

bool m3_mono_plan(m3_mono *m, const m3_step *st, bool intermediates, m3_mono_decision *why) {
    m3_mono_decision d = intermediates && m->state != M3_MONO_CLOSED
                             ? M3_MONO_STEP_INTERMEDIATES
                             : m3_mono_decide_step(m, st);
    if (why)
        *why = d;
    if (d != M3_MONO_STEP_MONO) {
        m->stock_steps++;
        return false;
    }
    begin_step(m, st);
    m->mono_steps++;
    return true;
}

m3_status m3_mono_run(m3_mono *m, const m3_step *st, uint16_t *hidden, uint16_t *residual) {
    if (m->state != M3_MONO_READY || !m->exec)
        return m3_fail(M3_ERR_INVALID_ARG, "mono: run while %s",
                       m->state == M3_MONO_CLOSED ? "closed" : "faulted");
    for (int i = m->cfg.first_layer; i <= m->cfg.last_layer; i++) {
        m3_status s = m->ops->layer(m->exec, st, i, m->views[i], &m->bound[i].ptrs, i == 0,
                                    m->epoch, hidden, residual);
        if (s)
            return m3_fail_context(s, "mono layer %d", i);
        if (m->ops != &cpu_exec)
            continue; /* the GPU's word is checked on the device after the step */
        /* a fault on this rank: end the peers' waits now (they would
         * otherwise wait out the timeout) and run nothing more */
        int32_t f[4];
        if (!cpu_read_fault(m->exec, f) && f[0]) {
            if (f[0] != M3_MONO_FAULT_ABORTED)
                m->ops->abort_all(m->exec);
            break;
        }
    }
    return M3_OK;
}

m3_status m3_mono_run_layer(m3_mono *m, const m3_step *st, int layer, uint16_t *hidden,
                            uint16_t *residual) {
    if (m->state != M3_MONO_READY || !m->exec)
        return m3_fail(M3_ERR_INVALID_ARG, "mono: run while %s",
                       m->state == M3_MONO_CLOSED ? "closed" : "faulted");
    if (layer < m->cfg.first_layer || layer > m->cfg.last_layer)
        return m3_fail(M3_ERR_INVALID_ARG, "mono: layer %d is outside the range [%d, %d]", layer,
                       m->cfg.first_layer, m->cfg.last_layer);
    if (!m->bound[layer].bound)
        return m3_fail(M3_ERR_INVALID_ARG, "mono: layer %d's cache is not bound", layer);
    return m->ops->layer(m->exec, st, layer, m->views[layer], &m->bound[layer].ptrs, layer == 0,
                         m->epoch, hidden, residual);
}

m3_status m3_mono_after_step(m3_mono *m, bool launched, m3_status failure) {
    if (!m->exec)
        return failure;
    /* A launched step that ends abnormally on any rank retires the mono path
     * on every rank (the failing rank by its own state, its peers through
     * the abort mark), so the ranks keep planning alike: stock from here. */
    if (failure) {
        if (launched) { /* peers may wait on this rank inside the step: end their waits */
            m->ops->abort_all(m->exec);
            m->state = M3_MONO_FAULTED;
            (void)m->ops->read_fault(m->exec, m->fault);
        }
        return failure;
    }
    if (!launched)
        return M3_OK;
    if (m->ops == &cuda_exec) /* the fault stops the process from the device */
        return m->ops->check_fault(m->exec);
    M3_TRY(m->ops->read_fault(m->exec, m->fault));
    if (!m->fault[0])
        return M3_OK;
    m->state = M3_MONO_FAULTED;
    if (m->fault[0] == M3_MONO_FAULT_ABORTED)
        return m3_fail(M3_ERR_FAULT, "mono: the step was aborted (a failure on another TP rank)");
    return m3_fail(M3_ERR_FAULT, "mono fault: %s (layer %d, row %d, value %d)",
                   m3_mono_fault_name(m->fault[0]), m->fault[1], m->fault[2], m->fault[3]);
}

void *m3_mono_executor(m3_mono *m) { return m->exec; }

m3_status m3_mono_plant_fault(m3_mono *m, int code, int layer) {
    if (!m->exec)
        return m3_fail(M3_ERR_INVALID_ARG, "mono: plant_fault after close");
    return m->ops->set_fault(m->exec, code, layer);
}

m3_mono_health m3_mono_get_health(const m3_mono *m) {
    m3_mono_health h = {m->state, m->ops ? m->ops->name : "none", m->cfg.first_layer,
                        m->cfg.last_layer, m->mono_steps, m->stock_steps, m->binds, m->epoch,
                        {m->fault[0], m->fault[1], m->fault[2], m->fault[3]}};
    return h;
}

int m3_mono_first_layer(const m3_mono *m) { return m->cfg.first_layer; }
int m3_mono_last_layer(const m3_mono *m) { return m->cfg.last_layer; }

int m3_mono_width(const m3_mono *m, int rows) {
    for (int i = 0; i < m->cfg.n_widths; i++)
        if (m->cfg.widths[i] >= rows)
            return m->cfg.widths[i];
    return -1;
}

void m3_mono_close(m3_mono *m) {
    if (!m || m->state == M3_MONO_CLOSED)
        return;
    if (m->exec)
        m->ops->destroy(m->exec);
    m->exec = NULL;
    m->state = M3_MONO_CLOSED;
}

void m3_mono_free(m3_mono *m) {
    if (!m)
        return;
    m3_mono_close(m);
    free(m->views);
    free(m->bound);
    free(m);
}
