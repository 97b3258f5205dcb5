/* y = x @ W^T on CPU with W held as GGUF quantized blocks, dequantized in registers.
 *
 * W [N, K] is the GGUF tensor as stored: each output row is K / B blocks of B weights (B = 32 for
 * Q8_0, Q4_0, Q4_1; 256 for the K-quants Q4_K, Q6_K), row_bytes bytes a row. A decode step reads
 * every weight once for one or a few rows of x, so reading the 4.5-8.5 bits a weight the file holds,
 * rather than a float32 or bfloat16 copy, is most of the speed (dspark_kernels/quant.py, the caller).
 *
 * The weight is read one output row after another, front to back: a single forward stream. On the
 * development box (AMD EPYC, AVX-512) reading two or four rows side by side, as a register tile of
 * outputs would, took the rate from memory from ~20 GB/s to ~8-10: the hardware prefetcher follows
 * one stream, not four interleaved in a page. Rows of x go in passes of ROWS over panels of PANEL
 * output rows, so that a pass after the first reads the panel from L1, not from memory.
 *
 * Float path (dspark_quant_gemm_f32): x, every product and every sum in float32. Each group of 32
 * weights of a row is decoded to two vectors of 16 floats bit-equal to gguf's dequantize (the
 * reference: quant.dequantize; no fused multiply-add inside a weight's formula), then multiplied
 * into two 16-lane accumulators per (row of x, output), low and high 16 weights, group after group
 * along K; then the two added and their 16 lanes summed in a fixed tree (hsum). That sequence is the
 * same whatever M is, so a row's result does not depend on the batch beside it (the engine's batch
 * invariance). With AVX-512, decoding each group again for every pass of ROWS rows measured faster,
 * at every M from 5 to 32, than decoding a panel once into a float32 buffer and reading it back
 * (loads, not multiply-adds, bound that loop). With AVX2 decoding costs more, and above ROWS rows the
 * wide tiles decode a few output rows once into such a buffer (the same sums in the same order).
 *
 * Int8 path (dspark_quant_gemm_q8act, Q4_0 / Q4_1 / Q8_0 with AVX512-VNNI or AVX2): each 32-block of
 * a row of x is rounded to int8 with its own scale, as llama.cpp does (its Q8_0 / Q8_1 activations);
 * the dot product of a weight block and an x block is then exact in int32 (vpdpbusd; on AVX2
 * vpmaddubsw and vpmaddwd), scaled by both blocks' scales into a float32 accumulator. Faster, and
 * as accurate as x's rounding to int8 (every weight, Q4_1's offset included, multiplies the same
 * rounded x; see quant.py): a separate entry point, not the float path.
 *
 * Threads (dspark_quant_set_threads): a call big enough is split by OUTPUT rows among the calling
 * thread and a small pool of pthreads of this library's own (not OpenMP: PyTorch's wheel carries its
 * libgomp, and a second OpenMP runtime in the process would fight it for the cores). Every output
 * row is computed whole by one thread, by the same code as with one thread, so its bits depend on
 * neither the thread count nor the batch. The pool is described where it is defined, below.
 *
 * Plain C with GCC/Clang vector extensions for the arithmetic, and AVX-512 intrinsics (guarded by
 * __AVX512F__ etc.) for the decoders, or AVX2 ones for Q8_0 / Q4_0 / Q4_1 (__AVX2__, __F16C__: most
 * laptops; and the AVX2 int8 path); without them a portable scalar decoder gives the same floats
 * and the int8 path a scalar loop. Built and loaded by dspark_kernels/cpu.py.
 */
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#if defined(__F16C__)
#include <immintrin.h> /* _cvtsh_ss (half below), and AVX2's intrinsics, on CPUs without AVX-512 too */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX512 1
#endif
#if !defined(QG_AVX512) && defined(__AVX2__) && defined(__F16C__)
#define QG_AVX2 1 /* most laptops' CPUs, and AMD's before Zen 4: decoders for Q8_0, Q4_0, Q4_1 */
#endif
#if defined(QG_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define QG_VNNI 1
#endif

/* GGML type ids (gguf.GGMLQuantizationType). */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

#define PANEL 16 /* output rows a panel: each pass of ROWS rows of x over it reads it again, from L1 */
#define ROWS 4   /* rows of x a pass (measured against 6 and 8: no clear gain, more code) */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load16(const float *p) { return *(const v16 *)p; }

/* An IEEE half's bits as float32, exactly (subnormals included). */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp == 0 && man == 0)
        bits = sign;
    else if (exp == 0) { /* subnormal: value man * 2^-24, renormalised */
        int shifts = 0;
        while (!(man & 0x400)) man <<= 1, ++shifts;
        bits = sign | ((uint32_t)(113 - shifts) << 23) | ((man & 0x3ff) << 13);
    } else
        bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The 16 lanes summed in a fixed tree (i with i + 8, then i + 4, i + 2, i + 1): the same additions
 * in the same order on every path. */
static inline float hsum(v16 a) {
#if defined(QG_AVX512)
    const __m512 z = (__m512)a;
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(z), high);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#else
    const float t0 = (a[0] + a[8]) + (a[4] + a[12]), t1 = (a[1] + a[9]) + (a[5] + a[13]);
    const float t2 = (a[2] + a[10]) + (a[6] + a[14]), t3 = (a[3] + a[11]) + (a[7] + a[15]);
    return (t0 + t2) + (t1 + t3);
#endif
}

/* A (row of x, output) result from its two accumulators, over the low and the high 16 weights of
 * every group (two chains of multiply-adds, so that one output row's sum is not held up by the
 * latency of each). Every mode and every M ends a result this way. */
static inline float finish(const v16 acc[2]) { return hsum(acc[0] + acc[1]); }

/* Q4_K's packed 6-bit scale and min of sub-block j (0..7), as ggml's get_scale_min_k4. */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- decoders: group g (32 weights) of a row -> lo (weights 0..15), hi (16..31) --------------------
 * Each weight is computed as gguf's numpy dequantize computes it (the same products and sums, each
 * rounded: no fused multiply-add inside a weight's formula), so the floats are bit-equal to it. */

