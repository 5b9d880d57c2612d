/* The product of a few rows with a weight packed by columns: a decode step's linear
 * layers and vocabulary projection, where a GEMM library's own passes around its product
 * (packing, dispatch, a matrix-vector path for one row) cost as much as the product.
 *
 * <weight>_matmul_<dtype>: out (M, N) = (x (M, K) . w (N, K)^T) * scale + bias, computed
 * in float32: x in float32 (a bfloat16 run's rows widened by the caller, once a call: a
 * bfloat16 value widened as each multiply-add reads it took 1.3-1.5x the time), bias and
 * out in <dtype>, float32 or bfloat16 (the bias widened as read, the result rounded once
 * as written); x's rows have stride ldx, out's ldo.
 *   int8_matmul_*: w int8, widened to float32 in registers; scale (N,) float32 per column
 *     (kernels._int8_widened).
 *   float_matmul_*: w float32, for a bfloat16 run a float32 copy of its weight (exactly its
 *     values); scale NULL, taken as 1 (kernels._linear_columns).
 * The weight comes packed by C = MATMUL_COLUMNS output columns, zero past N:
 *     packed[(n / C) * K * C + k * C + n % C] = w[n, k].
 * Each output is one float32 sum over k in order, one rounding per term (a fused
 * multiply-add), then its scale and bias in one more (with scale 1, the bias added with
 * one rounding): the same operations for a row whatever rows share the call, and on each
 * path (AVX-512: 16 columns a register, 16 rows a tile; AVX2: two registers of 8, 6 rows;
 * else plain C, one row), so every path gives the same bytes (test_kernels builds each).
 * The packing's columns are decided here alone: kernels.py packs by matmul_columns().
 *
 * While a tile sums one panel of the weight (K x C), the next panel is prefetched: the
 * weight streams from memory once a call, and a call's later tiles of rows, which read the
 * panel again from the first level cache, would leave memory idle. Milliseconds a call,
 * float32, 51864 x 384 (tiny's vocabulary projection) at 16 / 11 / 8 rows, 2 threads, Intel
 * Xeon with AMX: held to AVX2, 5.93 / 3.93 / 3.48 without the prefetch -> 3.41 / 2.40 /
 * 2.13 (oneDNN's packed GEMM 5.03 / 3.74 / 3.23); with AVX-512, 5.81 / 4.68 / 3.28 ->
 * 2.36 / 1.68 / 1.59 (oneDNN 3.16 / 2.80 / 2.53); int8 held to AVX2, 3.70 / 2.69 / 2.13
 * -> 3.38 / 2.40 / 1.92. Weights that stay in the caches (384 x 1536) lose at most 5%.
 *
 * Built by native.py with -ffp-contract=off: no fused multiply-add but those written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "floats.h"

#define MATMUL_COLUMNS 16

int64_t matmul_columns(void) { return MATMUL_COLUMNS; }

/* A tile's row of float32 results r, as many as remain before N. */
#define STORE_COLUMNS(o, r, left, STORE)                                                  \
    for (int64_t j = 0; j < (left < MATMUL_COLUMNS ? left : MATMUL_COLUMNS); j++)         \
        (o)[j] = STORE((r)[j]);

/* The weight's columns k of a panel as float32: 16 (AVX-512), 8 from j (AVX2), one. */
#define INT8_W16(wk) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wk))))
#define FLOAT_W16(wk) _mm512_loadu_ps(wk)
#define INT8_W8(wk, j)                                                                     \
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((wk) + (j)))))
#define FLOAT_W8(wk, j) _mm256_loadu_ps((wk) + (j))
#define INT8_W1(wk, j) ((float)(wk)[j])
#define FLOAT_W1(wk, j) ((wk)[j])

#define PREFETCH_NEXT_PANEL(wk) __builtin_prefetch((wk) + K * MATMUL_COLUMNS, 0, 2)

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 rows: a decode step's batch in one tile, each weight register serving 16
 * multiply-adds, 16 sums in flight (of the 32 registers). Against 8 rows, microseconds a
 * call (int8, Intel Xeon with AMX, 2 threads; K x N at 16 rows, then 11): 384 x 1536 116
 * -> 109 and 71 -> 55, 512 x 2048 144 -> 132 and 122 -> 95, but 2048 x 512 143 -> 149 and
 * 120 -> 94; at 4 rows and 1 the same. */
