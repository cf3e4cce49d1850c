/* ggml's K-quant block formats Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and the legacy Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, quantized as ggml's reference quantizers
 * (quantize_row_*_ref, the path llama_model_quantize takes without an importance matrix) quantize them,
 * byte for byte (slimtune/gguf/kquant_kernel.py builds it; slimtune/gguf/kquants.py is the same in torch).
 *
 * Written from the algorithm, not from ggml's text. Byte identity rests on doing the same IEEE float32
 * operations in the same order, one rounding each: the file is compiled with -ffp-contract=off (no fused
 * multiply-adds, as ggml-base's reference quantizers are built on x86-64), sums run one term at a time, an
 * int level meets a float by conversion, and nearest_int is ggml's bit trick (exact garbage included where
 * its argument is out of range). The fp16 block scales round to nearest, ties to even (NaN: 0x7e00 with
 * its sign), as ggml's fp32 -> fp16 conversion does. The K-quants' scale searches, independent per
 * sub-block, run on 8 sub-blocks at once in the lanes of a GCC/Clang vector, each lane doing the scalar
 * search's operations in the scalar order (a branch becomes a select): the same bytes, several times
 * ggml's scalar speed per core. */
#ifndef KQ_PASS /* the file, but for the lane code at its end (included once per pass) */
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

/* The scale searches run on LANES groups (sub-blocks) at once, one group per lane of a GCC/Clang vector:
 * every lane does the scalar search's float32 operations in the scalar order (sums one term at a time,
 * no operation reordered or fused), and a branch of one group becomes a select of its lane, so each
 * group's result is the scalar search's, bit for bit. x[i] holds value i of every lane's group.
 * That lane code is at the end of the file, compiled twice by including the file in itself: for AVX2
 * (x86-64; chosen at run time where the CPU has it) and for the baseline (SSE2, NEON, ...: comparisons
 * in pieces of 4 lanes); lane_ops() picks one. The helpers here serve the block code between. */
#define LANES 8
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef float hf __attribute__((vector_size(16))); /* half of one: 4 lanes */
typedef int32_t hi __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES))); /* LANES bf16 values' bits */
#define INLINE static inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi" /* vectors pass only between inlined functions */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(SLIMTUNE_BASELINE_ONLY)
#define WIDE __attribute__((target_clones("avx2", "default"))) /* chosen at load by the CPU; the same operations */
#else
#define WIDE
#endif

/* The vector helpers, defined with the qualifier Q: here for the block code, and again in each lane pass
 * for its target (their names renamed there by macros). m ? a : b lane by lane (vsel, isel); nearest_int
 * (vnearest); any lane set (any). */
#define VECTOR_HELPERS(Q)                                                                                          \
    Q vf vsplat(float a) {                                                                                         \
        vf v = {a, a, a, a, a, a, a, a};                                                                           \
        return v;                                                                                                  \
    }                                                                                                              \
    Q vi isplat(int a) {                                                                                           \
        vi v = {a, a, a, a, a, a, a, a};                                                                           \
        return v;                                                                                                  \
    }                                                                                                              \
    Q vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }                                      \
    Q vi isel(vi m, vi a, vi b) { return (a & m) | (b & ~m); }                                                     \
    Q vf vabs(vf a) { return (vf)((vi)a & 0x7fffffff); }                                                           \
    Q vf vfloat(vi a) { return __builtin_convertvector(a, vf); }                                                   \
    Q vi vnearest(vf f) { return ((vi)(f + vsplat(12582912.f)) & 0x7fffff) - 0x400000; }                          \
    Q int any(vi m) {                                                                                              \
        vi z = m;                                                                                                  \
        for (int k = 1; k < LANES; k++) z[0] |= m[k];                                                              \
        return z[0] != 0;                                                                                          \
    }
VECTOR_HELPERS(INLINE)

/* LANES groups of n values (n <= 32): the values, their weights (w; wx = w * x for the symmetric
 * searches), the levels found, each group's scale and -min. */
struct lanes {
    vf x[32], w[32], wx[32];
    vi L[32];
    vf scale, neg_min;
};
/* The search with a min: levels 0..nmax, candidate scales (rmin + rdelta * is + nmax) / (max - min) for
 * is = 0..nstep; the error the weighted squares, or (mad) the weighted absolute values. */
struct min_search {
    int n, nmax, nstep, mad;
    float rmin, rdelta;
};

/* Each type's search constants, static so that they fold into its lane code (a splat of a variable is
 * rebuilt in every loop: several times slower). */
static const struct min_search Q2_SEARCH = {16, 3, 15, 1, -0.5f, 0.1f}, Q4_SEARCH = {32, 15, 20, 0, -1.f, 0.1f};
static const struct min_search Q5_SEARCH = {32, 31, 15, 0, -0.5f, 0.1f};
/* The final levels from the stored scales: ngroups groups of n values, each value's level
 * clamp(nearest_int((x + m) / d), lo, hi) + off (without_min: of x / d), LANES values at a time; a group
 * whose d is 0 keeps its levels. */
struct final_levels {
    int ngroups, n, lo, hi, off, with_min;
};

static const struct final_levels Q2_LEVELS = {16, 16, 0, 3, 0, 1}, Q3_LEVELS = {16, 16, -4, 3, 4, 0};
static const struct final_levels Q4_LEVELS = {8, 32, 0, 15, 0, 1}, Q5_LEVELS = {8, 32, 0, 31, 0, 1};
static const struct final_levels Q6_LEVELS = {16, 16, -32, 31, 32, 0};
typedef void (*levels_fn)(const float *, const float *, const float *, uint8_t *);
/* LANES groups of n values from x (group k at x + n * k) into the lanes' x. */
static void gather(const float *x, int n, struct lanes *g) {
    for (int k = 0; k < LANES; k++)
        for (int i = 0; i < n; i++) g->x[i][k] = x[n * k + i];
}