#if defined(QG_AVX512)
static const v16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Stops the compiler fusing the multiply before it with the add after it. */
static inline __m512 rounded(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

/* The two halves at p (a block's d and the 2 bytes after it: m, or quants) widened, [h0, h1, h0, ...]:
 * moveldup gives h0 in every lane, movehdup h1. */
static inline __m512 halves(const uint8_t *p) {
    int32_t t;
    memcpy(&t, p, 4);
    return _mm512_cvtph_ps(_mm256_set1_epi32(t));
}

/* table[q] for q = 0..15 looked up by the low 4 bits of each of 16 int32 lanes (vpermps). */
static inline v16 lookup(__m512i q, __m512 table) { return (v16)_mm512_permutexvar_ps(q, table); }

static inline __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

static inline void dec_q8_0(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + g * 34;
    const __m512 d = _mm512_moveldup_ps(halves(b));
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
    *lo = (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
    *hi = (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
}

static inline void dec_q4_0(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + g * 18;
    const __m512 centred = _mm512_sub_ps((__m512)IOTA, _mm512_set1_ps(8.0f)); /* q - 8, exact */
    const __m512 table = _mm512_mul_ps(_mm512_moveldup_ps(halves(b)), centred);
    const __m512i q = bytes16(b + 2);
    *lo = lookup(q, table);
    *hi = lookup(_mm512_srli_epi32(q, 4), table);
}

static inline void dec_q4_1(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + g * 20;
    const __m512 dm = halves(b);
    const __m512 dq = rounded(_mm512_mul_ps(_mm512_moveldup_ps(dm), (__m512)IOTA));
    const __m512 table = _mm512_add_ps(dq, _mm512_movehdup_ps(dm));
    const __m512i q = bytes16(b + 4);
    *lo = lookup(q, table);
    *hi = lookup(_mm512_srli_epi32(q, 4), table);
}

static inline void dec_q4_k(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + (g >> 3) * 144;
    const int j = (int)(g & 7);
    int sc, mn;
    q4k_scale_min(b + 4, j, &sc, &mn);
    const float dsc = half(b) * (float)sc, dmn = half(b + 2) * (float)mn;
    const __m512 dq = rounded(_mm512_mul_ps(_mm512_set1_ps(dsc), (__m512)IOTA));
    const __m512 table = _mm512_sub_ps(dq, _mm512_set1_ps(dmn));
    const uint8_t *qs = b + 16 + (j >> 1) * 32;
    __m512i q0 = bytes16(qs), q1 = bytes16(qs + 16);
    if (j & 1) q0 = _mm512_srli_epi32(q0, 4), q1 = _mm512_srli_epi32(q1, 4);
    *lo = lookup(q0, table);
    *hi = lookup(q1, table);
}

static inline void dec_q6_k(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + (g >> 3) * 210;
    const int j = (int)(g & 7), h = j >> 2, c = j & 3;
    const float d = half(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192) + 2 * j;
    const uint8_t *ql = b + h * 64 + (c & 1) * 32, *qh = b + 128 + h * 32;
    const __m512i mask4 = _mm512_set1_epi32(15), mask2 = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
    const __m128i shift_l = _mm_cvtsi32_si128(c >= 2 ? 4 : 0), shift_h = _mm_cvtsi32_si128(2 * c);
    v16 out[2];
    for (int i = 0; i < 2; ++i) {
        const __m512i l = _mm512_and_si512(_mm512_srl_epi32(bytes16(ql + 16 * i), shift_l), mask4);
        const __m512i u = _mm512_and_si512(_mm512_srl_epi32(bytes16(qh + 16 * i), shift_h), mask2);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(u, 4)), off);
        out[i] = (v16)_mm512_mul_ps(_mm512_set1_ps(d * (float)scales[i]), _mm512_cvtepi32_ps(q));
    }
    *lo = out[0];
    *hi = out[1];
}

#else /* portable (and AVX2 for Q8_0, Q4_0, Q4_1, below): the same floats */

/* Keeps each product in t rounded before anything is added to it. */
#define ROUNDED(t) __asm__("" : "+m"(t))

static inline void split(const float t[32], v16 *lo, v16 *hi) {
    memcpy(lo, t, 64);
    memcpy(hi, t + 16, 64);
}

#if defined(QG_AVX2)
/* Eight weights at a time in a ymm register, a group as four (weights 0-7, 8-15, 16-23, 24-31): each
 * the same product (and sum) gguf computes, rounded on its own (rounded8 keeps a multiply from being
 * fused with the add after it). The float path's AVX2 tiles (below) take them as they are: the 64-byte
 * v16 of the portable path went through the stack on AVX2 and left a decode step ~30x slower. */
static inline __m256 rounded8(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* Bytes 0..7 and 8..15 of q, signed, as two vectors of 8 floats. */
static inline void widen_s8(__m128i q, __m256 out[2]) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}

static inline void dec_q8_0_8(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *b = row + g * 34;
    const __m256 d = _mm256_set1_ps(half(b));
    widen_s8(_mm_loadu_si128((const __m128i *)(b + 2)), w);
    widen_s8(_mm_loadu_si128((const __m128i *)(b + 18)), w + 2);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], d);
}

/* A Q4 block's 16 bytes of quants: weights 0..15 are their low nibbles, 16..31 their high ones. */
static inline void nibbles(const uint8_t *qs, __m128i out[2]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
    out[0] = _mm_and_si128(raw, mask);
    out[1] = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
}

static inline void dec_q4_0_8(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *b = row + g * 18;
    const __m256 d = _mm256_set1_ps(half(b));
    __m128i q[2];
    nibbles(b + 2, q);
    widen_s8(_mm_sub_epi8(q[0], _mm_set1_epi8(8)), w); /* q - 8, exact */
    widen_s8(_mm_sub_epi8(q[1], _mm_set1_epi8(8)), w + 2);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, w[i]);
}

static inline void dec_q4_1_8(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *b = row + g * 20;
    const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
    __m128i q[2];
    nibbles(b + 4, q);
    widen_s8(q[0], w); /* 0..15: the same signed as unsigned */
    widen_s8(q[1], w + 2);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_add_ps(rounded8(_mm256_mul_ps(d, w[i])), m);
}
#else
static inline void dec_q8_0(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + g * 34;
    const float d = half(b);
    float t[32];
    for (int i = 0; i < 32; ++i) t[i] = (float)(int8_t)b[2 + i] * d;
    split(t, lo, hi);
}

static inline void dec_q4_0(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + g * 18;
    const float d = half(b);
    float t[32];
    for (int i = 0; i < 16; ++i) t[i] = d * (float)((b[2 + i] & 15) - 8), t[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
    split(t, lo, hi);
}

static inline void dec_q4_1(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + g * 20;
    const float d = half(b), m = half(b + 2);
    float t[32];
    for (int i = 0; i < 16; ++i) t[i] = d * (float)(b[4 + i] & 15), t[i + 16] = d * (float)(b[4 + i] >> 4);
    ROUNDED(t);
    for (int i = 0; i < 32; ++i) t[i] += m;
    split(t, lo, hi);
}
#endif

static inline void dec_q4_k(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + (g >> 3) * 144;
    const int j = (int)(g & 7);
    int sc, mn;
    q4k_scale_min(b + 4, j, &sc, &mn);
    const float dsc = half(b) * (float)sc, dmn = half(b + 2) * (float)mn;
    const uint8_t *qs = b + 16 + (j >> 1) * 32;
    float t[32];
    for (int i = 0; i < 32; ++i) t[i] = dsc * (float)((j & 1) ? qs[i] >> 4 : qs[i] & 15);
    ROUNDED(t);
    for (int i = 0; i < 32; ++i) t[i] -= dmn;
    split(t, lo, hi);
}

static inline void dec_q6_k(const uint8_t *row, int64_t g, v16 *lo, v16 *hi) {
    const uint8_t *b = row + (g >> 3) * 210;
    const int j = (int)(g & 7), h = j >> 2, c = j & 3;
    const float d = half(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192) + 2 * j;
    const uint8_t *ql = b + h * 64 + (c & 1) * 32, *qh = b + 128 + h * 32;
    float t[32];
    for (int i = 0; i < 32; ++i) {
        const int q = (((c >= 2 ? ql[i] >> 4 : ql[i]) & 15) | (((qh[i] >> (2 * c)) & 3) << 4)) - 32;
        t[i] = (d * (float)scales[i >> 4]) * (float)q;
    }
    split(t, lo, hi);
}
#endif

/* ---- the float path ----------------------------------------------------------------------------------
 * Streaming tiles: R rows of x times `count` output rows, one output row after another (the weight
 * read as one forward stream: on the development box two or four rows read side by side took the
 * memory rate from ~20 to ~8-10 GB/s), each group decoded once and applied to the R rows. */

#if defined(QG_AVX2)
/* The K-quants keep the portable decoders on AVX2: their groups as the tiles take them. */
#define DEC8_OF(DEC)                                                                                          \
    static inline void DEC##_8(const uint8_t *row, int64_t g, __m256 w[4]) {                                  \
        v16 lo, hi;                                                                                           \
        DEC(row, g, &lo, &hi);                                                                                \
        memcpy(w, &lo, 64);                                                                                   \
        memcpy(w + 2, &hi, 64);                                                                               \
    }
DEC8_OF(dec_q4_k)
DEC8_OF(dec_q6_k)

#if defined(__FMA__)
#define MADD8(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define MADD8(a, b, c) _mm256_add_ps(c, _mm256_mul_ps(a, b))
#endif

/* finish(), for a result held as two ymm accumulators (a[0]: weights 0-7 then 16-23 of every group,
 * a[1]: 8-15 then 24-31): the two added, then the same tree as hsum. */
