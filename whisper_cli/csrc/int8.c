/* The float work around an int8 GEMM (kernels._int8_onednn, _int8_fbgemm), each in one
 * pass over its rows instead of torch's chain of elementwise calls; and the product of a
 * few rows with an int8 weight (int8_matmul_*, at the end).
 *
 * unit_rows_*: x (M, K) rows (float32 or bfloat16, row stride ld) -> unit (M, K) float32,
 * contiguous, each row divided by a = max |x[i, :]| (1 where the row is all zero), and
 * amax (M,) = a: kernels._unit_rows, in the same float32 operations.
 *
 * quantize_rows_*: x (M, K) rows (float32 or bfloat16, row stride ld) -> q (M, K) uint8,
 * contiguous, and amax (M,) float32, each row quantized on its own fixed grid, whose
 * steps and zero the caller passes (kernels.Grid, see activation_grid; the unit rows
 * take none):
 *     a = max |x[i, :]| (1 where the row is all zero),
 *     q[i, j] = round_half_even((x[i, j] / a) * steps) + zero,
 * the float32 operations torch performs for kernels._unit_rows and the grid, in the same
 * order, each rounded as torch rounds it: the same bytes (test_kernels asserts it).
 *
 * rescale_rows_*: acc (M, N) float32, contiguous -> out (M, N) (float32 or bfloat16, row
 * stride ld): out[i, j] = acc[i, j] * amax[i] (+ bias[j], in out's dtype, widened to
 * float32 as it is read), rounded once to out's dtype, as kernels._rescale computes it
 * with torch.mul / torch.addcmul (whose x86 kernel fuses the multiply-add: fmaf here,
 * one rounding).
 *
 * Built by native.py WITHOUT -ffast-math and with -ffp-contract=off: no reciprocal for
 * the division, no fused multiply-add but the one written, every operation rounded as
 * written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "floats.h"

static inline uint32_t abs_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x7fffffffu;
}

/* Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an
 * integer, half to even (the default rounding mode), as torch.round does. */
#define ROUNDER 12582912.0f

/* |x| compared as the bits of a non-negative float32 (their order is the numbers'):
 * an integer maximum, which vectorizes without -ffast-math. */
static inline float row_max(uint32_t top) {
    float a;
    memcpy(&a, &top, sizeof a);
    return a > 0.0f ? a : 1.0f; /* 1 for an all-zero row */
}

/* Each row's values divided by its maximum |x| (a float32 unit row), stored by STORE:
 * the unit row itself (fbgemm's input), or its point on the grid as uint8 (oneDNN's). */
#define ROWS(NAME, T, LOAD, OUT, STORE, PARAMS)                                           \
    void NAME(const T *x, int64_t M, int64_t K, int64_t ld, OUT *y, float *amax,           \
              PARAMS int threads) {                                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t i = 0; i < M; i++) {                                                  \
            const T *row = x + i * ld;                                                     \
            OUT *yi = y + i * K;                                                           \
            uint32_t top = 0;                                                              \
            for (int64_t j = 0; j < K; j++) {                                              \
                const uint32_t b = abs_bits(LOAD(row[j]));                                 \
                top = b > top ? b : top;                                                   \
            }                                                                              \
            const float a = row_max(top);                                                  \
            amax[i] = a;                                                                   \
            for (int64_t j = 0; j < K; j++) yi[j] = STORE(LOAD(row[j]) / a);               \
        }                                                                                  \
    }

static inline float unit(float u) { return u; }

static inline uint8_t on_grid(float u, float steps, float zero) {
    const float v = u * steps;
    const float r = (v + ROUNDER) - ROUNDER;
    return (uint8_t)(int32_t)(r + zero);
}

/* The unit rows take no more parameters; the quantized rows take their grid. */
#define NO_PARAMS
#define GRID_PARAMS float steps, float zero,
#define ON_GRID(u) on_grid((u), steps, zero)
ROWS(unit_rows_f32, float, as_float, float, unit, NO_PARAMS)
ROWS(unit_rows_bf16, uint16_t, from_bf16, float, unit, NO_PARAMS)
ROWS(quantize_rows_f32, float, as_float, uint8_t, ON_GRID, GRID_PARAMS)
ROWS(quantize_rows_bf16, uint16_t, from_bf16, uint8_t, ON_GRID, GRID_PARAMS)

