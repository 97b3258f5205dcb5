/*
 * A Llama-family decoder's layers over one packed step, on CPU, in one call: what the compiled
 * forward (dspark_ray/model/compiled.py) does for a model whose linears are GGUF blocks kept
 * (quant_gemm.c) and whose attention is the paged C kernel (cpu_attention.c), without a Python call,
 * a dispatcher call or a tensor allocation per op. On SmolLM2-135M at one decode token those cost
 * ~4 ms a step (30 layers of ~10 ops) against ~9 ms of matmuls.
 *
 * Each layer, x [N, H] the residual stream (updated in place):
 *   h = rmsnorm(x) * w_in;  qkv = h @ Wqkv^T (+ b);  rotary on q and k (the halves rotated, as
 *   layers.apply_rope);  out = attention(q, k, v) (K/V written to the layer's pools first);
 *   x += out @ Wo^T (+ b);  h = rmsnorm(x) * w_post;  gu = h @ Wgu^T (+ b);
 *   x += (silu(gate) * up) @ Wdown^T (+ b).
 * Every op works on one token's row at a time, in the same order whatever the other rows (the
 * matmuls and the attention keep that themselves), so a row's result is the same bits whatever
 * rows share its step. The final norm, the embedding and the LM head stay with the caller.
 *
 * Returns 0; -1 a matmul refused (its shapes or type), -2 the attention refused the step (its
 * indices or heads: checked once, before anything is written), -3 no memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

int dspark_quant_gemm_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                          int qtype, const float *bias, float *y);
int dspark_quant_gemm_q8act(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_bytes,
                            int qtype, const float *bias, float *y, uint8_t *scratch);
int64_t dspark_quant_gemm_q8act_scratch(int qtype, int64_t M, int64_t K);
int dspark_paged_step_check(const int64_t *write_index, const int32_t *key_index, int64_t key_count,
                            const int64_t *key_base, const int64_t *key_lo, const int64_t *key_hi, int64_t N,
                            int64_t P, int64_t Hq, int64_t Hkv, int64_t D);
int dspark_paged_attention_checked_f32(const float *q, const float *k_new, const float *v_new, float *k_pool,
                                       float *v_pool, const int64_t *write_index, const int32_t *key_index,
                                       const int64_t *key_base, const int64_t *key_lo, const int64_t *key_hi,
                                       int64_t N, int64_t Hq, int64_t Hkv, int64_t D, float scale, float *out);

/* One linear kept as blocks: [n, row_bytes] of GGUF type qtype; int8: activations rounded to int8
 * per block (quant_gemm.c's int8 path). */
typedef struct {
    const uint8_t *w;
    const float *bias; /* [n] or NULL */
    int64_t n, row_bytes;
    int32_t qtype, int8;
} DecoderGemm;

/* One layer: its two norms' weights [H] and four matmuls (q/k/v and gate/up fused, row-stacked). */
typedef struct {
    const float *norm_in, *norm_post;
    DecoderGemm qkv, o, gate_up, down;
} DecoderLayer;

/* The step's attention, as cpu.PagedStep holds it (dspark_paged_attention_f32's arguments). */
typedef struct {
    const int64_t *write_index, *key_base, *key_lo, *key_hi; /* [N] */
    const int32_t *table;
    int64_t table_numel, pool_rows;
} DecoderStep;

static int gemm(const DecoderGemm *g, const float *x, int64_t M, int64_t K, float *y, uint8_t *scratch) {
    const int code = g->int8 ? dspark_quant_gemm_q8act(x, M, K, g->w, g->n, g->row_bytes, g->qtype, g->bias, y, scratch)
                             : dspark_quant_gemm_f32(x, M, K, g->w, g->n, g->row_bytes, g->qtype, g->bias, y);
    return code == 0 ? 0 : -1;
}

/* out = rmsnorm(x) * w over rows of H: x * (1 / sqrt(mean(x^2) + eps)), then times w (RMSNorm's
 * order). The sum of squares in 8 lanes, added in a fixed tree. */
static void rmsnorm(const float *x, const float *w, int64_t N, int64_t H, float eps, float *out) {
    for (int64_t n = 0; n < N; ++n) {
        const float *r = x + n * H;
        float lanes[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
            for (int l = 0; l < 8; ++l) lanes[l] += r[i + l] * r[i + l];
        for (; i < H; ++i) lanes[i % 8] += r[i] * r[i];
        const float ss = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; ++i) out[n * H + i] = w[i] * (r[i] * inv);
    }
}

/* Rotary embedding in place on heads [N, heads, D] (a row every stride floats): x * cos + rotated *
 * sin, rotated = (-x[half:], x[:half]); cos/sin [N, D]. */