static inline float finish8(const __m256 a[2]) {
    const __m256 s8 = _mm256_add_ps(a[0], a[1]);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* One output row n of R rows of x, its group g's weights put in wv[4] by WEIGHTS: the multiply-adds
 * the streaming and the wide tiles share (the same order into the same two accumulators a row, so
 * both give the same bits). Two accumulators, not four: the wide tiles then hold two output rows of
 * three rows of x in twelve registers and load each vector of x once for both. */
#define TILE_ROW(R, WEIGHTS)                                                                                  \
    {                                                                                                         \
        __m256 acc[R][2];                                                                                     \
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                              \
        for (int64_t g = 0; g < K / 32; ++g) {                                                                \
            __m256 wv[4];                                                                                     \
            WEIGHTS;                                                                                          \
            for (int r = 0; r < R; ++r)                                                                       \
                for (int i = 0; i < 4; ++i)                                                                   \
                    acc[r][i & 1] = MADD8(wv[i], _mm256_loadu_ps(x + r * K + 32 * g + 8 * i), acc[r][i & 1]); \
        }                                                                                                     \
        for (int r = 0; r < R; ++r) y[r * ldy + n] = finish8(acc[r]);                                         \
    }

#define STREAM_TILE(NAME, DECODE, R)                                                                          \
    static void NAME(const float *x, int64_t K, const uint8_t *w, int64_t row_bytes, int64_t count, float *y, \
                     int64_t ldy) {                                                                           \
        for (int64_t n = 0; n < count; ++n) TILE_ROW(R, DECODE##_8(w + n * row_bytes, g, wv))                \
    }
#else
#define STREAM_TILE(NAME, DECODE, R)                                                                          \
    static void NAME(const float *x, int64_t K, const uint8_t *w, int64_t row_bytes, int64_t count, float *y, \
                     int64_t ldy) {                                                                           \
        for (int64_t n = 0; n < count; ++n) {                                                                 \
            const uint8_t *row = w + n * row_bytes;                                                           \
            v16 acc[R][2];                                                                                    \
            for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = (v16){0};                                     \
            for (int64_t g = 0; g < K / 32; ++g) {                                                            \
                v16 lo, hi;                                                                                   \
                DECODE(row, g, &lo, &hi);                                                                     \
                for (int r = 0; r < R; ++r) {                                                                 \
                    acc[r][0] += lo * load16(x + r * K + 32 * g);                                             \
                    acc[r][1] += hi * load16(x + r * K + 32 * g + 16);                                        \
                }                                                                                             \
            }                                                                                                 \
            for (int r = 0; r < R; ++r) y[r * ldy + n] = finish(acc[r]);                                      \
        }                                                                                                     \
    }

#endif

/* (x, K, blocks, row_bytes, output rows, y, ldy) */
typedef void (*StreamTile)(const float *, int64_t, const uint8_t *, int64_t, int64_t, float *, int64_t);

#if defined(QG_AVX2)
/* Wide tiles (AVX2, more than ROWS rows of x): WIDE_PANEL output rows decoded once into float32
 * (decode_T: the decoders' own floats, stored), then every pass of WIDE_ROWS rows of x multiplies them
 * from L1. The same accumulators and the same multiply-adds in the same order as the streaming tiles,
 * so a row's result is the same bits either way (batch invariance). On AVX2 decoding a group costs
 * about as much as multiplying it into four rows, so decoding it again for every pass of rows, as the
 * streaming tiles do, loses once M passes ROWS (the AVX-512 decoders are cheap enough that it did not).
 * WIDE_ROWS 3: two output rows at a time, each with two accumulators for each of three rows of x,
 * twelve registers, each vector of x loaded once for both outputs. On the AVX2 box (one thread, the
 * 121 fused linears of a SmolLM2 step, bench/quant_gemm.py --step --fused) that took 149.2 -> 142.4 ms
 * at 32 rows and 49.4 -> 48.3 at 8 against one output row at a time with four accumulators a row. */
#define WIDE_PANEL 8
#define WIDE_ROWS 3

typedef void (*DecodeRows)(const uint8_t *, int64_t, int64_t, int64_t, float *);
#define DECODE_ROWS(T, DECODE)                                                                                \
    static void decode_##T(const uint8_t *w, int64_t row_bytes, int64_t count, int64_t K, float *out) {     \
        for (int64_t n = 0; n < count; ++n)                                                                   \
            for (int64_t g = 0; g < K / 32; ++g) {                                                            \
                __m256 wv[4];                                                                                 \
                DECODE##_8(w + n * row_bytes, g, wv);                                                         \
                for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + n * K + 32 * g + 8 * i, wv[i]);           \
            }                                                                                                 \
    }
DECODE_ROWS(q8_0, dec_q8_0)
DECODE_ROWS(q4_0, dec_q4_0)
DECODE_ROWS(q4_1, dec_q4_1)
DECODE_ROWS(q4_k, dec_q4_k)
DECODE_ROWS(q6_k, dec_q6_k)

/* (x, K, decoded rows [count][K], output rows, y, ldy) */
typedef void (*WideTile)(const float *, int64_t, const float *, int64_t, float *, int64_t);
/* Output rows in pairs (the multiply-adds of TILE_ROW for each, a vector of x loaded once for both),
 * a last odd one alone. */
#define WIDE_TILE(NAME, R)                                                                                    \
    static void NAME(const float *x, int64_t K, const float *wf, int64_t count, float *y, int64_t ldy) {     \
        int64_t n = 0;                                                                                        \
        for (; n + 2 <= count; n += 2) {                                                                      \
            const float *w0 = wf + n * K, *w1 = w0 + K;                                                       \
            __m256 acc[R][2][2];                                                                              \
            for (int r = 0; r < R; ++r)                                                                       \
                acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = _mm256_setzero_ps();              \
            for (int64_t k = 0; k < K; k += 16)                                                               \
                for (int a = 0; a < 2; ++a) {                                                                 \
                    const __m256 v0 = _mm256_loadu_ps(w0 + k + 8 * a), v1 = _mm256_loadu_ps(w1 + k + 8 * a);  \
                    for (int r = 0; r < R; ++r) {                                                             \
                        const __m256 xv = _mm256_loadu_ps(x + r * K + k + 8 * a);                             \
                        acc[r][0][a] = MADD8(v0, xv, acc[r][0][a]);                                           \
                        acc[r][1][a] = MADD8(v1, xv, acc[r][1][a]);                                           \
                    }                                                                                         \
                }                                                                                             \
            for (int r = 0; r < R; ++r) {                                                                     \
                y[r * ldy + n] = finish8(acc[r][0]);                                                          \
                y[r * ldy + n + 1] = finish8(acc[r][1]);                                                      \
            }                                                                                                 \
        }                                                                                                     \
        for (; n < count; ++n)                                                                                \
            TILE_ROW(R, for (int i = 0; i < 4; ++i) wv[i] = _mm256_loadu_ps(wf + n * K + 32 * g + 8 * i))     \
    }
WIDE_TILE(wide_1, 1)
WIDE_TILE(wide_2, 2)
WIDE_TILE(wide_3, 3)
static const WideTile wide_tiles[WIDE_ROWS + 1] = {0, wide_1, wide_2, wide_3};
#endif

