/* ggml's K-quant block formats Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and the legacy Q4_0, Q4_1, Q5_0 and Q5_1, quantized as ggml's reference quantizers
 * (quantize_row_*_ref, the path llama_model_quantize takes without an importance matrix) quantize them,
 * byte for byte (slimtune/gguf/kquant_kernel.py builds it; slimtune/gguf/kquants.py is the same in torch).
 *
 * Written from the algorithm, not from ggml's text. Byte identity rests on doing the same IEEE float32
 * operations in the same order, one rounding each: the file is compiled with -ffp-contract=off (no fused
 * multiply-adds, as ggml-base's reference quantizers are built on x86-64), sums run one term at a time, an
 * int level meets a float by conversion, and nearest_int is ggml's bit trick (exact garbage included where
 * its argument is out of range). The fp16 block scales round to nearest, ties to even (NaN: 0x7e00 with
 * its sign), as ggml's fp32 -> fp16 conversion does. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK_K 256
#define GROUP_MAX_EPS 1e-15f

static inline int nearest_int(float f) {
    float v = f + 12582912.f;
    int32_t i;
    memcpy(&i, &v, 4);
    return (i & 0x7fffff) - 0x400000;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

static uint16_t fp16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* 65520 and above round to inf */
    uint32_t q, r, half;
    if (a >= 0x38800000u) { /* a normal half: rebias the exponent, keep 10 mantissa bits */
        uint32_t b = a - 0x38000000u;
        q = b >> 13;
        r = b & 0x1fffu;
        half = 0x1000u;
    } else {
        if (a <= 0x33000000u) return sign; /* at most half the smallest subnormal: 0 (the tie goes to even) */
        int shift = 126 - (int)(a >> 23);  /* subnormal half: units of 2^-24 */
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        q = m >> shift;
        r = m & ((1u << shift) - 1u);
        half = 1u << (shift - 1);
    }
    if (r > half || (r == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static float fp16_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; /* exact: m * 2^-24 */
        return sign ? -v : v;
    }
    u = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xff);
    p[1] = (uint8_t)(v >> 8);
}

/* The scale search with a min (Q2_K, Q4_K, Q5_K): levels 0..nmax of x = scale * l + min, the error the
 * weighted squares (mad: the weighted absolute values); candidate scales from (rmin + rdelta * is + nmax) /
 * (max - min), is = 0..nstep, each from the best min so far. Returns the scale, -min in *neg_min. */
static float search_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min, float rmin,
                        float rdelta, int nstep, int mad) {
    uint8_t cand[32];
    float lo = x[0], hi = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        float wi = w[i];
        sum_w += wi;
        sum_x += wi * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *neg_min = -lo;
        return 0.f;
    }
    float iscale = nmax / (hi - lo);
    float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * (x[i] - lo)), 0, nmax);
        L[i] = (uint8_t)l;
        float diff = scale * L[i] + lo - x[i];
        diff = mad ? fabsf(diff) : diff * diff;
        best += w[i] * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (hi - lo);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest_int(iscale * (x[i] - lo)), 0, nmax);
            cand[i] = (uint8_t)l;
            float wi = w[i];
            sum_l += wi * l;
            sum_l2 += wi * l * l;
            sum_xl += wi * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * cand[i] + this_min - x[i];
                diff = mad ? fabsf(diff) : diff * diff;
                err += w[i] * diff;
            }
            if (err < best) {
                memcpy(L, cand, (size_t)n);
                best = err;
                scale = this_scale;
                lo = this_min;
            }
        }
    }
    *neg_min = -lo;
    return scale;
}

/* The first value of largest magnitude (0 where all are 0), its magnitude in *amax. */
static float signed_absmax(int n, const float *x, float *amax) {
    float mx = 0, a = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > a) {
            a = ax;
            mx = x[i];
        }
    }
    *amax = a;
    return mx;
}

