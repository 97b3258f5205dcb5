/* CPU attention kernels for the engine's two attention callables, in float32.
 *
 * Each computes what its reference in dspark_kernels/reference.py computes
 * (tests/test_kernels_cpu.py checks both against it) in one call: the step's
 * new K/V written into the cache, then every query attended over its visible
 * keys with an online softmax. The torch path takes 10-20 small ops per layer
 * (writes, gathers, masks, SDPA), and at the shipped pair's sizes (a few
 * queries, 4 heads of 64, tens of keys) those ops' fixed costs, not the
 * arithmetic, were a quarter of an engine step on one core.
 *
 * Plain C, no torch headers: built at first use by dspark_kernels/cpu.py with
 * the system's C compiler and called through ctypes. The target's paged step
 * runs its (query, K/V head) pairs on the thread pool of quant_gemm.c when it
 * has more than one thread (dspark_quant_set_threads, which follows torch's):
 * each pair computed whole by one thread by the same code, so the bits depend
 * on neither the threads nor the batch. With AVX2 and FMA (head_dim a multiple
 * of 8) `attend_avx2` computes a query head's scores eight keys at a time;
 * elsewhere the inner loops over head_dim are `omp simd` reductions
 * (-fopenmp-simd: vectorised, no OpenMP runtime).
 *
 * NOTE: one layer of a decode step of 32 rows, SmolLM2's 9 / 3 heads of 64,
 * keys scattered over the pool, one thread of the AVX2 box (AMD EPYC Zen 3):
 * the v16 kernels took 891 / 1824 / 4703 / 26935 us at 64 / 128 / 256 / 1024
 * keys a row, attend_avx2 270 / 524 / 1032 / 9690 us (bench/HISTORY.md,
 * twenty-seventh session). In process, batch 32 of the chat prompts, two
 * threads, attention went from 18% of the steps' time to 8%.
 *
 * Return value: 0, or a negative code for an index out of range (checked before
 * anything is written, so a bad call changes nothing):
 *   -1 a write index outside the cache, -2 a key index outside the pool,
 *   -3 a slot outside the cache, -4 a layout this build does not take, -5 out of memory.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 1024
#define MAX_GROUP 64 /* query heads per K/V head */

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
}

/* exp(x) for x <= 0 (a softmax's shifted scores), vectorisable: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7 there), times 2^n built in the
 * exponent bits. Below -87 (2^n underflows) it returns 0, as expf does within a float's range. */