#define STREAM_TILES(T, DECODE)                                                                               \
    STREAM_TILE(stream_##T##_1, DECODE, 1)                                                                    \
    STREAM_TILE(stream_##T##_2, DECODE, 2)                                                                    \
    STREAM_TILE(stream_##T##_3, DECODE, 3)                                                                    \
    STREAM_TILE(stream_##T##_4, DECODE, 4)                                                                    \
    static const StreamTile stream_##T[ROWS + 1] = {0, stream_##T##_1, stream_##T##_2, stream_##T##_3,        \
                                                    stream_##T##_4};
STREAM_TILES(q8_0, dec_q8_0)
STREAM_TILES(q4_0, dec_q4_0)
STREAM_TILES(q4_1, dec_q4_1)
STREAM_TILES(q4_k, dec_q4_k)
STREAM_TILES(q6_k, dec_q6_k)

#if !defined(QG_AVX2)
typedef void (*DecodeRows)(void);
#define decode_q8_0 NULL
#define decode_q4_0 NULL
#define decode_q4_1 NULL
#define decode_q4_k NULL
#define decode_q6_k NULL
#endif

/* The streaming tiles of a type, its row decoder (NULL: no wide tiles here), and its block: weights
 * and bytes. 0 if the type is not taken. */
static int type_info(int qtype, const StreamTile **stream, DecodeRows *decode, int64_t *block, int64_t *bytes) {
    switch (qtype) {
    case Q8_0: *stream = stream_q8_0, *decode = decode_q8_0, *block = 32, *bytes = 34; return 1;
    case Q4_0: *stream = stream_q4_0, *decode = decode_q4_0, *block = 32, *bytes = 18; return 1;
    case Q4_1: *stream = stream_q4_1, *decode = decode_q4_1, *block = 32, *bytes = 20; return 1;
    case Q4_K: *stream = stream_q4_k, *decode = decode_q4_k, *block = 256, *bytes = 144; return 1;
    case Q6_K: *stream = stream_q6_k, *decode = decode_q6_k, *block = 256, *bytes = 210; return 1;
    default: return 0;
    }
}

/* ---- the thread pool ---------------------------------------------------------------------------------
 *
 * NOTE: a job is "compute output rows 0..rows of one call", cut into `chunks` runs of `chunk` rows
 * (whole PANELs). The calling thread opens the job, and it and every worker that joins in time
 * claim runs from one atomic counter until none is left; each run is computed by the code a
 * single-threaded call runs, so no row's bits depend on who computed it or on how many did. A
 * worker that is slow to wake (asleep, or its core lent to another process) costs nothing: the
 * caller takes the runs it would have taken. The caller then closes the job and waits only for
 * the workers that joined it.
 *
 * state packs the job's generation (high 32 bits), CLOSED, and how many workers joined (low bits).
 * A worker joins by a compare-and-swap on it, only while it is open and of the generation it saw,
 * so a worker that wakes after its job was closed never reads the next job's fields half written.
 *
 * Idle workers spin (pause) for SPIN_NS, so that the ~200 calls of a decode step, a few to a few
 * hundred microseconds apart, find them awake; then they sleep on a condition variable, so that an
 * idle server burns no CPU (measured: 0.4 ms of CPU in 10 s asleep). Past YIELD_AFTER_NS of a spin
 * a worker lends its core (sched_yield) between checks, to torch's own OpenMP threads or anyone
 * else; not sooner, since on a shared box each yield can lose the core for a whole time slice. Waking
 * a sleeper costs the caller a futex call and an interrupt to the other CPU (~7 us on the KVM
 * development box) and the worker comes too late for a small call, so only jobs of WAKE_WORK or
 * more wake sleepers; spinning workers join any job.
 *
 * A worker never stays on its caller's CPU (step_aside): on a box whose other core was busy the
 * scheduler left the worker beside the thread that started it, where it took no rows and its
 * spinning slowed the caller (the LM head at M = 1: 1.8 ms on one thread, 2.5 with such a worker,
 * 0.9-1.3 with the worker on the other core).
 *
 * Workers start at the first call that wants them, stop at exit (atexit) or when the thread count
 * changes, and a forked child starts its own afresh (pthread_atfork). One job at a time: a call
 * that finds the pool busy (another thread's call) runs on its own thread.
 *
 * Measured (2-core AMD EPYC KVM box, bench/quant_gemm.py, C harness, hot weights, per call): a
 * worker that joins halves a call (576 x 576 Q4_1 at M = 1 22.6 -> 11.5 us, 192 rows 7.5 -> 4.0);
 * a hand-off costs ~0.6 us (48 rows of K = 576 broke even). */

#define MAX_THREADS 64
#define CLOSED (1ull << 31)
#define JOINED_MASK (CLOSED - 1)
/* The tuning constants; -D overrides them for experiments. "Work" is weight bytes x passes of ROWS. */
#ifndef SPIN_NS
#define SPIN_NS 200000 /* a worker's spin before it sleeps */
#endif
#ifndef YIELD_AFTER_NS
#define YIELD_AFTER_NS 100000 /* spin this long before lending the core between checks */
#endif
#ifndef MIN_PARALLEL_WORK
#define MIN_PARALLEL_WORK 16384 /* work below which a call keeps to its thread */
#endif
#ifndef WAKE_WORK
#define WAKE_WORK 524288 /* work below which a job does not wake sleeping workers */
#endif
#ifndef MIN_RUN_WORK
#define MIN_RUN_WORK 262144 /* work of a run, at least, unless that leaves a thread none */
#endif
#ifndef RUNS_PER_THREAD
#define RUNS_PER_THREAD 4 /* runs a thread, at most: a worker that loses its core mid-run holds up less */
#endif

/* Computes output rows n0..n1 of the call `args` describes. */
typedef void (*RowsFn)(const void *args, int64_t n0, int64_t n1);

static struct {
    pthread_mutex_t lock; /* held by the thread whose call runs on the pool */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    _Atomic uint64_t state;  /* generation << 32 | CLOSED | joined */
    _Atomic int64_t next;    /* the next run to claim */
    _Atomic int64_t left;    /* joined workers that have finished */
    _Atomic int sleepers;    /* workers asleep on wake */
    _Atomic int stop;
    _Atomic int64_t worker_runs; /* runs computed by workers, ever: what tests check the pool ran by */
    RowsFn fn; /* the job: written by the caller while no worker is in a job */
    const void *args;
    int64_t rows, chunk, chunks;
    unsigned csr; /* the caller's MXCSR (rounding, flush-to-zero), which workers take on */
    _Atomic int threads; /* wanted, the caller included */
    int started;  /* workers running */
    int hooked;   /* atexit and pthread_atfork registered */
    _Atomic int caller_cpu; /* the CPU the last job's caller ran on, -1 unknown */
    pthread_t tid[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, .threads = 1,
        .caller_cpu = -1};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline unsigned get_csr(void) {
#if defined(__x86_64__) || defined(__i386__)
    return _mm_getcsr();
#else
    return 0;
#endif
}

static inline void set_csr(unsigned csr) {
#if defined(__x86_64__) || defined(__i386__)
    if (_mm_getcsr() != csr) _mm_setcsr(csr);
#else
    (void)csr;
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline uint32_t generation(uint64_t state) { return (uint32_t)(state >> 32); }

/* Claims and computes runs of the open job until none is left; returns how many it computed. */
static int64_t run_chunks(void) {
    for (int64_t done = 0;; ++done) {
        const int64_t c = atomic_fetch_add_explicit(&pool.next, 1, memory_order_relaxed);
        if (c >= pool.chunks) return done;
        const int64_t n0 = c * pool.chunk, n1 = n0 + pool.chunk < pool.rows ? n0 + pool.chunk : pool.rows;
        pool.fn(pool.args, n0, n1);
    }
}

/* A worker's CPUs: those it may run on as the process bound it (`base`), and those it took itself
 * (`mine`, a subset), so that a later binding by the process (runtime/cores.py) is followed. */
typedef struct {
#if defined(__linux__)
    cpu_set_t base, mine;
    int narrowed;
#endif
    int unused;
} Placement;

/* Off the caller's CPU, if the worker is on it and may run elsewhere: its CPUs less the caller's. */
static void step_aside(Placement *at) {
#if defined(__linux__)
    const int caller = atomic_load_explicit(&pool.caller_cpu, memory_order_relaxed);
    if (caller < 0 || caller >= CPU_SETSIZE || sched_getcpu() != caller) return;
    cpu_set_t now, away;
    if (pthread_getaffinity_np(pthread_self(), sizeof now, &now) != 0) return;
    if (!at->narrowed || !CPU_EQUAL(&now, &at->mine)) at->base = now; /* bound anew from outside */
    away = at->base;
    CPU_CLR(caller, &away);
    if (CPU_COUNT(&away) > 0 && pthread_setaffinity_np(pthread_self(), sizeof away, &away) == 0)
        at->mine = away, at->narrowed = 1;
#else
    (void)at;
#endif
}

/* The state once its generation is not `seen` (or the pool stops): spinning, then asleep. */
static uint64_t wait_job(uint32_t seen, Placement *at) {
    int64_t start = 0;
    for (unsigned i = 1;; ++i) {
        const uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
        if (generation(s) != seen || atomic_load_explicit(&pool.stop, memory_order_relaxed)) return s;
        if (i % 64 == 0) { /* ~2 us of pauses: the clock; past YIELD_AFTER_NS the core to any thread that wants it */
            const int64_t t = now_ns();
            if (start == 0) start = t;
            if (t - start > SPIN_NS) break;
            step_aside(at);
            if (t - start > YIELD_AFTER_NS) sched_yield();
        }
        cpu_relax();
    }
    /* The caller stores state, then reads sleepers; here sleepers is raised, then state read (both
     * sequentially consistent): one of the two sees the other, so no wake-up is lost. */
    uint64_t s;
    pthread_mutex_lock(&pool.sleep_lock);
    atomic_fetch_add(&pool.sleepers, 1);
    while (generation(s = atomic_load(&pool.state)) == seen && !atomic_load(&pool.stop))
        pthread_cond_wait(&pool.wake, &pool.sleep_lock);
    atomic_fetch_sub(&pool.sleepers, 1);
    pthread_mutex_unlock(&pool.sleep_lock);
    step_aside(at);
    return s;
}

static void *worker(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    Placement at = {0};
    for (;;) {
        uint64_t s = wait_job(seen, &at);
        if (atomic_load(&pool.stop)) return NULL;
        seen = generation(s);
        int joined = 0;
        while (!joined && generation(s) == seen && !(s & CLOSED))
            joined = atomic_compare_exchange_weak(&pool.state, &s, s + 1);
        if (!joined) continue; /* closed before this worker came: the caller did its share */
        set_csr(pool.csr);
        atomic_fetch_add_explicit(&pool.worker_runs, run_chunks(), memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.left, 1, memory_order_release);
    }
}

static void wake_all(void) {
    pthread_mutex_lock(&pool.sleep_lock);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep_lock);
}

/* Stops and joins the workers (pool.lock held). */
static void stop_workers(void) {
    if (pool.started == 0) return;
    atomic_store(&pool.stop, 1);
    wake_all();
    for (int i = 0; i < pool.started; ++i) pthread_join(pool.tid[i], NULL);
    pool.started = 0;
    atomic_store(&pool.stop, 0);
}

static void at_exit(void) {
    if (pthread_mutex_trylock(&pool.lock) != 0) return; /* a call still running at exit: leave it be */
    stop_workers();
    pthread_mutex_unlock(&pool.lock);
}

/* fork: the child has none of the parent's workers; it starts its own at its first call. */
static void before_fork(void) { pthread_mutex_lock(&pool.lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&pool.lock); }
static void after_fork_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.stop, 0);
    pool.started = 0;
}

/* Starts workers up to threads - 1 (pool.lock held), with every signal blocked (Python's handlers
 * run on its main thread). Fewer if the system refuses: the caller takes their share. */
static void start_workers(void) {
    if (!pool.hooked) {
        atexit(at_exit);
        pthread_atfork(before_fork, after_fork_parent, after_fork_child);
        pool.hooked = 1;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    const uint32_t seen = generation(atomic_load(&pool.state));
    while (pool.started < pool.threads - 1 &&
           pthread_create(&pool.tid[pool.started], NULL, worker, (void *)(uintptr_t)seen) == 0) {
#if defined(__linux__)
        pthread_setname_np(pool.tid[pool.started], "dspark-quant"); /* what top -H and the tests see */
#endif
        ++pool.started;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* fn(args, n0, n1) over rows 0..N of a call whose work (weight bytes x passes) is `work`: on the
 * pool when it is big enough and the pool free, else on this thread, rows in order. */
static void run_rows(RowsFn fn, const void *args, int64_t N, int64_t work) {
    if (pool.threads < 2 || work < MIN_PARALLEL_WORK || N <= PANEL || pthread_mutex_trylock(&pool.lock) != 0) {
        fn(args, 0, N);
        return;
    }
    if (pool.started < pool.threads - 1) start_workers();
    const int threads = pool.started + 1;
    /* Panels a run: long runs, since each starts a new stream from memory (measured at M = 1, cold:
     * q/o on 2 threads in runs of 34 KB 19.7 us, of 103 KB 17.6; gate/up 69 KB 40.8, 276 KB 37.7). */
    const int64_t panels = (N + PANEL - 1) / PANEL, per_panel = work / panels + 1;
    const int64_t most = (panels + threads - 1) / threads;
    const int64_t fewest = (panels + threads * RUNS_PER_THREAD - 1) / (threads * RUNS_PER_THREAD);
    int64_t chunk = (MIN_RUN_WORK + per_panel - 1) / per_panel;
    chunk = chunk > most ? most : chunk < fewest ? fewest : chunk;
    pool.fn = fn, pool.args = args, pool.rows = N, pool.chunk = chunk * PANEL;
    pool.chunks = (panels + chunk - 1) / chunk;
    pool.csr = get_csr();
#if defined(__linux__)
    atomic_store_explicit(&pool.caller_cpu, sched_getcpu(), memory_order_relaxed);
#endif
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.left, 0, memory_order_relaxed);
    const uint64_t open = (uint64_t)(generation(atomic_load(&pool.state)) + 1) << 32;
    atomic_store(&pool.state, open);
    if (work >= WAKE_WORK && atomic_load(&pool.sleepers) > 0) wake_all();
    run_chunks();
    const int64_t joined = (int64_t)(atomic_fetch_or(&pool.state, CLOSED) & JOINED_MASK);
    for (unsigned i = 1; atomic_load_explicit(&pool.left, memory_order_acquire) < joined; ++i)
        if (i % 1024 == 0) /* a joined worker lost its core mid-run: let it have this one */
            sched_yield();
        else
            cpu_relax();
    pthread_mutex_unlock(&pool.lock);
}

/* The pool for the library's other kernels (cpu_attention.c): fn(args, i0, i1) over items 0..N, as
 * run_rows runs a matmul's output rows, `work` in the same units (bytes read x passes). */
void dspark_pool_run(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t N, int64_t work) {
    run_rows(fn, args, N, work);
}

/* Threads a big call runs on, the caller included (1: every call on its caller's thread). */
int dspark_quant_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return -1;
    pthread_mutex_lock(&pool.lock);
    if (n != pool.threads) {
        stop_workers();
        pool.threads = n;
    }
    pthread_mutex_unlock(&pool.lock);
    return 0;
}

int dspark_quant_get_threads(void) { return pool.threads; }

/* Workers running now (they start at the first call that wants them). */
int dspark_quant_pool_workers(void) { return pool.started; }

/* Runs of rows the workers have computed since the library was loaded. */
int64_t dspark_quant_pool_worker_runs(void) { return atomic_load(&pool.worker_runs); }

static void add_bias(float *y, int64_t M, int64_t N, int64_t n0, int64_t n1, const float *bias) {
    if (bias != NULL)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
}

/* One float-path call, as its output rows are computed. */
typedef struct {
    const float *x, *bias;
    int64_t M, K, N, row_bytes;
    const uint8_t *w;
    const StreamTile *stream;
    DecodeRows decode;
    float *y;
} F32Call;

#if defined(QG_AVX2)
/* Decoded rows of up to this many bytes sit on the stack (WIDE_PANEL rows of K = 4096). */
#define STACK_WIDE 65536

/* f32_rows with wide tiles: WIDE_PANEL output rows decoded at a time, then all of x over them. */
static void f32_wide_rows(const F32Call *c, int64_t n0, int64_t n1) {
    const size_t bytes = (size_t)(WIDE_PANEL * c->K) * sizeof(float);
    float stack[bytes <= STACK_WIDE ? WIDE_PANEL * c->K : 1];
    float *wf = bytes <= STACK_WIDE ? stack : malloc(bytes);
    if (wf == NULL) { /* no memory for the decoded rows: the streaming tiles need none */
        for (int64_t m0 = 0; m0 < c->M; m0 += ROWS) {
            const int rows = c->M - m0 < ROWS ? (int)(c->M - m0) : ROWS;
            c->stream[rows](c->x + m0 * c->K, c->K, c->w + n0 * c->row_bytes, c->row_bytes, n1 - n0,
                            c->y + m0 * c->N + n0, c->N);
        }
        return;
    }
    for (int64_t p = n0; p < n1; p += WIDE_PANEL) {
        const int64_t width = n1 - p < WIDE_PANEL ? n1 - p : WIDE_PANEL;
        c->decode(c->w + p * c->row_bytes, c->row_bytes, width, c->K, wf);
        for (int64_t m0 = 0; m0 < c->M; m0 += WIDE_ROWS) {
            const int rows = c->M - m0 < WIDE_ROWS ? (int)(c->M - m0) : WIDE_ROWS;
            wide_tiles[rows](c->x + m0 * c->K, c->K, wf, width, c->y + m0 * c->N + p, c->N);
        }
    }
    if (wf != stack) free(wf);
}
#endif

/* Output rows n0..n1 (panels of PANEL, each swept by passes of ROWS rows of x; on AVX2 with more
 * than ROWS rows, the wide tiles), bias added. */
static void f32_rows(const void *args, int64_t n0, int64_t n1) {
    const F32Call *c = args;
#if defined(QG_AVX2)
    if (c->M > ROWS && c->decode != NULL) {
        f32_wide_rows(c, n0, n1);
        add_bias(c->y, c->M, c->N, n0, n1, c->bias);
        return;
    }
#endif
    for (int64_t p = n0; p < n1; p += PANEL) {
        const int64_t width = n1 - p < PANEL ? n1 - p : PANEL;
        for (int64_t m0 = 0; m0 < c->M; m0 += ROWS) {
            const int rows = c->M - m0 < ROWS ? (int)(c->M - m0) : ROWS;
            c->stream[rows](c->x + m0 * c->K, c->K, c->w + p * c->row_bytes, c->row_bytes, width, c->y + m0 * c->N + p,
                            c->N);
        }
    }
    add_bias(c->y, c->M, c->N, n0, n1, c->bias);
}

/* y [M, N] = x [M, K] @ dequantize(W [N, row_bytes])^T (+ bias [N] if not NULL), float32.
 * Returns 0, or -1 for a type it does not take, -2 for a K or row_bytes that does not fit it. */
int dspark_quant_gemm_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                          int qtype, const float *bias, float *y) {
    F32Call c = {x, bias, M, K, N, row_bytes, w, NULL, NULL, y};
    int64_t block, bytes;
    if (!type_info(qtype, &c.stream, &c.decode, &block, &bytes)) return -1;
    if (K % block != 0 || row_bytes != K / block * bytes) return -2;
    run_rows(f32_rows, &c, N, N * row_bytes * ((M + ROWS - 1) / ROWS));
    return 0;
}

/* ---- int8 activations (llama.cpp's scheme) --------------------------------------------------------
 *
 * Each 32-block of a row of x becomes int8 xq with scale dx = max|x| / 127 (xq = x * (127 / max|x|)
 * rounded half to even; all zeros where the block is), its sum of xq, and sx = dx * sum(xq): the sum
 * of the ROUNDED block, as llama.cpp's Q8_1 keeps it (its s), not the float sum of x. A weight
 * block's dot product with it is then exact in int32: vpdpbusd multiplies unsigned bytes by signed
 * ones, so Q4 nibbles (0..15) go in as they are, Q4_0's "- 8" and Q8_0's signed bytes (xor 0x80:
 * q + 128) are taken back through the block's sum of xq. Per block: y += d * dx * dot (+ m * sx for
 * Q4_1), which is sum_k w_k * dx * xq_k for the block's weights w = d * q + m: every weight meets the
 * same rounded x. With x's float sum in m's term instead, the block's error would be
 * sum_k (w_k - m) * (dx * xq_k - x_k): the offset taken out, the weights d * q in 0..15 d all of one
 * sign, so the roundings no longer cancel, and on SmolLM2's Q4_1 layers that was 2-3 times the error.
 * Unlike llama.cpp, dx and sx stay float32 (it stores both as float16: 2^-11 more relative error
 * in each block's terms, and s overflows where max|x| > 2047), so the two agree to that rounding.
 *
 * x is laid out per row in records of RECORD bytes, one a group (4 blocks of Q4, 2 of Q8_0), in the
 * order the weight decoder leaves the bytes, missing blocks of the last group zero:
 *   Q4_0 / Q4_1: [xq of weights 0..15 of blocks 0..3 : 64][weights 16..31 : 64]
 *                [16 float: dx of block l / 4][16: Q4_1 sx = dx * sum(xq), Q4_0 8 * sum(xq), in lane 4b, else 0]
 *   Q8_0:        [xq of blocks 0..1 : 64][unused : 64][16 float: dx of block l / 8]
 *                [16 int32: 128 * sum(xq) in lane 8b, else 0]
 * The AVX2 build (no VNNI) lays x out a block at a time instead, XBLOCK bytes each, whatever the
 * weight's type: [xq of weights 0..31 : 32][float dx][float sx = dx * sum(xq)], so that one load
 * takes a block's integers and one its two scales.
 */
#define RECORD 256

static inline int64_t per_group(int qtype) { return qtype == Q8_0 ? 2 : 4; }

static int int8_type(int qtype, int64_t *bytes) {
    switch (qtype) {
    case Q8_0: *bytes = 34; return 1;
    case Q4_0: *bytes = 18; return 1;
    case Q4_1: *bytes = 20; return 1;
    default: return 0;
    }
}

/* Records of up to this many bytes (a few rows: 3 KB a row at K = 1536) sit on the stack. */
#define STACK_RECORDS 32768

#if defined(QG_AVX2)
#define XBLOCK 40
#endif

static int64_t records_bytes(int qtype, int64_t M, int64_t K) {
#if defined(QG_AVX2)
    (void)qtype;
    return M * (K / 32) * XBLOCK;
#else
    return M * ((K / 32 + per_group(qtype) - 1) / per_group(qtype)) * RECORD;
#endif
}

/* Bytes of scratch the int8 path wants for M rows of K (0: its records fit on the stack). */
int64_t dspark_quant_gemm_q8act_scratch(int qtype, int64_t M, int64_t K) {
    const int64_t bytes = records_bytes(qtype, M, K);
    return bytes <= STACK_RECORDS ? 0 : bytes;
}

/* How the int8 path runs here: 2 AVX512-VNNI, 1 AVX2, 0 the portable scalar loop. */
int dspark_quant_gemm_q8act_native(void) {
#if defined(QG_VNNI)
    return 2;
#elif defined(QG_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* One 32-block of x, as llama.cpp's quantize_row_q8_0 / q8_1 round it: dx = max|x| / 127 and
 * q = round-half-even(x * (127 / max|x|)) in -127..127 (q all zero where the block is), the sum of q,
 * and sx = dx * sum(q) (layout comment above: the rounded block's sum, not x's). */
static inline void quantize_block(const float *xb, int8_t q[32], float *dx_out, int32_t *sum_out, float *sx_out) {
#if defined(QG_AVX512)
    /* ~15 cycles a block, against ~400 for the scalar loop below (bench: M = 32 rows of K = 1536 took
     * ~240 us a call, longer than the matmul it fed). rint is the cvt under the default MXCSR. */
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))), lo), hi);
    const __m512i qb = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv))), lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    *dx_out = dx, *sum_out = sum, *sx_out = dx * (float)sum;