/* The symmetric scale search of Q6_K (weights x^2): levels -nmax..nmax-1 stored as l + nmax; the first
 * scale -nmax / max, then -(nmax + 0.1 * is) / max for is = -9..-1, 1..9, the best by sumlx^2 / suml2. */
static float search_sym(int n, int nmax, const float *x, int8_t *L) {
    float amax, mx = signed_absmax(n, x, &amax);
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / mx;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / mx;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)(nmax + clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's search: levels from -nmax / max, then up to 5 rounds that move one level at a time where that
 * raises sumlx^2 / suml2 (weights x^2). Levels stored as l + nmax. */
static float search_q3(int n, int nmax, const float *x, int8_t *L) {
    float amax, mx = signed_absmax(n, x, &amax);
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / mx;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int round = 0; round < 5; round++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int nl = clampi(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (nl != L[i]) {
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)nl;
                        sumlx = slx;
                        suml2 = sl2;
                        changed++;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return sumlx / suml2;
}

/* 2-bit levels L[256] (0..3) -> 64 bytes: byte 32h + l holds L[128h + l + 32k] at bits 2k. */
static void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* Q2_K block: scales[16] (scale | min << 4), qs[64], d, dmin. */
static void q2_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K], *sc = y, *qs = y + 16;
    float w[16], mins[16], scales[16], max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 16; l++) w[l] = fabsf(x[16 * j + l]);
        scales[j] = search_min(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, 1);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    uint16_t d, dmin;
    if (max_scale > 0) {
        float iscale = 15.f / max_scale;
        for (int j = 0; j < 16; j++) sc[j] = (uint8_t)nearest_int(iscale * scales[j]);
        d = fp16_bits(max_scale / 15.f);
    } else {
        memset(sc, 0, 16);
        d = fp16_bits(0.f);
    }
    if (max_min > 0) {
        float iscale = 15.f / max_min;
        for (int j = 0; j < 16; j++) sc[j] |= (uint8_t)(nearest_int(iscale * mins[j]) << 4);
        dmin = fp16_bits(max_min / 15.f);
    } else {
        dmin = fp16_bits(0.f);
    }
    for (int j = 0; j < 16; j++) {
        const float dj = fp16_f32(d) * (sc[j] & 0xF);
        if (!dj) continue;
        const float mj = fp16_f32(dmin) * (sc[j] >> 4);
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)clampi(nearest_int((x[16 * j + i] + mj) / dj), 0, 3);
    }
    pack2(L, qs);
    put16(y + 80, d);
    put16(y + 82, dmin);
}