/* The lanes' levels back to groups of n (L + n * k), their scales and -mins (where asked) to arrays. */
static void scatter(const struct lanes *g, int n, uint8_t *L, float *scale, float *neg_min) {
    for (int k = 0; k < LANES; k++) {
        for (int i = 0; i < n; i++) L[n * k + i] = (uint8_t)g->L[i][k];
        scale[k] = g->scale[k];
        if (neg_min) neg_min[k] = g->neg_min[k];
    }
}

/* The lane code for each type (Q2_K .. Q6_K) and Q8_0's, of one pass. */
typedef void (*lanes_fn)(struct lanes *);
struct lane_ops {
    lanes_fn search[5];
    levels_fn levels[5];
    int (*q8_0)(const float *, uint8_t *);
    int64_t (*q8_0_bf16)(const uint16_t *, uint8_t *, int64_t, int);
    int (*legacy[4])(const float *, uint8_t *); /* Q4_0, Q4_1, Q5_0, Q5_1 */
};

/* 2-bit levels L[256] (0..3) -> 64 bytes: byte 32h + l holds L[128h + l + 32k] at bits 2k. */
static void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* Q2_K block: scales[16] (scale | min << 4), qs[64], d, dmin. */
static void q2_k(const struct lane_ops *ops, const float *x, uint8_t *y) {
    uint8_t L[QK_K], *sc = y, *qs = y + 16;
    float mins[16], scales[16], max_scale = 0, max_min = 0;
    struct lanes g;
    for (int j = 0; j < 16; j += LANES) {
        gather(x + 16 * j, 16, &g);
        for (int i = 0; i < 16; i++) g.w[i] = vabs(g.x[i]);
        ops->search[0](&g);
        scatter(&g, 16, L + 16 * j, scales + j, mins + j);
    }
    for (int j = 0; j < 16; j++) {
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
    float dj[16], mj[16];
    for (int j = 0; j < 16; j++) {
        dj[j] = fp16_f32(d) * (sc[j] & 0xF);
        mj[j] = fp16_f32(dmin) * (sc[j] >> 4);
    }
    ops->levels[0](x, dj, mj, L);
    pack2(L, qs);
    put16(y + 80, d);
    put16(y + 82, dmin);
}

/* Q3_K block: hmask[32], qs[64], scales[12] (6-bit, offset 32), d. */
static void q3_k(const struct lane_ops *ops, const float *x, uint8_t *y) {
    int8_t L[QK_K];
    uint8_t *hmask = y, *qs = y + 32, *sc = y + 96;
    float scales[16], amax = 0, max_scale = 0;
    struct lanes g;
    for (int j = 0; j < 16; j += LANES) {
        gather(x + 16 * j, 16, &g);
        ops->search[1](&g);
        scatter(&g, 16, (uint8_t *)L + 16 * j, scales + j, 0);
    }
    for (int j = 0; j < 16; j++) {
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
    float dj[16];
    for (int j = 0; j < 16; j++) {
        int8_t s = (int8_t)(j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4);
        s = (int8_t)((s | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        dj[j] = fp16_f32(d) * s;
    }
    ops->levels[1](x, dj, 0, (uint8_t *)L);
    memset(hmask, 0, 32);
    uint8_t low[QK_K];
    for (int j = 0; j < QK_K; j++) { /* levels 0..7: bit 2 to hmask (bit j / 32 of byte j % 32), the rest to qs */
        hmask[j % 32] |= (uint8_t)(((L[j] >> 2) & 1) << (j / 32));
        low[j] = (uint8_t)(L[j] & 3);
    }
    pack2(low, qs);
    put16(y + 108, d);
}

/* Q4_K and Q5_K's weights of 32-value groups: av_x + |x|, av_x = sqrt(the mean of x^2). */
static void qkx_weights(struct lanes *g) {
    vf sum_x2 = vsplat(0), av_x;
    for (int i = 0; i < 32; i++) sum_x2 += g->x[i] * g->x[i];
    sum_x2 = sum_x2 / vsplat(32);
    for (int k = 0; k < LANES; k++) av_x[k] = sqrtf(sum_x2[k]);
    for (int i = 0; i < 32; i++) g->w[i] = av_x + vabs(g->x[i]);
}

/* Q4_K and Q5_K's shared part: per 32-value sub-block a scale and a min by search_min (weights
 * av_x + |x|), both to 6 bits against their largest (12 packed bytes), then the levels again from the
 * stored ones. Writes d, dmin and the scales at y, the levels to L. */
static void qkx(const float *x, uint8_t *y, uint8_t *L, lanes_fn search, levels_fn levels) {
    uint8_t *packed = y + 4;
    float mins[8], scales[8], max_scale = 0, max_min = 0;
    struct lanes g;
    gather(x, 32, &g);
    qkx_weights(&g);
    search(&g);
    scatter(&g, 32, L, scales, mins);
    for (int j = 0; j < 8; j++) {
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
    float dj[8], mj[8];
    for (int j = 0; j < 8; j++) {
        dj[j] = fp16_f32(d) * ls[j];
        mj[j] = fp16_f32(dmin) * lm[j];
    }
    levels(x, dj, mj, L);
}

/* Q4_K block: d, dmin, scales[12], qs[128] (byte 32h + l: L[64h + l] low nibble, L[64h + 32 + l] high). */
static void q4_k(const struct lane_ops *ops, const float *x, uint8_t *y) {
    uint8_t L[QK_K], *qs = y + 16;
    qkx(x, y, L, ops->search[2], ops->levels[2]);
    for (int j = 0; j < QK_K; j += 64)
        for (int l = 0; l < 32; l++) qs[j / 2 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

/* Q5_K block: d, dmin, scales[12], qh[32] (bit 2h of byte l: L[64h + l]'s bit 4, bit 2h + 1: L[64h + 32 + l]'s), qs[128]. */
static void q5_k(const struct lane_ops *ops, const float *x, uint8_t *y) {
    uint8_t L[QK_K], *qh = y + 16, *qs = y + 48;
    qkx(x, y, L, ops->search[3], ops->levels[3]);
    memset(qh, 0, 32);
    for (int h = 0; h < 4; h++)
        for (int l = 0; l < 32; l++) {
            int a = L[64 * h + l], b = L[64 * h + 32 + l];
            qh[l] |= (uint8_t)(((a >> 4) << (2 * h)) | ((b >> 4) << (2 * h + 1)));
            qs[32 * h + l] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
        }
}

/* Q6_K block: ql[128], qh[64], scales[16] (int8), d. */
static void q6_k(const struct lane_ops *ops, const float *x, uint8_t *y) {
    int8_t L[QK_K];
    uint8_t *ql = y, *qh = y + 128;
    int8_t *sc = (int8_t *)(y + 192);
    float scales[16], max_abs = 0, max_scale = 0;
    struct lanes g;
    for (int j = 0; j < 16; j += LANES) {
        gather(x + 16 * j, 16, &g);
        ops->search[4](&g);
        scatter(&g, 16, (uint8_t *)L + 16 * j, scales + j, 0);
    }
    for (int j = 0; j < 16; j++) {
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
    float dj[16];
    for (int j = 0; j < 16; j++) dj[j] = fp16_f32(d) * sc[j];
    ops->levels[4](x, dj, 0, (uint8_t *)L);
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

/* The legacy 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) run in the lane code too, 8 values at a time. Each
 * returns whether a stored fp16 scale is inf or NaN (an overflow the caller refuses). */
static inline int overflows(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

/* A legacy type: its scale's divisor (d = max / -scale; with a min, (max - min) / (scale - 1)), the level's
 * addend and top (MIN(top, (int8_t)(x * id + add))), whether it stores a min, whether 5-bit (qh). Static,
 * so that they fold into the lane code. */
struct legacy_type {
    float scale, add;
    int top, with_min, five;
};
static const struct legacy_type Q4_0_TYPE = {8, 8.5f, 15, 0, 0}, Q5_0_TYPE = {16, 16.5f, 31, 0, 1};
static const struct legacy_type Q4_1_TYPE = {16, 0.5f, 15, 1, 0}, Q5_1_TYPE = {32, 0.5f, 31, 1, 1};

/* The first value equal to v (v == 0: which zero, +0 or -0, comes first). */
static float first_equal(const float *x, float v) {
    for (int j = 0; j < 32; j++)
        if (x[j] == v) return x[j];
    return v;
}

/* The largest |x| of a block as ggml's fold amax = amax > |x| ? amax : |x| (from 0) finds it: without a
 * NaN the maximum of the bits of |x| (they order as the values do; a loop that vectorizes); with one, the
 * fold itself (a NaN resets it: what follows the last NaN decides). */
static float abs_max(const float *x) {
    uint32_t top = 0;
    for (int j = 0; j < 32; j++) {
        uint32_t u;
        memcpy(&u, x + j, 4);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    float amax = 0.0f;
    if (top <= 0x7f800000u) {
        memcpy(&amax, &top, 4);
        return amax;
    }
    for (int j = 0; j < 32; j++) amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]);
    return amax;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(SLIMTUNE_BASELINE_ONLY)
#define KQ_AVX2 1
#define KQ_PASS 1
#include "kquant_kernel.c" /* this file again: its lane code at the end, for this pass */
#undef KQ_PASS
static const struct lane_ops AVX2_OPS = {{search_q2_avx2, search_q3_16_avx2, search_q4_avx2, search_q5_avx2, search_q6_16_avx2},
                                         {levels_q2_avx2, levels_q3_avx2, levels_q4_avx2, levels_q5_avx2, levels_q6_avx2},
                                         q8_0_avx2, q8_0_bf16_avx2, {q4_0_avx2, q4_1_avx2, q5_0_avx2, q5_1_avx2}};
#endif
#define KQ_PASS 2
#include "kquant_kernel.c" /* this file again: its lane code at the end, for this pass */
#undef KQ_PASS
static const struct lane_ops BASE_OPS = {{search_q2_base, search_q3_16_base, search_q4_base, search_q5_base, search_q6_16_base},
                                         {levels_q2_base, levels_q3_base, levels_q4_base, levels_q5_base, levels_q6_base},
                                         q8_0_base, q8_0_bf16_base, {q4_0_base, q4_1_base, q5_0_base, q5_1_base}};

/* AVX2's lane code where the CPU has it, else the baseline's. */
static const struct lane_ops *lane_ops(void) {
#ifdef KQ_AVX2
    if (__builtin_cpu_supports("avx2")) return &AVX2_OPS;
#endif
    return &BASE_OPS;
}

typedef void (*block_fn)(const struct lane_ops *, const float *, uint8_t *);
static const block_fn BLOCKS[5] = {q2_k, q3_k, q4_k, q5_k, q6_k};
static const int BYTES[5] = {84, 110, 144, 176, 210};
typedef int (*legacy_fn)(const float *, uint8_t *);
static const int LEGACY_BYTES[5] = {18, 20, 22, 24, 34};

/* Blocks [0, n) of x of type t into out (n * its block bytes): t 0..4 Q2_K .. Q6_K (256 values a block),
 * 5..9 Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32). Returns the blocks whose fp16 scale overflowed (legacy types;
 * the K-quants write ggml's bytes for any input), or -1 for an unknown type. */
int64_t slimtune_kquant(int t, const float *x, uint8_t *out, int64_t n) {
    if (t >= 0 && t <= 4) {
        const struct lane_ops *ops = lane_ops();
        for (int64_t b = 0; b < n; b++) BLOCKS[t](ops, x + QK_K * b, out + (int64_t)BYTES[t] * b);
        return 0;
    }
    if (t < 5 || t > 9) return -1;
    int64_t bad = 0;
    legacy_fn quantize = t == 9 ? lane_ops()->q8_0 : lane_ops()->legacy[t - 5];
    for (int64_t b = 0; b < n; b++) bad += quantize(x + 32 * b, out + (int64_t)LEGACY_BYTES[t - 5] * b);
    return bad;
}

/* slimtune_kquant of bf16 blocks x (their bits), each widened to its exact float32 values in a buffer of
 * one block first (the bytes are those of the float32 values, with no pass of its own over them). With
 * check, a NaN or an infinity anywhere (exponent bits all ones) stops it: returns -2 (before anything is
 * quantized; Q8_0, whose blocks are widened in registers, at the first such block). */
int64_t slimtune_kquant_bf16(int t, const uint16_t *x, uint8_t *out, int64_t n, int check) {
    int values = t >= 0 && t <= 4 ? QK_K : 32;
    if (t < 0 || t > 9) return -1;
    if (t == 9) return lane_ops()->q8_0_bf16(x, out, n, check); /* widened in registers, checked from its max */
    if (check) {
        uint16_t bad = 0;
        for (int64_t i = 0; i < n * values; i++) bad |= (uint16_t)((x[i] & 0x7f80u) == 0x7f80u);
        if (bad) return -2;
    }
    float block[QK_K];
    int64_t overflowed = 0;
    for (int64_t b = 0; b < n; b++) {
        const uint16_t *src = x + (int64_t)values * b;
        for (int j = 0; j < values; j++) {
            uint32_t u = (uint32_t)src[j] << 16;
            memcpy(block + j, &u, 4);
        }
        int64_t bytes = t <= 4 ? BYTES[t] : LEGACY_BYTES[t - 5];
        overflowed += slimtune_kquant(t, block, out + bytes * b, 1);
    }
    return overflowed;
}

/* fp32 -> fp16 bits, n values (the tests compare it with ggml's). */
void slimtune_fp16_bits(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fp16_bits(x[i]);
}

#else /* KQ_PASS: the lane code, once for AVX2 (KQ_PASS 1, x86-64) and once for the baseline (2) */
#if KQ_PASS == 1
#define LN(name) name##_avx2
#define LANE_FN static __attribute__((target("avx2")))
#define LANE_INLINE static inline __attribute__((always_inline, target("avx2")))
#else
#define LN(name) name##_base
#define LANE_FN static
#define LANE_INLINE INLINE
#endif
/* The vector helpers again, compiled for this pass's target (GCC lowers a vector operation in the
 * function that holds it, before inlining: a baseline helper in an AVX2 function builds each splat lane
 * by lane). */
#define vsplat LN(vsplat)
#define isplat LN(isplat)
#define vsel LN(vsel)
#define isel LN(isel)
#define vabs LN(vabs)
#define vfloat LN(vfloat)
#define vnearest LN(vnearest)
#define any LN(any)
VECTOR_HELPERS(LANE_INLINE)

/* Comparisons (-1 where true). Without AVX2 GCC lowers a comparison of 8 lanes lane by lane in scalar
 * code: the baseline pass compares in pieces of 4 (SSE2's, NEON's) and joins them; GCC before 12 has no
 * __builtin_shufflevector for that, and compares whole. */
#if KQ_PASS == 1 || !(defined(__clang__) || __GNUC__ >= 12)
#define CMP(name, type, half, op) \
    LANE_INLINE vi name(type a, type b) { return a op b; }
#else
#define CMP(name, type, half, op)                                                                          \
    LANE_INLINE vi name(type a, type b) {                                                                  \
        half a0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), a1 = __builtin_shufflevector(a, a, 4, 5, 6, 7); \
        half b0 = __builtin_shufflevector(b, b, 0, 1, 2, 3), b1 = __builtin_shufflevector(b, b, 4, 5, 6, 7); \
        hi m0 = a0 op b0, m1 = a1 op b1;                                                                   \
        return __builtin_shufflevector(m0, m1, 0, 1, 2, 3, 4, 5, 6, 7);                                    \
    }
#endif
CMP(LN(flt), vf, hf, <)
CMP(LN(fle), vf, hf, <=)
CMP(LN(feq), vf, hf, ==)
CMP(LN(fne), vf, hf, !=)
CMP(LN(ilt), vi, hi, <)
CMP(LN(ine), vi, hi, !=)

LANE_INLINE vi LN(vclamp)(vi v, int lo, int hi) {
    v = isel(LN(ilt)(v, isplat(lo)), isplat(lo), v);
    return isel(LN(ilt)(isplat(hi), v), isplat(hi), v);
}

/* The levels of x = scale * l + min at iscale, in cand; their weighted sums sum_l, sum_l2, sum_xl in s. */
LANE_INLINE void LN(min_levels)(const struct min_search *p, const struct lanes *g, vf iscale, vf lo, vf *cand, vf *s) {
    vf sum_l = vsplat(0), sum_l2 = vsplat(0), sum_xl = vsplat(0);
    for (int i = 0; i < p->n; i++) {
        vf l = vfloat(LN(vclamp)(vnearest(iscale * (g->x[i] - lo)), 0, p->nmax));
        cand[i] = l;
        vf wl = g->w[i] * l;
        sum_l += wl;
        sum_l2 += wl * l;
        sum_xl += wl * g->x[i];
    }
    s[0] = sum_l, s[1] = sum_l2, s[2] = sum_xl;
}

/* The weighted error of levels l at scale and min. */
LANE_INLINE vf LN(min_error)(const struct min_search *p, const struct lanes *g, const vf *l, vf scale, vf min) {
    vf err = vsplat(0);
    for (int i = 0; i < p->n; i++) {
        vf diff = scale * l[i] + min - g->x[i];
        diff = p->mad ? vabs(diff) : diff * diff;
        err += g->w[i] * diff;
    }
    return err;
}

/* The scale search with a min (Q2_K, Q4_K, Q5_K), on every lane: the first levels from nmax / (max - min),
 * then each candidate scale's levels, their least-squares scale and min (min <= 0), kept where the error
 * is lower; the candidates from the best min so far. A group with max == min: levels 0, scale 0. */
LANE_INLINE void LN(search_min)(const struct min_search *p, struct lanes *g) {
    vf lo = g->x[0], hi = lo, sum_w = g->w[0], sum_x = sum_w * g->x[0], L[32], cand[32], s[3];
    for (int i = 1; i < p->n; i++) {
        lo = vsel(LN(flt)(g->x[i], lo), g->x[i], lo);
        hi = vsel(LN(flt)(hi, g->x[i]), g->x[i], hi);
        sum_w += g->w[i];
        sum_x += g->w[i] * g->x[i];
    }
    lo = vsel(LN(flt)(vsplat(0), lo), vsplat(0), lo);
    vi flat = LN(feq)(hi, lo);
    vf lo0 = lo, iscale = vsplat((float)p->nmax) / (hi - lo), scale = vsplat(1) / iscale;
    LN(min_levels)(p, g, iscale, lo, L, s);
    vf best = LN(min_error)(p, g, L, scale, lo);
    for (int is = 0; is <= p->nstep; is++) {
        LN(min_levels)(p, g, vsplat(p->rmin + p->rdelta * is + p->nmax) / (hi - lo), lo, cand, s);
        vf D = sum_w * s[1] - s[0] * s[0];
        vi ok = LN(flt)(vsplat(0), D);
        if (!any(ok)) continue;
        vf this_scale = (sum_w * s[2] - sum_x * s[0]) / D, this_min = (s[1] * sum_x - s[0] * s[2]) / D;
        vi pos = LN(flt)(vsplat(0), this_min);
        this_min = vsel(pos, vsplat(0), this_min);
        this_scale = vsel(pos, s[2] / s[1], this_scale);
        vf err = LN(min_error)(p, g, cand, this_scale, this_min);
        vi take = ok & LN(flt)(err, best);
        if (!any(take)) continue;
        for (int i = 0; i < p->n; i++) L[i] = vsel(take, cand[i], L[i]);
        best = vsel(take, err, best);
        scale = vsel(take, this_scale, scale);
        lo = vsel(take, this_min, lo);
    }
    for (int i = 0; i < p->n; i++) g->L[i] = isel(flat, isplat(0), __builtin_convertvector(L[i], vi));
    g->scale = vsel(flat, vsplat(0), scale);
    g->neg_min = -vsel(flat, lo0, lo);
}

LANE_FN void LN(search_q2)(struct lanes *g) { LN(search_min)(&Q2_SEARCH, g); }
LANE_FN void LN(search_q4)(struct lanes *g) { LN(search_min)(&Q4_SEARCH, g); }
LANE_FN void LN(search_q5)(struct lanes *g) { LN(search_min)(&Q5_SEARCH, g); }

/* Every lane's first value of largest magnitude (0 where all are 0), its magnitude in *amax. */
LANE_INLINE vf LN(signed_absmax)(int n, const struct lanes *g, vf *amax) {
    vf mx = vsplat(0), a = vsplat(0);
    for (int i = 0; i < n; i++) {
        vf ax = vabs(g->x[i]);
        vi m = LN(flt)(a, ax);
        a = vsel(m, ax, a);
        mx = vsel(m, g->x[i], mx);
    }
    *amax = a;
    return mx;
}

/* The weights x^2 and x^3 of the symmetric searches. */
LANE_INLINE void LN(square_weights)(int n, struct lanes *g) {
    for (int i = 0; i < n; i++) {
        g->w[i] = g->x[i] * g->x[i];
        g->wx[i] = g->w[i] * g->x[i];
    }
}

/* Levels -nmax..nmax-1 at iscale in cand (may be g->L), their sums sumlx (s[0]) and suml2 (s[1]). */
LANE_INLINE void LN(sym_levels)(int n, int nmax, const struct lanes *g, vf iscale, vi *cand, vf *s) {
    vf sumlx = vsplat(0), suml2 = vsplat(0);
    for (int i = 0; i < n; i++) {
        vi l = LN(vclamp)(vnearest(iscale * g->x[i]), -nmax, nmax - 1);
        vf lf = vfloat(l);
        cand[i] = l;
        sumlx += g->wx[i] * lf;
        suml2 += g->w[i] * lf * lf;
    }
    s[0] = sumlx, s[1] = suml2;
}

/* The symmetric scale search of Q6_K on every lane (weights x^2): levels -nmax..nmax-1 stored as
 * l + nmax; the first scale -nmax / max, then -(nmax + 0.1 * is) / max for is = -9..-1, 1..9, the best
 * by sumlx^2 / suml2. A group whose max is below GROUP_MAX_EPS: levels 0, scale 0. */
LANE_INLINE void LN(search_sym)(int n, int nmax, struct lanes *g) {
    vf amax, mx = LN(signed_absmax)(n, g, &amax), s[2];
    vi small = LN(flt)(amax, vsplat(GROUP_MAX_EPS)), cand[32];
    LN(square_weights)(n, g);
    LN(sym_levels)(n, nmax, g, vsplat((float)-nmax) / mx, g->L, s);
    vf scale = vsel(LN(fne)(s[1], vsplat(0)), s[0] / s[1], vsplat(0)), best = scale * s[0];
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        LN(sym_levels)(n, nmax, g, vsplat(-(nmax + 0.1f * is)) / mx, cand, s);
        vi take = LN(flt)(vsplat(0), s[1]) & LN(flt)(best * s[1], s[0] * s[0]);
        if (!any(take)) continue;
        for (int i = 0; i < n; i++) g->L[i] = isel(take, cand[i], g->L[i]);
        vf this_scale = s[0] / s[1];
        scale = vsel(take, this_scale, scale);
        best = vsel(take, this_scale * s[0], best);
    }
    for (int i = 0; i < n; i++) g->L[i] = isel(small, isplat(0), g->L[i] + nmax);
    g->scale = vsel(small, vsplat(0), scale);
}

/* One round of Q3_K's search on the active lanes: each level in turn moved to its best where that raises
 * sumlx^2 / suml2 (s[0], s[1]). Returns the lanes where a level moved. */
LANE_INLINE vi LN(q3_round)(int n, int nmax, struct lanes *g, vf *s, vi active) {
    vi changed = isplat(0);
    for (int i = 0; i < n; i++) {
        vf Lf = vfloat(g->L[i]);
        vf slx = s[0] - g->wx[i] * Lf;
        vi m = active & LN(flt)(vsplat(0), slx);
        if (!any(m)) continue;
        vf sl2 = s[1] - g->w[i] * Lf * Lf;
        vi nl = LN(vclamp)(vnearest(g->x[i] * sl2 / slx), -nmax, nmax - 1);
        vf nlf = vfloat(nl);
        slx += g->wx[i] * nlf;
        sl2 += g->w[i] * nlf * nlf;
        m &= LN(ine)(nl, g->L[i]) & LN(flt)(vsplat(0), sl2) & LN(flt)(s[0] * s[0] * sl2, slx * slx * s[1]);
        g->L[i] = isel(m, nl, g->L[i]);
        s[0] = vsel(m, slx, s[0]);
        s[1] = vsel(m, sl2, s[1]);
        changed |= m;
    }
    return changed;
}

/* Q3_K's search on every lane: levels from -nmax / max, then up to 5 rounds (q3_round) until one moves
 * nothing. Levels stored as l + nmax; a group whose max is below GROUP_MAX_EPS: levels 0, scale 0. */
LANE_INLINE void LN(search_q3)(int n, int nmax, struct lanes *g) {
    vf amax, mx = LN(signed_absmax)(n, g, &amax), s[2];
    vi small = LN(flt)(amax, vsplat(GROUP_MAX_EPS)), active = ~small;
    LN(square_weights)(n, g);
    LN(sym_levels)(n, nmax, g, vsplat((float)-nmax) / mx, g->L, s);
    for (int round = 0; round < 5 && any(active); round++) active &= LN(q3_round)(n, nmax, g, s, active);
    for (int i = 0; i < n; i++) g->L[i] = isel(small, isplat(0), g->L[i] + nmax);
    g->scale = vsel(small, vsplat(0), s[0] / s[1]);
}

LANE_FN void LN(search_q3_16)(struct lanes *g) { LN(search_q3)(16, 4, g); }
LANE_FN void LN(search_q6_16)(struct lanes *g) { LN(search_sym)(16, 32, g); }

/* The final levels of a block (struct final_levels), LANES values at a time. */
LANE_INLINE void LN(apply_levels)(const struct final_levels *p, const float *x, const float *d, const float *m, uint8_t *L) {
    int32_t l[32];
    for (int j = 0; j < p->ngroups; j++) {
        if (!d[j]) continue;
        for (int i = 0; i < p->n; i += LANES) {
            vf v;
            memcpy(&v, x + p->n * j + i, sizeof v);
            if (p->with_min) v = v + vsplat(m[j]);
            vi q = LN(vclamp)(vnearest(v / vsplat(d[j])), p->lo, p->hi) + p->off;
            memcpy(l + i, &q, sizeof q);
        }
        for (int i = 0; i < p->n; i++) L[p->n * j + i] = (uint8_t)l[i];
    }
}

LANE_FN void LN(levels_q2)(const float *x, const float *d, const float *m, uint8_t *L) { LN(apply_levels)(&Q2_LEVELS, x, d, m, L); }
LANE_FN void LN(levels_q3)(const float *x, const float *d, const float *m, uint8_t *L) { LN(apply_levels)(&Q3_LEVELS, x, d, m, L); }
LANE_FN void LN(levels_q4)(const float *x, const float *d, const float *m, uint8_t *L) { LN(apply_levels)(&Q4_LEVELS, x, d, m, L); }
LANE_FN void LN(levels_q5)(const float *x, const float *d, const float *m, uint8_t *L) { LN(apply_levels)(&Q5_LEVELS, x, d, m, L); }
LANE_FN void LN(levels_q6)(const float *x, const float *d, const float *m, uint8_t *L) { LN(apply_levels)(&Q6_LEVELS, x, d, m, L); }

/* roundf(v) of LANES values as x86-64's (int8_t) conversion sees it: half away from zero; NaN, an
 * infinity or |v| >= 2^31 as cvttss2si's 0x80000000 (low byte 0) does. v - t is exact. */
LANE_INLINE vi LN(round_int)(vf v) {
    v = vsel(LN(flt)(vabs(v), vsplat(2147483648.f)), v, vsplat(0));
    vi t = __builtin_convertvector(v, vi);
    vf frac = v - vfloat(t);
    return t - LN(fle)(vsplat(0.5f), frac) + LN(fle)(frac, vsplat(-0.5f)); /* a true comparison is -1 */
}

/* The largest |x| of a block as ggml's fold amax = amax > |x| ? amax : |x| (from 0) finds it: without a
 * NaN the largest bits of |x| (they order as the values do), 8 lanes at a time; with one, abs_max. */
LANE_INLINE float LN(abs_max)(const float *x) {
    vi top = isplat(0);
    for (int j = 0; j < 32; j += LANES) {
        vi u;
        memcpy(&u, x + j, sizeof u);
        u &= 0x7fffffff;
        top = isel(LN(ilt)(top, u), u, top);
    }
    int32_t t = top[0];
    for (int k = 1; k < LANES; k++) t = top[k] > t ? top[k] : t;
    if (t > 0x7f800000) return abs_max(x);
    float amax;
    memcpy(&amax, &t, 4);
    return amax;
}

/* Q8_0 block: d = max |x| / 127 (fp16), qs[32] = roundf(x * id), id = d ? 1 / d : 0. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("O3"))) /* the bytes' loop vectorizes */
#endif
LANE_FN int LN(q8_0)(const float *x, uint8_t *y) {
    float d = LN(abs_max)(x) / 127, id = d ? 1.0f / d : 0.0f;
    int32_t q[32];
    uint16_t h = fp16_bits(d);
    put16(y, h);
    for (int j = 0; j < 32; j += LANES) {
        vf v;
        memcpy(&v, x + j, sizeof v);
        vi l = LN(round_int)(v * vsplat(id));
        memcpy(q + j, &l, sizeof l);
    }
    for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)q[j]; /* the low byte (a loop that vectorizes) */
    return overflows(h);
}

/* Q8_0 of n blocks of bf16 bits x: each block widened in registers to its exact float32 values (bits << 16)
 * and quantized with q8_0's operations on them; a block holding a NaN goes through q8_0 itself (the fold's
 * answer). Returns the blocks whose fp16 scale overflowed; with check, -2 at the first block holding a
 * NaN or an infinity (its largest |bits| is the exponent's all ones: no pass of its own), the output
 * written so far to be discarded. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("O3")))
#endif
LANE_FN int64_t LN(q8_0_bf16)(const uint16_t *x, uint8_t *y, int64_t n, int check) {
    int64_t bad = 0;
    for (int64_t b = 0; b < n; b++, x += 32, y += 34) {
        vf v[32 / LANES];
        vi top = isplat(0);
        for (int k = 0; k < 32 / LANES; k++) {
            vh bits;
            memcpy(&bits, x + LANES * k, sizeof bits);
            vi u = __builtin_convertvector(bits, vi) << 16; /* zero-extended: the float32 bits */
            v[k] = (vf)u;
            u &= 0x7fffffff;
            top = isel(LN(ilt)(top, u), u, top);
        }
        int32_t t = top[0];
        for (int k = 1; k < LANES; k++) t = top[k] > t ? top[k] : t;
        if (check && t >= 0x7f800000) return -2;
        if (t > 0x7f800000) {
            float block[32];
            memcpy(block, v, sizeof block);
            bad += LN(q8_0)(block, y);
            continue;
        }
        float amax;
        memcpy(&amax, &t, 4);
        float d = amax / 127, id = d ? 1.0f / d : 0.0f;
        uint16_t h = fp16_bits(d);
        put16(y, h);
        int32_t q[32];
        for (int k = 0; k < 32 / LANES; k++) {
            vi l = LN(round_int)(v[k] * vsplat(id));
            memcpy(q + LANES * k, &l, sizeof l);
        }
        for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)q[j];
        bad += overflows(h);
    }
    return bad;
}

/* The legacy types' levels: MIN(top, (int8_t)(x * id + add)) of 8 values (ggml's, with x - min first
 * where with_min). (int8_t) of a float: C's truncation toward zero, then the low byte; an infinite or NaN
 * level (a block whose scale is subnormal: 1.0f/d overflows) or |v| >= 2^31 converts as x86-64's
 * cvttss2si does, to 0x80000000, whose low byte is 0. */
LANE_INLINE vi LN(legacy_levels)(const float *x, float id, float mn, float add, int top, int with_min) {
    vf v;
    memcpy(&v, x, sizeof v);
    if (with_min) v = v - vsplat(mn);
    v = v * vsplat(id) + vsplat(add); /* two roundings: the file has no contraction */
    v = vsel(LN(flt)(vabs(v), vsplat(2147483648.f)), v, vsplat(0));
    vi l = (__builtin_convertvector(v, vi) << 24) >> 24; /* the low byte, signed: (int8_t) */
    return isel(LN(ilt)(isplat(top), l), isplat(top), l);
}

/* Q4_0 / Q5_0's scale: the first value of largest magnitude (0 where all are 0; NaN never is), from the
 * largest bits of |x| over the lanes (NaN lanes out); d = max / -half. */
LANE_INLINE void LN(signed_scale)(const float *x, float half, float *d, float *id) {
    vi top = isplat(0);
    for (int j = 0; j < 32; j += LANES) {
        vi u;
        memcpy(&u, x + j, sizeof u);
        u &= 0x7fffffff;
        u = isel(LN(ilt)(isplat(0x7f800000), u), isplat(0), u);
        top = isel(LN(ilt)(top, u), u, top);
    }
    int32_t t = top[0];
    for (int k = 1; k < LANES; k++) t = top[k] > t ? top[k] : t;
    float mx = 0.0f;
    if (t)
        for (int j = 0; j < 32; j++) {
            uint32_t u;
            memcpy(&u, x + j, 4);
            if ((int32_t)(u & 0x7fffffffu) == t) {
                mx = x[j];
                break;
            }
        }
    *d = mx / -half;
    *id = *d ? 1.0f / *d : 0.0f;
}

/* Q4_1 / Q5_1's scale: the min and max folded lane by lane (NaN never is), then over the lanes (a zero's
 * sign is the first zero's: first_equal); d = (max - min) / (levels - 1). */
LANE_INLINE void LN(min_scale)(const float *x, float levels, float *d, float *id, float *mn) {
    vf lo = vsplat(3.40282347e38f), hi = vsplat(-3.40282347e38f);
    for (int j = 0; j < 32; j += LANES) {
        vf v;
        memcpy(&v, x + j, sizeof v);
        lo = vsel(LN(flt)(v, lo), v, lo);
        hi = vsel(LN(flt)(hi, v), v, hi);
    }
    float l = lo[0], h = hi[0];
    for (int k = 1; k < LANES; k++) {
        l = lo[k] < l ? lo[k] : l;
        h = hi[k] > h ? hi[k] : h;
    }
    if (l == 0.0f) l = first_equal(x, l);
    if (h == 0.0f) h = first_equal(x, h);
    *d = (h - l) / (levels - 1);
    *id = *d ? 1.0f / *d : 0.0f;
    *mn = l;
}

/* Levels j and 16 + j of a block, 8 j at a time: byte j of qs holds level j's low nibble and level
 * 16 + j's above it (4-bit: the level as it is, ggml's OR); with qh, bit 4 of level j goes to bit j of
 * qh and that of level 16 + j to bit 16 + j (5-bit). */
LANE_INLINE uint32_t LN(legacy_pack)(const float *x, float id, float mn, float add, int top, int with_min, int five, uint8_t *qs) {
    static const vi shift = {0, 1, 2, 3, 4, 5, 6, 7};
    uint32_t qh = 0;
    for (int j = 0; j < 16; j += LANES) {
        vi a = LN(legacy_levels)(x + j, id, mn, add, top, with_min), b = LN(legacy_levels)(x + 16 + j, id, mn, add, top, with_min);
        vi q = five ? (a & 0xF) | ((b & 0xF) << 4) : a | (b << 4);
        int32_t lanes[LANES];
        memcpy(lanes, &q, sizeof q);
        for (int k = 0; k < LANES; k++) qs[j + k] = (uint8_t)lanes[k];
        if (five) {
            vi bits = (((a & 0x10) >> 4) << (shift + j)) | (((b & 0x10) >> 4) << (shift + (16 + j)));
            for (int k = 0; k < LANES; k++) qh |= (uint32_t)bits[k];
        }
    }
    return qh;
}

/* One legacy block: d (and m, with_min), qh (five: 5-bit levels), qs[16]. */
LANE_INLINE int LN(legacy_block)(const struct legacy_type *t, const float *x, uint8_t *y) {
    float d, id, mn = 0.0f;
    if (t->with_min)
        LN(min_scale)(x, t->scale, &d, &id, &mn);
    else
        LN(signed_scale)(x, t->scale, &d, &id);
    uint16_t h = fp16_bits(d);
    put16(y, h);
    int bad = overflows(h), at = 2;
    if (t->with_min) {
        uint16_t m = fp16_bits(mn);
        put16(y + 2, m);
        bad |= overflows(m);
        at = 4;
    }
    uint32_t qh = LN(legacy_pack)(x, id, mn, t->add, t->top, t->with_min, t->five, y + at + (t->five ? 4 : 0));
    if (t->five)
        for (int k = 0; k < 4; k++) y[at + k] = (uint8_t)(qh >> (8 * k));
    return bad;
}

LANE_FN int LN(q4_0)(const float *x, uint8_t *y) { return LN(legacy_block)(&Q4_0_TYPE, x, y); }
LANE_FN int LN(q4_1)(const float *x, uint8_t *y) { return LN(legacy_block)(&Q4_1_TYPE, x, y); }
LANE_FN int LN(q5_0)(const float *x, uint8_t *y) { return LN(legacy_block)(&Q5_0_TYPE, x, y); }
LANE_FN int LN(q5_1)(const float *x, uint8_t *y) { return LN(legacy_block)(&Q5_1_TYPE, x, y); }

#undef CMP
#undef vsplat
#undef isplat
#undef vsel
#undef isel
#undef vabs
#undef vfloat
#undef vnearest
#undef any
#undef LANE_INLINE
#undef LN
#undef LANE_FN
#endif /* KQ_PASS */
