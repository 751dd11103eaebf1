/*
 * Shape arithmetic for tensor views (see tensor.h).
 */
#include "core/tensor.h"

size_t m3_dtype_size(m3_dtype dt) {
    switch (dt) {
    case M3_DT_BF16: return 2;
    case M3_DT_F32: return 4;
    case M3_DT_F8_E4M3: return 1;
    case M3_DT_U8: return 1;
    case M3_DT_I32: return 4;
    case M3_DT_I64: return 8;
    case M3_DT_F64: return 8;
    case M3_DT_NONE: break;
    }
    return 0;
}

const char *m3_dtype_name(m3_dtype dt) {
    switch (dt) {
    case M3_DT_BF16: return "BF16";
    case M3_DT_F32: return "F32";
    case M3_DT_F8_E4M3: return "F8_E4M3";
    case M3_DT_U8: return "U8";
    case M3_DT_I32: return "I32";
    case M3_DT_I64: return "I64";
    case M3_DT_F64: return "F64";
    case M3_DT_NONE: break;
    }
    return "NONE";
}

int64_t m3_tensor_nelem(const m3_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->ne[i];
    return n;
}

m3_tensor m3_tensor_make(m3_dtype dt, int ndim, const int64_t *ne, void *data) {
    m3_tensor t = {0};
    t.dtype = dt;
    t.ndim = ndim;
    t.data = data;
    int64_t stride = (int64_t)m3_dtype_size(dt);
    for (int i = ndim - 1; i >= 0; i--) {
        t.ne[i] = ne[i];
        t.nb[i] = stride;
        stride *= ne[i];
    }
    return t;
}

bool m3_tensor_is_contiguous(const m3_tensor *t) {
    int64_t stride = (int64_t)m3_dtype_size(t->dtype);
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->ne[i] != 1 && t->nb[i] != stride)
            return false;
        stride *= t->ne[i];
    }
    return true;
}

m3_tensor m3_tensor_rows(const m3_tensor *t, int64_t first, int64_t count) {
    m3_tensor v = *t;
    v.ne[0] = count;
    if (t->data)
        v.data = (char *)t->data + first * t->nb[0];
    return v;
}

m3_linear m3_linear_rows_view(const m3_linear *l, int64_t first, int64_t count) {
    m3_linear v = *l;
    v.w = m3_tensor_rows(&l->w, first, count);
    if (l->scale.data)
        v.scale = m3_tensor_rows(&l->scale, first, count);
    return v;
}