#define RESCALE_ROWS(NAME, T, LOAD, STORE)                                                \
    void NAME(const float *acc, int64_t M, int64_t N, const float *amax, const T *bias,    \
              T *out, int64_t ld, int threads) {                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t i = 0; i < M; i++) {                                                  \
            const float *ai = acc + i * N;                                                 \
            const float s = amax[i];                                                       \
            T *oi = out + i * ld;                                                          \
            if (bias)                                                                      \
                for (int64_t j = 0; j < N; j++)                                            \
                    oi[j] = STORE(fmaf(ai[j], s, LOAD(bias[j])));                          \
            else                                                                           \
                for (int64_t j = 0; j < N; j++) oi[j] = STORE(ai[j] * s);                  \
        }                                                                                  \
    }

RESCALE_ROWS(rescale_rows_f32, float, as_float, as_float)
RESCALE_ROWS(rescale_rows_bf16, uint16_t, from_bf16, to_bf16)

/* int8_matmul_*: out (M, N) = (x (M, K) . w (N, K)^T) * scale + bias, computed in float32
 * with the int8 weight widened to float32 in registers, x, bias and out in float32 or
 * bfloat16 (widened as read, the result rounded once as written): for the few rows of a
 * decode step, where an int8 GEMM's own passes (quantizing the rows, packing, rescaling)
 * cost more than the product (kernels._int8_widened). x's rows have stride ldx, out's
 * ldo; the weight comes packed by C = MATMUL_COLUMNS output columns, zero past N:
 *     packed[(n / C) * K * C + k * C + n % C] = w[n, k].
 * Each output is one float32 sum over k in order, one rounding per term (a fused
 * multiply-add), then its scale and bias in one more: the same operations for a row
 * whatever rows share the call, and on each path (AVX-512: 16 columns a register, 16
 * rows a tile; AVX2: two registers of 8, 4 rows; else plain C, one row), so every path
 * gives the same bytes (test_kernels builds each). The packing's columns are decided
 * here alone: kernels.py packs by int8_matmul_columns(). */
#define MATMUL_COLUMNS 16

int64_t int8_matmul_columns(void) { return MATMUL_COLUMNS; }

/* A tile's row of float32 results r, as many as remain before N. */
#define STORE_COLUMNS(o, r, left, STORE)                                                  \
    for (int64_t j = 0; j < (left < MATMUL_COLUMNS ? left : MATMUL_COLUMNS); j++)         \
        (o)[j] = STORE((r)[j]);

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 rows: a decode step's batch in one tile, each widened weight register serving 16
 * multiply-adds, 16 sums in flight (of the 32 registers). Against 8 rows, microseconds a
 * call (Intel Xeon with AMX, 2 threads; K x N at 16 rows, then 11): 384 x 1536 116 -> 109
 * and 71 -> 55, 512 x 2048 144 -> 132 and 122 -> 95, but 2048 x 512 143 -> 149 and 120 ->
 * 94; at 4 rows and 1 the same. */
#define MATMUL_ROWS 16
#define MATMUL_TILE(MB, LOAD, STORE)                                                       \
    {                                                                                      \
        __m512 acc[MB];                                                                    \
        for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();                         \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const int8_t *wk = wb + k * MATMUL_COLUMNS;                                    \
            const __m128i b = _mm_loadu_si128((const __m128i *)wk);                        \
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));                  \
            for (int i = 0; i < MB; i++) {                                                 \
                const __m512 xi = _mm512_set1_ps(LOAD(xr[i * ldx + k]));                   \
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
#define MATMUL_ROWS 4
#define MATMUL_TILE(MB, LOAD, STORE)                                                       \
    {                                                                                      \
        __m256 lo[MB], hi[MB];                                                             \
        for (int i = 0; i < MB; i++) lo[i] = hi[i] = _mm256_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const int8_t *wk = wb + k * MATMUL_COLUMNS;                                    \
            const __m256 wl = _mm256_cvtepi32_ps(                                          \
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)wk)));               \
            const __m256 wh = _mm256_cvtepi32_ps(                                          \
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wk + 8))));         \
            for (int i = 0; i < MB; i++) {                                                 \
                const __m256 xi = _mm256_set1_ps(LOAD(xr[i * ldx + k]));                   \
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
#define MATMUL_TILE(MB, LOAD, STORE)                                                       \
    {                                                                                      \
        float acc[MATMUL_COLUMNS] = {0.0f}, r[MATMUL_COLUMNS];                             \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const float xk = LOAD(xr[k]);                                                  \
            for (int64_t j = 0; j < MATMUL_COLUMNS; j++)                                   \
                acc[j] = fmaf(xk, (float)wb[k * MATMUL_COLUMNS + j], acc[j]);              \
        }                                                                                  \
        for (int64_t j = 0; j < MATMUL_COLUMNS; j++) r[j] = fmaf(acc[j], s[j], c[j]);      \
        STORE_COLUMNS(out + m0 * ldo + n0, r, N - n0, STORE)                               \
    }