static inline float exp_neg(float x) {
    if (x < -87.0f) return 0.0f;
    /* Rounded to the nearest integer by adding and taking away 1.5 * 2^23 (no libm call: vectorises). */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 in two parts: exact n * hi */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* 16 floats at any alignment (GCC/Clang vector extension: one AVX-512 register, or two AVX2 or
 * four NEON ones, whatever the target has). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* The sum of v's 16 lanes, halving the vector at each step (a serial sum was a third of a call). */
static inline float hsum(v16 v) {
    union { v16 w; v8 h[2]; } a = {v};
    union { v8 w; v4 h[2]; } b = {a.h[0] + a.h[1]};
    const v4 c = b.h[0] + b.h[1];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* Softmax of s[0..span) in place; returns 1 / the sum of the exponentials. */
static inline float softmax(float *restrict s, int64_t span) {
    float m = s[0], sum = 0.0f;
    for (int64_t j = 1; j < span; ++j) m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < span; ++j) {
        s[j] = exp_neg(s[j] - m);
        sum += s[j];
    }
    return 1.0f / sum;
}

/* `group` query heads qh[group, D] sharing one K/V head, over `span` keys whose vectors are at
 * krow[j] and vrow[j]: scores, softmax, weighted sum of the values into o[group, D]. `s` holds
 * span floats. For head_dim a multiple of 16 up to 256 (`attend_vec`: the query and the
 * accumulator held in vector registers, NV of 16 floats each), and for any other (`attend_any`). */
#define DEFINE_ATTEND_VEC(NAME, NV)                                                                  \
    static void NAME(const float *restrict qh, int64_t group, const float *const *krow,              \
                     const float *const *vrow, int64_t span, float scale, float *restrict s,         \
                     float *restrict o) {                                                            \
        for (int64_t g = 0; g < group; ++g) {                                                        \
            v16 qr[NV], acc[NV];                                                                     \
            for (int c = 0; c < NV; ++c) qr[c] = ((const v16 *)(qh + g * 16 * NV))[c];              \
            for (int64_t j = 0; j < span; ++j) {                                                     \
                const v16 *k = (const v16 *)krow[j];                                                 \
                v16 a = qr[0] * k[0];                                                                \
                for (int c = 1; c < NV; ++c) a += qr[c] * k[c];                                      \
                s[j] = hsum(a) * scale;                                                              \
            }                                                                                        \
            const float inv = softmax(s, span);                                                      \
            for (int c = 0; c < NV; ++c) acc[c] = (v16){0};                                          \
            for (int64_t j = 0; j < span; ++j) {                                                     \
                const v16 *v = (const v16 *)vrow[j];                                                 \
                for (int c = 0; c < NV; ++c) acc[c] += s[j] * v[c];                                  \
            }                                                                                        \
            for (int c = 0; c < NV; ++c) ((v16 *)(o + g * 16 * NV))[c] = acc[c] * inv;              \
        }                                                                                            \
    }

DEFINE_ATTEND_VEC(attend_64, 4)
DEFINE_ATTEND_VEC(attend_128, 8)
DEFINE_ATTEND_VEC(attend_256, 16)

static void attend_any(const float *restrict qh, int64_t group, int64_t D, const float *const *krow,
                       const float *const *vrow, int64_t span, float scale, float *restrict s,
                       float *restrict o) {
    for (int64_t g = 0; g < group; ++g) {
        for (int64_t j = 0; j < span; ++j) s[j] = dot(qh + g * D, krow[j], D) * scale;
        const float inv = softmax(s, span);
        float *restrict og = o + g * D;
        for (int64_t i = 0; i < D; ++i) og[i] = 0.0f;
        for (int64_t j = 0; j < span; ++j) {
            const float w = s[j], *restrict v = vrow[j];
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) og[i] += w * v[i];
        }
        for (int64_t i = 0; i < D; ++i) og[i] *= inv;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2 + FMA, head_dim a multiple of 8 (most laptops' and servers' x86 CPUs). The v16 kernels above
 * reduce each key's score on its own, a horizontal sum whose shuffles and latency cost more than the
 * key's multiply-adds: a decode step of 32 rows x 64 keys (9 / 3 heads of 64) ran at ~2.6 GFLOP-pairs
 * a second on one core. Here eight keys' scores are reduced together (one transpose-and-add tree for
 * the eight), and the weighted sum of values keeps up to 64 floats of the output in registers across
 * the keys (a wider head in slices of 64). Each query head's result depends only on its own keys: the
 * same bits whatever the batch or the threads. */

/* The eight lane-sums of a[0..7], in order (a[j]'s sum in lane j). */
static inline __m256 sum8x8(const __m256 a[8]) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    /* q0: [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], q1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

static inline float hsum8(__m256 a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

static void attend_avx2(const float *restrict qh, int64_t group, int64_t D, const float *const *krow,
                        const float *const *vrow, int64_t span, float scale, float *restrict s,
                        float *restrict o) {
    const int64_t nv = D / 8;
    for (int64_t g = 0; g < group; ++g) {
        const float *q = qh + g * D;
        int64_t j = 0;
        for (; j + 8 <= span; j += 8) { /* scores of keys j..j+7 */
            __m256 a[8];
            for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
            for (int64_t c = 0; c < nv; ++c) {
                const __m256 qc = _mm256_loadu_ps(q + 8 * c);
                for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(krow[j + t] + 8 * c), a[t]);
            }
            _mm256_storeu_ps(s + j, _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale)));
        }
        for (; j < span; ++j) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t c = 0; c < nv; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(krow[j] + 8 * c), a);
            s[j] = hsum8(a) * scale;
        }
        const __m256 inv = _mm256_set1_ps(softmax(s, span));
        float *og = o + g * D;
        for (int64_t c0 = 0; c0 < nv; c0 += 8) { /* 64 floats of the output at a time */
            const int64_t w = nv - c0 < 8 ? nv - c0 : 8;
            __m256 acc[8];
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
            if (w == 8) {
                for (int64_t k = 0; k < span; ++k) {
                    const __m256 p = _mm256_broadcast_ss(s + k);
                    const float *v = vrow[k] + 8 * c0;
                    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
                }
            } else {
                for (int64_t k = 0; k < span; ++k) {
                    const __m256 p = _mm256_broadcast_ss(s + k);
                    const float *v = vrow[k] + 8 * c0;
                    for (int64_t i = 0; i < w; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
                }
            }
            for (int64_t i = 0; i < w; ++i) _mm256_storeu_ps(og + 8 * (c0 + i), _mm256_mul_ps(acc[i], inv));
        }
    }
}
#endif

static void attend(const float *qh, int64_t group, int64_t D, const float *const *krow,
                   const float *const *vrow, int64_t span, float scale, float *s, float *o) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        attend_avx2(qh, group, D, krow, vrow, span, scale, s, o);
        return;
    }
#endif
    if (D == 64)
        attend_64(qh, group, krow, vrow, span, scale, s, o);
    else if (D == 128)
        attend_128(qh, group, krow, vrow, span, scale, s, o);
    else if (D == 256)
        attend_256(qh, group, krow, vrow, span, scale, s, o);
    else
        attend_any(qh, group, D, krow, vrow, span, scale, s, o);
}