/* Q3_K block: hmask[32], qs[64], scales[12] (6-bit, offset 32), d. */
static void q3_k(const float *x, uint8_t *y) {
    int8_t L[QK_K];
    uint8_t *hmask = y, *qs = y + 32, *sc = y + 96;
    float scales[16], amax = 0, max_scale = 0;
    for (int j = 0; j < 16; j++) {
        scales[j] = search_q3(16, 4, x + 16 * j, L + 16 * j);
        float a = fabsf(scales[j]);
        if (a > amax) {
            amax = a;
            max_scale = scales[j];
        }
    }
    memset(sc, 0, 12);
    uint16_t d;
    if (max_scale) {
        float iscale = -32.f / max_scale;
        for (int j = 0; j < 16; j++) {
            int8_t l = (int8_t)nearest_int(iscale * scales[j]);
            l = (int8_t)(clampi(l, -32, 31) + 32);
            if (j < 8)
                sc[j] = (uint8_t)(l & 0xF);
            else
                sc[j - 8] |= (uint8_t)((l & 0xF) << 4);
            l >>= 4;
            sc[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
        }
        d = fp16_bits(1 / iscale);
    } else {
        d = fp16_bits(0.f);
    }
    for (int j = 0; j < 16; j++) {
        int8_t s = (int8_t)(j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4);
        s = (int8_t)((s | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        float dj = fp16_f32(d) * s;
        if (!dj) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (int8_t)(clampi(nearest_int(x[16 * j + i] / dj), -4, 3) + 4);
    }
    memset(hmask, 0, 32);
    uint8_t low[QK_K];
    for (int j = 0; j < QK_K; j++) {
        int l = L[j];
        if (l > 3) {
            hmask[j % 32] |= (uint8_t)(1u << (j / 32));
            l -= 4;
        }
        low[j] = (uint8_t)l;
    }
    pack2(low, qs);
    put16(y + 108, d);
}

/* Q4_K and Q5_K's shared part: per 32-value sub-block a scale and a min by search_min (weights
 * av_x + |x|), both to 6 bits against their largest (12 packed bytes), then the levels again from the
 * stored ones. Writes d, dmin and the scales at y, the levels to L. */
static void qkx(const float *x, uint8_t *y, uint8_t *L, int nmax, float rmin, int nstep) {
    uint8_t *packed = y + 4;
    float w[32], mins[8], scales[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        scales[j] = search_min(32, nmax, xs, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        uint8_t s = (uint8_t)nearest_int(inv_scale * scales[j]), m = (uint8_t)nearest_int(inv_min * mins[j]);
        ls[j] = s < 63 ? s : 63;
        lm[j] = m < 63 ? m : 63;
    }
    for (int j = 0; j < 4; j++) {
        packed[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        packed[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        packed[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
    }
    uint16_t d = fp16_bits(max_scale / 63.f), dmin = fp16_bits(max_min / 63.f);
    put16(y, d);
    put16(y + 2, dmin);
    for (int j = 0; j < 8; j++) {
        const float dj = fp16_f32(d) * ls[j];
        if (!dj) continue;
        const float mj = fp16_f32(dmin) * lm[j];
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)clampi(nearest_int((x[32 * j + i] + mj) / dj), 0, nmax);
    }
}

/* Q4_K block: d, dmin, scales[12], qs[128] (byte 32h + l: L[64h + l] low nibble, L[64h + 32 + l] high). */
static void q4_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K], *qs = y + 16;
    qkx(x, y, L, 15, -1.f, 20);
    for (int j = 0; j < QK_K; j += 64)
        for (int l = 0; l < 32; l++) qs[j / 2 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

/* Q5_K block: d, dmin, scales[12], qh[32] (bit 2h of byte l: L[64h + l]'s bit 4, bit 2h + 1: L[64h + 32 + l]'s), qs[128]. */
static void q5_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K], *qh = y + 16, *qs = y + 48;
    qkx(x, y, L, 31, -0.5f, 15);
    memset(qh, 0, 32);
    for (int h = 0; h < 4; h++)
        for (int l = 0; l < 32; l++) {
            int a = L[64 * h + l], b = L[64 * h + 32 + l];
            qh[l] |= (uint8_t)(((a >> 4) << (2 * h)) | ((b >> 4) << (2 * h + 1)));
            qs[32 * h + l] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
        }
}

/* Q6_K block: ql[128], qh[64], scales[16] (int8), d. */
static void q6_k(const float *x, uint8_t *y) {
    int8_t L[QK_K];
    uint8_t *ql = y, *qh = y + 128;
    int8_t *sc = (int8_t *)(y + 192);
    float scales[16], max_abs = 0, max_scale = 0;
    for (int j = 0; j < 16; j++) {
        scales[j] = search_sym(16, 32, x + 16 * j, L + 16 * j);
        float a = fabsf(scales[j]);
        if (a > max_abs) {
            max_abs = a;
            max_scale = scales[j];
        }
    }
    if (max_abs < GROUP_MAX_EPS) {
        memset(y, 0, 210);
        return;
    }
    float iscale = -128.f / max_scale;
    uint16_t d = fp16_bits(1 / iscale);
    for (int j = 0; j < 16; j++) {
        int l = nearest_int(iscale * scales[j]);
        sc[j] = (int8_t)(l < 127 ? l : 127);
    }
    for (int j = 0; j < 16; j++) {
        float dj = fp16_f32(d) * sc[j];
        if (!dj) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (int8_t)(clampi(nearest_int(x[16 * j + i] / dj), -32, 31) + 32);
    }
    for (int h = 0; h < 2; h++) {
        const int8_t *Lh = L + 128 * h;
        for (int l = 0; l < 32; l++) {
            ql[64 * h + l] = (uint8_t)((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
            ql[64 * h + l + 32] = (uint8_t)((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
            qh[32 * h + l] = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
        }
    }
    put16(y + 208, d);
}

#if defined(__GNUC__) && !defined(__clang__)
/* The legacy types' 16-value loops vectorize at -O3 (Q4_0, Q4_1 a quarter faster); the K-quants' searches
 * run slower there (Q6_K by a fifth), so only these functions get it. */
#pragma GCC push_options
#pragma GCC optimize("O3")
#endif
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define WIDE __attribute__((target_clones("avx2", "default"))) /* chosen at load by the CPU; the same operations */
#else
#define WIDE
#endif

/* The legacy 32-value blocks. (int8_t)v of a float level: C's truncation toward zero; an infinite or NaN v
 * (a block whose scale is subnormal: 1.0f/d overflows) converts as x86-64's cvttss2si does, to 0x80000000,
 * whose low byte is 0. Each returns whether a stored fp16 scale is inf or NaN (an overflow the caller refuses). */
static inline int8_t to_int8(float v) {
    float in_range = fabsf(v) < 2147483648.f ? v : 0.f; /* a select, not a branch: the loop vectorizes */
    return (int8_t)(int32_t)in_range;
}

static inline int overflows(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

/* max: the first value of largest magnitude (0 where all are 0; NaN never is); d = max / -levels/2. The
 * magnitude first (a maximum: exact, so any order), then the first value of it: loops that vectorize. */
static void signed_scale(const float *x, int half, float *d, float *id) {
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    if (amax > 0.0f)
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) == amax) {
                mx = x[j];
                break;
            }
    *d = mx / -half;
    *id = *d ? 1.0f / *d : 0.0f;
}

/* Q4_0 block: d, qs[16] (level j low nibble, level j + 16 high). */
WIDE static int q4_0(const float *x, uint8_t *y) {
    float d, id;
    signed_scale(x, 8, &d, &id);
    uint16_t h = fp16_bits(d);
    put16(y, h);
    for (int j = 0; j < 16; j++) {
        int a = to_int8(x[j] * id + 8.5f), b = to_int8(x[16 + j] * id + 8.5f);
        y[2 + j] = (uint8_t)((a < 15 ? a : 15) | ((b < 15 ? b : 15) << 4));
    }
    return overflows(h);
}

/* Q5_0 block: d, qh (bit j: level j's bit 4, little-endian uint32), qs[16]. */
WIDE static int q5_0(const float *x, uint8_t *y) {
    float d, id;
    signed_scale(x, 16, &d, &id);
    uint16_t h = fp16_bits(d);
    put16(y, h);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int a = to_int8(x[j] * id + 16.5f), b = to_int8(x[16 + j] * id + 16.5f);
        a = a < 31 ? a : 31;
        b = b < 31 ? b : 31;
        y[6 + j] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
        qh |= (((uint32_t)a & 0x10u) >> 4) << j;
        qh |= (((uint32_t)b & 0x10u) >> 4) << (j + 16);
    }
    for (int k = 0; k < 4; k++) y[2 + k] = (uint8_t)(qh >> (8 * k));
    return overflows(h);
}

/* The first value equal to v (v == 0: which zero, +0 or -0, comes first). */
static float first_equal(const float *x, float v) {
    for (int j = 0; j < 32; j++)
        if (x[j] == v) return x[j];
    return v;
}

/* min and max: the first of each (NaN never is; both as the maxima and minima are, exact in any order but
 * for the sign of a zero, which is the first zero's); d = (max - min) / (levels - 1). */
static void min_scale(const float *x, int levels, float *d, float *id, float *mn) {
    float lo = 3.40282347e38f, hi = -3.40282347e38f;
    for (int j = 0; j < 32; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    if (lo == 0.0f) lo = first_equal(x, lo);
    if (hi == 0.0f) hi = first_equal(x, hi);
    *d = (hi - lo) / (levels - 1);
    *id = *d ? 1.0f / *d : 0.0f;
    *mn = lo;
}

/* Q4_1 block: d, m, qs[16]. */
WIDE static int q4_1(const float *x, uint8_t *y) {
    float d, id, mn;
    min_scale(x, 16, &d, &id, &mn);
    uint16_t h = fp16_bits(d), m = fp16_bits(mn);
    put16(y, h);
    put16(y + 2, m);
    for (int j = 0; j < 16; j++) {
        int a = to_int8((x[j] - mn) * id + 0.5f), b = to_int8((x[16 + j] - mn) * id + 0.5f);
        y[4 + j] = (uint8_t)((a < 15 ? a : 15) | ((b < 15 ? b : 15) << 4));
    }
    return overflows(h) | overflows(m);
}

/* Q5_1 block: d, m, qh, qs[16]. */
WIDE static int q5_1(const float *x, uint8_t *y) {
    float d, id, mn;
    min_scale(x, 32, &d, &id, &mn);
    uint16_t h = fp16_bits(d), m = fp16_bits(mn);
    put16(y, h);
    put16(y + 2, m);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int a = to_int8((x[j] - mn) * id + 0.5f), b = to_int8((x[16 + j] - mn) * id + 0.5f);
        a = a < 31 ? a : 31;
        b = b < 31 ? b : 31;
        y[8 + j] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
        qh |= (((uint32_t)a & 0x10u) >> 4) << j;
        qh |= (((uint32_t)b & 0x10u) >> 4) << (j + 16);
    }
    for (int k = 0; k < 4; k++) y[4 + k] = (uint8_t)(qh >> (8 * k));
    return overflows(h) | overflows(m);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

typedef void (*block_fn)(const float *, uint8_t *);
static const block_fn BLOCKS[5] = {q2_k, q3_k, q4_k, q5_k, q6_k};
static const int BYTES[5] = {84, 110, 144, 176, 210};
typedef int (*legacy_fn)(const float *, uint8_t *);
static const legacy_fn LEGACY[4] = {q4_0, q4_1, q5_0, q5_1};
static const int LEGACY_BYTES[4] = {18, 20, 22, 24};

/* Blocks [0, n) of x of type t into out (n * its block bytes): t 0..4 Q2_K .. Q6_K (256 values a block),
 * 5..8 Q4_0, Q4_1, Q5_0, Q5_1 (32). Returns the blocks whose fp16 scale overflowed (legacy types;
 * the K-quants write ggml's bytes for any input), or -1 for an unknown type. */
int64_t slimtune_kquant(int t, const float *x, uint8_t *out, int64_t n) {
    if (t >= 0 && t <= 4) {
        for (int64_t b = 0; b < n; b++) BLOCKS[t](x + QK_K * b, out + (int64_t)BYTES[t] * b);
        return 0;
    }
    if (t < 5 || t > 8) return -1;
    int64_t bad = 0;
    for (int64_t b = 0; b < n; b++) bad += LEGACY[t - 5](x + 32 * b, out + (int64_t)LEGACY_BYTES[t - 5] * b);
    return bad;
}

/* fp32 -> fp16 bits, n values (the tests compare it with ggml's). */
void slimtune_fp16_bits(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fp16_bits(x[i]);
}