#elif defined(QG_AVX2)
    /* The scalar loop's integers (cvtps rounds half to even under the default MXCSR, as rintf does),
     * packed back into x's order: the packs work within 128-bit lanes, so the 4-byte runs come out as
     * a0 b0 c0 d0 | a1 b1 c1 d1 (a..d: x's four ymm) and one dword permute mends that. */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))), lo), hi);
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    *dx_out = dx, *sum_out = sum, *sx_out = dx * (float)sum;
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
        const float v = fminf(fmaxf(rintf(xb[i] * inv), -127.0f), 127.0f);
        q[i] = (int8_t)v;
        sum += q[i];
    }
    *dx_out = dx, *sum_out = sum, *sx_out = dx * (float)sum;
#endif
}

/* Rows of x [M, K] to their records (layout above). */
static void quantize_x(const float *x, int64_t M, int64_t K, int qtype, uint8_t *records) {
#if defined(QG_AVX2)
    (void)qtype;
    for (int64_t b = 0; b < M * (K / 32); ++b) { /* the rows' blocks one after another, as x's */
        uint8_t *rec = records + b * XBLOCK;
        float scales[2];
        int32_t sum;
        quantize_block(x + 32 * b, (int8_t *)rec, &scales[0], &sum, &scales[1]);
        memcpy(rec + 32, scales, 8);
    }
#else
    const int64_t blocks = K / 32, pg = per_group(qtype), groups = (blocks + pg - 1) / pg;
    memset(records, 0, (size_t)(M * groups * RECORD));
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            int8_t q[32];
            float dx, sx;
            int32_t sum;
            quantize_block(x + r * K + 32 * b, q, &dx, &sum, &sx);
            uint8_t *rec = records + (r * groups + b / pg) * RECORD;
            float *dxs = (float *)(rec + 128);
            const int i = (int)(b % pg);
            if (qtype == Q8_0) {
                memcpy(rec + 32 * i, q, 32);
                for (int l = 0; l < 8; ++l) dxs[8 * i + l] = dx;
                ((int32_t *)(rec + 192))[8 * i] = 128 * sum;
            } else {
                memcpy(rec + 16 * i, q, 16);
                memcpy(rec + 64 + 16 * i, q + 16, 16);
                for (int l = 0; l < 4; ++l) dxs[4 * i + l] = dx;
                if (qtype == Q4_1)
                    ((float *)(rec + 192))[4 * i] = sx;
                else
                    ((int32_t *)(rec + 192))[4 * i] = 8 * sum;
            }
        }
