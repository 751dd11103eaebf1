/*
 * The world-1 communicator and helpers common to every communicator.
 */
#include "dist/comm.h"

#include <stdlib.h>
#include <string.h>

#include "core/status.h"

static m3_status single_all_reduce(m3_comm *c, float *buf, int64_t n) { return M3_OK; }

static m3_status single_all_reduce_f64(m3_comm *c, double *buf, int64_t n) { return M3_OK; }

static m3_status single_all_reduce_bf16(m3_comm *c, uint16_t *buf, int64_t n) { return M3_OK; }

static void single_abort(m3_comm *c, const char *msg) {}

static m3_status single_all_gather(m3_comm *c, const void *in, void *out, int64_t bytes) {
    if (in != out && bytes > 0)
        memmove(out, in, (size_t)bytes);
    return M3_OK;
}

static m3_status single_agree_min(m3_comm *c, int64_t local, int64_t *global) {
    *global = local;
    return M3_OK;
}

static void single_destroy(m3_comm *c) { free(c); }

static const m3_comm_ops single_ops = {single_all_reduce, single_all_reduce_f64,
                                       single_all_reduce_bf16,
                                       single_all_gather, single_agree_min, single_abort,
                                       single_destroy};

m3_status m3_comm_create_single(m3_comm **out) {
    m3_comm *c = calloc(1, sizeof *c);
    if (!c)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating a communicator");
    c->ops = &single_ops;
    c->rank = 0;
    c->world = 1;
    *out = c;
    return M3_OK;
}

void m3_comm_free(m3_comm *c) {
    if (c)
        c->ops->destroy(c);
}

m3_status m3_comm_agree(m3_comm *c, bool ok, bool *all_ok) {
    int64_t global;
    M3_TRY(c->ops->agree_min(c, ok ? 1 : 0, &global));
    *all_ok = global == 1;
    return M3_OK;
}
