/* y = x @ W^T on CPU for a few rows, with W held as bfloat16 and every product and sum in float32.
 *
 * For the models whose float32 weights are bfloat16 values widened (a bfloat16 checkpoint loaded in
 * float32, as the shipped pair is): W's bfloat16 copy is the same numbers in half the bytes, so this
 * computes the float32 model (only the order of the sums differs from another BLAS, ~1e-6), while a
 * small matmul, which streams its weight once and does little with each element, reads half as much.
 * dspark_ray/model/cpu_gemm.py packs the copy at load and calls this below a row count.
 *
 * Packed layout (dspark_kernels.cpu.Bf16Gemm packs it): column panels of PANEL outputs, each [K][PANEL] bfloat16,
 * so a panel is one contiguous stream; the last panel is padded with zeros. Each panel is multiplied
 * by ROWS rows of x at a time, the PANEL x ROWS sums held in vector registers over the whole of K, and
 * the panel (K * PANEL * 2 bytes: 32 KB at K = 256) is read again from L1/L2 for the next rows.
 * Every row's sums run in the same order whatever the number of rows beside it, so a row's result
 * does not depend on its batch.
 *
 * Plain C with GCC/Clang vector extensions (one v16 is an AVX-512 register, or two AVX2 or four NEON
 * ones); no torch headers; built and loaded by dspark_kernels/cpu.py.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 64 /* outputs per panel: four vectors of 16 */
#define ROWS 6   /* rows of x per pass over a panel: 24 accumulators */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u16x32 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));

/* 16 bfloat16 values widened to float32 (a bfloat16 is a float32's upper half). */
static inline v16 widen(const uint16_t *p) {
    const u16x32 bits = __builtin_convertvector(*(const h16 *)p, u16x32) << 16;
    v16 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Rows m0..m0+r (r <= ROWS) of x [M, K] times one panel [K][PANEL] -> out[r][PANEL]: from the
 * packed bfloat16 panel (panel_rows_R), or from the panel widened once into float32 (wide_rows_R, when
 * several passes of ROWS rows read it: the widening is then done once, not once a pass). The same
 * multiply-adds in the same order either way, so a row's result does not depend on which ran. */
#define PANEL_ROWS(NAME, R, T, LOAD)                                                                 \
    static void NAME(const float *x, int64_t K, const T *panel, v16 out[][4]) {                      \
        v16 acc[R][4];                                                                               \
        for (int r = 0; r < R; ++r)                                                                  \
            for (int c = 0; c < 4; ++c) acc[r][c] = (v16){0};                                        \
        for (int64_t k = 0; k < K; ++k) {                                                            \
            const T *w = panel + k * PANEL;                                                          \
            const v16 w0 = LOAD(w), w1 = LOAD(w + 16), w2 = LOAD(w + 32), w3 = LOAD(w + 48);         \
            for (int r = 0; r < R; ++r) {                                                            \
                const float xr = x[r * K + k];                                                       \
                acc[r][0] += xr * w0;                                                                \
                acc[r][1] += xr * w1;                                                                \
                acc[r][2] += xr * w2;                                                                \
                acc[r][3] += xr * w3;                                                                \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; ++r)                                                                  \
            for (int c = 0; c < 4; ++c) out[r][c] = acc[r][c];                                       \
    }

static inline v16 load_f32(const float *p) { return *(const v16 *)p; }

#define BOTH(R)                                                                                      \
    PANEL_ROWS(panel_rows_##R, R, uint16_t, widen)                                                   \
    PANEL_ROWS(wide_rows_##R, R, float, load_f32)
BOTH(1)
BOTH(2)
BOTH(3)
BOTH(4)
BOTH(5)
BOTH(6)

typedef void (*PanelRows)(const float *, int64_t, const uint16_t *, v16[][4]);
typedef void (*WideRows)(const float *, int64_t, const float *, v16[][4]);
static const PanelRows panel_rows[ROWS + 1] = {0,            panel_rows_1, panel_rows_2, panel_rows_3,
                                                panel_rows_4, panel_rows_5, panel_rows_6};
static const WideRows wide_rows[ROWS + 1] = {0,           wide_rows_1, wide_rows_2, wide_rows_3,
                                             wide_rows_4, wide_rows_5, wide_rows_6};

/* y [M, N] = x [M, K] @ W^T (+ bias [N] if not NULL), W packed as above. `scratch` (K * PANEL floats,
 * or NULL) holds a panel widened to float32 when more than ROWS rows pass over it. */
void dspark_gemm_bf16w(const float *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                       const float *bias, float *y, float *scratch) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    v16 out[ROWS][4];
    for (int64_t p = 0; p < panels; ++p) {
        const uint16_t *panel = packed + p * K * PANEL;
        const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        const int wide = M > ROWS && scratch != NULL;
        if (wide)
            for (int64_t i = 0; i < K * PANEL; i += 16) {
                const v16 w = widen(panel + i);
                memcpy(scratch + i, &w, sizeof w);
            }
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            if (wide)
                wide_rows[rows](x + m0 * K, K, scratch, out);
            else
                panel_rows[rows](x + m0 * K, K, panel, out);
            for (int r = 0; r < rows; ++r) {
                float *yr = y + (m0 + r) * N + n0;
                const float *o = (const float *)out[r];
                memcpy(yr, o, (size_t)width * sizeof(float));
                if (bias != NULL)
                    for (int64_t i = 0; i < width; ++i) yr[i] += bias[n0 + i];
            }
        }
    }
}