#endif
}

/* One int8-path call, x already in records, as its output rows are computed. */
typedef struct {
    const uint8_t *records, *w;
    int64_t M, K, N, row_bytes, size;
    int qtype;
    const float *bias;
    float *y;
} Int8Call;

#if defined(QG_VNNI)
/* One group of a weight row, decoded: q as unsigned bytes in the records' order, d (and m) a lane. */
typedef struct {
    __m512i lo, hi;
    __m512 d, m;
} Group;

/* Byte indices into the 128 bytes (a, b) of a group for vpermi2b. */
#define IDX(EXPR)                                                                                             \
    ({                                                                                                        \
        uint8_t t_[64];                                                                                       \
        for (int i = 0; i < 64; ++i) t_[i] = (uint8_t)(EXPR);                                                 \
        _mm512_loadu_si512(t_);                                                                               \
    })

/* Q4_0 / Q4_1: 4 blocks. */
static inline Group group_q4(__m512i a, __m512i b, __m512i idx_qs, __m512i idx_hdr) {
    const __m512i qs = _mm512_permutex2var_epi8(a, idx_qs, b), low = _mm512_set1_epi8(15);
    const __m512i hdr = _mm512_permutex2var_epi8(a, idx_hdr, b);
    return (Group){_mm512_and_si512(qs, low), _mm512_and_si512(_mm512_srli_epi16(qs, 4), low),
                   _mm512_cvtph_ps(_mm512_castsi512_si256(hdr)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hdr, 1))};
}