#define MATMUL_ROWS 16
#define MATMUL_TILE(MB, W, STORE)                                                    \
    {                                                                                      \
        __m512 acc[MB];                                                                    \
        for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();                         \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const W##_T *wk = wb + k * MATMUL_COLUMNS;                                     \
            PREFETCH_NEXT_PANEL(wk);                                                       \
            const __m512 w = W##_W16(wk);                                                  \
            for (int i = 0; i < MB; i++) {                                                 \
                const __m512 xi = _mm512_set1_ps(xr[i * ldx + k]);                         \
                acc[i] = _mm512_fmadd_ps(xi, w, acc[i]);                                   \
            }                                                                              \
        }                                                                                  \
        for (int i = 0; i < MB; i++) {                                                     \
            float r[MATMUL_COLUMNS];                                                       \
            const __m512 si = _mm512_loadu_ps(s), ci = _mm512_loadu_ps(c);                \
            _mm512_storeu_ps(r, _mm512_fmadd_ps(acc[i], si, ci));                          \
            STORE_COLUMNS(out + (m0 + i) * ldo + n0, r, N - n0, STORE)                     \
        }                                                                                  \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* 6 rows: 12 sums in registers, beside the panel's two and a row's value (of 16). Against
 * 4 rows, milliseconds a call (as above, 16 rows, then 11): 51864 x 384 float32 3.97 ->
 * 3.41 and 3.03 -> 2.40, int8 3.68 -> 3.38 and 2.69 -> 2.40; 1536 x 384 int8 0.112 ->
 * 0.099 and 0.080 -> 0.069. */
#define MATMUL_ROWS 6
#define MATMUL_TILE(MB, W, STORE)                                                    \
    {                                                                                      \
        __m256 lo[MB], hi[MB];                                                             \
        for (int i = 0; i < MB; i++) lo[i] = hi[i] = _mm256_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const W##_T *wk = wb + k * MATMUL_COLUMNS;                                     \
            PREFETCH_NEXT_PANEL(wk);                                                       \
            const __m256 wl = W##_W8(wk, 0), wh = W##_W8(wk, 8);                          \
            for (int i = 0; i < MB; i++) {                                                 \
                const __m256 xi = _mm256_set1_ps(xr[i * ldx + k]);                         \
                lo[i] = _mm256_fmadd_ps(xi, wl, lo[i]);                                    \
                hi[i] = _mm256_fmadd_ps(xi, wh, hi[i]);                                    \
            }                                                                              \
        }                                                                                  \
        for (int i = 0; i < MB; i++) {                                                     \
            float r[MATMUL_COLUMNS];                                                       \
            const __m256 sl = _mm256_loadu_ps(s), cl = _mm256_loadu_ps(c);                \
            const __m256 sh = _mm256_loadu_ps(s + 8), ch = _mm256_loadu_ps(c + 8);         \
            _mm256_storeu_ps(r, _mm256_fmadd_ps(lo[i], sl, cl));                           \
            _mm256_storeu_ps(r + 8, _mm256_fmadd_ps(hi[i], sh, ch));                       \
            STORE_COLUMNS(out + (m0 + i) * ldo + n0, r, N - n0, STORE)                     \
        }                                                                                  \
    }
#else
#define MATMUL_ROWS 1
#define MATMUL_TILE(MB, W, STORE)                                                    \
    {                                                                                      \
        float acc[MATMUL_COLUMNS] = {0.0f}, r[MATMUL_COLUMNS];                             \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const float xk = xr[k];                                                        \
            for (int64_t j = 0; j < MATMUL_COLUMNS; j++)                                   \
                acc[j] = fmaf(xk, W##_W1(wb + k * MATMUL_COLUMNS, j), acc[j]);             \
        }                                                                                  \
        for (int64_t j = 0; j < MATMUL_COLUMNS; j++) r[j] = fmaf(acc[j], s[j], c[j]);      \
        STORE_COLUMNS(out + m0 * ldo + n0, r, N - n0, STORE)                               \
    }
