/* NF4 -> bf16 dequantization of torchao's NF4 layout with torchao's bits (slimtune/quant/nf4_kernel.py builds it).
 *
 * A block b of 64 values: 32 bytes of codes (the first value in the high nibble), a double-quantized scale
 * s_b = bf16(bf16(q_b / factor_g) + mean) (q_b int8, factor_g bf16 per group of sbs blocks, mean bf16), and
 * value = bf16(nf4[code] * s_b): every operation in float32 and rounded to bf16 (nearest, ties to even), as
 * torch computes bf16 arithmetic on the CPU (a NaN written as its vectorized kernels write it: 0xffff). So
 * each block's 16 possible values are made first and its 64 values are looked up from them: a register
 * shuffle where the CPU has one. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* torch's vectorized float -> bf16: nearest, ties to even; NaN 0xffff */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float block_scale(const int8_t *q, const uint16_t *factor, float mean, int64_t sbs, int64_t b) {
    return bf16_f32(f32_bf16(bf16_f32(f32_bf16((float)q[b] / bf16_f32(factor[b / sbs]))) + mean));
}

static void block_values(const float *table, float s, uint16_t *t) {
    for (int c = 0; c < 16; c++) t[c] = f32_bf16(table[c] * s);
}

static void dequantize_plain(const uint8_t *codes, const int8_t *q, const uint16_t *factor, float mean, int64_t sbs,
                             const float *table, uint16_t *out, int64_t b0, int64_t b1) {
    uint16_t t[16];
    for (int64_t b = b0; b < b1; b++) {
        block_values(table, block_scale(q, factor, mean, sbs, b), t);
        const uint8_t *p = codes + 32 * b;
        uint16_t *o = out + 64 * (b - b0);
        for (int j = 0; j < 32; j++) {
            o[2 * j] = t[p[j] >> 4];
            o[2 * j + 1] = t[p[j] & 15];
        }
    }
}

#if defined(__x86_64__)
/* SSE4.1: the 16 values' low and high bytes as two 16-byte tables, looked up by pshufb. */
__attribute__((target("sse4.1"))) static inline __m128i bf16_rne_sse(__m128 f) {
    __m128i u = _mm_castps_si128(f);
    __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1))), 16);
    __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    return _mm_blendv_epi8(r, _mm_set1_epi32(0xffff), nan);
}

__attribute__((target("sse4.1"))) static void dequantize_sse41(const uint8_t *codes, const int8_t *q, const uint16_t *factor,
                                                               float mean, int64_t sbs, const float *table, uint16_t *out,
                                                               int64_t b0, int64_t b1) {
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m128 tf[4];
    for (int i = 0; i < 4; i++) tf[i] = _mm_loadu_ps(table + 4 * i);
    for (int64_t b = b0; b < b1; b++) {
        __m128 s = _mm_set1_ps(block_scale(q, factor, mean, sbs, b));
        __m128i t0 = _mm_packus_epi32(bf16_rne_sse(_mm_mul_ps(tf[0], s)), bf16_rne_sse(_mm_mul_ps(tf[1], s))); /* values 0-7 */
        __m128i t1 = _mm_packus_epi32(bf16_rne_sse(_mm_mul_ps(tf[2], s)), bf16_rne_sse(_mm_mul_ps(tf[3], s))); /* values 8-15 */
        t0 = _mm_shuffle_epi8(t0, split); /* lo bytes 0-7 | hi bytes 0-7 */
        t1 = _mm_shuffle_epi8(t1, split);
        __m128i lo = _mm_unpacklo_epi64(t0, t1), hi = _mm_unpackhi_epi64(t0, t1);
        const uint8_t *p = codes + 32 * b;
        uint16_t *o = out + 64 * (b - b0);
        for (int h = 0; h < 2; h++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + 16 * h));
            __m128i first = _mm_and_si128(_mm_srli_epi16(v, 4), nib), second = _mm_and_si128(v, nib);
            for (int k = 0; k < 2; k++) {
                __m128i idx = k ? _mm_unpackhi_epi8(first, second) : _mm_unpacklo_epi8(first, second);
                __m128i l = _mm_shuffle_epi8(lo, idx), u = _mm_shuffle_epi8(hi, idx);
                _mm_storeu_si128((__m128i *)(o + 32 * h + 16 * k), _mm_unpacklo_epi8(l, u));
                _mm_storeu_si128((__m128i *)(o + 32 * h + 16 * k + 8), _mm_unpackhi_epi8(l, u));
            }
        }
    }
}

/* AVX-512 BW: the 16 values in one register, 32 looked up per vpermw. */
__attribute__((target("avx512f,avx512bw"))) static void dequantize_avx512(const uint8_t *codes, const int8_t *q,
                                                                           const uint16_t *factor, float mean, int64_t sbs,
                                                                           const float *table, uint16_t *out, int64_t b0,
                                                                           int64_t b1) {
    const __m512i nib = _mm512_set1_epi32(15), round = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000), qnan = _mm512_set1_epi32(0xffff);
    const __m512 tf = _mm512_loadu_ps(table);
    for (int64_t b = b0; b < b1; b++) {
        __m512i u = _mm512_castps_si512(_mm512_mul_ps(tf, _mm512_set1_ps(block_scale(q, factor, mean, sbs, b))));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, round), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), inf), qnan);
        __m512i tv = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(r)); /* the 16 values in lanes 0-15 */
        const uint8_t *p = codes + 32 * b;
        uint16_t *o = out + 64 * (b - b0);
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
            __m512i idx = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(_mm512_and_si512(v, nib), 16));
            _mm512_storeu_si512((void *)(o + 32 * h), _mm512_permutexvar_epi16(idx, tv));
        }
    }
}
#endif

/* Which loop this CPU runs: 2 AVX-512 BW, 1 SSE4.1, 0 the plain C. */
int slimtune_nf4_kind(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("sse4.1")) return 1;
#endif
    return 0;
}

/* Blocks [b0, b1) of one NF4 weight into out ((b1 - b0) * 64 bf16 values). codes, q, factor: the weight's
 * whole quantized_data, quantized_scalers and quantization_factor, mean its scaler_mean; nf4: its 16 code values
 * (bf16). The caller checks that the arrays hold blocks [b0, b1). */
void slimtune_nf4_bf16(const uint8_t *codes, const int8_t *q, const uint16_t *factor, const uint16_t *mean, int64_t sbs,
                       const uint16_t *nf4, uint16_t *out, int64_t b0, int64_t b1, int kind) {
    float table[16];
    for (int c = 0; c < 16; c++) table[c] = bf16_f32(nf4[c]);
    float m = bf16_f32(*mean);
#if defined(__x86_64__)
    if (kind == 2) {
        dequantize_avx512(codes, q, factor, m, sbs, table, out, b0, b1);
        return;
    }
    if (kind == 1) {
        dequantize_sse41(codes, q, factor, m, sbs, table, out, b0, b1);
        return;
    }
#endif
    dequantize_plain(codes, q, factor, m, sbs, table, out, b0, b1);
}