/* Q8_0: 2 blocks, the signed bytes as unsigned q + 128. */
static inline Group group_q8(__m512i a, __m512i b, __m512i idx_qs, __m512i idx_hdr) {
    const __m512i qs = _mm512_permutex2var_epi8(a, idx_qs, b);
    const __m512i hdr = _mm512_permutex2var_epi8(a, idx_hdr, b);
    return (Group){_mm512_xor_si512(qs, _mm512_set1_epi8((char)0x80)), _mm512_setzero_si512(),
                   _mm512_cvtph_ps(_mm512_castsi512_si256(hdr)), _mm512_setzero_ps()};
}

/* One group of one row of x (its record rec): acc[0] += d * dx * dot, acc[1] += m * sx (Q4_1). */
static inline void apply_q4_1(__m512 *acc, __m512 *accm, const Group *w, const uint8_t *rec) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->lo, _mm512_loadu_si512(rec));
    dot = _mm512_dpbusd_epi32(dot, w->hi, _mm512_loadu_si512(rec + 64));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w->d, _mm512_loadu_ps(rec + 128)), *acc);
    *accm = _mm512_fmadd_ps(w->m, _mm512_loadu_ps(rec + 192), *accm);
}

/* Q4_0: the dot starts from -8 * sum(xq) (its "- 8"). */
static inline void apply_q4_0(__m512 *acc, __m512 *accm, const Group *w, const uint8_t *rec) {
    (void)accm;
    const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(rec + 192));
    __m512i dot = _mm512_dpbusd_epi32(start, w->lo, _mm512_loadu_si512(rec));
    dot = _mm512_dpbusd_epi32(dot, w->hi, _mm512_loadu_si512(rec + 64));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w->d, _mm512_loadu_ps(rec + 128)), *acc);
}

/* Q8_0: the dot of q + 128, less 128 * sum(xq). */
static inline void apply_q8_0(__m512 *acc, __m512 *accm, const Group *w, const uint8_t *rec) {
    (void)accm;
    const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(rec + 192));
    const __m512i dot = _mm512_dpbusd_epi32(start, w->lo, _mm512_loadu_si512(rec));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w->d, _mm512_loadu_ps(rec + 128)), *acc);
}

/* A whole group's bytes (PG * SIZE: 64 + 16, 8 or 4), exactly those. */
static inline void load_group(const uint8_t *p, int tail, __m512i *a, __m512i *b) {
    *a = _mm512_loadu_si512(p);
    *b = _mm512_castsi128_si512(_mm_maskz_loadu_epi8((__mmask16)((1u << tail) - 1), p + 64));
}

/* Group g of a row into accumulator A (0: even groups, 1: odd) of every row of x. */
#define INT8_GROUP(GROUP, APPLY, R, G, A)                                                                     \
    {                                                                                                         \
        const Group dec = GROUP(a, b, idx_qs, idx_hdr);                                                       \
        for (int r = 0; r < R; ++r)                                                                           \
            APPLY(&acc[r][A], &acc[r][2], &dec, xr + (r * groups + (G)) * RECORD);                            \
    }

/* R rows of x (records xr, `groups` a row) times `count` weight rows from w, one row after another
 * (as the float path's tiles): full groups with plain loads, a short last group with a masked one
 * (nothing past the row is read). */
#define INT8_TILE(NAME, GROUP, APPLY, SIZE, PG, R)                                                            \
    static void NAME(const uint8_t *xr, int64_t groups, int64_t blocks, const uint8_t *w, int64_t row_bytes,  \
                     int64_t count, __m512i idx_qs, __m512i idx_hdr, float *y, int64_t ldy) {                 \
        const int64_t full = blocks / PG;                                                                     \
        const int tail = PG * SIZE - 64, part = (int)((blocks - full * PG) * SIZE);                           \
        for (int64_t n = 0; n < count; ++n) {                                                                 \
            const uint8_t *row = w + n * row_bytes;                                                           \
            __m512 acc[R][3];                                                                                 \
            for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();              \
            __m512i a, b;                                                                                     \
            int64_t g = 0;                                                                                    \
            for (; g + 1 < full; g += 2) {                                                                    \
                load_group(row + g * PG * SIZE, tail, &a, &b);                                                \
                INT8_GROUP(GROUP, APPLY, R, g, 0)                                                             \
                load_group(row + (g + 1) * PG * SIZE, tail, &a, &b);                                          \
                INT8_GROUP(GROUP, APPLY, R, g + 1, 1)                                                         \
            }                                                                                                 \
            if (g < full) {                                                                                   \
                load_group(row + g * PG * SIZE, tail, &a, &b);                                                \
                INT8_GROUP(GROUP, APPLY, R, g, 0)                                                             \
                ++g;                                                                                          \
            }                                                                                                 \
            if (part > 0) { /* the short last group: into accumulator 0 whatever its parity */                \
                a = _mm512_maskz_loadu_epi8((__mmask64)((1ull << part) - 1), row + g * PG * SIZE);            \
                b = _mm512_setzero_si512();                                                                   \
                INT8_GROUP(GROUP, APPLY, R, g, 0)                                                             \
            }                                                                                                 \
            for (int r = 0; r < R; ++r)                                                                       \
                y[r * ldy + n] = hsum((v16)(acc[r][0] + acc[r][1] + acc[r][2]));                              \
        }                                                                                                     \
    }

typedef void (*Int8Tile)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, __m512i, __m512i,
                         float *, int64_t);