static void rope(float *y, int64_t N, int64_t stride, int64_t heads, int64_t D, const float *cos,
                 const float *sin) {
    const int64_t half = D / 2;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < heads; ++h) {
            float *v = y + n * stride + h * D;
            const float *c = cos + n * D, *s = sin + n * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

/* act[n, i] = silu(gate) * up = gate / (1 + exp(-gate)) * up, gu's rows [gate | up] of 2I. */
#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for 8 floats, Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 polynomial,
 * times 2^n through the exponent's bits; within 2 ulp of expf over the clamped range (x outside
 * -87.3..88.3 takes its end: silu's 1 + exp(-g) is then g's 1 or a huge number, either way the
 * quotient's right value to float32). ~20 instructions for 8, against ~8 ns a scalar expf. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

static void silu_mul(const float *gu, int64_t N, int64_t I, float *act) {
    for (int64_t n = 0; n < N; ++n) {
        const float *gate = gu + n * 2 * I, *up = gate + I;
        float *out = act + n * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= I; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 den = _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, den), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < I; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* silu_mul over [N, 2I] -> [N, I], on its own: what the tests hold to float64. */
void dspark_silu_mul_f32(const float *gu, int64_t N, int64_t I, float *act) { silu_mul(gu, N, I, act); }

int dspark_decoder_f32(const DecoderLayer *layers, int64_t L, float *const *k_pools, float *const *v_pools,
                       const DecoderStep *step, float *x, int64_t N, int64_t H, int64_t Hq, int64_t Hkv,
                       int64_t D, int64_t I, float eps, float scale, const float *cos, const float *sin) {
    /* The step's indices once, before anything is written (every layer attends over the same ones). */
    if (dspark_paged_step_check(step->write_index, step->table, step->table_numel, step->key_base, step->key_lo,
                                step->key_hi, N, step->pool_rows, Hq, Hkv, D) != 0)
        return -2;
    const int64_t nq = Hq * D, nkv = Hkv * D, width = nq + 2 * nkv;
    int64_t records = 0;
    for (int64_t l = 0; l < L; ++l) {
        const DecoderLayer *ly = &layers[l];
        const DecoderGemm *g[4] = {&ly->qkv, &ly->o, &ly->gate_up, &ly->down};
        const int64_t k[4] = {H, nq, H, I};
        for (int i = 0; i < 4; ++i)
            if (g[i]->int8) {
                const int64_t bytes = dspark_quant_gemm_q8act_scratch(g[i]->qtype, N, k[i]);
                records = bytes > records ? bytes : records;
            }
    }
    const int64_t floats = N * (H + width + nq + 2 * nkv + nq + 2 * I + I);
    float *buf = malloc((size_t)floats * sizeof(float));
    uint8_t *scratch = records > 0 ? malloc((size_t)records) : NULL;
    if (buf == NULL || (records > 0 && scratch == NULL)) {
        free(buf), free(scratch);
        return -3;
    }
    float *h = buf, *qkv = h + N * H, *q = qkv + N * width, *kn = q + N * nq, *vn = kn + N * nkv;
    float *att = vn + N * nkv, *gu = att + N * nq, *act = gu + N * 2 * I;
    int code = 0;
    for (int64_t l = 0; l < L && code == 0; ++l) {
        const DecoderLayer *ly = &layers[l];
        rmsnorm(x, ly->norm_in, N, H, eps, h);
        if ((code = gemm(&ly->qkv, h, N, H, qkv, scratch)) != 0) break;
        rope(qkv, N, width, Hq + Hkv, D, cos, sin);
        for (int64_t n = 0; n < N; ++n) { /* the kernel takes q, k, v contiguous */
            memcpy(q + n * nq, qkv + n * width, (size_t)nq * sizeof(float));
            memcpy(kn + n * nkv, qkv + n * width + nq, (size_t)nkv * sizeof(float));
            memcpy(vn + n * nkv, qkv + n * width + nq + nkv, (size_t)nkv * sizeof(float));
        }
        if (dspark_paged_attention_checked_f32(q, kn, vn, k_pools[l], v_pools[l], step->write_index, step->table,
                                               step->key_base, step->key_lo, step->key_hi, N, Hq, Hkv, D, scale,
                                               att) != 0) {
            code = -3; /* its only failure left: a worker's scratch */
            break;
        }
        if ((code = gemm(&ly->o, att, N, nq, h, scratch)) != 0) break;
        for (int64_t i = 0; i < N * H; ++i) x[i] += h[i];
        rmsnorm(x, ly->norm_post, N, H, eps, h);
        if ((code = gemm(&ly->gate_up, h, N, H, gu, scratch)) != 0) break;
        silu_mul(gu, N, I, act);
        if ((code = gemm(&ly->down, act, N, I, h, scratch)) != 0) break;
        for (int64_t i = 0; i < N * H; ++i) x[i] += h[i];
    }
    free(buf), free(scratch);
    return code;
}