#endif

#define INT8_MATMUL(NAME, T, LOAD, STORE)                                                  \
    void NAME(const T *x, int64_t M, int64_t K, int64_t ldx, const int8_t *packed,         \
              int64_t N, const float *scale, const T *bias, T *out, int64_t ldo,           \
              int threads) {                                                               \
        const int64_t tiles = (N + MATMUL_COLUMNS - 1) / MATMUL_COLUMNS;                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t t = 0; t < tiles; t++) {                                              \
            const int64_t n0 = t * MATMUL_COLUMNS;                                         \
            const int8_t *wb = packed + t * K * MATMUL_COLUMNS;                            \
            /* Its scales and biases, zero past N (those columns are not stored). */       \
            float s[MATMUL_COLUMNS], c[MATMUL_COLUMNS];                                    \
            for (int64_t j = 0; j < MATMUL_COLUMNS; j++) {                                 \
                s[j] = n0 + j < N ? scale[n0 + j] : 0.0f;                                  \
                c[j] = n0 + j < N && bias ? LOAD(bias[n0 + j]) : 0.0f;                     \
            }                                                                              \
            for (int64_t m0 = 0; m0 < M; m0 += MATMUL_ROWS) {                              \
                const T *xr = x + m0 * ldx;                                                \
                const int64_t rows = M - m0 < MATMUL_ROWS ? M - m0 : MATMUL_ROWS;          \
                MATMUL_ROWS_SWITCH(rows, LOAD, STORE)                                      \
            }                                                                              \
        }                                                                                  \
    }

/* The tile for the rows left: a tile's rows are a constant (its sums stay in registers). */
#if MATMUL_ROWS >= 16
#define MATMUL_ROWS_SWITCH(rows, LOAD, STORE)                                              \
    switch (rows) {                                                                        \
    case 16: MATMUL_TILE(16, LOAD, STORE) break;                                           \
    case 15: MATMUL_TILE(15, LOAD, STORE) break;                                           \
    case 14: MATMUL_TILE(14, LOAD, STORE) break;                                           \
    case 13: MATMUL_TILE(13, LOAD, STORE) break;                                           \
    case 12: MATMUL_TILE(12, LOAD, STORE) break;                                           \
    case 11: MATMUL_TILE(11, LOAD, STORE) break;                                           \
    case 10: MATMUL_TILE(10, LOAD, STORE) break;                                           \
    case 9: MATMUL_TILE(9, LOAD, STORE) break;                                             \
    case 8: MATMUL_TILE(8, LOAD, STORE) break;                                             \
    case 7: MATMUL_TILE(7, LOAD, STORE) break;                                             \
    case 6: MATMUL_TILE(6, LOAD, STORE) break;                                             \
    case 5: MATMUL_TILE(5, LOAD, STORE) break;                                             \
    case 4: MATMUL_TILE(4, LOAD, STORE) break;                                             \
    case 3: MATMUL_TILE(3, LOAD, STORE) break;                                             \
    case 2: MATMUL_TILE(2, LOAD, STORE) break;                                             \
    default: MATMUL_TILE(1, LOAD, STORE) break;                                            \
    }
#elif MATMUL_ROWS >= 4
#define MATMUL_ROWS_SWITCH(rows, LOAD, STORE)                                              \
    switch (rows) {                                                                        \
    case 4: MATMUL_TILE(4, LOAD, STORE) break;                                             \
    case 3: MATMUL_TILE(3, LOAD, STORE) break;                                             \
    case 2: MATMUL_TILE(2, LOAD, STORE) break;                                             \
    default: MATMUL_TILE(1, LOAD, STORE) break;                                            \
    }
#else
#define MATMUL_ROWS_SWITCH(rows, LOAD, STORE) (void)(rows); MATMUL_TILE(1, LOAD, STORE)
#endif

INT8_MATMUL(int8_matmul_f32, float, as_float, as_float)
INT8_MATMUL(int8_matmul_bf16, uint16_t, from_bf16, to_bf16)