#define INT8_TILES(T, GROUP, APPLY, SIZE, PG)                                                                 \
    INT8_TILE(int8_##T##_1, GROUP, APPLY, SIZE, PG, 1)                                                        \
    INT8_TILE(int8_##T##_2, GROUP, APPLY, SIZE, PG, 2)                                                        \
    INT8_TILE(int8_##T##_3, GROUP, APPLY, SIZE, PG, 3)                                                        \
    INT8_TILE(int8_##T##_4, GROUP, APPLY, SIZE, PG, 4)                                                        \
    static const Int8Tile int8_##T[ROWS + 1] = {0, int8_##T##_1, int8_##T##_2, int8_##T##_3, int8_##T##_4};
INT8_TILES(q4_0, group_q4, apply_q4_0, 18, 4)
INT8_TILES(q4_1, group_q4, apply_q4_1, 20, 4)
INT8_TILES(q8_0, group_q8, apply_q8_0, 34, 2)

/* Output rows n0..n1 of the call c (panels of PANEL, each swept by passes of ROWS rows of x). */
static void int8_gemm(const Int8Call *c, int64_t n0, int64_t n1) {
    const int qtype = c->qtype;
    const int64_t M = c->M, N = c->N, size = c->size, row_bytes = c->row_bytes;
    const int64_t blocks = c->K / 32, pg = per_group(qtype), groups = (blocks + pg - 1) / pg;
    const Int8Tile *tiles = qtype == Q8_0 ? int8_q8_0 : qtype == Q4_1 ? int8_q4_1 : int8_q4_0;
    __m512i idx_qs, idx_hdr;
    if (qtype == Q8_0) {
        idx_qs = IDX((i / 32) * 34 + 2 + i % 32);
        idx_hdr = IDX(((i / 2) / 8) * 34 + i % 2); /* f16 lane i / 2 (of the low 16): block (i / 2) / 8 */
    } else {
        const int off = qtype == Q4_1 ? 4 : 2;
        idx_qs = IDX((i / 16) * size + off + i % 16);
        /* f16 lanes 0..15: d of block lane / 4; 16..31: m of block (lane - 16) / 4 */
        idx_hdr = IDX(((i / 2) % 16 / 4) * size + (i / 32) * 2 + i % 2);
    }
    for (int64_t p = n0; p < n1; p += PANEL) {
        const int64_t width = n1 - p < PANEL ? n1 - p : PANEL;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            tiles[rows](c->records + m0 * groups * RECORD, groups, blocks, c->w + p * row_bytes, row_bytes, width,
                        idx_qs, idx_hdr, c->y + m0 * N + p, N);
        }
    }
}

#elif defined(QG_AVX2)
/* AVX2 without VNNI (llama.cpp's way there), one 32-block at a time. A Q4 block's 16 bytes of quants
 * become 32 unsigned bytes (the low nibbles, weights 0..15, in the low lane; the high ones, 16..31,
 * in the high lane: the order of the xq in x's block, XBLOCK above). vpmaddubsw multiplies unsigned
 * by signed bytes and adds neighbours into int16 (|sum| <= 2 * 128 * 127: no saturation), vpmaddwd
 * by ones adds those pairs into int32: the block's dot product, exact, as vpdpbusd gives it. Signed
 * weights (Q8_0's, and Q4_0's with its 8 taken off) go in as |q| against xq given q's sign (vpsignb).
 *
 * The scales: the weight block's (d, m) as two floats (one vcvtph2ps) times x's (dx, sx) give
 * (d * dx, m * sx) in one multiply; y += (d * dx) * dot in float32 (one ymm accumulator a result),
 * and Q4_1's m * sx adds into lane 1 of an xmm accumulator. Every result (row of x, output row) is
 * that sequence over its blocks, in block order, whatever tile computes it (a tile: R rows of x, 1 to
 * ROWS, times one output row at a time; each weight block decoded once for the R rows), so a row's
 * result is the same bits whatever rows share its call (batch invariance).
 *
 * Measured on a Zen 3 core (bench/quant_gemm.py --step --fused, 1 thread): against llama.cpp-style
 * two-accumulator tiles that loaded x's halves apart, 11.5 -> 9.5 ms a SmolLM2 step at M = 1 and
 * 193 -> 134 ms at M = 32. Tiles of 2 or 4 output rows at a time (x's blocks loaded once for them)
 * were slower at M = 1 (the LM head's Q8_0 1.8-2x), and two accumulators a result no faster. */

/* The weight block's 32 quants as bytes: Q4 as unsigned 0..15 (one 16-byte broadcast, the high lane
 * shifted by 4), Q8_0 as they are. */
static inline __m256i q4_quants(const uint8_t *qs) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

/* The block's scales as floats: (d, m) for Q4_1, (d, 0) for the others. */
static inline __m128 scales_dm(const uint8_t *blk) {
    int32_t h;
    memcpy(&h, blk, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(h));
}
static inline __m128 scales_d(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk, 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(h));
}

/* One weight block decoded: u the unsigned bytes that meet x, q the signs x takes (signed types), sc
 * its scales. */
typedef struct {
    __m256i u, q;
    __m128 sc;
} WBlock;

static inline __attribute__((always_inline)) WBlock wblock(int qtype, const uint8_t *blk) {
    WBlock w;
    if (qtype == Q4_1) {
        w.u = q4_quants(blk + 4), w.q = w.u, w.sc = scales_dm(blk);
    } else if (qtype == Q4_0) {
        w.q = _mm256_sub_epi8(q4_quants(blk + 2), _mm256_set1_epi8(8));
        w.u = _mm256_abs_epi8(w.q), w.sc = scales_d(blk);
    } else {
        w.q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        w.u = _mm256_abs_epi8(w.q), w.sc = scales_d(blk);
    }
    return w;
}

/* The tile: R rows of x (blocks from xr, a row every xstride bytes) times count output rows of w. */
static inline __attribute__((always_inline)) void int8_tile(int qtype, int R, const uint8_t *xr, int64_t xstride,
                                                             int64_t blocks, const uint8_t *w, int64_t row_bytes,
                                                             int64_t count, float *y, int64_t ldy) {
    const int64_t size = qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = 0; n < count; ++n) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[ROWS];
        __m128 accm[ROWS];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), accm[r] = _mm_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const WBlock wb = wblock(qtype, row + b * size);
            for (int r = 0; r < R; ++r) {
                const uint8_t *xb = xr + r * xstride + b * XBLOCK;
                const __m256i xq = _mm256_loadu_si256((const __m256i *)xb);
                const __m128 xs = _mm_castpd_ps(_mm_load_sd((const double *)(xb + 32)));
                const __m256i xv = qtype == Q4_1 ? xq : _mm256_sign_epi8(xq, wb.q);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wb.u, xv), ones));
                const __m128 s = _mm_mul_ps(wb.sc, xs); /* (d * dx, m * sx) */
                acc[r] = MADD8(dot, _mm256_broadcastss_ps(s), acc[r]);
                if (qtype == Q4_1) accm[r] = _mm_add_ps(accm[r], s);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            float v = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
            if (qtype == Q4_1) v += _mm_cvtss_f32(_mm_shuffle_ps(accm[r], accm[r], 1));
            y[r * ldy + n] = v;
        }
    }
}

typedef void (*Int8Tile)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *, int64_t);
#define INT8_TILE(T, QT, R)                                                                                   \
    static void int8_##T##_##R(const uint8_t *xr, int64_t xstride, int64_t blocks, const uint8_t *w,          \
                               int64_t row_bytes, int64_t count, float *y, int64_t ldy) {                     \
        int8_tile(QT, R, xr, xstride, blocks, w, row_bytes, count, y, ldy);                                   \
    }
#define INT8_TILES(T, QT)                                                                                     \
    INT8_TILE(T, QT, 1)                                                                                       \
    INT8_TILE(T, QT, 2)                                                                                       \
    INT8_TILE(T, QT, 3)                                                                                       \
    INT8_TILE(T, QT, 4)                                                                                       \
    static const Int8Tile int8_##T[ROWS + 1] = {0, int8_##T##_1, int8_##T##_2, int8_##T##_3, int8_##T##_4};
INT8_TILES(q4_0, Q4_0)
INT8_TILES(q4_1, Q4_1)
INT8_TILES(q8_0, Q8_0)

/* Output rows n0..n1 of the call c (panels of PANEL, each swept by passes of ROWS rows of x). */
static void int8_gemm(const Int8Call *c, int64_t n0, int64_t n1) {
    const int qtype = c->qtype;
    const int64_t M = c->M, N = c->N, row_bytes = c->row_bytes, blocks = c->K / 32, xstride = blocks * XBLOCK;
    const Int8Tile *tiles = qtype == Q8_0 ? int8_q8_0 : qtype == Q4_1 ? int8_q4_1 : int8_q4_0;
    for (int64_t p = n0; p < n1; p += PANEL) {
        const int64_t width = n1 - p < PANEL ? n1 - p : PANEL;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            tiles[rows](c->records + m0 * xstride, xstride, blocks, c->w + p * row_bytes, row_bytes, width,
                        c->y + m0 * N + p, N);
        }
    }
}

#else /* portable: one block at a time */

static void int8_gemm(const Int8Call *c, int64_t n0, int64_t n1) {
    const int qtype = c->qtype;
    const int64_t N = c->N, size = c->size, row_bytes = c->row_bytes;
    const int64_t blocks = c->K / 32, pg = per_group(qtype), groups = (blocks + pg - 1) / pg;
    const uint8_t *w = c->w, *records = c->records;
    for (int64_t r = 0; r < c->M; ++r)
        for (int64_t n = n0; n < n1; ++n) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t *blk = w + n * row_bytes + b * size, *rec = records + (r * groups + b / pg) * RECORD;
                const int i = (int)(b % pg);
                const float dx = ((const float *)(rec + 128))[qtype == Q8_0 ? 8 * i : 4 * i];
                int32_t dot = 0;
                if (qtype == Q8_0) {
                    for (int k = 0; k < 32; ++k) dot += (int8_t)blk[2 + k] * (int8_t)rec[32 * i + k];
                } else {
                    const uint8_t *qs = blk + (qtype == Q4_1 ? 4 : 2);
                    for (int k = 0; k < 16; ++k)
                        dot += (qs[k] & 15) * (int8_t)rec[16 * i + k] + (qs[k] >> 4) * (int8_t)rec[64 + 16 * i + k];
                    if (qtype == Q4_0) dot -= ((const int32_t *)(rec + 192))[4 * i];
                }
                acc += (float)dot * (half(blk) * dx);
                if (qtype == Q4_1) acc += half(blk + 2) * ((const float *)(rec + 192))[4 * i];
            }
            c->y[r * N + n] = acc;
        }
}
#endif

static void int8_rows(const void *args, int64_t n0, int64_t n1) {
    const Int8Call *c = args;
    int8_gemm(c, n0, n1);
    add_bias(c->y, c->M, c->N, n0, n1, c->bias);
}

/* y [M, N] = x [M, K] @ W^T (+ bias [N] if not NULL), x's 32-blocks rounded to int8 (above), for
 * Q8_0, Q4_0, Q4_1. scratch: dspark_quant_gemm_q8act_scratch(qtype, M, K) bytes for x's records
 * (NULL when that is 0).
 * Returns 0, or -1 for a type it does not take, -2 for a K, row_bytes or scratch that does not fit. */
int dspark_quant_gemm_q8act(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                            int qtype, const float *bias, float *y, uint8_t *scratch) {
    int64_t size;
    if (!int8_type(qtype, &size)) return -1;
    if (K % 32 != 0 || row_bytes != K / 32 * size) return -2;
    uint8_t stack[STACK_RECORDS] __attribute__((aligned(64)));
    if (scratch == NULL) {
        if (records_bytes(qtype, M, K) > STACK_RECORDS) return -2;
        scratch = stack;
    }
    quantize_x(x, M, K, qtype, scratch);
    const Int8Call c = {scratch, w, M, K, N, row_bytes, size, qtype, bias, y};
    run_rows(int8_rows, &c, N, N * row_bytes * ((M + ROWS - 1) / ROWS));
    return 0;
}