#endif
#define INT8_T int8_t
#define FLOAT_T float

/* The tile for the rows left: a tile's rows are a constant (its sums stay in registers). */
#if MATMUL_ROWS >= 16
#define WIDE_TILES(W, STORE)                                                               \
    case 16: MATMUL_TILE(16, W, STORE) break;                                              \
    case 15: MATMUL_TILE(15, W, STORE) break;                                              \
    case 14: MATMUL_TILE(14, W, STORE) break;                                              \
    case 13: MATMUL_TILE(13, W, STORE) break;                                              \
    case 12: MATMUL_TILE(12, W, STORE) break;                                              \
    case 11: MATMUL_TILE(11, W, STORE) break;                                              \
    case 10: MATMUL_TILE(10, W, STORE) break;                                              \
    case 9: MATMUL_TILE(9, W, STORE) break;                                                \
    case 8: MATMUL_TILE(8, W, STORE) break;                                                \
    case 7: MATMUL_TILE(7, W, STORE) break;
#else
#define WIDE_TILES(W, STORE)
#endif
#if MATMUL_ROWS >= 6
#define MATMUL_ROWS_SWITCH(rows, W, STORE)                                                 \
    switch (rows) {                                                                        \
    WIDE_TILES(W, STORE)                                                                   \
    case 6: MATMUL_TILE(6, W, STORE) break;                                                \
    case 5: MATMUL_TILE(5, W, STORE) break;                                                \
    case 4: MATMUL_TILE(4, W, STORE) break;                                                \
    case 3: MATMUL_TILE(3, W, STORE) break;                                                \
    case 2: MATMUL_TILE(2, W, STORE) break;                                                \
    default: MATMUL_TILE(1, W, STORE) break;                                               \
    }
#else
#define MATMUL_ROWS_SWITCH(rows, W, STORE) (void)(rows); MATMUL_TILE(1, W, STORE)
#endif

#define MATMUL(NAME, W, T, LOAD, STORE)                                                    \
    void NAME(const float *x, int64_t M, int64_t K, int64_t ldx, const W##_T *packed,      \
              int64_t N, const float *scale, const T *bias, T *out, int64_t ldo,           \
              int threads) {                                                               \
        const int64_t tiles = (N + MATMUL_COLUMNS - 1) / MATMUL_COLUMNS;                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t t = 0; t < tiles; t++) {                                              \
            const int64_t n0 = t * MATMUL_COLUMNS;                                         \
            const W##_T *wb = packed + t * K * MATMUL_COLUMNS;                             \
            /* Its scales and biases, zero past N (those columns are not stored). */       \
            float s[MATMUL_COLUMNS], c[MATMUL_COLUMNS];                                    \
            for (int64_t j = 0; j < MATMUL_COLUMNS; j++) {                                 \
                s[j] = n0 + j < N ? (scale ? scale[n0 + j] : 1.0f) : 0.0f;                 \
                c[j] = n0 + j < N && bias ? LOAD(bias[n0 + j]) : 0.0f;                     \
            }                                                                              \
            for (int64_t m0 = 0; m0 < M; m0 += MATMUL_ROWS) {                              \
                const float *xr = x + m0 * ldx;                                            \
                const int64_t rows = M - m0 < MATMUL_ROWS ? M - m0 : MATMUL_ROWS;          \
                MATMUL_ROWS_SWITCH(rows, W, STORE)                                         \
            }                                                                              \
        }                                                                                  \
    }

MATMUL(int8_matmul_f32, INT8, float, as_float, as_float)
MATMUL(int8_matmul_bf16, INT8, uint16_t, from_bf16, to_bf16)
MATMUL(float_matmul_f32, FLOAT, float, as_float, as_float)
MATMUL(float_matmul_bf16, FLOAT, uint16_t, from_bf16, to_bf16)
