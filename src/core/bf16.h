/*
 * bf16 and e4m3 number formats. bf16 is the storage type of every tensor
 * in the model (SPEC §2.3): values are rounded from fp32 with
 * round-to-nearest-even at the SPEC's rounding points, and widened exactly.
 * e4m3 (OCP "fn" variant: no infinities, S.1111.111 is NaN) is the element
 * type of MXFP8 weights, whose 32-column blocks carry a power-of-two scale.
 */
#ifndef M3_CORE_BF16_H
#define M3_CORE_BF16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float m3_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t m3_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a quiet NaN */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* fp32 -> bf16 -> fp32: the value a rounding point leaves. */
static inline float m3_round_bf16(float f) { return m3_bf16_to_f32(m3_f32_to_bf16(f)); }

static inline float m3_e4m3_to_f32(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
    float v;
    if (exp == 0xf && man == 7)
        return NAN;
    if (exp == 0)
        v = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -v : v;
}

/* fp32 -> e4m3 (fn), round to nearest, ties to even, for |f| <= 448 (the
 * largest finite e4m3; callers scale blocks into range first): a binary
 * search over the 127 increasing magnitudes, each built from its bits
 * (subnormals m * 2^-9, normals (1 + m/8) * 2^(e-7)). Used by synth. */
static inline float m3_e4m3_magnitude_(int c) {
    int e = c >> 3, m = c & 7;
    if (e == 0)
        return (float)m * 0.001953125f;
    uint32_t bits = (uint32_t)(e - 7 + 127) << 23 | (uint32_t)m << 20;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
static inline uint8_t m3_f32_to_e4m3(float f) {
    uint8_t sign = f < 0 ? 0x80 : 0;
    float a = fabsf(f);
    int lo = 0, hi = 126; /* the largest code whose magnitude is <= a */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (m3_e4m3_magnitude_(mid) <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    if (lo < 126) {
        float below = a - m3_e4m3_magnitude_(lo), above = m3_e4m3_magnitude_(lo + 1) - a;
        if (above < below || (above == below && !((lo + 1) & 1)))
            lo++;
    }
    return sign | (uint8_t)lo;
}

/* The MXFP8 block scale 2^(s-127) (s = 255 is NaN in the OCP format). */
static inline float m3_e8m0_to_f32(uint8_t s) {
    if (s == 255)
        return NAN;
    return ldexpf(1.0f, (int)s - 127);
}

#endif