/* Scratch for one query's keys: their scores and where their K and V vectors are. */
typedef struct {
    float *s;
    const float **krow, **vrow;
} Scratch;

static int scratch(Scratch *w, int64_t keys) {
    w->s = malloc((size_t)keys * sizeof(float));
    w->krow = malloc((size_t)keys * sizeof(float *));
    w->vrow = malloc((size_t)keys * sizeof(float *));
    if (w->s && w->krow && w->vrow) return 0;
    free(w->s), free(w->krow), free(w->vrow);
    return -5;
}

static void release(Scratch *w) { free(w->s), free(w->krow), free(w->vrow); }

void dspark_pool_run(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t N, int64_t work);

/* One paged step's attention, its pairs (query n, K/V head h) numbered n * Hkv + h. */
typedef struct {
    const float *q, *k_pool, *v_pool;
    const int32_t *key_index;
    const int64_t *key_base, *key_lo, *key_hi;
    int64_t Hq, Hkv, D, group;
    float scale;
    float *out;
    int64_t widest; /* the most keys a query sees */
    _Atomic int failed; /* a thread found no memory for its scratch */
} PagedStepJob;

/* Pairs i0..i1 of the job (each thread with scratch of its own). */
static void paged_pairs(const void *args, int64_t i0, int64_t i1) {
    const PagedStepJob *j = args;
    const int64_t Hkv = j->Hkv, D = j->D, group = j->group;
    Scratch w;
    if (scratch(&w, j->widest) != 0) {
        atomic_store(&((PagedStepJob *)j)->failed, 1);
        return;
    }
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = i / Hkv, kvh = i % Hkv, lo = j->key_lo[n], hi = j->key_hi[n];
        float *o = j->out + (n * j->Hq + kvh * group) * D;
        if (j->key_base[n] < 0 || hi < lo) { /* not a query, or it sees no key */
            memset(o, 0, (size_t)(group * D) * sizeof(float));
            continue;
        }
        const int32_t *keys = j->key_index + j->key_base[n];
        for (int64_t kp = lo; kp <= hi; ++kp) {
            w.krow[kp - lo] = j->k_pool + (keys[kp] * Hkv + kvh) * D;
            w.vrow[kp - lo] = j->v_pool + (keys[kp] * Hkv + kvh) * D;
        }
        attend(j->q + (n * j->Hq + kvh * group) * D, group, D, w.krow, w.vrow, hi - lo + 1, j->scale, w.s, o);
    }
    release(&w);
}

/* The target's packed step (PackedAttention): token n's K/V go to pool index write_index[n]; then
 * query n attends over key positions key_lo[n]..key_hi[n] of its row, position kp at pool index
 * key_index[key_base[n] + kp] (int32: the request-to-token table itself, a row per slot);
 * key_base[n] < 0: not a query, zeros. q/out [N, Hq, D]; k_new/v_new [N, Hkv, D];
 * k_pool/v_pool [P, Hkv, D]; all contiguous. */
/* The step's checks, apart so that a caller running many layers over one step (cpu_decoder.c) makes
 * them once: 0, or the error the step gets. */
int dspark_paged_step_check(const int64_t *write_index, const int32_t *key_index, int64_t key_count,
                            const int64_t *key_base, const int64_t *key_lo, const int64_t *key_hi, int64_t N,
                            int64_t P, int64_t Hq, int64_t Hkv, int64_t D) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D <= 0 || D > MAX_HEAD_DIM) return -4;
    for (int64_t n = 0; n < N; ++n) {
        if (write_index[n] < 0 || write_index[n] >= P) return -1;
        if (key_base[n] < 0) continue;
        if (key_lo[n] < 0 || key_base[n] + key_hi[n] >= key_count) return -2;
        for (int64_t kp = key_lo[n]; kp <= key_hi[n]; ++kp) {
            const int64_t row = key_index[key_base[n] + kp]; /* the request-to-token table: int32 */
            if (row < 0 || row >= P) return -2;
        }
    }
    return 0;
}

/* dspark_paged_attention_f32 without the checks: for a step dspark_paged_step_check passed. */
int dspark_paged_attention_checked_f32(const float *q, const float *k_new, const float *v_new, float *k_pool,
                                       float *v_pool, const int64_t *write_index, const int32_t *key_index,
                                       const int64_t *key_base, const int64_t *key_lo, const int64_t *key_hi,
                                       int64_t N, int64_t Hq, int64_t Hkv, int64_t D, float scale, float *out) {
    const int64_t group = Hq / Hkv;
    const size_t token = (size_t)(Hkv * D);
    for (int64_t n = 0; n < N; ++n) {
        memcpy(k_pool + write_index[n] * token, k_new + n * token, token * sizeof(float));
        memcpy(v_pool + write_index[n] * token, v_new + n * token, token * sizeof(float));
    }
    PagedStepJob job = {q, k_pool, v_pool, key_index, key_base, key_lo, key_hi, Hq, Hkv, D, group, scale, out, 1, 0};
    int64_t keys_read = 0; /* the pool's measure of work: K/V bytes read, a pass per query head */
    for (int64_t n = 0; n < N; ++n)
        if (key_base[n] >= 0 && key_hi[n] >= key_lo[n]) {
            const int64_t span = key_hi[n] - key_lo[n] + 1;
            job.widest = span > job.widest ? span : job.widest;
            keys_read += span;
        }
    dspark_pool_run(paged_pairs, &job, N * Hkv, keys_read * Hq * D * 2 * (int64_t)sizeof(float));
    return atomic_load(&job.failed) ? -5 : 0;
}

int dspark_paged_attention_f32(const float *q, const float *k_new, const float *v_new, float *k_pool,
                               float *v_pool, const int64_t *write_index, const int32_t *key_index,
                               int64_t key_count, const int64_t *key_base, const int64_t *key_lo,
                               const int64_t *key_hi, int64_t N, int64_t P, int64_t Hq, int64_t Hkv,
                               int64_t D, float scale, float *out) {
    const int code = dspark_paged_step_check(write_index, key_index, key_count, key_base, key_lo, key_hi, N, P, Hq,
                                             Hkv, D);
    if (code != 0) return code;
    return dspark_paged_attention_checked_f32(q, k_new, v_new, k_pool, v_pool, write_index, key_index, key_base,
                                              key_lo, key_hi, N, Hq, Hkv, D, scale, out);
}

/* The draft's window cache (RingAttention): each slot's ring holds position p at ring index
 * p % ring. Row b's token t (position positions[b, t], < 0: padding, neither written nor attended,
 * zeros) is written to its slot's ring; with update_lengths, each slot's length grows to cover its
 * positions (the first layer of a pass). Then query (b, t) at p attends over key positions
 * max(0, p - window + 1)..min(p, length[slot] - 1) (none: zeros).
 * q/out [B, T, Hq, D]; k_new/v_new [B, T, Hkv, D]; k_cache/v_cache [S, ring, Hkv, D]. */
int dspark_ring_attention_f32(const float *q, const float *k_new, const float *v_new, float *k_cache,
                              float *v_cache, const int64_t *slots, const int64_t *positions,
                              int64_t *lengths, int update_lengths, int64_t B, int64_t T, int64_t S,
                              int64_t ring, int64_t window, int64_t Hq, int64_t Hkv, int64_t D,
                              float scale, float *out) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D <= 0 || D > MAX_HEAD_DIM || ring <= 0)
        return -4;
    const int64_t group = Hq / Hkv;
    for (int64_t b = 0; b < B; ++b)
        if (slots[b] < 0 || slots[b] >= S) return -3;
    const size_t token = (size_t)(Hkv * D);
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < T; ++t) {
            const int64_t p = positions[b * T + t];
            if (p < 0) continue;
            const int64_t at = (slots[b] * ring + p % ring) * (int64_t)token;
            memcpy(k_cache + at, k_new + (b * T + t) * token, token * sizeof(float));
            memcpy(v_cache + at, v_new + (b * T + t) * token, token * sizeof(float));
            if (update_lengths && lengths[slots[b]] < p + 1) lengths[slots[b]] = p + 1;
        }
    }
    Scratch w;
    if (scratch(&w, window < ring ? window : ring) != 0) return -5;
    for (int64_t b = 0; b < B; ++b) {
        const float *kc = k_cache + slots[b] * ring * (int64_t)token;
        const float *vc = v_cache + slots[b] * ring * (int64_t)token;
        const int64_t length = lengths[slots[b]];
        for (int64_t t = 0; t < T; ++t) {
            const int64_t n = b * T + t, p = positions[n];
            const int64_t lo = p - window + 1 > 0 ? p - window + 1 : 0;
            const int64_t hi = p < length - 1 ? p : length - 1;
            if (p < 0 || hi < lo) {
                memset(out + n * Hq * D, 0, (size_t)(Hq * D) * sizeof(float));
                continue;
            }
            for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
                for (int64_t kp = lo; kp <= hi; ++kp) {
                    w.krow[kp - lo] = kc + ((kp % ring) * Hkv + kvh) * D;
                    w.vrow[kp - lo] = vc + ((kp % ring) * Hkv + kvh) * D;
                }
                attend(q + (n * Hq + kvh * group) * D, group, D, w.krow, w.vrow, hi - lo + 1, scale, w.s,
                       out + (n * Hq + kvh * group) * D);
            }
        }
    }
    release(&w);
    return 0;
}
